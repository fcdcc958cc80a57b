"""A compiled CPU kernel for the prefill attention of one sequence over paged K/V, and for
decode steps (float32 or bfloat16 caches; float32 scores, softmax and sums).

`prefixcache/native/attention.c` is built with the system C compiler (``$CC``, else ``cc``;
``-O3 -march=native -fopenmp``; `prefixcache.native`) at first use into the user cache dir and
called through ``ctypes``, like `prefixcache.model.packed_gemm`. Per kv head and tile of new
tokens it stacks the G query heads, computes the scores against only the keys the tile may see
into a buffer that stays in L2, runs the softmax over each row's visible keys (no mask tensor),
multiplies by V and normalises the output rows; the GEMMs are the sgemm of the MKL inside
libtorch, single-threaded inside the kernel's OpenMP team (torch's own libgomp). After a cache
hit (more context than new tokens), where each thread gets whole kv heads, each thread gathers
the K/V of the head it works on, so its tiles read them from L2. With head_dim 16, 32, 64, 80,
96 or 128 (AVX-512 or portable vector code), the direct path skips the gather, with or without
cached context, and computes each row's keys in one order whatever the step (batch invariance,
docs/model.md): register-tiled loops
read K and V straight from the cache (`prefill_path` says which split a call takes), and decode
steps read their shared prefix the same way. Figures: docs/performance.md.

A bfloat16 cache is widened to float32 as its rows are gathered (exact: a bfloat16 is the high
half of a float), so a bfloat16 model's attention runs at float32 precision while reading half
the bytes; its bfloat16 queries are widened before the call and the outputs rounded back after
it (round to nearest even, as torch rounds). For a bfloat16 model on a CPU with AVX512_BF16
the direct path instead multiplies bfloat16 pairs as stored (``vdpbf16ps``, float32
accumulation; the probabilities rounded to bfloat16 for P V, as bfloat16 FlashAttention
kernels do): twice the multiply-adds per instruction (figures: docs/performance.md;
tolerances: tests/test_attention_native.py).

`available()` is False, and callers keep the torch paths, when there is no compiler, no MKL in
libtorch (ARM, macOS), the build or load fails, a one-time probe disagrees with the torch
reference, or ``PREFIXCACHE_NATIVE_ATTENTION=0``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from _ctypes import CFuncPtr
from typing import Any

import torch

from prefixcache.native import Switch, load_library, machine

__all__ = [
    "applies",
    "attend",
    "available",
    "decode",
    "disabled_by_env",
    "enabled",
    "kernel_name",
    "PreparedAttend",
    "PreparedDecode",
    "prefill_path",
    "set_enabled",
]

log = logging.getLogger(__name__)

# The direct path's tiles (attention.c): key block, tiles sharing each key block
_GROUP_TILES = 4
_MAX_TILE_ROWS = 4096  # MAX_TILE_ROWS in attention.c: stacked query rows of one work item
_DIRECT_ROWS = 256  # MAX_TILE_VECS * LANES in attention.c: most rows of a direct-path tile
# Most decode sequences per work item: their G query heads stack into one GEMM over the shared
# keys; more per item means larger GEMMs, fewer items to spread over threads (`decode_chunk`).
MAX_DECODE_CHUNK = 16
# A decode work item's fixed cost in stacked query rows (measured over the benchmark shapes:
# docs/performance.md)
_ITEM_ROWS = 32
_KEY_BLOCK = 32  # KEY_BLOCK in attention.c

_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64




def _available() -> bool:
    return available()  # looked up at each call, so tests may replace it


_switch = Switch("PREFIXCACHE_NATIVE_ATTENTION", _available)
disabled_by_env = _switch.disabled_by_env
set_enabled = _switch.set_enabled  # False: the torch paths, e.g. for side-by-side benchmarks
enabled = _switch.enabled


def _bind(
    library: ctypes.CDLL, name: str, restype: type[Any] | None, argtypes: list[type[Any]]
) -> CFuncPtr:
    """Library function `name` with its C signature set (ctypes checks the arguments)."""
    function = library[name]
    function.restype = restype
    function.argtypes = argtypes
    return function


def _address(function: CFuncPtr) -> int:
    """A bound function's address, for compiled callers (`kernel_arguments`)."""
    address = ctypes.cast(function, _P).value
    assert address is not None  # a symbol the library exports
    return address


