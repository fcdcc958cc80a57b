"""Qwen3: Llama's decoder with a per-head RMSNorm of q and of k before the rotary embedding."""

from prefixcache.model.arch.spec import Architecture

QWEN3 = Architecture(
    name="Qwen3ForCausalLM",
    model_type="qwen3",
    family="qwen3",
    gguf_name="qwen3",
    qk_norm=True,
)
