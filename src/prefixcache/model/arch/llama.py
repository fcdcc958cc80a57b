"""Llama (1 to 3.x, SmolLM2): the decoder every other architecture here is told apart from."""

from prefixcache.model.arch.spec import Architecture

LLAMA = Architecture(
    name="LlamaForCausalLM",
    model_type="llama",
    family="llama",
    gguf_name="llama",
    sliding_window_by_default=True,
    gguf_permuted_qk=True,
)