class _Kernel:
    def __init__(self, library: ctypes.CDLL, sgemm: int, set_threads: int) -> None:
        attention = [_P, _I64] + [_P] * 5 + [_I] * 5 + [ctypes.c_float, _I, _I, _P, _P]
        decode = [_P, _I64, _P, _P, _P, _I, _P, _P, _I, _P, _P] + [_I] * 4
        decode += [ctypes.c_float, _I, _I, _P, _P]
        # by the caches' dtype: float32, or bfloat16
        self.attention = _bind(library, "pc_attention", None, attention)
        self.decode = _bind(library, "pc_decode", None, decode)
        # ... over bfloat16 caches, with a last flag: bfloat16 products (bfloat16 queries)
        self.attention_kv16 = _bind(library, "pc_attention_kv16", None, [*attention, _I])
        self.decode_kv16 = _bind(library, "pc_decode_kv16", None, [*decode, _I])
        # ... over quantized caches: the layout's code (kv_quant.h) and a buffer for the
        # queries of a rotated layout
        self.attention_quant = _bind(library, "pc_attention_quant", None, [*attention, _I, _P])
        self.decode_quant = _bind(library, "pc_decode_quant", None, [*decode, _I, _P])
        self.kv_write = _bind(library, "pc_kv_write", None,
                              [_P, _I64, _P, _I64, _I, _I, _I, _I, _P, _P, _P, _I])
        self.kv_row_bytes = _bind(library, "pc_kv_row_bytes", _I64, [_I, _I])
        self.hadamard_rows = _bind(library, "pc_hadamard_rows", None, [_P, _I64, _I])
        self.kv_read = _bind(library, "pc_kv_read", None, [_P, _P, _I64, _I, _I])
        self.scratch_floats = _bind(library, "pc_scratch_floats", _I64, [_I] * 6)
        self.decode_scratch_floats = _bind(library, "pc_decode_scratch_floats", _I64, [_I] * 8)
        self.decode_direct = _bind(library, "pc_decode_direct", _I, [_I] * 4)
        self.attention_path = _bind(library, "pc_attention_path", _I, [_I] * 8)
        self.isa = _bind(library, "pc_attention_isa", _I, [])()
        self.sgemm, self.set_threads = sgemm, set_threads
        self.attention_address = _address(self.attention)
        self.decode_address = _address(self.decode)
        self.decode_kv16_address = _address(self.decode_kv16)


@functools.cache
def _kernel() -> _Kernel | None:
    has_mkl: bool = torch.backends.mkl.is_available()  # type: ignore[no-untyped-call]  # unhinted
    if disabled_by_env() or not has_mkl:
        return None
    library = load_library("attention")
    if library is None:
        return None
    try:
        torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        libtorch = ctypes.CDLL(os.path.join(torch_lib, "libtorch_cpu.so"))
        sgemm = ctypes.cast(libtorch.sgemm_, _P).value
        set_threads = ctypes.cast(libtorch.MKL_Set_Num_Threads_Local, _P).value
    except (OSError, AttributeError) as exc:
        log.warning("native attention off: %s", exc)
        return None
    if not sgemm or not set_threads:
        return None
    return _Kernel(library, sgemm, set_threads)


_KV_DTYPES = (torch.float32, torch.bfloat16)


# kv_quant.h's first quantized layout code: codes from here are quantized caches (bytes)
QUANTIZED = 3


def applies(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_code: int = 0
) -> bool:
    """Whether the attention paths hand this step to the kernel: `enabled()`, CPU queries
    [T, heads, head_dim] with contiguous heads (rows may be strided) and contiguous caches, all
    float32 or all bfloat16, or float32 or bfloat16 queries over a quantized cache
    (``kv_code``: its layout's code, `kv_format.KVFormat.code`)."""
    return q.stride(2) == 1 and q.stride(1) == q.shape[2] and applies_to(
        q.dtype, q.device, k_cache, v_cache, kv_code
    )


