"""The paged KV cache's layouts (``--kv-cache-dtype``): what one token's K or V of one kv head,
a cache row, is stored as, and how the quantized layouts are written and read.

``float32``, ``bfloat16`` (and ``float16``) rows are the head's values. The quantized rows are
llama.cpp's block layouts over the head's values in blocks of 32, each block a float16 scale
then the values (`prefixcache/native/kv_quant.h` gives the bytes): ``int8`` (Q8_0: 34 bytes per
32 values, 1.06 bytes a value), ``int4`` (Q4_0 over the head rotated by the normalised
Hadamard transform: 18 bytes per 32, 0.56 a value), ``fp8_e4m3`` and ``fp8_e5m2`` (8-bit floats
with the same block scale, 34 bytes per 32). A row is quantized once, when the step that
computed it writes it (`write`), from its own values only: its bytes do not depend on the batch,
the chunking or anything else in the step. The attention kernel reads the blocks as stored
(`native_attention`); the torch paths read them dequantized (`dequantize`).

The quantized layouts' cache tensors are bytes (uint8) of shape [num_blocks, block_size,
num_kv_heads, `KVFormat.row_width`]; which layout they hold travels beside them as the
`KVFormat` (`PagedKVCache.kv_format`, `AttentionPlan.kv_format`). Accepted spellings are vLLM's
as well: ``fp8`` is ``fp8_e4m3``; ``auto`` is resolved by the model's loader
(`prefixcache.model.kv_choice`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache.attention import native_attention

__all__ = [
    "ALIASES",
    "BLOCK",
    "FORMATS",
    "KVFormat",
    "format_of_dtype",
    "hadamard",
    "kv_format",
]

BLOCK = 32  # values per quantized block, each with its own float16 scale

# kv_quant.h's codes
_F32, _BF16, _Q8, _Q4, _E4M3, _E5M2 = 0, 1, 3, 4, 5, 6


@dataclass(frozen=True, slots=True)
class KVFormat:
    """One cache layout. ``layout`` is what names it where blocks must not mix (the cache
    namespace, tier records): it changes whenever the bytes of a row would."""

    name: str
    code: int  # kv_quant.h's enum
    storage: torch.dtype  # the cache tensors' element type
    layout: str
    q_max: float = 0.0  # the largest quantized magnitude (int8 127, int4 8, fp8 their max)

    @property
    def quantized(self) -> bool:
        return self.code >= _Q8

    @property
    def rotated(self) -> bool:
        """K and V are stored rotated (the Hadamard transform of each head's row)."""
        return self.code == _Q4

    def check_head_dim(self, head_dim: int) -> None:
        """Raise a clear `ValueError` where a model's head_dim cannot be kept in this layout."""
        if not self.quantized:
            return
        if head_dim % BLOCK or head_dim > 512:
            raise ValueError(f"--kv-cache-dtype {self.name} keeps each head in blocks of {BLOCK} "
                             f"values (at most 512): head_dim {head_dim} is not a multiple of "
                             f"{BLOCK}")  # fmt: skip
        if self.rotated and head_dim & (head_dim - 1):
            raise ValueError(f"--kv-cache-dtype {self.name} rotates each head by a Hadamard "
                             f"transform, which needs a power-of-two head_dim, not "
                             f"{head_dim}")  # fmt: skip

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one row (one token's K or V of one kv head)."""
        if not self.quantized:
            return head_dim * _element_size(self.storage)
        per_block = 2 + (BLOCK // 2 if self.code == _Q4 else BLOCK)
        return head_dim // BLOCK * per_block

    def row_width(self, head_dim: int) -> int:
        """The cache tensors' last dimension, in elements of ``storage``."""
        return self.row_bytes(head_dim) // _element_size(self.storage)

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store the step's new K/V (k, v: [T, num_kv_heads, head_dim]) at their slots, in this
        layout: the kernel's writer where it is built (int8, int4), else `quantize`."""
        kv_heads = k.shape[1]
        k_rows = k_cache.view(-1, kv_heads, k_cache.shape[-1])
        v_rows = v_cache.view(-1, kv_heads, v_cache.shape[-1])
        if not self.quantized:  # rounded to a narrower float layout where it is one
            k_rows.index_copy_(0, slot_mapping, k.to(self.storage))
            v_rows.index_copy_(0, slot_mapping, v.to(self.storage))
            return
        if self.code in (_Q8, _Q4) and native_attention.kv_write(k, v, k_rows, v_rows,
                                                                 slot_mapping, self.code):
            return
        k_rows.index_copy_(0, slot_mapping, self.quantize(k))
        v_rows.index_copy_(0, slot_mapping, self.quantize(v))

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x [..., head_dim] (any float dtype) -> their stored bytes [..., row_width]:
        the reference the kernel's writer matches bit for bit."""
        x = x.float()
        if self.rotated:
            x = hadamard(x)
        blocks = x.reshape(*x.shape[:-1], -1, BLOCK)  # [..., head_dim / 32, 32]
        magnitude = blocks.abs()
        if self.code == _Q4:  # near the value of largest magnitude (the first) / -8
            extreme = blocks.gather(-1, magnitude.argmax(-1, keepdim=True))
            extreme = torch.where(extreme == 0, torch.zeros_like(extreme), extreme)  # never -0
            scale = _q4_scale(blocks, extreme)
        else:
            scale = (magnitude.amax(-1, keepdim=True) / self.q_max).to(torch.float16)
        d = scale.float()
        inverse = _inverse(d)
        if self.code == _Q8:
            values = (blocks * inverse).round().clamp_(-127, 127).to(torch.int8)
            values = values.view(torch.uint8)
        elif self.code == _Q4:
            nibbles = _q4_nibbles(blocks, inverse).to(torch.uint8)
            values = nibbles[..., : BLOCK // 2] | (nibbles[..., BLOCK // 2 :] << 4)
        else:
            values = (blocks * inverse).to(_FP8[self.code]).view(torch.uint8)
        packed = torch.cat((scale.view(torch.uint8), values), dim=-1)  # [..., blocks, bytes]
        return packed.reshape(*x.shape[:-1], -1)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stored rows [..., row_width] -> the values they stand for [..., head_dim] in
        ``dtype``, rotated back (the values the kernel's scores and sums equal in exact
        arithmetic)."""
        if not self.quantized:
            return rows.to(dtype)
        per_block = self.row_bytes(BLOCK)
        blocks = rows.reshape(*rows.shape[:-1], -1, per_block)
        d = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., blocks, 1]
        payload = blocks[..., 2:]
        if self.code == _Q8:
            values = payload.contiguous().view(torch.int8).float()
        elif self.code == _Q4:
            low, high = (payload & 15).float() - 8, (payload >> 4).float() - 8
            values = torch.cat((low, high), dim=-1)
        else:
            values = payload.contiguous().view(_FP8[self.code]).float()
        out = (values * d).reshape(*rows.shape[:-1], -1)
        if self.rotated:
            out = hadamard(out)
        return out.to(dtype)


_FP8 = {_E4M3: torch.float8_e4m3fn, _E5M2: torch.float8_e5m2}

# kv_quant.h's q4_factors: int4's scales tried per block (exact binary fractions, 1 first)
_Q4_FACTORS = (1.0, *(1 + i / 32 for i in range(-8, 9) if i))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _q4_nibbles(blocks: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """kv_quant.h's q4_nibble: each value + 8 on the scale, as a float in [0, 15]."""
    return (blocks * inverse + 8.5).floor_().clamp_(0, 15)


def _q4_scale(blocks: torch.Tensor, extreme: torch.Tensor) -> torch.Tensor:
    """kv_quant.h's q4_scale, per block [..., 32]: the float16 scale of `_Q4_FACTORS` whose
    values come back with the least squared error (summed in the kernel's order: value i's and
    value 16 + i's into lane i, then the lanes in halves; the first of equal errors)."""
    best: torch.Tensor | None = None
    best_err = torch.zeros(())
    half = BLOCK // 2
    for factor in _Q4_FACTORS:
        scale = (extreme / -8.0 * factor).to(torch.float16)
        d = scale.float()
        error = blocks - (_q4_nibbles(blocks, _inverse(d)) - 8.0) * d
        err = error[..., :half] * error[..., :half] + error[..., half:] * error[..., half:]
        width = half // 2
        while width >= 1:
            err = err[..., :width] + err[..., width : 2 * width]
            width //= 2
        if best is None:
            best, best_err = scale, err
            continue
        better = err < best_err
        best, best_err = torch.where(better, scale, best), torch.where(better, err, best_err)
    assert best is not None
    return best


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


FORMATS: dict[str, KVFormat] = {
    "float32": KVFormat("float32", _F32, torch.float32, "float32"),
    "bfloat16": KVFormat("bfloat16", _BF16, torch.bfloat16, "bfloat16"),
    "float16": KVFormat("float16", -1, torch.float16, "float16"),
    "int8": KVFormat("int8", _Q8, torch.uint8, "int8:q8_0/32", 127.0),
    "int4": KVFormat("int4", _Q4, torch.uint8, "int4:q4_0/32+hadamard", 8.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", _E4M3, torch.uint8, "fp8_e4m3/32", 448.0),
    "fp8_e5m2": KVFormat("fp8_e5m2", _E5M2, torch.uint8, "fp8_e5m2/32", 57344.0),
}


# vLLM's spellings (its CPU and GPU backends take ``fp8`` as e4m3)
ALIASES = {"fp8": "fp8_e4m3"}


def kv_format(name: str) -> KVFormat:
    """The layout ``--kv-cache-dtype`` names (vLLM's spellings too: ``fp8``); ``auto`` is
    the engine's to resolve first."""
    canonical = ALIASES.get(name, name)
    if canonical not in FORMATS:
        known = ", ".join(["auto", *sorted(set(FORMATS) | set(ALIASES))])
        raise ValueError(f"unknown KV cache dtype {name!r} (one of {known})")
    found = FORMATS[canonical]
    if found.code in _FP8 and not _fp8_supported(_FP8[found.code]):
        raise ValueError(f"--kv-cache-dtype {name}: this torch ({torch.__version__}) cannot "
                         f"convert to {_FP8[found.code]} on the CPU")  # fmt: skip
    return found


def format_of_dtype(dtype: torch.dtype) -> KVFormat:
    """The float layout whose rows are ``dtype`` values (a cache that keeps the activations'
    dtype)."""
    for found in FORMATS.values():
        if not found.quantized and found.storage == dtype:
            return found
    raise ValueError(f"no KV cache layout stores {dtype}")


def _fp8_supported(dtype: torch.dtype) -> bool:
    try:
        return bool(torch.ones(2).to(dtype).float().eq(1).all())
    except (RuntimeError, TypeError):
        return False


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x H / sqrt(D), the normalised Walsh-Hadamard transform over the last
    dimension (D a power of two; its own inverse), with the butterflies in kv_quant.h's order
    so that the bits are the kernel's."""
    dim = x.shape[-1]
    y = x.reshape(-1, dim)
    h = 1
    while h < dim:
        pairs = y.view(-1, dim // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, dim)
        h *= 2
    return (y * (1.0 / torch.tensor(float(dim)).sqrt())).view(x.shape)
