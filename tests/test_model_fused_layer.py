"""The decoder's steps around each attention as two compiled calls (`native_layers.
attention_inputs`, `native_layers.mlp_block`): the same bits as the separate steps, for prefills
with and without cached context, chunked MLPs, qkv bias and decode steps; used exactly where it
applies; bad input refused. (The HF parity tests run the whole model through it too.)"""

from __future__ import annotations

import pytest
import torch

from native_support import require_native_layers
from prefixcache.attention import AttentionMetadata, PagedKVCache
from prefixcache.model import decoder, native_layers, packed_gemm
from prefixcache.model.config import ModelConfig, RopeConfig
from prefixcache.model.packed_gemm import PackedWeight

BLOCK = 16


@pytest.fixture(autouse=True)
def _native() -> None:
    require_native_layers()
    if not packed_gemm.available():
        pytest.skip("packed GEMM (MKL) is not available here")


def _model(qkv_bias: bool, qk_norm: bool = False) -> decoder.CausalLM:
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
    model.prepare_cpu_projections()
    return model


def _steps(model: decoder.CausalLM, fused: bool, monkeypatch: pytest.MonkeyPatch) -> list:
    """A 40-token prefill (MLP in 16-row chunks), 30 more over it as a cache hit, two sequences
    decoding together: the logits of each step."""
    monkeypatch.setattr(decoder, "MLP_CHUNK_ROWS", 16)
    if not fused:
        monkeypatch.setattr(decoder.DecoderLayer, "_fusable", lambda self, h: None)
    c = model.config
    cache = PagedKVCache(c.num_hidden_layers, 12, BLOCK, c.num_key_value_heads, c.head_dim)
    tables = [[7, 2, 9, 4, 0], [5, 11, 3]]
    ids = torch.randint(0, c.vocab_size, (80,), generator=torch.Generator().manual_seed(1))

    def step(tables_, computed, new, tokens):  # noqa: ANN001, ANN202
        meta = AttentionMetadata.build(tables_, computed, new, BLOCK)
        return model(tokens, meta.positions, cache, meta)

    out = [step([tables[0]], [0], [40], ids[:40])]
    out.append(step([tables[0]], [40], [30], ids[40:70]))
    out.append(step([tables[1]], [0], [9], ids[70:79]))
    out.append(step(tables, [70, 9], [1, 1], ids[[79, 0]]))
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_fused_steps_give_the_same_bits(qkv_bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(qkv_bias)
    fused, plain = _steps(model, True, monkeypatch), _steps(model, False, monkeypatch)
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a, b)


def test_fused_where_it_applies() -> None:
    h = torch.randn(5, 64)
    layer = _model(qkv_bias=True).model.layers[0]
    assert layer._fusable(h) is not None
    assert layer._fusable(h.double()) is None
    assert _model(qkv_bias=False, qk_norm=True).model.layers[0]._fusable(h) is None  # Qwen3
    with torch.no_grad():
        layer.self_attn.o_proj.weight.mul_(2)  # a changed weight: its packed copy is stale
    assert layer._fusable(h) is None
    native_layers.set_enabled(False)
    try:
        assert _model(qkv_bias=False).model.layers[0]._fusable(h) is None
    finally:
        native_layers.set_enabled(True)


def test_rejects_input_it_would_misread() -> None:
    gen = torch.Generator().manual_seed(0)
    qkv = PackedWeight.pack(torch.randn(8 * 16, 64, generator=gen))  # 4 heads + 2 x 2 kv heads
    h, norm = torch.randn(3, 64, generator=gen), torch.ones(64)
    cos, sin = torch.ones(3, 1, 16), torch.zeros(3, 1, 16)
    k_cache, v_cache = torch.zeros(4, BLOCK, 2, 16), torch.zeros(4, BLOCK, 2, 16)

    def inputs(**change):  # noqa: ANN003, ANN202
        args = dict(h=h, delta=None, norm_weight=norm, eps=1e-6, qkv_weight=qkv, qkv_bias=None,
                    num_heads=4, num_kv_heads=2, cos=cos, signed_sin=sin, k_cache=k_cache,
                    v_cache=v_cache, slot_mapping=torch.tensor([0, 5, 63]))  # fmt: skip
        return native_layers.attention_inputs(**(args | change))

    assert inputs().shape == (3, 8, 16)
    with pytest.raises(ValueError, match="slot out of range"):
        inputs(slot_mapping=torch.tensor([0, 5, 64]))
    with pytest.raises(ValueError, match="slot out of range"):
        inputs(slot_mapping=torch.tensor([-1, 5, 6]))
    with pytest.raises(ValueError, match="unsupported"):
        inputs(num_heads=5)  # the packed weight has another width
    with pytest.raises(ValueError, match="unsupported"):
        inputs(cos=torch.ones(2, 1, 16))
    with pytest.raises(ValueError, match="unsupported"):
        inputs(h=torch.randn(64, 3).t())  # not contiguous
    with pytest.raises(ValueError, match="unsupported"):
        inputs(slot_mapping=torch.tensor([0, 5, 6], dtype=torch.int32))

    o = PackedWeight.pack(torch.randn(64, 64, generator=gen))
    gate_up = PackedWeight.pack(torch.randn(2 * 96, 64, generator=gen))
    down = PackedWeight.pack(torch.randn(64, 96, generator=gen))
    attended = torch.randn(3, 64, generator=gen)
    assert native_layers.mlp_block(attended, h, norm, 1e-6, o, gate_up, down, 2).shape == (3, 64)
    with pytest.raises(ValueError, match="unsupported"):
        native_layers.mlp_block(attended, h, norm, 1e-6, o, down, gate_up, 2)  # swapped
    with pytest.raises(ValueError, match="unsupported"):
        native_layers.mlp_block(attended[:2], h, norm, 1e-6, o, gate_up, down, 2)
