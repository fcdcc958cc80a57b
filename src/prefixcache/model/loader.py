"""`load_model`: a built-in name or a checkpoint directory -> `LoadedModel`.

Ties together config, decoder, weights, tokenizer and identity; the engine's only entry point
into this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache.attention import PagedKVCache
from prefixcache.model.builtin import BUILTIN_MODELS, cache_dir, ensure_builtin
from prefixcache.model.config import ModelConfig
from prefixcache.model.decoder import CausalLM
from prefixcache.model.identity import model_identity
from prefixcache.model.tokenizer import Tokenizer
from prefixcache.model.weights import load_weights, weight_files

__all__ = ["DTYPES", "LoadedModel", "ModelLoadError", "load_model", "resolve_model_path"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class ModelLoadError(ValueError):
    """The named model cannot be found or loaded."""


@dataclass(slots=True)
class LoadedModel:
    """A ready model: weights on device, tokenizer, and the identity for the cache namespace."""

    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    path: Path
    identity: str
    dtype: torch.dtype
    device: torch.device

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """Paged K/V storage shaped for this model, in its dtype and on its device."""
        c = self.config
        return PagedKVCache(
            c.num_hidden_layers,
            num_blocks,
            block_size,
            c.num_key_value_heads,
            c.head_dim,
            self.dtype,
            self.device,
        )


def resolve_model_path(name_or_dir: str) -> Path:
    """A built-in name (created on first use) or an existing checkpoint directory."""
    if name_or_dir in BUILTIN_MODELS:
        return ensure_builtin(name_or_dir)
    path = Path(name_or_dir).expanduser()
    if not path.is_dir():
        names = ", ".join(BUILTIN_MODELS)
        raise ModelLoadError(
            f"model {name_or_dir!r} is neither a built-in model ({names}) nor a directory"
        )
    return path


def load_model(
    name_or_dir: str, dtype: str = "float32", device: str = "cpu", pack_weights: bool = True
) -> LoadedModel:
    """Load config, weights (cast to ``dtype``) and tokenizer; no network access.

    ``pack_weights``: on CPU in float32, also keep each projection weight in MKL's packed GEMM
    layout (`prefixcache.model.packed_gemm`): faster steps for about the projections' size
    again in memory.
    """
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    path = resolve_model_path(name_or_dir)
    config = ModelConfig.from_dir(path)
    torch_dtype, torch_device = DTYPES[dtype], torch.device(device)
    model = _build(config, path, torch_dtype, torch_device, pack_weights)
    files = weight_files(path)
    identity = model_identity(path, config, dtype, files, cache_dir() / "digests")
    return LoadedModel(
        config, model, Tokenizer.from_dir(path), path, identity, torch_dtype, torch_device
    )


def _build(
    config: ModelConfig, path: Path, dtype: torch.dtype, device: torch.device, pack: bool
) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:  # to_empty re-creates parameters: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    load_weights(model, path)
    model.prepare_cpu_projections(pack)
    model.init_rotary()
    return model.eval()
