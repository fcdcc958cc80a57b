"""The compiled element-wise kernels of the decoder (`model.native_layers`): residual add +
RMSNorm, rotary embedding, SwiGLU. Each equals a float64 reference for any shape, thread count
and magnitude; in bfloat16 each gives transformers' bfloat16 bits; bad input is refused.
(Their build, portable variant and switch: tests/test_native_build.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from native_support import require_native_layers
from prefixcache.model import native_layers
from prefixcache.model.rope import apply_rotary


@pytest.fixture(autouse=True)
def _native() -> None:
    require_native_layers()


def _on_threads(threads: int, fn):  # noqa: ANN001, ANN202
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 70),
    width=st.integers(1, 300),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    with_delta=st.booleans(),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_add_rms_norm_equals_reference(rows, width, scale, with_delta, threads, seed) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, width, generator=gen) * scale
    delta = torch.randn(rows, width, generator=gen) * scale if with_delta else None
    weight = torch.randn(width, generator=gen)
    summed = h + delta if delta is not None else h.clone()
    out = _on_threads(threads, lambda: native_layers.add_rms_norm(h, delta, weight, 1e-5))
    assert torch.equal(h, summed)  # the residual stream holds exactly h + delta
    x = summed.double()
    ref = weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6 * ref.abs().max().item())


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    width=st.integers(1, 200),
    scale=st.sampled_from([0.1, 3.0, 30.0, 1e4]),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_silu_mul_equals_reference(rows, width, scale, threads, seed) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * scale
    out = _on_threads(threads, lambda: native_layers.silu_mul(gate_up))
    gate, up = gate_up.double().split(width, dim=-1)
    ref = F.silu(gate) * up  # large |gate|: e^-gate saturates to x or ~0, never inf / nan
    # below gate = -88 the kernel's e^-gate stops at e^88, leaving |gate * up| / e^88 (< 1e-30
    # here) where the exact value is smaller still
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=1e-20)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 50),
    heads=st.integers(1, 6),
    half=st.integers(1, 64),
    extra_columns=st.sampled_from([0, 3]),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_rotary_equals_torch(tokens, heads, half, extra_columns, threads, seed) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(seed)
    head_dim = 2 * half
    # the decoder rotates a column slice of the fused qkv output in place (strided rows)
    fused = torch.randn(tokens, heads + extra_columns, head_dim, generator=gen)
    x = fused[:, :heads]
    angles = torch.rand(tokens, 1, half, generator=gen) * 8000  # positions up to ~8k
    cos = torch.cat((angles, angles), -1).cos()
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1)
    ref = apply_rotary(x.double(), cos.double(), signed_sin.double())
    untouched = fused[:, heads:].clone()
    out = _on_threads(threads, lambda: native_layers.rotary_(x, cos, signed_sin))
    assert out.data_ptr() == fused.data_ptr()  # in place
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(fused[:, heads:], untouched)  # the v columns stay as they were


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    width=st.integers(1, 200),
    scale=st.sampled_from([1e-2, 1.0, 30.0]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_bfloat16_steps_round_where_transformers_rounds(rows, width, scale, threads, seed) -> None:  # noqa: ANN001
    # float32 inside each step, bfloat16 where transformers' bfloat16 code rounds: the residual
    # sum, the normalised value before the weight, silu before the product, each rotary product
    # and their sum; the same bits, except where float32 rounding inside a step (the mean of
    # squares, the exp polynomial) tips a value over a bfloat16 rounding boundary
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).bfloat16()

    h, delta, weight = randn(rows, width), randn(rows, width), randn(width)
    expected_h = h + delta
    x32 = expected_h.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = weight * x32.bfloat16()  # LlamaRMSNorm
    got = _on_threads(threads, lambda: native_layers.add_rms_norm(h, delta, weight, 1e-6))
    assert torch.equal(h, expected_h)
    assert (got != expected).sum() <= max(2, 0.01 * got.numel())  # see silu below
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-30)
    gate_up = randn(rows, 2 * width)
    gate, up = gate_up.split(width, dim=-1)
    got = _on_threads(threads, lambda: native_layers.silu_mul(gate_up))
    expected = F.silu(gate) * up
    # 1% of the values, at least 2: on a short row a couple may tip over a bfloat16 boundary
    # (silu of a very negative gate, whose exp lies deep in float32's subnormal range)
    assert (got != expected).sum() <= max(2, 0.01 * got.numel())
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-30)
    half = max(1, width // 8)
    x = randn(rows, 3, 2 * half)
    angles = torch.randn(rows, 1, half, generator=gen) * 10
    cos = torch.cat((angles, angles), -1).cos().bfloat16()
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1).bfloat16()
    expected = x * cos + x.roll(half, dims=-1) * signed_sin  # transformers' apply_rotary_pos_emb
    assert torch.equal(apply_rotary(x, cos, signed_sin), expected)  # the torch path
    rotated = _on_threads(threads, lambda: native_layers.rotary_(x.clone(), cos, signed_sin))
    assert torch.equal(rotated, expected)


def test_rejects_input_it_would_misread() -> None:
    h, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match="unsupported"):
        native_layers.add_rms_norm(h.double(), None, w.double(), 1e-5)
    with pytest.raises(ValueError, match="unsupported"):
        native_layers.add_rms_norm(h, torch.randn(4, 7), w, 1e-5)
    with pytest.raises(ValueError, match="unsupported"):
        native_layers.add_rms_norm(h.t(), None, torch.randn(4), 1e-5)
    with pytest.raises(ValueError, match="unsupported"):
        native_layers.silu_mul(torch.randn(3, 5))  # odd width: no gate/up halves
    with pytest.raises(ValueError, match="unsupported"):
        native_layers.silu_mul(torch.randn(6, 3).t())
    cos = torch.ones(2, 1, 8)
    with pytest.raises(ValueError, match="unsupported"):
        native_layers.rotary_(torch.randn(2, 3, 8).transpose(1, 2), cos, cos)
    with pytest.raises(ValueError, match="unsupported"):
        native_layers.rotary_(torch.randn(3, 3, 8), cos, cos)  # 3 tokens, tables for 2
