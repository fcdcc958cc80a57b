"""Projection weights kept quantized (8-bit integers in blocks of 32 with a float16 scale and
optional minimum per block), multiplied in float32 without dequantizing the model.

GGUF files ship their weights in block formats: Q8_0 (``w = d * q``, q 8-bit), Q4_0 and Q5_0
(4 and 5 bits, offset), Q4_1 and Q5_1 (``w = d * q + m``) and Q4_K (256-value super-blocks of
eight 32-value blocks with 6-bit scales and minimums). Each of them is an 8-bit ``q`` per value
and a scale (and minimum) per 32 values, so `gguf_blocks` reads them into that one form exactly
(Q4_K's products of two scales rounded to float16), and `quantize_q8_0` makes it from float
weights the way llama.cpp's Q8_0 does.

`prefixcache/native/quant_gemm.h` (in the layers library) multiplies through it as llama.cpp's
CPU backend does for these types: each activation row quantized to 8 bits per 32-value block,
integer dot products (AVX512-VNNI ``vpdpbusd``, or AVX2's ``vpmaddubsw`` as llama.cpp's AVX2 path
does), one float scaling per block. A decode step then
streams about 1.2 bytes per weight instead of 4 (0.7 for the 4-bit types, kept as nibbles).
`QuantWeight.matmul` equals ``F.linear`` over the dequantized weight up to the activations' 8-bit
rounding (what llama.cpp's own results carry), whatever the row count: a row's result does not
depend on its batch.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from prefixcache.model import native_layers, packed_gemm

__all__ = [
    "BLOCK",
    "GGUF_NATIVE_TYPES",
    "QuantBlocks",
    "QuantWeight",
    "available",
    "compute_address",
    "gguf_blocks",
    "kernel_name",
    "quantize_q8_0",
    "vectorised",
]

BLOCK = 32
# one weight's blocks as `QuantWeight.pack` takes them: q, d, m (None where w = d * q), and the
# GGUF type (or a label) they came from
QuantBlocks = tuple[np.ndarray, np.ndarray, "np.ndarray | None", str]
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class _Struct(ctypes.Structure):
    """``struct quant_weight`` of quant_gemm.h."""

    _fields_ = [("data", _P), ("form", _I)]


# how quant_gemm.h lays the blocks out: bytes, bytes with minimums, 4-bit values in nibbles
# (with minimums: a signed 4-bit block's offset becomes one)
BYTES, BYTES_MIN, NIBBLES = 0, 1, 2


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = native_layers.library()
    if library is None:
        return None
    library.pc_quant_isa.restype = _I
    library.pc_quant_isa.argtypes = []
    library.pc_quant_size.restype = _I64
    library.pc_quant_size.argtypes = [_I, _I, _I]
    library.pc_quant_pack.restype = None
    library.pc_quant_pack.argtypes = [_P, _P, _P, _I, _I, _I, _P]
    library.pc_quant_gemm.restype = _I
    library.pc_quant_gemm.argtypes = [_P, _I64, _I, _I, _P, _I, _I, _P, _F, _P, _I64, _I]
    library.pc_quant_reserve.restype = _I
    library.pc_quant_reserve.argtypes = [_I, _I]
    return library


def _library_or_raise() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise RuntimeError("the quantized GEMM needs the native layers library")
    return library


@dataclass(slots=True, eq=False)
class QuantWeight:
    """A linear weight [out, in] as 8-bit blocks (`prefixcache/native/quant_gemm.h`'s layout);
    ``matmul(x, bias)`` ~ ``F.linear(x, dequantize(), bias)`` for 2-D float32 ``x``."""

    buffer: torch.Tensor  # uint8, the packed panels
    out_features: int
    in_features: int
    form: int  # BYTES, BYTES_MIN or NIBBLES
    kind: str  # what the blocks came from: q8_0, q4_1, ... (for logs and /v1/models)
    struct: _Struct

    @classmethod
    def pack(
        cls, q: np.ndarray, d: np.ndarray, m: np.ndarray | None, kind: str = "q8_0"
    ) -> QuantWeight:
        """q [out, in] int8, d and m [out, in / 32] (float16; m None where w = d * q)."""
        library = _library_or_raise()
        out_features, in_features = q.shape
        blocks = (out_features, in_features // BLOCK)
        if q.dtype != np.int8 or in_features % BLOCK or in_features == 0:
            raise ValueError(f"expected int8 q [out, in] with in a multiple of {BLOCK}")
        if d.shape != blocks or (m is not None and m.shape != blocks):
            raise ValueError(f"expected float16 scales [{blocks[0]}, {blocks[1]}]")
        low, high = (int(q.min()), int(q.max())) if q.size else (0, 0)
        if m is None and -8 <= low and high <= 7:  # Q4_0: d * q = d * (q + 8) - 8 * d
            q, m = (q + 8).astype(np.int8), (d.astype(np.float32) * -8).astype(np.float16)
            low, high = low + 8, high + 8
        form = BYTES if m is None else NIBBLES if 0 <= low and high <= 15 else BYTES_MIN
        q = np.ascontiguousarray(q)
        d = np.ascontiguousarray(d, dtype=np.float16)
        m = None if m is None else np.ascontiguousarray(m, dtype=np.float16)
        size = library.pc_quant_size(out_features, in_features, form)
        buffer = torch.empty(size, dtype=torch.uint8)
        library.pc_quant_pack(q.ctypes.data, d.ctypes.data, None if m is None else m.ctypes.data,
                              out_features, in_features, form, buffer.data_ptr())  # fmt: skip
        struct = _Struct(buffer.data_ptr(), form)
        return cls(buffer, out_features, in_features, form, kind, struct)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> QuantWeight:
        """Q8_0 of a float weight [out, in] (in a multiple of 32)."""
        return cls.pack(*quantize_q8_0(weight.detach().float().numpy()), kind="q8_0")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it multiplies: float32 activations in, float32 out."""
        return torch.float32

    @property
    def gemm_kind(self) -> str:
        """Which C GEMM multiplies it (`pc_quant_compute`)."""
        return "quant"

    @property
    def operand(self) -> int:
        """What the compiled layers hand the GEMM as its packed weight: the address of its
        ``struct quant_weight``."""
        return ctypes.addressof(self.struct)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] float32 on the CPU -> [rows, out] (+ bias)."""
        x, bias = packed_gemm.checked_operands(x, bias, self.in_features, self.out_features,
                                               torch.float32)  # fmt: skip
        rows = x.shape[0]
        out = x.new_empty(rows, self.out_features)
        if rows == 0:
            return out
        library = _library_or_raise()
        failed = library.pc_quant_gemm(
            x.data_ptr(), x.stride(0), rows, self.in_features, self.buffer.data_ptr(),
            self.out_features, self.form, None if bias is None else bias.data_ptr(),
            0.0, out.data_ptr(), self.out_features, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("quantized GEMM: no memory for the quantized activations")
        return out

    def reserve(self, rows: int) -> None:
        """Scratch for ``rows`` rows in this thread, ahead of the compiled layers' calls."""
        if _library_or_raise().pc_quant_reserve(rows, self.in_features):
            raise MemoryError("quantized GEMM: no memory for the quantized activations")

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] the blocks hold (for tests and fallbacks)."""
        eye = torch.eye(self.in_features)
        # an identity row quantizes exactly (one value per block at full scale): W^T's rows
        return self.matmul(eye).t().contiguous()


def quantize_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """llama.cpp's Q8_0 of float weights [out, in]: per 32 values d = max|w| / 127 (float16),
    q = round(w / d)."""
    out_features, in_features = w.shape
    if in_features % BLOCK:
        raise ValueError(f"Q8_0 needs in_features a multiple of {BLOCK}, got {in_features}")
    blocks = w.reshape(out_features, in_features // BLOCK, BLOCK).astype(np.float32)
    d = np.abs(blocks).max(axis=2) / 127.0
    inverse = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.round(blocks * inverse[..., None]).astype(np.int8)
    return q.reshape(out_features, in_features), d.astype(np.float16), None


def _halves(raw: np.ndarray, offset: int) -> np.ndarray:
    halves: np.ndarray = raw[..., offset : offset + 2].copy().view(np.float16)[..., 0]
    return halves


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the low nibbles, then the high ones (Q4/Q5 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes of a little-endian 32-bit mask -> [..., 32] values of 16 or 0."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits.astype(np.int16) << 4


def _q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return raw[..., 2:].copy().view(np.int8), _halves(raw, 0), None


def _q4_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return _nibbles(raw[..., 2:]) - 8, _halves(raw, 0), None


def _q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(raw[..., 4:]), _halves(raw, 0), _halves(raw, 2)


def _q5_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return (_nibbles(raw[..., 6:]) | _fifth_bits(raw[..., 2:6])) - 16, _halves(raw, 0), None


def _q5_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = _nibbles(raw[..., 8:]) | _fifth_bits(raw[..., 4:8])
    return q, _halves(raw, 0), _halves(raw, 2)


def _q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 256-value super-block: d, dmin (float16), 12 bytes of eight 6-bit scales and minimums,
    128 bytes of nibbles (each 64 values: 32 bytes, low nibbles first)."""
    d = _halves(raw, 0).astype(np.float32)[..., None]
    dmin = _halves(raw, 2).astype(np.float32)[..., None]
    s = raw[..., 4:16].astype(np.int16)
    low_scales = s[..., 0:4] & 63
    low_mins = s[..., 4:8] & 63
    high_scales = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    high_mins = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    scales = np.concatenate([low_scales, high_scales], axis=-1)
    mins = np.concatenate([low_mins, high_mins], axis=-1)
    qs = raw[..., 16:].reshape(*raw.shape[:-1], 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*raw.shape[:-1], 8, BLOCK)
    return q.astype(np.int16), (d * scales).astype(np.float16), (-dmin * mins).astype(np.float16)


