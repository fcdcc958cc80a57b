"""Projection weights packed into column panels for the package's own GEMM (CPU, float32 or
bfloat16), and whether it beats the libraries on the model's shape, measured at start-up.

A decode step multiplies a few rows by every weight of the model: the weights stream from
memory once per step, and the GEMM libraries' small-row kernels keep neither the memory nor the
FMA units busy while they do (oneDNN's and MKL's, on the 2-core AMD machine of
docs/performance.md). `prefixcache/native/panel_gemm.h` (compiled into the layers library) lays
each weight out once as panels of 48 output columns that stay in L2 while every 8-row tile of
the input goes through them, prefetching the weight stream ahead of the first tile; in bfloat16
it multiplies pairs with ``vdpbf16ps`` (float32 sums, one rounding at the end). Each output
value is the same sequence of operations whatever the row or thread count, so a row's result
does not depend on the batch it is in.

`prefer_panel` times it against the library the model would use otherwise (at 16 and 128 rows
on one projection of the model, once per shape and process) and keeps that library only where it
is clearly faster; ``PREFIXCACHE_PANEL_GEMM=1`` or ``=0`` forces the choice. Where the
CPU lacks AVX-512 (float32) or AVX512_BF16 (bfloat16) the kernels are plain loops and never
chosen.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixcache.model import native_layers, onednn_gemm, packed_gemm

__all__ = [
    "PanelWeight", "available", "compute_address", "kernel_name", "prefer_panel", "vectorised",
]

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_DTYPES = (torch.float32, torch.bfloat16)
# The other library must be this much faster to be kept (timing noise; in float32 the panel GEMM
# also lets the compiled whole-layer steps run).
MIN_SPEEDUP = 1.1


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = native_layers.library()
    if library is None:
        return None
    library.pc_panel_isa.restype = _I
    library.pc_panel_isa.argtypes = []
    library.pc_panel_size.restype = _I64
    library.pc_panel_size.argtypes = [_I, _I]
    for name in ("pc_panel_pack", "pc_panel_pack_bf16", "pc_panel_pack_bf16w"):
        getattr(library, name).restype = None
        getattr(library, name).argtypes = [_P, _I, _I, _P]
    for name in ("pc_panel_gemm", "pc_panel_gemm_bf16w"):
        getattr(library, name).restype = None
        getattr(library, name).argtypes = [_P, _I64, _I, _I, _P, _I, _P, _F, _P, _I64, _I]
    library.pc_panel_gemm_bf16.restype = None
    library.pc_panel_gemm_bf16.argtypes = [_P, _I64, _I, _I, _P, _I, _P, _P, _I64, _I]
    return library


def _library_or_raise() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise RuntimeError("the panel GEMM needs the native layers library")
    return library


@dataclass(slots=True, eq=False)
class PanelWeight:
    """A linear weight [out, in] in column panels, stored in float32 or bfloat16, multiplied in
    ``dtype``: float32 (a bfloat16 weight widened to float32 in the kernel) or bfloat16 (a
    bfloat16 weight); ``matmul(x, bias)`` equals ``F.linear(x, weight, bias)`` over the stored
    weight up to float rounding, for 2-D ``x`` of ``dtype`` and any row count."""

    buffer: torch.Tensor
    out_features: int
    in_features: int
    dtype: torch.dtype  # what it multiplies: x, bias and the result

    @classmethod
    def pack(cls, weight: torch.Tensor, dtype: torch.dtype | None = None) -> PanelWeight:
        """Pack ``weight`` as it is, for inputs of ``dtype`` (default: the weight's own; a
        bfloat16 weight can also serve float32 inputs)."""
        library = _library_or_raise()
        if weight.dim() != 2 or weight.dtype not in _DTYPES or weight.device.type != "cpu":
            raise ValueError("the panel GEMM packs 2-D float32 or bfloat16 CPU weights")
        dtype = weight.dtype if dtype is None else dtype
        if dtype not in (weight.dtype, torch.float32):
            raise ValueError(f"a {weight.dtype} panel weight cannot multiply {dtype} inputs")
        weight = weight.detach().contiguous()
        out_features, in_features = weight.shape
        buffer = weight.new_empty(library.pc_panel_size(out_features, in_features))
        if weight.dtype == torch.float32:
            pack = library.pc_panel_pack
        else:
            bf16 = dtype == torch.bfloat16
            pack = library.pc_panel_pack_bf16 if bf16 else library.pc_panel_pack_bf16w
        pack(weight.data_ptr(), out_features, in_features, buffer.data_ptr())
        return cls(buffer, out_features, in_features, dtype)

    @property
    def storage(self) -> torch.dtype:
        """The dtype the weights are stored in."""
        return self.buffer.dtype

    @property
    def gemm_kind(self) -> str:
        """Which C GEMM multiplies it: panel-float32, panel-bfloat16 or panel-bf16w (bfloat16
        weights, float32 inputs)."""
        if self.dtype == torch.float32 and self.storage == torch.bfloat16:
            return "panel-bf16w"
        return f"panel-{str(self.dtype).removeprefix('torch.')}"

    @property
    def operand(self) -> int:
        """What the compiled layers hand the GEMM as its packed weight."""
        return self.buffer.data_ptr()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] of the weight's dtype on the CPU -> [rows, out] = x @ weight^T (+ bias)."""
        x, bias = packed_gemm.checked_operands(x, bias, self.in_features, self.out_features,
                                               self.dtype)  # fmt: skip
        rows = x.shape[0]
        out = x.new_empty(rows, self.out_features)
        if rows == 0:
            return out
        library, threads = _library_or_raise(), torch.get_num_threads()
        bias_ptr = None if bias is None else bias.data_ptr()
        args = (x.data_ptr(), x.stride(0), rows, self.in_features, self.buffer.data_ptr(),
                self.out_features, bias_ptr)  # fmt: skip
        if self.dtype == torch.float32:
            wide = self.storage == torch.float32
            gemm = library.pc_panel_gemm if wide else library.pc_panel_gemm_bf16w
            gemm(*args, 0.0, out.data_ptr(), self.out_features, threads)
        else:
            library.pc_panel_gemm_bf16(*args, out.data_ptr(), self.out_features, threads)
        return out