def applies_to(
    dtype: torch.dtype,
    device: torch.device,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_code: int = 0,
) -> bool:
    """`applies` for queries of ``dtype`` on ``device`` laid out as the decoder's are
    ([T, heads, head_dim] views with contiguous heads): decided before the step runs."""
    quantized = kv_code >= QUANTIZED
    # float32 queries over a bfloat16 cache: the kernel widens its rows
    widened = dtype == torch.float32 and k_cache.dtype == torch.bfloat16
    return (
        device.type == "cpu"
        and dtype in _KV_DTYPES
        and (k_cache.dtype == v_cache.dtype == torch.uint8 if quantized
             else (dtype == k_cache.dtype or widened) and k_cache.dtype == v_cache.dtype)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and enabled()
    )  # fmt: skip


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_code: int,
) -> bool:
    """The step's K/V rows (k, v: [T, kv_heads, head_dim], float32 or bfloat16, heads
    contiguous, rows may be strided) quantized into k_rows, v_rows ([num_slots, kv_heads,
    row bytes] uint8) at ``slot_mapping`` by the kernel's writer (`pc_kv_write`: int8 and
    int4); False, and nothing written, where it is not built here or the tensors are not ones
    it takes (the caller then quantizes in torch, to the same bytes)."""
    kernel = _kernel()
    num_tokens, kv_heads, head_dim = k.shape
    if kernel is None or num_tokens == 0:
        return kernel is not None
    width = kernel.kv_row_bytes(head_dim, kv_code)
    ok = (
        k.dtype == v.dtype in _KV_DTYPES and k.device.type == v.device.type == "cpu"
        and v.shape == k.shape and k.stride(2) == v.stride(2) == 1
        and k.stride(1) == v.stride(1) == head_dim
        and k_rows.dtype == v_rows.dtype == torch.uint8
        and k_rows.shape == v_rows.shape == (k_rows.shape[0], kv_heads, width)
        and k_rows.is_contiguous() and v_rows.is_contiguous()
        and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
        and slot_mapping.shape == (num_tokens,)
    )  # fmt: skip
    if not ok:
        return False
    low, high = min_max_slots(slot_mapping)
    if low < 0 or high >= k_rows.shape[0]:
        raise ValueError("native KV write: slot out of range")
    kernel.kv_write(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), num_tokens, kv_heads, head_dim,
        int(k.dtype == torch.bfloat16), slot_mapping.data_ptr(), k_rows.data_ptr(),
        v_rows.data_ptr(), kv_code,
    )  # fmt: skip
    return True


def kv_write_address() -> int | None:
    """`pc_kv_write`'s address, for compiled callers (`fused_layers`), or None where the
    kernel is not built."""
    kernel = _kernel()
    return None if kernel is None else _address(kernel.kv_write)


def min_max_slots(slots: torch.Tensor) -> tuple[int, int]:
    low, high = slots.aminmax()
    return int(low), int(high)


def _kernel_or_raise() -> _Kernel:
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("native attention is not available")
    return kernel


