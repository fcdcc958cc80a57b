"""Compiled CPU kernels for the decoder's element-wise steps (float32).

`prefixcache/native/layers.c`, built at first use like the attention kernel
(`prefixcache.native`):
residual add + RMSNorm in one pass (`add_rms_norm`), the rotary embedding in place (`rotary_`),
and SwiGLU's ``silu(gate) * up`` (`silu_mul`). torch runs each as 2-6 kernels with temporaries;
on `small` (2 threads) the three take a 2,048-token prefill from 1,163 to 1,080 ms and a
128-token step after a cache hit from 98.1 to 93.9 ms (`benchmarks/bench_model.py` figures in
docs/model.md). Results differ from torch's only by float rounding (summation order, fused
multiply-adds, a polynomial exp with relative error <= 3.1e-7).

Where the projections hold packed weights (`packed_gemm`), the decoder runs the steps before
each attention (add + norm, qkv projection, rotary, K/V write: `attention_inputs`) and after it
(o projection, add + norm, MLP: `mlp_block`) as one call each, calling MKL's packed GEMM from C:
the same operations and bits, without the 50-100 Python operations between calls that each ran
on caches a GEMM had just flushed (a 128-token step after a cache hit on `small`: 108.7 -> 105.7
and 113.2 -> 109.3 ms alternating in one process; docs/model.md).

`available()` is False, and the decoder keeps its torch code, where there is no C compiler, the
build or a one-time probe against torch fails, or ``PREFIXCACHE_NATIVE_LAYERS=0``;
`set_enabled(False)` switches them off at run time (side-by-side benchmarks and tests).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from prefixcache.model import packed_gemm
from prefixcache.model.packed_gemm import PackedWeight
from prefixcache.native import Switch, load_library

__all__ = [
    "add_rms_norm",
    "applies",
    "attention_inputs",
    "available",
    "disabled_by_env",
    "enabled",
    "mlp_block",
    "rotary_",
    "set_enabled",
    "silu_mul",
]

log = logging.getLogger(__name__)

_P, _I = ctypes.c_void_p, ctypes.c_int
_switch = Switch("PREFIXCACHE_NATIVE_LAYERS", lambda: available())
disabled_by_env = _switch.disabled_by_env
set_enabled = _switch.set_enabled  # False: the torch paths, e.g. for side-by-side benchmarks
enabled = _switch.enabled


def applies(x: torch.Tensor) -> bool:
    """Whether the decoder hands ``x`` (float32 on the CPU) to these kernels now."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and enabled()


@functools.cache
def _library() -> ctypes.CDLL | None:
    if disabled_by_env():
        return None
    library = load_library("layers")
    if library is None:
        return None
    library.pc_add_rms_norm.argtypes = [_P, _P, _P, _P, _I, _I, ctypes.c_float, _I]
    library.pc_silu_mul.argtypes = [_P, _P, _I, _I, _I]
    library.pc_rotary.argtypes = [_P, ctypes.c_int64, _I, _I, _I, _P, _P, _I]
    library.pc_attention_inputs.argtypes = [_P, _P, _P, _P, ctypes.c_float, _P, _I, _I, _P, _P]
    library.pc_attention_inputs.argtypes += [_P, _I, _I, _I, _P, _P, _P, _P, _P, _I]
    library.pc_mlp_block.argtypes = [_P, _P, _I, _I, _P, _P, _I, _P, ctypes.c_float, _P, _I]
    library.pc_mlp_block.argtypes += [_P] * 6 + [_I, _I]
    for function in (
        library.pc_add_rms_norm,
        library.pc_silu_mul,
        library.pc_rotary,
        library.pc_attention_inputs,
        library.pc_mlp_block,
    ):
        function.restype = None
    return library


def _library_or_raise() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise RuntimeError("native layers are not available")
    return library


