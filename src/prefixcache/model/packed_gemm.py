"""Projection weights packed once into MKL's GEMM layout (CPU, float32).

``torch.nn.functional.linear`` on CPU calls MKL's sgemm, which copies the weight into its blocked
layout on every call. At a 2,048-row prefill that copy is amortised; at the 128 rows of a
prefill after a cache hit, or the few rows of a decode step, it is a quarter of the GEMM time.
MKL's packed API (``cblas_sgemm_pack`` once, ``cblas_sgemm_compute`` per call) keeps the packed
copy; it is the same scheme as IPEX's packed linear and oneDNN's prepacked weights in vLLM's CPU
backend. It pays most at tens to hundreds of rows, little at thousands or at one
(`benchmarks/bench_packed_gemm.py`; figures in docs/performance.md).

PyTorch exports the cblas symbols of the MKL it links (``libtorch_cpu``) but no Python binding
that takes a packed weight for any row count (``torch.ops.mkl._mkl_linear`` only uses it when the
rows equal the packing's, else falls back to the unpacked weight), so the two calls go through
``ctypes``. The packed B layout does not depend on the row count (MKL sizes it from n and k
alone): one packed copy serves every step. Where the symbols are missing (no MKL: ARM, macOS) or
a one-time probe against ``F.linear`` disagrees, `available()` is False and callers keep
``F.linear``.
"""

from __future__ import annotations

import ctypes
import functools
import os
from _ctypes import CFuncPtr
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["PackedWeight", "available", "compute_address"]

# CBLAS enum values (mkl_cblas.h).
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
_INT, _PTR, _FLOAT = ctypes.c_int, ctypes.c_void_p, ctypes.c_float  # MKL_INT is 32-bit (LP64)
# The row count packing is told to expect. The packed layout's size does not depend on it and any
# row count computes correctly, but MKL tunes the layout for it: 128 was no slower than 1 or
# 2,048 at any row count from 1 to 2,048 on `small`'s projections (docs/performance.md).
PACK_ROWS_HINT = 128


@dataclass(slots=True, frozen=True)
class _Cblas:
    pack_get_size: CFuncPtr
    pack: CFuncPtr
    compute: CFuncPtr


@functools.cache
def _cblas() -> _Cblas | None:
    """The packed-GEMM entry points of the MKL inside libtorch_cpu, or None."""
    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]  # torch: unhinted
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        get_size, pack, compute = (
            lib.cblas_sgemm_pack_get_size,
            lib.cblas_sgemm_pack,
            lib.cblas_sgemm_compute,
        )
    except (OSError, AttributeError):
        return None
    get_size.restype = ctypes.c_size_t
    get_size.argtypes = [_INT, _INT, _INT, _INT]
    pack.restype = None
    pack.argtypes = [_INT, _INT, _INT, _INT, _INT, _INT, _FLOAT, _PTR, _INT, _PTR]
    compute.restype = None
    compute.argtypes = [_INT, _INT, _INT, _INT, _INT, _INT, _PTR, _INT, _PTR, _INT, _FLOAT]
    compute.argtypes += [_PTR, _INT]
    return _Cblas(get_size, pack, compute)


