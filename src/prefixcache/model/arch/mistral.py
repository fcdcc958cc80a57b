"""Mistral: Llama's decoder with a sliding window in config.json (served up to the window).
llama.cpp writes it as a "llama" GGUF, so it has no GGUF name of its own."""

from prefixcache.model.arch.spec import Architecture

MISTRAL = Architecture(
    name="MistralForCausalLM",
    model_type="mistral",
    family="llama",
    sliding_window_by_default=True,
)
