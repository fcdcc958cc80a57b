"""The decoder's layers as compiled calls (`model.fused_layers`): the same bits as the separate
steps, for prefills with and without cached context (one call per layer), chunked MLPs, qkv
bias, batches and decode steps (two calls around the attention); used exactly where it applies;
a step it would misread refused. (The HF parity tests run the whole model through it too.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from native_support import require_native_layers
from prefixcache.attention import AttentionMetadata, PagedKVCache
from prefixcache.attention.plan import build_plan
from prefixcache.model import decoder, native_layers, packed_gemm, panel_gemm, quant_gemm, tuning
from prefixcache.model.config import ModelConfig, RopeConfig
from prefixcache.model.fused_layers import FusedLayers

BLOCK = 16


@pytest.fixture(autouse=True, params=["mkl", "panel"])
def _native(request: pytest.FixtureRequest, gemm_library) -> None:  # noqa: ANN001
    """Each test over MKL-packed weights and over the panel GEMM's (the two the fused steps
    multiply through)."""
    require_native_layers()
    if request.param == "mkl" and not packed_gemm.available():
        pytest.skip("packed GEMM (MKL) is not available here")
    if request.param == "panel" and not panel_gemm.available():
        pytest.skip("the panel GEMM does not run here")
    gemm_library(request.param)


def _model(
    qkv_bias: bool, qk_norm: bool = False, dtype: torch.dtype = torch.float32
) -> decoder.CausalLM:
    config = ModelConfig(
        architecture="Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        attention_bias=qkv_bias,
        qk_norm=qk_norm,
    )
    model = decoder.CausalLM(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.to(dtype).prepare_cpu_projections()
    return model


def _prepare(
    model: decoder.CausalLM, h: torch.Tensor, cos_sin: Any, cache: PagedKVCache,
    meta: AttentionMetadata,
) -> FusedLayers | None:
    c = model.config
    plan = build_plan(meta, *cache.layer(0), c.num_attention_heads, h.dtype, h.device)
    return FusedLayers.prepare(c, model.layer_parts(), h, cos_sin, cache, meta, plan)


def _steps(model: decoder.CausalLM, fused: bool, monkeypatch: pytest.MonkeyPatch) -> list:
    """A 40-token prefill (MLP in 16-row chunks), 30 more over it as a cache hit, two sequences
    decoding together, a decode beside a chunk, two decodes sharing blocks: the logits of each
    step."""
    monkeypatch.setattr(tuning, "MLP_CHUNK_ROWS", 16)
    calls: list[bool] = []
    prepare = FusedLayers.prepare

    def record(*args):  # noqa: ANN002, ANN202
        result = prepare(*args) if fused else None
        calls.append(None if result is None else result.one_call_per_layer)
        return result

    monkeypatch.setattr(decoder.FusedLayers, "prepare", record)
    c, dtype = model.config, model.model.embed_tokens.weight.dtype
    cache = PagedKVCache(c.num_hidden_layers, 12, BLOCK, c.num_key_value_heads, c.head_dim, dtype)
    tables = [[7, 2, 9, 4, 0], [5, 11, 3]]
    ids = torch.randint(0, c.vocab_size, (80,), generator=torch.Generator().manual_seed(1))

    def step(tables_, computed, new, tokens):  # noqa: ANN001, ANN202
        meta = AttentionMetadata.build(tables_, computed, new, BLOCK)
        return model(tokens, meta.positions, cache, meta)

    out = [step([tables[0]], [0], [40], ids[:40])]
    out.append(step([tables[0]], [40], [30], ids[40:70]))
    out.append(step([tables[1]], [0], [9], ids[70:79]))
    out.append(step(tables, [70, 9], [1, 1], ids[[79, 0]]))
    out.append(step(tables, [71, 10], [1, 5], ids[:6]))  # a decode and a chunk together
    # two decodes sharing the first two blocks: one kernel call reads them once for both
    out.append(step([tables[0], [7, 2, 6]], [72, 32], [1, 1], ids[[1, 2]]))
    monkeypatch.undo()
    # one call per layer where one kernel call attends the whole step (one sequence's prefill
    # in float32, decodes only), two around paged_attention otherwise
    prefill = dtype == torch.float32
    assert calls == ([prefill] * 3 + [True, False, True] if fused else [None] * 6)
    return out


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_fused_steps_give_the_same_bits(qkv_bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(qkv_bias)
    fused, plain = _steps(model, True, monkeypatch), _steps(model, False, monkeypatch)
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("_native", ["panel"], indirect=True)  # MKL has no bfloat16 GEMM
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_bfloat16_fused_steps_give_the_same_bits(
    qkv_bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bfloat16: two calls per layer around the attention, over the panel GEMM's weights
    model = _model(qkv_bias, dtype=torch.bfloat16)
    fused, plain = _steps(model, True, monkeypatch), _steps(model, False, monkeypatch)
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("_native", ["panel"], indirect=True)
@pytest.mark.parametrize("weights", ["bfloat16", "q8_0"])
def test_stored_weights_fused_steps_give_the_same_bits(
    weights: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a float32 model keeping bfloat16 panels or 8-bit blocks: the compiled calls multiply
    # through the same GEMM as the separate steps
    if weights == "q8_0" and not quant_gemm.available():
        pytest.skip("the quantized GEMM does not run here")
    model = _model(True)
    model.store_weights(weights)
    kinds = {type(p.current_copy()).__name__ for p in model.projections()}
    assert kinds == {"PanelWeight" if weights == "bfloat16" else "QuantWeight"}
    fused, plain = _steps(model, True, monkeypatch), _steps(model, False, monkeypatch)
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a, b)


def _step_inputs(model: decoder.CausalLM, rows: int, num_blocks: int = 12):  # noqa: ANN202
    c = model.config
    cache = PagedKVCache(c.num_hidden_layers, num_blocks, BLOCK, c.num_key_value_heads, c.head_dim)
    meta = AttentionMetadata.build([[9, 2, 7, 4, 0]], [0], [rows], BLOCK)
    model.init_rotary()
    cos_sin = model.rotary.cos_sin(meta.positions, torch.float32)  # type: ignore[union-attr]
    return torch.randn(rows, c.hidden_size), cos_sin, cache, meta


def test_fused_where_it_applies() -> None:
    model = _model(qkv_bias=True)
    h, cos_sin, cache, meta = _step_inputs(model, 5)
    assert _prepare(model, h, cos_sin, cache, meta) is not None
    assert _prepare(model, h.double(), cos_sin, cache, meta) is None
    assert _prepare(model, h[:0], cos_sin, cache, meta) is None
    qwen3 = _model(qkv_bias=False, qk_norm=True)  # q/k norm: the separate steps
    assert _prepare(qwen3, h, cos_sin, cache, meta) is None
    assert model.kernels()["layers"] == "compiled"
    assert qwen3.kernels()["layers"].startswith("torch modules (q/k norm")  # and it says so
    expected = decoder.expected_kernels(qwen3.config, torch.float32, "float32")
    assert expected["layers"] == qwen3.kernels()["layers"]
    native_layers.set_enabled(False)
    try:
        assert _prepare(model, h, cos_sin, cache, meta) is None
    finally:
        native_layers.set_enabled(True)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(2)  # its packed copy is now stale
    assert _prepare(model, h, cos_sin, cache, meta) is None  # the checked part is not reused
    model.prepare_cpu_projections()  # packed again: the calls read the new weight
    fused = _prepare(model, h, cos_sin, cache, meta)
    assert fused is not None
    down = model.model.layers[1].mlp.down_proj.current_copy()
    assert fused._args[1].w_down == down.operand  # type: ignore[union-attr]


def test_refuses_a_step_it_would_misread() -> None:
    model = _model(qkv_bias=False)
    h, cos_sin, cache, meta = _step_inputs(model, 5)
    small_cache = _step_inputs(model, 5, num_blocks=8)[2]  # block 9 of the table is beyond it
    with pytest.raises(ValueError, match="slot out of range"):
        _prepare(model, h, cos_sin, small_cache, meta)
    with pytest.raises(ValueError, match="unsupported"):
        _prepare(model, h, (cos_sin[0][:4], cos_sin[1][:4]), cache, meta)
    with pytest.raises(ValueError, match="unsupported"):
        _prepare(model, torch.randn(5, 32), cos_sin, cache, meta)  # wrong width
    c = model.config
    wrong_heads = PagedKVCache(c.num_hidden_layers, 12, BLOCK, 1, c.head_dim)
    with pytest.raises(ValueError, match="unsupported"):
        _prepare(model, h, cos_sin, wrong_heads, meta)