@dataclass(slots=True, eq=False)
class PackedWeight:
    """A linear weight [out_features, in_features] in MKL's packed layout.

    ``buffer`` must never move (MKL keeps aligned metadata inside it): it is a uint8 tensor
    owned here and never copied. ``matmul(x, bias)`` equals ``F.linear(x, weight, bias)`` up to
    float rounding, for any number of rows.
    """

    buffer: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight:
        """Pack a float32 CPU weight [out, in]; requires `available()`."""
        cblas = _cblas()
        if cblas is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("packed GEMM needs MKL and a float32 CPU weight")
        weight = weight.detach().contiguous()
        out_features, in_features = weight.shape
        # B = weight^T [in, out]; packing takes it from the row-major [out, in] array, transposed.
        size = cblas.pack_get_size(_B_MATRIX, PACK_ROWS_HINT, out_features, in_features)
        buffer = torch.empty(size, dtype=torch.uint8)
        cblas.pack(
            _ROW_MAJOR, _B_MATRIX, _TRANS, PACK_ROWS_HINT, out_features, in_features, 1.0,
            weight.data_ptr(), in_features, buffer.data_ptr(),
        )  # fmt: skip
        return cls(buffer, out_features, in_features)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it multiplies (float32 only)."""
        return torch.float32

    @property
    def gemm_kind(self) -> str:
        """Which C GEMM multiplies it (MKL's packed compute)."""
        return "mkl"

    @property
    def operand(self) -> int:
        """What the compiled layers hand the GEMM as its packed weight."""
        return self.buffer.data_ptr()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] float32 CPU -> [rows, out] = x @ weight^T (+ bias)."""
        # MKL reads raw pointers: a wrong dtype or width would read out of bounds, not fail
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected x [rows, {self.in_features}], got {tuple(x.shape)}")
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"expected float32 CPU input, got {x.dtype} on {x.device}")
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"expected bias [{self.out_features}], got {tuple(bias.shape)}")
        if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) < self.in_features):
            x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows == 0:
            return out
        beta = 0.0
        if bias is not None:
            out.copy_(bias.expand(rows, self.out_features))
            beta = 1.0
        _cblas().compute(  # type: ignore[union-attr]
            _ROW_MAJOR, _NO_TRANS, _PACKED, rows, self.out_features, self.in_features,
            x.data_ptr(), x.stride(0) if rows > 1 else self.in_features, self.buffer.data_ptr(),
            self.in_features, beta, out.data_ptr(), self.out_features,
        )  # fmt: skip
        return out


@functools.cache
def compute_address() -> int:
    """Address of MKL's ``cblas_sgemm_compute``, for compiled code that multiplies through
    packed weights itself (`prefixcache.model.fused_layers`)."""
    cblas = _cblas()
    address = None if cblas is None else ctypes.cast(cblas.compute, ctypes.c_void_p).value
    if not address:
        raise RuntimeError("packed GEMM is not available")
    return address


@functools.cache
def available() -> bool:
    """True when packed GEMM runs here and matches ``F.linear`` (checked once per process)."""
    return _cblas() is not None and agrees_with_linear(PackedWeight.pack, 1e-5)


def checked_operands(
    x: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` [rows, in_features] and ``bias`` [out_features] (or None) of ``dtype`` on the CPU,
    rows contiguous, for a kernel reading raw pointers (a wrong dtype or width would read out
    of bounds): ValueError otherwise."""
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"expected x [rows, {in_features}], got {tuple(x.shape)}")
    if x.dtype != dtype or x.device.type != "cpu":
        raise ValueError(f"expected {dtype} CPU input, got {x.dtype} on {x.device}")
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != dtype
                             or not bias.is_cpu):  # fmt: skip
        raise ValueError(f"expected a {dtype} bias [{out_features}]")
    if x.stride(1) != 1 or x.stride(0) < in_features:
        x = x.contiguous()
    return x, None if bias is None else bias.contiguous()


def agrees_with_linear(
    pack: Callable[[torch.Tensor], Any], tol: float, dtype: torch.dtype = torch.float32
) -> bool:
    """A one-time probe: ``pack(weight).matmul(x, bias)`` equals ``F.linear`` within ``tol`` at
    the row counts that take different kernel paths (weights and inputs in ``dtype``)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(67, 45, generator=gen).to(dtype)
    bias = torch.randn(67, generator=gen).to(dtype)
    packed = pack(weight)
    for rows in (1, 3, 64, 130):
        x = torch.randn(rows, 45, generator=gen).to(dtype)
        ref = F.linear(x, weight, bias).float()
        if not torch.allclose(packed.matmul(x, bias).float(), ref, rtol=tol, atol=tol):
            return False
    return True
