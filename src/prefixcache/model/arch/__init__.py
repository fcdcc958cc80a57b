"""The architectures this runtime serves: one module each (its `Architecture`), one line each
in `ARCHITECTURES`. Adding one is a module and a line here, where its decoder is one the
`Architecture` fields describe.
"""

from __future__ import annotations

from prefixcache.model.arch.llama import LLAMA
from prefixcache.model.arch.mistral import MISTRAL
from prefixcache.model.arch.qwen2 import QWEN2
from prefixcache.model.arch.qwen3 import QWEN3
from prefixcache.model.arch.spec import Architecture

__all__ = ["ARCHITECTURES", "Architecture", "by_gguf_name", "by_model_type"]

# config.json's "architectures" name -> the architecture
ARCHITECTURES: dict[str, Architecture] = {
    LLAMA.name: LLAMA,
    MISTRAL.name: MISTRAL,
    QWEN2.name: QWEN2,
    QWEN3.name: QWEN3,
}


def by_model_type(model_type: str) -> Architecture | None:
    """The architecture of a config.json without "architectures" (transformers falls back to
    its "model_type" the same way, through its auto classes)."""
    return next((a for a in ARCHITECTURES.values() if a.model_type == model_type), None)


def by_gguf_name(gguf_name: str) -> Architecture | None:
    """The architecture a GGUF file's "general.architecture" is read as."""
    return next((a for a in ARCHITECTURES.values() if a.gguf_name == gguf_name), None)
