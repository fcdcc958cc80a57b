"""`load_model`: a built-in name, a checkpoint directory or a .gguf file -> `LoadedModel`.

Ties together config, decoder, weights, tokenizer and identity; the engine's only entry point
into this package. A checkpoint is either a transformers-style directory (config.json,
safetensors, tokenizer.json) or a GGUF file (`prefixcache.model.gguf_checkpoint`); both give the
same `ModelConfig`, `Tokenizer` and parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache.attention import KVLayout, PagedKVCache
from prefixcache.model.builtin import (
    BUILTIN_MODELS,
    PACKAGED_MODELS,
    PackagedModelMissing,
    builtin_names,
    cache_dir,
    ensure_builtin,
    ensure_packaged,
)
from prefixcache.model.config import ModelConfig
from prefixcache.model.decoder import CausalLM
from prefixcache.model.gguf_checkpoint import GGUFCheckpoint, find_gguf
from prefixcache.model.identity import model_identity
from prefixcache.model.tokenizer import Tokenizer
from prefixcache.model.weights import load_weights, weight_files

__all__ = [
    "DTYPES",
    "Checkpoint",
    "LoadedModel",
    "ModelLoadError",
    "cpu_has_native_bf16",
    "load_model",
    "open_checkpoint",
    "resolve_dtype",
    "resolve_model_path",
]

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

    @property
    def kv_layout(self) -> KVLayout:
        """The shape of this model's KV, in its dtype: every KV size is computed from it."""
        return KVLayout.of(self.config, self.dtype)

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """Paged K/V storage shaped for this model, in its dtype and on its device."""
        return self.kv_layout.allocate(num_blocks, block_size, self.device)


def resolve_model_path(name_or_path: str) -> Path:
    """A built-in name (generated on first use, or a packaged model's file), an existing
    checkpoint directory, or a .gguf file."""
    if name_or_path in BUILTIN_MODELS:
        return ensure_builtin(name_or_path)
    if name_or_path in PACKAGED_MODELS:
        try:
            return ensure_packaged(name_or_path)
        except PackagedModelMissing as exc:
            raise ModelLoadError(str(exc)) from None
    path = Path(name_or_path).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return path
    names = ", ".join(builtin_names())
    raise ModelLoadError(
        f"model {name_or_path!r} is neither a built-in model ({names}), "
        "a checkpoint directory nor a .gguf file"
    )


@dataclass(slots=True)
class Checkpoint:
    """What a checkpoint gives before its weights are read: config, tokenizer, identity."""

    path: Path  # a checkpoint directory, or a .gguf file
    config: ModelConfig
    gguf: GGUFCheckpoint | None = None

    def tokenizer(self) -> Tokenizer:
        return self.gguf.tokenizer() if self.gguf else Tokenizer.from_dir(self.path)

    def load_weights(self, model: CausalLM) -> None:
        if self.gguf:
            self.gguf.load_weights(model, self.config)
        else:
            load_weights(model, self.path)

    def identity(self, dtype: str) -> str:
        """The fingerprint that roots the cache namespace (covers every byte of the weights)."""
        files = [self.gguf.path] if self.gguf else weight_files(self.path)
        return model_identity(self.path, self.config, dtype, files, cache_dir() / "digests")


def open_checkpoint(name_or_path: str) -> Checkpoint:
    """Resolve ``name_or_path`` and read its configuration (no weights yet)."""
    path = resolve_model_path(name_or_path)
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        gguf = GGUFCheckpoint(gguf_file)
        return Checkpoint(gguf_file, gguf.config(), gguf)
    return Checkpoint(path, ModelConfig.from_dir(path))


def load_model(
    name_or_path: str, dtype: str = "float32", device: str = "cpu", pack_weights: bool = True
) -> LoadedModel:
    """Load config, weights (cast to ``dtype``) and tokenizer; no network access.

    ``pack_weights``: on CPU in float32, also keep each projection weight in MKL's packed GEMM
    layout (`prefixcache.model.packed_gemm`): faster steps for about the projections' size
    again in memory.
    """
    if dtype not in DTYPES and dtype != "auto":
        raise ModelLoadError(f"unsupported dtype {dtype!r} (supported: auto, {', '.join(DTYPES)})")
    checkpoint = open_checkpoint(name_or_path)
    if dtype == "auto":
        dtype = resolve_dtype(checkpoint.config.torch_dtype)
    torch_dtype, torch_device = DTYPES[dtype], torch.device(device)
    model = _build(checkpoint, torch_dtype, torch_device, pack_weights)
    return LoadedModel(
        checkpoint.config,
        model,
        checkpoint.tokenizer(),
        checkpoint.path,
        checkpoint.identity(dtype),
        torch_dtype,
        torch_device,
    )


def resolve_dtype(checkpoint_dtype: str | None) -> str:
    """``--dtype auto``: a bfloat16 (or float16) checkpoint runs in bfloat16 where this CPU has
    native bf16 dot products (AVX512_BF16 or AMX), as vLLM's CPU backend does (a quantized GGUF
    counts as bfloat16: `GGUFCheckpoint.weights_dtype`); everything else, and any CPU without
    them, in float32."""
    name = (checkpoint_dtype or "").replace("torch.", "")
    if name in ("bfloat16", "float16") and cpu_has_native_bf16():
        return "bfloat16"
    return "float32"


def cpu_has_native_bf16() -> bool:
    """The CPU advertises AVX512_BF16 or AMX-BF16 (Linux's /proc/cpuinfo; False elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def _build(
    checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, pack: bool
) -> CausalLM:
    config = checkpoint.config
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:  # to_empty re-creates parameters: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    checkpoint.load_weights(model)
    model.prepare_cpu_projections(pack)
    model.init_rotary()
    return model.eval()
