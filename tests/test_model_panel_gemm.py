"""The panel GEMM (`model.panel_gemm`): equal to F.linear for any shape, row count and input
stride in float32 and bfloat16, a row's result independent of the batch around it, refused input
it would misread, and the loaded model's projections through it agreeing with the unpacked
model, never from a stale copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from native_support import require_native_layers
from prefixcache.attention import AttentionMetadata
from prefixcache.model import load_model, panel_gemm
from prefixcache.model.panel_gemm import PanelWeight

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _library() -> None:
    require_native_layers()


def _close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):  # noqa: ANN202
    """got against the float64 product of the same (rounded) inputs: float32 within float32
    summation error; bfloat16 within two of its rounding steps (2^-8 each) of the result."""
    ref = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(got.double(), ref, rtol=2**-7, atol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_available_and_agrees_with_linear(dtype: torch.dtype) -> None:
    assert panel_gemm.available(dtype)  # the build's own probe, vector kernel or plain loops


@settings(max_examples=60, deadline=None)
@given(
    out_features=st.integers(1, 200),
    in_features=st.integers(1, 200),
    rows=st.integers(0, 40),
    with_bias=st.booleans(),
    column_slice=st.booleans(),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matmul_equals_linear(
    out_features, in_features, rows, with_bias, column_slice, bf16, seed
) -> None:  # noqa: ANN001
    # odd widths: a last panel part full, a last k pair with one value (bfloat16)
    dtype = torch.bfloat16 if bf16 else torch.float32
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    wide = torch.randn(rows, in_features + 5, generator=gen).to(dtype)
    x = wide[:, 2 : 2 + in_features] if column_slice else wide[:, :in_features].contiguous()
    got = PanelWeight.pack(weight).matmul(x, bias)
    assert got.shape == (rows, out_features) and got.dtype == dtype
    _close(got, x, weight, bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_result_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    # batch invariance: the same bits for a row alone, in a batch of 37 (tiles of 8 and a tail
    # of 5) and with another thread count
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 576, generator=gen).to(dtype)
    batch = torch.randn(37, 576, generator=gen).to(dtype)
    packed = PanelWeight.pack(weight)
    together = packed.matmul(batch)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([packed.matmul(batch[i : i + 1]) for i in range(37)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)


def test_rejects_input_it_would_misread() -> None:
    packed = PanelWeight.pack(torch.randn(8, 6))
    with pytest.raises(ValueError, match=r"x \[rows, 6\]"):
        packed.matmul(torch.randn(3, 5))
    with pytest.raises(ValueError, match="float32 CPU input"):
        packed.matmul(torch.randn(3, 6).bfloat16())
    with pytest.raises(ValueError, match="bias"):
        packed.matmul(torch.randn(3, 6), torch.randn(7))
    with pytest.raises(ValueError, match="bias"):
        packed.matmul(torch.randn(3, 6), torch.randn(8).bfloat16())
    with pytest.raises(ValueError, match="2-D float32 or bfloat16"):
        PanelWeight.pack(torch.randn(8, 6, dtype=torch.float64))


def _logits(loaded, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    cache = loaded.make_kv_cache(num_blocks=16, block_size=16)
    meta = AttentionMetadata.build([list(range(16))], [0], [len(ids)], 16)
    return loaded.model(torch.tensor(ids), meta.positions, cache, meta)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loaded_projections_use_it_and_agree_with_unpacked(dtype: str, gemm_library) -> None:  # noqa: ANN001
    gemm_library("panel")
    packed, plain = load_model("tiny", dtype), load_model("tiny", dtype, pack_weights=False)
    projections = [*packed.model.projections(), packed.model.lm_head]
    assert all(p.panel is not None and p.packed is None and p.onednn is None for p in projections)
    ids = list(range(40, 240))
    got, want = _logits(packed, ids), _logits(plain, ids)
    if dtype == "float32":
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    else:  # bfloat16 sums in another order, through 2 layers: the same greedy token, and as
        # close to the float32 model as torch's bfloat16 is (logits here reach ~28, where one
        # bfloat16 step is 0.125: the two roundings need not agree to a fixed tolerance)
        assert torch.equal(got.argmax(), want.argmax())
        ref = _logits(load_model("tiny", "float32", pack_weights=False), ids)
        ours, torchs = (got.float() - ref).abs().max(), (want.float() - ref).abs().max()
        assert ours <= 1.25 * torchs, (ours, torchs)
    proj = packed.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, proj.in_features).to(proj.weight.dtype)
    with torch.no_grad():
        proj.weight.mul_(2.0)  # in place: the panel copy is stale and must not be used
    torch.testing.assert_close(proj(x), F.linear(x, proj.weight))
    assert proj.panel is None


def test_the_choice_is_forced_by_the_environment(gemm_library, monkeypatch) -> None:  # noqa: ANN001
    gemm_library("panel")
    assert panel_gemm.prefer_panel(64, 128, torch.float32, False) is True
    gemm_library("mkl")
    assert panel_gemm.prefer_panel(64, 128, torch.bfloat16, False) is False
    monkeypatch.delenv("PREFIXCACHE_PANEL_GEMM")
    panel_gemm.prefer_panel.cache_clear()
    chosen = panel_gemm.prefer_panel(64, 128, torch.float32, False)  # timed here, either way
    assert chosen is False or panel_gemm.vectorised(torch.float32)  # plain loops never chosen
