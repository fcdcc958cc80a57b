"""Projection weights prepacked for oneDNN's GEMM (CPU, float32 or bfloat16), and for float32
the choice between it and MKL's packed GEMM, measured at start-up on the model's own shape.

Which library multiplies fastest depends on the CPU, not the model: the MKL inside torch picks
its kernels by vendor, and on AMD's full-width AVX-512 cores (Zen 5) its float32 GEMM runs at
about half the rate oneDNN reaches (figures in docs/performance.md). Where MKL is not slower,
its packed GEMM also lets the compiled whole-layer steps run (they call it from C,
`fused_layers`). `prefer_onednn` therefore times both on one projection of the model (a few
milliseconds, once per shape and process) and takes oneDNN only where it is clearly faster.
``PREFIXCACHE_ONEDNN_LINEAR=1`` or ``=0`` forces the choice. A bfloat16 weight has no MKL
alternative: its prepacked copy gives the same bits as ``F.linear`` (which calls oneDNN too),
without re-laying out the weight on every call, so it is always used where it runs.

oneDNN's prepacked weight is an opaque tensor (``torch.ops.mkldnn._reorder_linear_weight``) that
``torch.ops.mkldnn._linear_pointwise`` multiplies for any row count; a one-time probe against
``F.linear`` guards the path (`available`).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixcache.model import packed_gemm

__all__ = ["OneDnnWeight", "alternating_medians", "available", "forced_by_env", "prefer_onednn"]

# The row count the reorder is told to expect (as MKL's PACK_ROWS_HINT): any row count computes.
PACK_ROWS_HINT = 128
# oneDNN must beat MKL's packed GEMM by this factor to be chosen (timing noise, and MKL's path
# also enables the compiled whole-layer steps, which oneDNN's cannot enter).
MIN_SPEEDUP = 1.25


@dataclass(slots=True, eq=False)
class OneDnnWeight:
    """A linear weight [out, in] (float32 or bfloat16) prepacked for oneDNN; ``matmul(x, bias)``
    equals ``F.linear(x, weight, bias)`` up to float rounding, for 2-D ``x`` of the weight's
    dtype and any row count."""

    packed: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> OneDnnWeight:
        out_features, in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        return cls(packed, out_features, in_features)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it multiplies (the weight's)."""
        return self.packed.dtype

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected x [rows, {self.in_features}], got {tuple(x.shape)}")
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, bias, "none", [], ""
        )
        return out


@functools.cache
def available(dtype: torch.dtype = torch.float32) -> bool:
    """True when oneDNN's prepacked linear runs here for ``dtype`` and matches ``F.linear``
    (probed once per dtype)."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]  # torch: unhinted
        return False
    # bfloat16: the same products as F.linear; the tolerance covers a rounding step of 2^-8
    tol = 1e-4 if dtype == torch.float32 else 2**-7
    try:
        return packed_gemm.agrees_with_linear(OneDnnWeight.pack, tol, dtype)
    except (RuntimeError, AttributeError):  # an op missing from this torch build
        return False


def _forced() -> bool | None:
    return forced_by_env("PREFIXCACHE_ONEDNN_LINEAR")


def forced_by_env(variable: str) -> bool | None:
    """A GEMM choice the environment forces: True for ``1``/``true``/``yes``/``on``, False for
    ``0``/``false``/``no``/``off``, else None (measure)."""
    value = os.environ.get(variable, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


@functools.cache
def prefer_onednn(in_features: int, out_features: int) -> bool:
    """Whether this process should multiply float32 projections of this shape through oneDNN
    rather than MKL's packed GEMM: forced by the environment, else measured (medians of
    alternating calls at 16 and 128 rows; oneDNN must be `MIN_SPEEDUP` times faster at both)."""
    forced = _forced()
    if forced is not None:
        return forced and available()
    if not available():
        return False
    if not packed_gemm.available():
        return True
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen)
    mkl, dnnl = packed_gemm.PackedWeight.pack(weight), OneDnnWeight.pack(weight)
    for rows in (16, 128):
        x = torch.randn(rows, in_features, generator=gen)
        dnnl_s, mkl_s = alternating_medians(dnnl.matmul, mkl.matmul, x)
        if dnnl_s * MIN_SPEEDUP > mkl_s:
            return False
    return True


def alternating_medians(
    a: Callable[[torch.Tensor], torch.Tensor],
    b: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    repeats: int = 9,
) -> tuple[float, float]:
    """Median seconds of ``a(x)`` and ``b(x)``, timed in turn after two warm-up rounds, so that
    a change in the machine's speed while they run hits both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeats + 2):
        for f, spent in zip((a, b), times, strict=True):
            start = time.perf_counter()
            f(x)
            if i >= 2:
                spent.append(time.perf_counter() - start)
    return sorted(times[0])[repeats // 2], sorted(times[1])[repeats // 2]