def _check(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    out: torch.Tensor,
    slot_tensors: list[torch.Tensor],
    rows_per_head: int,
    what: str,
    slot_range: tuple[int, int] | None = None,
    kv_code: int = 0,
) -> None:
    """The kernels read raw pointers: reject everything a wrong shape would turn into a bad read."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_flat.shape[1]
    if kv_code >= QUANTIZED:  # bytes: rows of the layout's blocks; queries float32 or widened
        width = _kernel_or_raise().kv_row_bytes(head_dim, kv_code)
        caches_ok = k_flat.dtype == v_flat.dtype == torch.uint8 and head_dim % 32 == 0
    else:
        width = head_dim
        caches_ok = k_flat.dtype == v_flat.dtype in _KV_DTYPES and (
            q.dtype == torch.float32 or k_flat.dtype == torch.bfloat16
        )
    if not (
        q.dtype == out.dtype in _KV_DTYPES
        and caches_ok
        and q.stride(2) == 1
        and q.stride(1) == head_dim
        and out.is_contiguous()
        and out.shape == q.shape
        and k_flat.is_contiguous()
        and v_flat.is_contiguous()
        and k_flat.shape == v_flat.shape == (k_flat.shape[0], num_kv_heads, width)
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads * rows_per_head <= _MAX_TILE_ROWS
        and all(t.dtype == torch.int64 and t.is_contiguous() for t in slot_tensors)
    ):
        raise ValueError(f"native {what}: unsupported shapes, strides or dtypes")
    for slots in slot_tensors:
        if slots.numel():
            low, high = slots.aminmax() if slot_range is None else slot_range  # one pass
            if int(low) < 0 or int(high) >= k_flat.shape[0]:
                raise ValueError(f"native {what}: slot out of range")


PREFILL_PATHS = ("shared gather", "gather per kv head", "direct per kv head")


def tile_rows(head_dim: int, caches: machine.Caches | None = None) -> int:
    """Stacked query rows per prefill tile on this machine: the largest power of two from 16 to
    256 (a direct-path tile's most) for which one key block's scores (`_KEY_BLOCK` x rows
    floats) take at most half the L1d, and the `_GROUP_TILES` tiles that share each key block,
    their transposed queries and output sums (2 x rows x head_dim floats a tile), at most half
    the L2 (the rule and what it gives: docs/performance.md)."""
    caches = caches or machine.caches()
    rows = 16
    while (
        rows < _DIRECT_ROWS
        and _KEY_BLOCK * 2 * rows * 4 <= caches.l1d // 2
        and _GROUP_TILES * 2 * (2 * rows) * head_dim * 4 <= caches.l2 // 2
    ):
        rows *= 2
    return rows


def tile_tokens(
    num_heads: int, num_kv_heads: int, head_dim: int = 64, caches: machine.Caches | None = None
) -> int:
    """New tokens per prefill tile for this shape: the largest power of two up to 128 whose G
    stacked query heads make at most `tile_rows` rows (at least one token), e.g. with 128 rows
    32 at G = 3 or 4, 16 at G = 8, 128 without GQA: up to G = 256 the tiles stay on the direct
    path, and few query heads per kv head still fill its register tiles."""
    group, tokens, rows = num_heads // num_kv_heads, 128, tile_rows(head_dim, caches)
    while tokens > 1 and group * tokens > rows:
        tokens //= 2
    return tokens


def prefill_path(
    num_tokens: int,
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype = torch.float32,
) -> str:
    """How `attend` splits a prefill of these sizes at the current thread count: one of
    `PREFILL_PATHS`: reading the cache straight in key blocks where the head_dim is one the
    direct path is compiled for (16, 32, 64, 80, 96 or 128) and a tile's stacked query heads
    fit 256 rows (`tile_tokens`), cached context or not; else all kv heads gathered once for
    the team, or after a cache hit each thread gathering the head it works on where the threads
    divide the kv heads."""
    kernel = _kernel_or_raise()
    path = kernel.attention_path(
        num_tokens, seq_len, num_heads, num_kv_heads, head_dim,
        tile_tokens(num_heads, num_kv_heads, head_dim), torch.get_num_threads(),
        kv_dtype == torch.bfloat16,
    )  # fmt: skip
    return PREFILL_PATHS[path]


def attend(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    slot_range: tuple[int, int] | None = None,
    kv_code: int = 0,
) -> None:
    """One sequence's prefill attention into ``out``; requires `available()`.

    q, out: [T, num_heads, head_dim] CPU, the T new tokens (q's rows may be strided, out
    contiguous); k_flat, v_flat: the paged cache flattened to [num_slots, num_kv_heads,
    head_dim], already holding the new tokens' K/V (float32 or bfloat16; bfloat16 queries need
    a bfloat16 cache); slots: [S] int64, the slot of every
    position 0 .. S - 1 (S >= T: the cached context, then the new tokens). New token t sits at
    position S - T + t and attends positions 0 .. S - T + t. ``slot_range``: the slots' (min,
    max) when the caller already has them, else computed. ``kv_code``: a quantized cache's
    layout (`kv_format.KVFormat.code`; k_flat, v_flat then [num_slots, kv_heads, row bytes]
    uint8), 0 for the float caches.
    """
    prepared = PreparedAttend(q, k_flat, v_flat, slots, out, slot_range, kv_code=kv_code)
    prepared(q, k_flat, v_flat, scale, out)


class PreparedAttend:
    """`attend` for one sequence in every layer of a step, its checks and scratch done once.

    Built from the first layer's tensors; a call takes any layer's, which must have the first's
    shapes, strides, dtypes and device (each layer's cache is a tensor of the same shape), and
    checks only that: per-layer checks, allocation and dispatch in Python would run on caches the
    GEMMs had just flushed. ``scratch``: a buffer to use when large enough.
    """

    def __init__(
        self,
        q: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        slots: torch.Tensor,
        out: torch.Tensor,
        slot_range: tuple[int, int] | None = None,
        scratch: torch.Tensor | None = None,
        kv_code: int = 0,
    ) -> None:
        kernel = self._kernel = _kernel_or_raise()
        num_tokens, num_heads, head_dim = q.shape
        seq_len, num_kv_heads = slots.shape[0], k_flat.shape[1]
        self._tile_tokens = tile_tokens(num_heads, num_kv_heads, head_dim)
        _check(q, k_flat, v_flat, out, [slots], self._tile_tokens, "attention", slot_range,
               kv_code)
        if not 0 < num_tokens <= seq_len:
            raise ValueError(
                f"native attention: unsupported: {num_tokens} new tokens over {seq_len} positions"
            )
        self._threads = torch.get_num_threads()
        floats = kernel.scratch_floats(
            seq_len, num_heads, num_kv_heads, head_dim, self._tile_tokens, self._threads
        )
        if scratch is None or scratch.numel() < floats or scratch.dtype != torch.float32:
            scratch = torch.empty(floats, dtype=torch.float32)
        self.scratch, self._slots = scratch, slots
        self._sizes = (num_tokens, seq_len, num_heads, num_kv_heads, head_dim)
        self._signature = self.signature(q, k_flat, v_flat, out)
        # bfloat16 queries: widened before each call, the float32 outputs rounded back after
        self._out32 = torch.empty(q.shape) if q.dtype == torch.bfloat16 else None
        self._extra: tuple[Any, ...] = ()
        self._function = kernel.attention
        if kv_code >= QUANTIZED:  # a rotated layout's queries are rotated into a buffer
            self._qrot = _rotation_buffer(q.shape, kv_code)
            code = _with_products(kernel, kv_code, self._out32 is not None)
            self._function, self._extra = kernel.attention_quant, (code, self._qrot)
        elif k_flat.dtype == torch.bfloat16:
            self._function, self._extra = kernel.attention_kv16, (int(self._out32 is not None),)

    @staticmethod
    def signature(
        q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, out: torch.Tensor
    ) -> tuple[object, ...]:
        return tuple((t.shape, t.stride(), t.dtype, t.is_cpu) for t in (q, k_flat, v_flat, out))

    def kernel_arguments(self, out: torch.Tensor) -> dict[str, int]:
        """For compiled callers (`pc_layer`), by ``struct layer_args``' field names: the
        kernel's address, the slots' address, S, the tile size, the scratch's address, sgemm
        and set_threads; ``out`` must be the output it was prepared with."""
        if self.signature(out, out, out, out)[3] != self._signature[3]:
            raise ValueError("native attention: output unlike the one it was prepared for")
        if self._function is not self._kernel.attention or self._out32 is not None:
            raise ValueError("native attention: compiled callers pass float32 tensors")
        kernel = self._kernel
        return {
            "attention": kernel.attention_address, "seq_slots": self._slots.data_ptr(),
            "S": self._sizes[1], "tile_tokens": self._tile_tokens,
            "scratch": self.scratch.data_ptr(), "sgemm": kernel.sgemm,
            "set_threads": kernel.set_threads,
        }  # fmt: skip

    def __call__(
        self,
        q: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        if self.signature(q, k_flat, v_flat, out) != self._signature:
            raise ValueError("native attention: tensors unlike those it was prepared for")
        kernel, out32 = self._kernel, self._out32
        if out32 is not None:
            q = q.float()
        self._function(
            q.data_ptr(), q.stride(0), k_flat.data_ptr(), v_flat.data_ptr(),
            self._slots.data_ptr(), (out if out32 is None else out32).data_ptr(),
            self.scratch.data_ptr(), *self._sizes, scale, self._tile_tokens, self._threads,
            kernel.sgemm, kernel.set_threads, *self._extra,
        )  # fmt: skip
        if out32 is not None:
            out.copy_(out32)


def decode(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    shared_slots: torch.Tensor,
    tail_slots: torch.Tensor,
    tail_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    kv_code: int = 0,
) -> None:
    """Decode attention of B sequences (one query each) into ``out``; requires `available()`.

    q, out: [B, num_heads, head_dim] CPU (q's rows may be strided, out contiguous); k_flat,
    v_flat: [num_slots, num_kv_heads, head_dim] (dtypes as for `attend`); shared_slots: [P]
    int64, the keys every sequence starts with (P may be 0); tail_slots: [B, max_tail] int64,
    then each sequence's own keys, tail_lens[b] (int32, 1 .. max_tail) of them; ``kv_code`` as
    for `attend`.
    """
    prepared = PreparedDecode(q, k_flat, v_flat, shared_slots, tail_slots, tail_lens, out,
                              kv_code)
    prepared(q, k_flat, v_flat, scale, out)


class PreparedDecode:
    """`decode` for the same sequences in every layer of a step, its checks, scratch and
    widening buffers done once (as `PreparedAttend` for a prefill): built from the first
    layer's tensors, called with any layer's, which must match the first's shapes, strides,
    dtypes and device."""

    def __init__(
        self,
        q: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        shared_slots: torch.Tensor,
        tail_slots: torch.Tensor,
        tail_lens: torch.Tensor,
        out: torch.Tensor,
        kv_code: int = 0,
    ) -> None:
        kernel = self._kernel = _kernel_or_raise()
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads, max_tail = k_flat.shape[1], tail_slots.shape[1]
        threads = self._threads = torch.get_num_threads()
        shared, group = shared_slots.shape[0], num_heads // num_kv_heads
        chunk = decode_chunk(num_seqs, num_kv_heads, threads, group)
        _check(q, k_flat, v_flat, out, [shared_slots, tail_slots], chunk, "decode",
               kv_code=kv_code)
        if not (
            tail_lens.dtype == torch.int32
            and tail_lens.is_contiguous()
            and tail_slots.shape[0] == tail_lens.shape[0] == num_seqs > 0
            and max_tail > 0
        ):
            raise ValueError("native decode: unsupported shapes, strides or dtypes")
        if int(tail_lens.min()) < 1 or int(tail_lens.max()) > max_tail:
            raise ValueError("native decode: tail lengths out of range")
        self._scratch = torch.empty(
            kernel.decode_scratch_floats(
                shared, max_tail, num_seqs, num_heads, num_kv_heads, head_dim, chunk, threads,
            ),
            dtype=torch.float32,
        )
        self._slots = (shared_slots, tail_slots, tail_lens)
        self._sizes = (shared, max_tail, num_seqs, num_heads, num_kv_heads, head_dim)
        self._chunk = chunk
        self._signature = PreparedAttend.signature(q, k_flat, v_flat, out)
        # bfloat16 queries: widened before each call, the float32 outputs rounded back after
        wide = q.dtype == torch.bfloat16
        self._q32 = torch.empty(q.shape) if wide else None
        self._out32 = torch.empty(q.shape) if wide else None
        self._function, self._extra = kernel.decode, tuple[Any, ...]()
        if kv_code >= QUANTIZED:
            self._qrot = _rotation_buffer(q.shape, kv_code)
            code = _with_products(kernel, kv_code, wide)
            self._function, self._extra = kernel.decode_quant, (code, self._qrot)
        elif k_flat.dtype == torch.bfloat16:
            self._function, self._extra = kernel.decode_kv16, (int(wide),)

    def kernel_arguments(self, out: torch.Tensor) -> dict[str, int]:
        """For compiled callers (`pc_layer`, `pc_layer_bf16`), by ``struct layer_args``' field
        names: the kernel's address (pc_decode, or pc_decode_kv16 for bfloat16 queries), the
        slots' and lengths' addresses and counts, the scratch's address, the chunk and runs,
        sgemm and set_threads, and for bfloat16 queries the float32 buffers they are widened
        into and the output is rounded from; ``out`` must be the output it was prepared
        with."""
        if PreparedAttend.signature(out, out, out, out)[3] != self._signature[3]:
            raise ValueError("native decode: output unlike the one it was prepared for")
        kernel, (shared_slots, tail_slots, tail_lens) = self._kernel, self._slots
        fields = {
            "shared_slots": shared_slots.data_ptr(), "shared": self._sizes[0],
            "tail_slots": tail_slots.data_ptr(), "tail_lens": tail_lens.data_ptr(),
            "max_tail": self._sizes[1], "scratch": self._scratch.data_ptr(),
            "decode_chunk": self._chunk, "sgemm": kernel.sgemm,
            "set_threads": kernel.set_threads,
        }  # fmt: skip
        if self._function is kernel.decode and self._q32 is None:
            return {"decode": kernel.decode_address, **fields}
        if self._function is kernel.decode_kv16 and self._q32 is not None:
            assert self._out32 is not None
            return {
                "decode": kernel.decode_kv16_address, "products": self._extra[0],
                "q32": self._q32.data_ptr(), "out32": self._out32.data_ptr(), **fields,
            }  # fmt: skip
        raise ValueError("native decode: compiled callers pass float32 or bfloat16 throughout")

    def __call__(
        self,
        q: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        if PreparedAttend.signature(q, k_flat, v_flat, out) != self._signature:
            raise ValueError("native decode: tensors unlike those it was prepared for")
        kernel, q32, out32 = self._kernel, self._q32, self._out32
        if q32 is not None:
            q = q32.copy_(q)
        shared_slots, tail_slots, tail_lens = self._slots
        shared, max_tail, num_seqs, num_heads, num_kv_heads, head_dim = self._sizes
        self._function(
            q.data_ptr(), q.stride(0), k_flat.data_ptr(), v_flat.data_ptr(),
            shared_slots.data_ptr(), shared, tail_slots.data_ptr(), tail_lens.data_ptr(), max_tail,
            (out if out32 is None else out32).data_ptr(), self._scratch.data_ptr(), num_seqs,
            num_heads, num_kv_heads, head_dim, scale, self._chunk, self._threads,
            kernel.sgemm, kernel.set_threads, *self._extra,
        )  # fmt: skip
        if out32 is not None:
            out.copy_(out32)


def _with_products(kernel: _Kernel, kv_code: int, bfloat16_queries: bool) -> int:
    """A quantized layout's code as the kernel takes it: for a bfloat16 model's queries on a
    CPU with AVX512_BF16, its blocks read as bfloat16 and multiplied in pairs (kv_quant.h's
    KV_PRODUCTS), as a bfloat16 cache is."""
    return kv_code | (_PRODUCTS if bfloat16_queries and kernel.isa & 2 else 0)


_PRODUCTS = 16  # kv_quant.h's KV_PRODUCTS


def _rotation_buffer(shape: torch.Size, kv_code: int) -> _Buffer | None:
    """Where a rotated layout's kernels put the rotated queries ([rows, heads, head_dim]
    float32, kept alive by the caller), as the kernel's last argument; None (NULL) for the
    others."""
    if kv_code != _ROTATED:
        return None
    return _Buffer(torch.empty(shape, dtype=torch.float32))


_ROTATED = 4  # kv_quant.h's KV_Q4: K and V rotated, so are the queries and outputs


class _Buffer:
    """A tensor passed to ctypes as its address, kept alive with the call's arguments."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._as_parameter_ = tensor.data_ptr()


def decode_chunk(num_seqs: int, num_kv_heads: int, threads: int, group: int = 1) -> int:
    """Sequences per decode work item, the three largest of 16, 8, 4, 2, 1 whose ``group``
    stacked query heads fit a direct-path tile: the work items are kv heads x chunks of
    sequences (on the direct path each item's keys in segments of 256, one unit each, which
    balance long contexts over the threads), and the busiest thread's work should be least,
    counted as its items' stacked rows plus `_ITEM_ROWS` per item (each item reads, and in
    bfloat16 pairs, the shared keys' K and V again). E.g. 16 sequences over 3 kv heads of 3
    query heads on 2 threads: chunks of 16 (3 items of 48 rows, 2 on one thread) rather than 8
    (6 items of 24, 3 per thread); one kv head of 8: chunks of 8 (one item per thread). Ties
    go to the larger chunk (larger GEMMs)."""
    best, best_cost = 1, -1
    for chunk in _chunk_sizes(group):
        items = num_kv_heads * -(-num_seqs // chunk)
        cost = -(-items // threads) * (group * min(chunk, num_seqs) + _ITEM_ROWS)
        if best_cost < 0 or cost < best_cost:
            best, best_cost = chunk, cost
    return best


def _chunk_sizes(group: int) -> list[int]:
    """Decode chunk sizes to consider: the three largest of 16, 8, 4, 2, 1 whose ``group``
    stacked query heads fit a direct-path tile (at least 1)."""
    sizes = [c for c in (16, 8, 4, 2, 1) if c <= MAX_DECODE_CHUNK and group * c <= _DIRECT_ROWS]
    return sizes[:3] or [1]


def kernel_name(head_dim: int, dtype: torch.dtype) -> str:
    """Which path attends a model of this head_dim and dtype here: the direct path and its
    vector code (``direct (AVX-512)``, with bfloat16 pairs ``direct (AVX512_BF16)``, or
    ``direct (AVX2)``), the gather path (other head_dims: MKL's GEMMs over gathered K/V), or
    ``torch`` where the kernel is off."""
    kernel = _kernel()
    if kernel is None or not enabled():
        return "torch"
    if not kernel.decode_direct(1, 1, head_dim, 1):
        return "gather (MKL)"
    if dtype == torch.bfloat16 and kernel.isa & 2:
        return "direct (AVX512_BF16)"
    return "direct (AVX-512)" if kernel.isa & 1 else "direct (AVX2)"


@functools.cache
def available() -> bool:
    """True when the kernel builds here and matches a float64 reference, over float32,
    bfloat16 and the quantized caches (their written rows read back, checked once)."""
    kernel = _kernel()
    if kernel is None:
        return False
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, context, new = 6, 2, 37, 21
    slots = torch.randperm(80, generator=gen)[: context + new]
    ok = True
    for dim, dtype, code in ((16, torch.float32, 0), (16, torch.bfloat16, 0),
                             (32, torch.float32, 3), (32, torch.float32, 4)):  # fmt: skip
        k_flat = torch.randn(80, kv_heads, dim, generator=gen)
        v_flat = torch.randn(80, kv_heads, dim, generator=gen)
        q = torch.randn(new, heads, dim, generator=gen)
        k, v = k_flat.to(dtype), v_flat.to(dtype)
        if code:  # written as the layout, read back as the values it stores
            k, v = (torch.zeros(80, kv_heads, kernel.kv_row_bytes(dim, code), dtype=torch.uint8)
                    for _ in range(2))  # fmt: skip
            kv_write(k_flat, v_flat, k, v, torch.arange(80), code)
            k_flat, v_flat = _read_rows(kernel, k, dim, code), _read_rows(kernel, v, dim, code)
        out = torch.empty_like(q)
        attend(q, k, v, slots, dim**-0.5, out, kv_code=code)
        ref = _reference(q, k_flat.to(dtype), v_flat.to(dtype), slots, context)
        ok = ok and torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
    if not ok:
        log.warning("native attention off: its probe disagrees with the reference")
    return ok


def _read_rows(kernel: _Kernel, rows: torch.Tensor, dim: int, code: int) -> torch.Tensor:
    """A quantized cache's rows [n, kv_heads, bytes] as the values they hold [n, kv_heads,
    dim], rotated back."""
    out = torch.empty(rows.shape[0], rows.shape[1], dim)
    for i in range(rows.shape[0] * rows.shape[1]):
        kernel.kv_read(out.data_ptr() + 4 * dim * i, rows.data_ptr(), i, dim, code)
    if code == _ROTATED:
        kernel.hadamard_rows(out.data_ptr(), out.shape[0] * out.shape[1], dim)
    return out


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, context: int
) -> torch.Tensor:
    """Causal attention in float64 of q [T, heads, dim] after ``context`` keys of k, v."""
    new, heads, dim = q.shape
    group = heads // k.shape[1]
    keys = k[slots].double().repeat_interleave(group, 1)  # [S, heads, dim]
    values = v[slots].double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), keys) * dim**-0.5
    visible = torch.arange(context + new) <= (torch.arange(new) + context).unsqueeze(1)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, values)
