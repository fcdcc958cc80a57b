"""Qwen2 and Qwen2.5: Llama's decoder with biases on the q, k and v projections."""

from prefixcache.model.arch.spec import Architecture

QWEN2 = Architecture(
    name="Qwen2ForCausalLM",
    model_type="qwen2",
    family="qwen2",
    gguf_name="qwen2",
    attention_bias=True,
)
