"""Compiled CPU kernels for the decoder's element-wise steps (float32 or bfloat16).

`prefixcache/native/layers.c`, built at first use like the attention kernel
(`prefixcache.native`):
residual add + RMSNorm in one pass (`add_rms_norm`), the rotary embedding in place (`rotary_`),
and SwiGLU's ``silu(gate) * up`` (`silu_mul`). torch runs each as 2-6 kernels with temporaries
that stream the activations through memory again (what that costs: docs/performance.md).
Results differ from torch's only by float rounding (summation order, fused
multiply-adds, a polynomial exp with relative error <= 3.1e-7). In bfloat16 they compute in
float32 and round to bfloat16 where torch's bfloat16 code does (the residual sum, the normalised
value before the weight, each product and sum of the rotary).

The library also runs a whole layer as one call (`pc_layer`) or two around the attention
(`pc_layer_inputs`, `pc_layer_outputs`, and their bfloat16 versions), for
`prefixcache.model.fused_layers`, and holds the panel GEMM (`prefixcache.model.panel_gemm`) and
the LoRA updates (`prefixcache.model.lora_batch`).

`available()` is False, and the decoder keeps its torch code, where there is no C compiler, the
build or a one-time probe against torch fails, or ``PREFIXCACHE_NATIVE_LAYERS=0``;
`set_enabled(False)` switches them off at run time (side-by-side benchmarks and tests).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from _ctypes import CFuncPtr

import torch
import torch.nn.functional as F

from prefixcache.native import Switch, load_library, machine

__all__ = [
    "add_rms_norm",
    "applies",
    "available",
    "disabled_by_env",
    "enabled",
    "library",
    "rotary_",
    "set_enabled",
    "silu_mul",
]

log = logging.getLogger(__name__)

_P, _I = ctypes.c_void_p, ctypes.c_int


def _available() -> bool:
    return available()  # looked up at each call, so tests may replace it


_switch = Switch("PREFIXCACHE_NATIVE_LAYERS", _available)
disabled_by_env = _switch.disabled_by_env
set_enabled = _switch.set_enabled  # False: the torch paths, e.g. for side-by-side benchmarks
enabled = _switch.enabled


_DTYPES = (torch.float32, torch.bfloat16)


def applies(x: torch.Tensor) -> bool:
    """Whether the decoder hands ``x`` (float32 or bfloat16 on the CPU) to these kernels now."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and enabled()


@functools.cache
def _library() -> ctypes.CDLL | None:
    if disabled_by_env():
        return None
    library = load_library("layers")
    if library is None:
        return None
    library.pc_set_prefetch_bytes.argtypes = [_I]
    library.pc_set_prefetch_bytes(machine.prefetch_bytes())  # the GEMMs' prefetch distance
    for suffix in ("", "_bf16"):  # attribute access: ctypes caches the function objects
        getattr(library, "pc_add_rms_norm" + suffix).argtypes = [
            _P, _P, _P, _P, _I, _I, ctypes.c_float, _I
        ]  # fmt: skip
        getattr(library, "pc_silu_mul" + suffix).argtypes = [_P, _P, _I, _I, _I]
        getattr(library, "pc_rotary" + suffix).argtypes = [_P, ctypes.c_int64] + [_I] * 3 + [
            _P, _P, _I
        ]  # fmt: skip
        for name in ("pc_add_rms_norm", "pc_silu_mul", "pc_rotary"):
            getattr(library, name + suffix).restype = None
    # LoRA updates after a projection (lora.h; `lora_batch.LoraStep.apply`)
    library.pc_lora_apply.argtypes = [_P, _P, _P, ctypes.c_int64, _I, _P, ctypes.c_int64,
                                      _I, _I, _I, _I]  # fmt: skip
    library.pc_lora_apply.restype = None
    # a struct layer_args (`fused_layers.LayerArgs`)
    library.pc_layer.argtypes = library.pc_layer_bf16.argtypes = [_P]
    library.pc_layer_inputs.argtypes = library.pc_layer_inputs_bf16.argtypes = [_P]
    library.pc_layer_outputs.argtypes = library.pc_layer_outputs_bf16.argtypes = [_P, _P]
    for function in (
        library.pc_layer,
        library.pc_layer_bf16,
        library.pc_layer_inputs,
        library.pc_layer_outputs,
        library.pc_layer_inputs_bf16,
        library.pc_layer_outputs_bf16,
    ):
        function.restype = None
    return library