def vectorised(dtype: torch.dtype) -> bool:
    """Whether this build's kernel for ``dtype`` is the vector one (AVX-512F for float32,
    AVX512_BF16 for bfloat16), not the plain loops."""
    library = _library()
    if library is None or dtype not in _DTYPES:
        return False
    return bool(library.pc_panel_isa() & (1 if dtype == torch.float32 else 2))


def kernel_name(dtype: torch.dtype) -> str:
    """The instruction set of this build's kernel for ``dtype``: ``AVX-512F``, ``AVX512_BF16``,
    ``AVX2`` (bfloat16 widened to float32 there) or ``plain loops``."""
    library = _library()
    if library is None or not vectorised(dtype):
        return "plain loops"
    bf16 = dtype == torch.bfloat16
    if library.pc_panel_isa() & (8 if bf16 else 4):
        return "AVX2"
    return "AVX512_BF16" if bf16 else "AVX-512F"


@functools.cache
def available(dtype: torch.dtype = torch.float32) -> bool:
    """True when the panel GEMM builds here and agrees with ``F.linear`` for ``dtype`` (probed
    once per dtype)."""
    if _library() is None or dtype not in _DTYPES:
        return False
    tol = 1e-4 if dtype == torch.float32 else 2**-7  # bfloat16: a rounding step of 2^-8
    return packed_gemm.agrees_with_linear(PanelWeight.pack, tol, dtype)


@functools.cache
def compute_address(bf16w: bool = False) -> int:
    """Address of ``pc_panel_compute`` (MKL's ``cblas_sgemm_compute`` signature over a float32
    `PanelWeight`), or with ``bf16w`` of ``pc_panel_compute_bf16w`` (bfloat16 weights, float32
    inputs), for the compiled layer steps (`prefixcache.model.fused_layers`)."""
    library = _library_or_raise()
    function = library.pc_panel_compute_bf16w if bf16w else library.pc_panel_compute
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address
    return address


@functools.cache
def prefer_panel(in_features: int, out_features: int, dtype: torch.dtype, onednn: bool) -> bool:
    """Whether this process multiplies projections of this shape and dtype through the panel
    GEMM rather than the library it would use otherwise (float32: MKL's packed GEMM, or oneDNN's
    with ``onednn``; bfloat16: oneDNN's, else ``F.linear``): forced by the environment, else
    measured at 16 and 128 rows (medians of alternating calls); the other library must be
    `MIN_SPEEDUP` times faster at one of them to be kept."""
    forced = onednn_gemm.forced_by_env("PREFIXCACHE_PANEL_GEMM")
    if forced is not None:
        return forced and available(dtype)
    if not (vectorised(dtype) and available(dtype)):
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    other, panel = _alternative(weight, onednn), PanelWeight.pack(weight).matmul
    for rows in (16, 128):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        panel_s, other_s = onednn_gemm.alternating_medians(panel, other, x)
        if other_s * MIN_SPEEDUP < panel_s:
            return False
    return True


def _alternative(weight: torch.Tensor, onednn: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    if weight.dtype == torch.float32 and not onednn and packed_gemm.available():
        return packed_gemm.PackedWeight.pack(weight).matmul
    if onednn_gemm.available(weight.dtype):
        return onednn_gemm.OneDnnWeight.pack(weight).matmul
    return functools.partial(F.linear, weight=weight)
