"""The built-in models: ``tiny`` and ``small`` created from a seed on first use, and ``smollm2``,
a trained instruct model that a pip package ships as a GGUF file. Nothing is downloaded at run time.

Each is written as an ordinary checkpoint directory (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) under the user cache dir, so loading
runs the real config, weight and tokenizer code. Creation is atomic (temp dir + rename), so
concurrent processes are safe. ``tiny`` is initialised with a wide logit spread so greedy
decoding is robust to the ~1e-6 rounding changes that batch composition causes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from prefixcache.catalog import PACKAGED_MODELS, PackagedModel
from prefixcache.model.byte_tokenizer import ByteVocab, write_byte_tokenizer
from prefixcache.paths import cache_dir

__all__ = [
    "BUILTIN_MODELS",
    "PACKAGED_MODELS",
    "BuiltinSpec",
    "PackagedModel",
    "PackagedModelMissing",
    "builtin_names",
    "cache_dir",
    "ensure_builtin",
    "ensure_packaged",
    "locate_packaged",
]

RECIPE_VERSION = 1
CONVERSION_VERSION = 2  # of `convert_to_directory`'s output: a change re-converts packaged models


@dataclass(frozen=True, slots=True)
class BuiltinSpec:
    """Shape and init of a built-in model."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    embed_std: float  # tied embedding / lm_head init: sets the logit spread
    proj_std: float  # other linear layers
    seed: int


BUILTIN_MODELS: dict[str, BuiltinSpec] = {
    "tiny": BuiltinSpec(256, 512, 4, 4, 2, embed_std=0.5, proj_std=0.08, seed=1234),
    "small": BuiltinSpec(768, 2048, 12, 12, 4, embed_std=0.1, proj_std=0.02, seed=5678),
}
MAX_POSITIONS = 8192


class PackagedModelMissing(LookupError):
    """A packaged model whose package is not installed; the message gives the command."""


def builtin_names() -> list[str]:
    """Every name `--model` accepts besides a path: packaged models first, then generated ones."""
    return [*PACKAGED_MODELS, *BUILTIN_MODELS]


def locate_packaged(name: str) -> Path:
    """The file of packaged model ``name``, found without importing its package.

    The package's ``__init__`` imports its own runtime (llama.cpp bindings, which are not
    installed), so the file is located through the import system's spec of the package, the
    location `importlib.resources` would read, rather than through an import.
    """
    import importlib.util

    model = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / model.file
        if candidate.is_file():
            return candidate
    raise PackagedModelMissing(
        f"model {name!r} ({model.description}) needs its package: {model.install_command}"
    )


def ensure_builtin(name: str) -> Path:
    """The checkpoint directory of built-in model ``name``, created on first use."""
    spec = BUILTIN_MODELS[name]
    target = cache_dir() / "models" / f"{name}-v{RECIPE_VERSION}"
    return _create_once(target, lambda staging: _write_checkpoint(staging, spec))


def ensure_packaged(name: str) -> Path:
    """Packaged model ``name`` as a float32 checkpoint directory, converted from its GGUF file
    on first use (keyed by the file's SHA-256, so a new package version converts again)."""
    from prefixcache.model.gguf_checkpoint import GGUFCheckpoint, convert_to_directory
    from prefixcache.model.identity import file_digest

    source = locate_packaged(name)
    digest = file_digest(source, cache_dir() / "digests")
    target = cache_dir() / "models" / f"{name}-{digest[:16]}-v{CONVERSION_VERSION}"
    return _create_once(
        target, lambda staging: convert_to_directory(GGUFCheckpoint(source), staging, digest)
    )


def _create_once(target: Path, write: Callable[[Path], None]) -> Path:
    """``target``, written by ``write`` into a temp dir renamed into place (race-safe)."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_checkpoint(path: Path, spec: BuiltinSpec) -> None:
    vocab = write_byte_tokenizer(path)
    config = _config(spec, vocab)
    (path / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = {"bos_token_id": vocab.bos_id, "eos_token_id": list(vocab.eos_ids)}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_file(
        _weights(spec, vocab.size), str(path / "model.safetensors"), metadata={"format": "pt"}
    )


def _config(spec: BuiltinSpec, vocab: ByteVocab) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab.size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": vocab.bos_id,
        "eos_token_id": list(vocab.eos_ids),
        "torch_dtype": "float32",
    }


def _weights(spec: BuiltinSpec, vocab_size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed)
    hidden, inter = spec.hidden_size, spec.intermediate_size
    head_dim = hidden // spec.num_attention_heads
    kv = spec.num_key_value_heads * head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {
        "model.embed_tokens.weight": normal(vocab_size, hidden, std=spec.embed_std),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "self_attn.q_proj.weight": normal(hidden, hidden, std=spec.proj_std),
                p + "self_attn.k_proj.weight": normal(kv, hidden, std=spec.proj_std),
                p + "self_attn.v_proj.weight": normal(kv, hidden, std=spec.proj_std),
                p + "self_attn.o_proj.weight": normal(hidden, hidden, std=spec.proj_std),
                p + "mlp.gate_proj.weight": normal(inter, hidden, std=spec.proj_std),
                p + "mlp.up_proj.weight": normal(inter, hidden, std=spec.proj_std),
                p + "mlp.down_proj.weight": normal(hidden, inter, std=spec.proj_std),
                p + "input_layernorm.weight": torch.ones(hidden),
                p + "post_attention_layernorm.weight": torch.ones(hidden),
            }
        )
    return weights
