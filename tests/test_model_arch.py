"""The architecture registry (`prefixcache.model.arch`): each entry is what config.json and a
GGUF file are read as, and what config.json leaves to the architecture comes from it."""

from __future__ import annotations

from typing import Any

import pytest

from prefixcache.model import ARCHITECTURES
from prefixcache.model.arch import by_gguf_name, by_model_type
from prefixcache.model.config import ConfigError, ModelConfig


def _raw(**fields: Any) -> dict[str, Any]:
    return {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "sliding_window": 256, **fields}  # fmt: skip


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_config_json_takes_the_architectures_defaults(name: str) -> None:
    arch = ARCHITECTURES[name]
    for raw in (_raw(architectures=[name]), _raw(model_type=arch.model_type)):
        config = ModelConfig.from_dict(raw)
        assert config.architecture == name and config.family == arch.family
        assert config.attention_bias == arch.attention_bias
        assert config.qk_norm == arch.qk_norm
        assert config.max_model_len == (256 if arch.sliding_window_by_default else 1024)
    # config.json's own word wins over the architecture's default
    config = ModelConfig.from_dict(_raw(architectures=[name], attention_bias=True,
                                        use_sliding_window=False))  # fmt: skip
    assert config.attention_bias and config.max_model_len == 1024


def test_names_in_config_json_and_gguf() -> None:
    assert [a.family for a in ARCHITECTURES.values()] == ["llama", "llama", "qwen2", "qwen3"]
    assert by_model_type("mistral") is ARCHITECTURES["MistralForCausalLM"]
    # llama.cpp writes Mistral as "llama": the one GGUF name is Llama's, q/k rows permuted
    llama = by_gguf_name("llama")
    assert llama is ARCHITECTURES["LlamaForCausalLM"] and llama.gguf_permuted_qk
    assert not any(a.gguf_permuted_qk for a in ARCHITECTURES.values() if a is not llama)
    assert by_gguf_name("qwen3") is ARCHITECTURES["Qwen3ForCausalLM"]
    assert by_gguf_name("mistral") is None and by_model_type("gpt_neox") is None
    with pytest.raises(ConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_dict(_raw(architectures=["GPT2LMHeadModel"]))
