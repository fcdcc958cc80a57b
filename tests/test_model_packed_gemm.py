"""MKL packed-weight GEMM: equal to F.linear for any shape and row count, used by the loaded
model's projections, never stale after the weight changes."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.attention import AttentionMetadata
from prefixcache.model import load_model, packed_gemm
from prefixcache.model.packed_gemm import PackedWeight

MKL_HERE = torch.backends.mkl.is_available() and platform.machine() in ("x86_64", "AMD64")
needs_mkl = pytest.mark.skipif(not MKL_HERE, reason="packed GEMM needs the MKL of x86 torch")


@needs_mkl
def test_packed_gemm_is_available_where_torch_has_mkl() -> None:
    # a failed self-check would silently turn packing off: on x86 with MKL it must pass
    assert packed_gemm.available()


@needs_mkl
@settings(max_examples=60, deadline=None)
@given(
    out_features=st.integers(1, 300),
    in_features=st.integers(1, 300),
    rows=st.integers(0, 300),
    with_bias=st.booleans(),
    column_slice=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_matmul_equals_linear(
    out_features, in_features, rows, with_bias, column_slice, seed
) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    wide = torch.randn(rows, in_features + 5, generator=gen)
    x = wide[:, 2 : 2 + in_features] if column_slice else wide[:, :in_features].contiguous()
    got = PackedWeight.pack(weight).matmul(x, bias)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_pack_rejects_what_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="float32 CPU weight"):
        PackedWeight.pack(torch.zeros(4, 4, dtype=torch.bfloat16))


@needs_mkl
def test_matmul_rejects_input_it_would_misread() -> None:
    packed = PackedWeight.pack(torch.randn(8, 6))
    with pytest.raises(ValueError, match=r"x \[rows, 6\]"):
        packed.matmul(torch.randn(3, 5))
    with pytest.raises(ValueError, match="float32 CPU"):
        packed.matmul(torch.randn(3, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias"):
        packed.matmul(torch.randn(3, 6), torch.randn(7))


def _logits(loaded, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    cache = loaded.make_kv_cache(num_blocks=16, block_size=16)
    meta = AttentionMetadata.build([list(range(16))], [0], [len(ids)], 16)
    return loaded.model(torch.tensor(ids), meta.positions, cache, meta)[0]


@needs_mkl
def test_loaded_projections_are_packed_and_agree_with_unpacked(gemm_library) -> None:
    gemm_library("mkl")
    packed, plain = load_model("tiny"), load_model("tiny", pack_weights=False)
    assert all(p.packed is not None for p in [*packed.model.projections(), packed.model.lm_head])
    assert all(p.packed is None for p in [*plain.model.projections(), plain.model.lm_head])
    ids = list(range(40, 240))
    torch.testing.assert_close(_logits(packed, ids), _logits(plain, ids), rtol=0, atol=1e-4)
    assert not any(p.packed is not None for p in load_model("tiny", "bfloat16").model.projections())


def test_onednn_prepacked_projections_agree_with_unpacked(gemm_library) -> None:
    from prefixcache.model import onednn_gemm

    if not onednn_gemm.available():
        pytest.skip("oneDNN's prepacked linear does not run here")
    gemm_library("onednn")
    packed, plain = load_model("tiny"), load_model("tiny", pack_weights=False)
    projections = [*packed.model.projections(), packed.model.lm_head]
    assert all(p.onednn is not None and p.packed is None for p in projections)
    ids = list(range(40, 240))
    torch.testing.assert_close(_logits(packed, ids), _logits(plain, ids), rtol=0, atol=1e-4)
    proj = packed.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, proj.in_features)
    with torch.no_grad():
        proj.weight.mul_(2.0)  # in place: the prepacked copy is stale and must not be used
    torch.testing.assert_close(proj(x), F.linear(x, proj.weight), rtol=1e-5, atol=1e-5)
    assert proj.onednn is None


def test_bfloat16_projections_are_prepacked_and_give_the_same_bits(gemm_library) -> None:
    # no MKL path in bfloat16: oneDNN's prepacked weight (where the panel GEMM is not chosen),
    # the same products F.linear computes (it calls oneDNN too), so the logits are bit for bit
    # those of the plain model
    from prefixcache.model import onednn_gemm

    if not onednn_gemm.available(torch.bfloat16):
        pytest.skip("oneDNN's prepacked bfloat16 linear does not run here")
    gemm_library("onednn")
    packed = load_model("tiny", "bfloat16")
    plain = load_model("tiny", "bfloat16", pack_weights=False)
    projections = [*packed.model.projections(), packed.model.lm_head]
    assert all(p.onednn is not None and p.packed is None for p in projections)
    assert all(p.onednn is None for p in [*plain.model.projections(), plain.model.lm_head])
    ids = list(range(40, 240))
    assert torch.equal(_logits(packed, ids), _logits(plain, ids))
    proj = packed.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, proj.in_features).bfloat16()
    with torch.no_grad():
        proj.weight.mul_(2.0)  # in place: the prepacked copy is stale and must not be used
    assert torch.equal(proj(x), F.linear(x, proj.weight))
    assert proj.onednn is None


def test_the_gemm_choice_is_measured_unless_forced(gemm_library, monkeypatch) -> None:
    from prefixcache.model import onednn_gemm

    gemm_library("mkl")
    assert onednn_gemm.prefer_onednn(64, 128) is False
    gemm_library("onednn")
    assert onednn_gemm.prefer_onednn(64, 128) is onednn_gemm.available()
    monkeypatch.delenv("PREFIXCACHE_ONEDNN_LINEAR")
    onednn_gemm.prefer_onednn.cache_clear()
    assert isinstance(onednn_gemm.prefer_onednn(64, 128), bool)  # timed here, either way


@needs_mkl
def test_a_changed_weight_is_never_served_from_a_stale_packed_copy(gemm_library) -> None:
    gemm_library("mkl")
    loaded = load_model("tiny")
    proj = loaded.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, proj.in_features)
    with torch.no_grad():
        proj.weight.mul_(2.0)  # in place: same storage, new version
    torch.testing.assert_close(proj(x), F.linear(x, proj.weight), rtol=1e-5, atol=1e-5)
    assert proj.packed is None
    assert proj.pack()  # re-packing picks the new values up
    torch.testing.assert_close(proj(x), F.linear(x, proj.weight), rtol=1e-5, atol=1e-5)