def _is_f32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``h += delta`` in place (unless delta is None), then RMSNorm(h) * weight as a new tensor.

    h, delta: [rows, n] contiguous float32 CPU; weight: [n].
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
        and _is_f32_cpu(h, *others)
    ):
        raise ValueError("native add_rms_norm: unsupported shapes, strides or dtypes")
    out = torch.empty_like(h)
    library.pc_add_rms_norm(
        h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
        out.data_ptr(), rows, n, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 * I] contiguous float32 CPU -> silu(gate) * up, [rows, I]."""
    library = _library_or_raise()
    if not (
        gate_up.dim() == 2
        and gate_up.shape[1] % 2 == 0
        and gate_up.is_contiguous()
        and _is_f32_cpu(gate_up)
    ):
        raise ValueError("native silu_mul: unsupported shapes, strides or dtypes")
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    library.pc_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2,
                        torch.get_num_threads())  # fmt: skip
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in place (rows may be strided; heads and head_dim
    contiguous) by `RotaryEmbedding.cos_sin`'s tables ([T, 1, head_dim] each); returns x."""
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
        and _is_f32_cpu(x, cos, signed_sin)
    ):
        raise ValueError("native rotary_: unsupported shapes, strides or dtypes")
    library.pc_rotary(
        x.data_ptr(), x.stride(0), num_tokens, heads, head_dim, cos.data_ptr(),
        signed_sin.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return x


def attention_inputs(
    h: torch.Tensor,
    delta: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: PackedWeight,
    qkv_bias: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    slot_range: tuple[int, int] | None = None,
) -> torch.Tensor:
    """A layer's steps before its attention, in one call: ``h += delta`` (unless None), x =
    RMSNorm(h) * norm_weight, qkv = x W^T (+ bias) through the packed weight, q and k rotated,
    this step's k and v written to their cache slots. Returns qkv [rows, heads + 2 kv_heads,
    head_dim].

    h, delta: [rows, hidden] contiguous float32 CPU; cos, signed_sin: [rows, 1, head_dim]
    (`RotaryEmbedding.cos_sin`); caches contiguous, viewable as [num_slots, kv_heads,
    head_dim]; slot_mapping: [rows] int64. ``slot_range``: the mapping's (min, max) when the
    caller already has them (computed once per step for all layers), else computed here.
    """
    library = _library_or_raise()
    rows, hidden = h.shape if h.dim() == 2 else (-1, -1)
    head_dim = cos.shape[-1]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    kv_width = num_kv_heads * head_dim
    if not (
        h.dim() == 2
        and h.is_contiguous()
        and (delta is None or (delta.shape == h.shape and delta.is_contiguous()))
        and norm_weight.shape == (hidden,)
        and norm_weight.is_contiguous()
        and (qkv_weight.in_features, qkv_weight.out_features) == (hidden, width)
        and (qkv_bias is None or (qkv_bias.shape == (width,) and qkv_bias.is_contiguous()))
        and head_dim % 2 == 0
        and cos.shape == signed_sin.shape == (rows, 1, head_dim)
        and cos.is_contiguous()
        and signed_sin.is_contiguous()
        and k_cache.shape == v_cache.shape
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.numel() % kv_width == 0
        and slot_mapping.shape == (rows,)
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and _is_f32_cpu(h, norm_weight, cos, signed_sin, k_cache, v_cache)
        and (delta is None or _is_f32_cpu(delta))
        and (qkv_bias is None or _is_f32_cpu(qkv_bias))
    ):
        raise ValueError("native attention_inputs: unsupported shapes, strides or dtypes")
    if rows and slot_range is None:
        low, high = slot_mapping.aminmax()
        slot_range = (int(low), int(high))
    if rows and not (0 <= slot_range[0] and slot_range[1] < k_cache.numel() // kv_width):
        raise ValueError("native attention_inputs: slot out of range")
    x = torch.empty_like(h)
    qkv = h.new_empty(rows, num_heads + 2 * num_kv_heads, head_dim)
    library.pc_attention_inputs(
        packed_gemm.compute_address(), h.data_ptr(), None if delta is None else delta.data_ptr(),
        norm_weight.data_ptr(), eps, x.data_ptr(), rows, hidden, qkv_weight.buffer.data_ptr(),
        None if qkv_bias is None else qkv_bias.data_ptr(), qkv.data_ptr(), num_heads,
        num_kv_heads, head_dim, cos.data_ptr(), signed_sin.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), slot_mapping.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return qkv


def mlp_block(
    attended: torch.Tensor,
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    o_weight: PackedWeight,
    gate_up_weight: PackedWeight,
    down_weight: PackedWeight,
    chunk_rows: int,
) -> torch.Tensor:
    """A layer's steps after its attention, in one call: ``h += attended W_o^T``, x =
    RMSNorm(h) * norm_weight, and the SwiGLU MLP of x (``chunk_rows`` rows at a time); returns
    the MLP output [rows, hidden] (the next layer adds it to h).

    attended: [rows, q_size], h: [rows, hidden], both contiguous float32 CPU.
    """
    library = _library_or_raise()
    rows, hidden = h.shape if h.dim() == 2 else (-1, -1)
    intermediate = gate_up_weight.out_features // 2
    if not (
        h.dim() == 2
        and h.is_contiguous()
        and attended.shape == (rows, o_weight.in_features)
        and attended.is_contiguous()
        and o_weight.out_features == hidden
        and norm_weight.shape == (hidden,)
        and norm_weight.is_contiguous()
        and (gate_up_weight.in_features, gate_up_weight.out_features) == (hidden, 2 * intermediate)
        and (down_weight.in_features, down_weight.out_features) == (intermediate, hidden)
        and chunk_rows > 0
        and _is_f32_cpu(h, attended, norm_weight)
    ):
        raise ValueError("native mlp_block: unsupported shapes, strides or dtypes")
    chunk = min(rows, chunk_rows)
    o, x, out = torch.empty_like(h), torch.empty_like(h), torch.empty_like(h)
    gate_up = h.new_empty(chunk, 2 * intermediate)
    act = h.new_empty(chunk, intermediate)
    library.pc_mlp_block(
        packed_gemm.compute_address(), attended.data_ptr(), rows, o_weight.in_features,
        o_weight.buffer.data_ptr(), h.data_ptr(), hidden, norm_weight.data_ptr(), eps,
        gate_up_weight.buffer.data_ptr(), intermediate, down_weight.buffer.data_ptr(),
        o.data_ptr(), x.data_ptr(), gate_up.data_ptr(), act.data_ptr(), out.data_ptr(),
        max(chunk, 1), torch.get_num_threads(),
    )  # fmt: skip
    return out


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
    gate, up = gate_up.split(40, dim=-1)
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