# GGUF type -> (values per block, bytes per block, decoder to per-32 blocks)
_DECODERS = {
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q4_K": (256, 144, _q4_k),
}
GGUF_NATIVE_TYPES = tuple(_DECODERS)


def gguf_blocks(
    raw: np.ndarray, type_name: str, out_features: int, in_features: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A GGUF tensor's bytes [out, bytes per row] of one of `GGUF_NATIVE_TYPES` -> q [out, in]
    int8, d and m [out, in / 32] float16 (m None for the symmetric types)."""
    if type_name not in _DECODERS:
        raise ValueError(f"GGUF type {type_name} has no 8-bit block form")
    per_block, size, decode = _DECODERS[type_name]
    if in_features % per_block or raw.shape != (out_features, in_features // per_block * size):
        raise ValueError(f"{type_name} tensor of {raw.shape} bytes is not [{out_features}, "
                         f"{in_features}]")  # fmt: skip
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(out_features, -1, size)
    q, d, m = decode(blocks)
    nb = in_features // BLOCK
    q = q.reshape(out_features, in_features).astype(np.int8)
    d = d.reshape(out_features, nb)
    return q, d, None if m is None else m.reshape(out_features, nb)


def vectorised() -> bool:
    """Whether this build's quantized kernel is vector code (AVX512-VNNI or AVX2), not the
    plain loops."""
    library = _library()
    return library is not None and bool(library.pc_quant_isa())


def kernel_name() -> str:
    """The instruction set of this build's quantized kernel: ``AVX512-VNNI``, ``AVX2`` or
    ``plain loops``."""
    library = _library()
    isa = library.pc_quant_isa() if library is not None else 0
    return {1: "AVX512-VNNI", 2: "AVX2"}.get(isa, "plain loops")


@functools.cache
def available() -> bool:
    """True when the quantized GEMM builds here and agrees with ``F.linear`` over its own
    dequantized weight (probed once)."""
    if _library() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 96, generator=gen)
    x = torch.randn(5, 96, generator=gen)
    packed = QuantWeight.from_float(weight)
    want = torch.nn.functional.linear(x, packed.dequantize())
    # the activations' 8-bit rounding: ~ |x| / 254 per value
    tol = 0.02 * float(want.abs().max()) + 1e-3
    return bool((packed.matmul(x) - want).abs().max() <= tol)


@functools.cache
def compute_address() -> int:
    """Address of ``pc_quant_compute`` (MKL's ``cblas_sgemm_compute`` signature, B a
    `QuantWeight.address`), for the compiled layer steps."""
    address = ctypes.cast(_library_or_raise().pc_quant_compute, ctypes.c_void_p).value
    assert address
    return address