def _library_or_raise() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise RuntimeError("native layers are not available")
    return library


def _one_cpu_dtype(*tensors: torch.Tensor) -> bool:
    """All on the CPU, all float32 or all bfloat16."""
    dtype = tensors[0].dtype
    return dtype in _DTYPES and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)


def _function(library: ctypes.CDLL, name: str, dtype: torch.dtype) -> CFuncPtr:
    suffix = "_bf16" if dtype == torch.bfloat16 else ""
    function: CFuncPtr = getattr(library, name + suffix)
    return function


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``h += delta`` in place (unless delta is None), then RMSNorm(h) * weight as a new tensor.

    h, delta: [rows, n] contiguous CPU, float32 or bfloat16; weight: [n], the same dtype.
    """
    library = _library_or_raise()
    rows, n = h.shape if h.dim() == 2 else (-1, -1)
    others = [weight] if delta is None else [weight, delta]
    if not (
        h.dim() == 2
        and h.is_contiguous()
        and weight.shape == (n,)
        and weight.is_contiguous()
        and (delta is None or (delta.shape == h.shape and delta.is_contiguous()))
        and _one_cpu_dtype(h, *others)
    ):
        raise ValueError("native add_rms_norm: unsupported shapes, strides or dtypes")
    out = torch.empty_like(h)
    _function(library, "pc_add_rms_norm", h.dtype)(
        h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
        out.data_ptr(), rows, n, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 * I] contiguous CPU (float32 or bfloat16) -> silu(gate) * up,
    [rows, I]."""
    library = _library_or_raise()
    if not (
        gate_up.dim() == 2
        and gate_up.shape[1] % 2 == 0
        and gate_up.is_contiguous()
        and _one_cpu_dtype(gate_up)
    ):
        raise ValueError("native silu_mul: unsupported shapes, strides or dtypes")
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    silu_mul_fn = _function(library, "pc_silu_mul", gate_up.dtype)
    silu_mul_fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in place (rows may be strided; heads and head_dim
    contiguous) by `RotaryEmbedding.cos_sin`'s tables ([T, 1, head_dim] each, x's dtype);
    returns x."""
    library = _library_or_raise()
    num_tokens, heads, head_dim = x.shape if x.dim() == 3 else (-1, -1, -1)
    if not (
        x.dim() == 3
        and head_dim % 2 == 0
        and x.stride(2) == 1
        and x.stride(1) == head_dim
        and x.stride(0) >= heads * head_dim
        and cos.shape == signed_sin.shape == (num_tokens, 1, head_dim)
        and cos.is_contiguous()
        and signed_sin.is_contiguous()
        and _one_cpu_dtype(x, cos, signed_sin)
    ):
        raise ValueError("native rotary_: unsupported shapes, strides or dtypes")
    _function(library, "pc_rotary", x.dtype)(
        x.data_ptr(), x.stride(0), num_tokens, heads, head_dim, cos.data_ptr(),
        signed_sin.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return x


def library() -> ctypes.CDLL | None:
    """The built library (for `fused_layers`, which calls its layer functions directly after
    checking a step once), or None where it is unavailable."""
    return _library()


@functools.cache
def available() -> bool:
    """True when the kernels build here and agree with torch on a probe (checked once)."""
    if _library() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(5, 48, generator=gen)
    delta, weight = torch.randn(5, 48, generator=gen), torch.randn(48, generator=gen)
    expected_h = h + delta
    ok = torch.allclose(
        add_rms_norm(h, delta, weight, 1e-6), F.rms_norm(expected_h, (48,), weight, 1e-6),
        rtol=1e-5, atol=1e-5,
    ) and torch.equal(h, expected_h)  # fmt: skip
    gate_up = torch.randn(3, 2 * 40, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    ok = ok and torch.allclose(silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 3, 16, generator=gen)
    angles = torch.randn(4, 1, 8, generator=gen)
    cos = torch.cat((angles, angles), -1).cos()
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1)
    expected = x * cos + x.roll(8, dims=-1) * signed_sin
    ok = ok and torch.allclose(rotary_(x, cos, signed_sin), expected, rtol=1e-5, atol=1e-5)
    if not ok:
        log.warning("native layers off: the probe disagrees with torch")
    return bool(ok)
