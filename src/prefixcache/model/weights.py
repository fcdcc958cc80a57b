"""Safetensors loading into `CausalLM`: single-file and sharded checkpoints, any float dtype.

Maps transformers tensor names onto our parameters (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``), checks every shape, and fails with the name of the first missing or unexpected
tensor. Knows nothing about tokenizers or the cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from prefixcache.model.config import ModelConfig
from prefixcache.model.decoder import CausalLM

__all__ = ["WeightLoadError", "load_tensors", "load_weights", "weight_files"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# tensors some checkpoints carry that hold nothing we need
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    """The checkpoint's tensors do not fit the config; names the first offending tensor."""


@dataclass(slots=True)
class _Target:
    """Where one checkpoint tensor lands: a parameter, and a row range of it (fused)."""

    param: torch.Tensor
    start: int
    size: int


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint (validating a sharded index)."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        return _sharded_files(index)
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    raise WeightLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def _sharded_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise WeightLoadError(f"invalid sharded index {index}: {exc!r}") from None
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.is_file():
            raise WeightLoadError(f"shard {file.name} listed in {index.name} is missing")
    return files


def load_weights(model: CausalLM, path: str | Path) -> None:
    """Fill every parameter of ``model`` from the safetensors checkpoint at ``path``."""
    files = weight_files(path)
    source = str(files[0]) if len(files) == 1 else f"checkpoint {path}"
    load_tensors(model, _safetensors_items(files), source)


def _safetensors_items(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                names = list(handle.keys())  # noqa: SIM118 (safe_open is not a mapping)
                for name in names:
                    tensor = handle.get_tensor(name)
                    yield name, tensor
        except (SafetensorError, OSError) as exc:  # a damaged header or data section
            raise WeightLoadError(f"cannot read {file}: {exc}") from None


def load_tensors(
    model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str
) -> None:
    """Copy transformers-named tensors into ``model`` (fusing q/k/v and gate/up), one at a time,
    checking every shape; every parameter must be filled. ``source`` names the checkpoint."""
    targets = _targets(model, model.config)
    loaded: set[str] = set()
    for name, tensor in tensors:
        if _load_one(name, tensor, targets, model.config, source):
            loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightLoadError(f"missing tensor {missing[0]!r}{more} in {source}")


def _load_one(
    name: str, tensor: torch.Tensor, targets: dict[str, _Target], config: ModelConfig,
    source: str,
) -> bool:
    """Copy one checkpoint tensor into place; False when it is deliberately skipped."""
    if name.endswith(_IGNORED_SUFFIXES):
        return False
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return False
    target = targets.get(name)
    if target is None:
        raise WeightLoadError(f"unexpected tensor {name!r} in {source}")
    expected = (target.size, *target.param.shape[1:])
    if tuple(tensor.shape) != expected:
        raise WeightLoadError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected} in {source}"
        )
    with torch.no_grad():
        target.param[target.start : target.start + target.size].copy_(tensor)
    return True


def _targets(model: CausalLM, config: ModelConfig) -> dict[str, _Target]:
    """Checkpoint tensor name -> destination, for every tensor the checkpoint must hold."""
    params = dict(model.named_parameters(remove_duplicate=False))
    targets = {
        "model.embed_tokens.weight": _whole(params["model.embed_tokens.weight"]),
        "model.norm.weight": _whole(params["model.norm.weight"]),
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = _whole(params["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        targets.update(_layer_targets(params, f"model.layers.{i}.", config))
    return targets


def _layer_targets(
    params: dict[str, torch.nn.Parameter], prefix: str, config: ModelConfig
) -> dict[str, _Target]:
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    suffixes = ["weight", "bias"] if config.attention_bias else ["weight"]
    out: dict[str, _Target] = {}
    for suffix in suffixes:
        fused = params[f"{attn}qkv_proj.{suffix}"]
        out[f"{attn}q_proj.{suffix}"] = _Target(fused, 0, q)
        out[f"{attn}k_proj.{suffix}"] = _Target(fused, q, kv)
        out[f"{attn}v_proj.{suffix}"] = _Target(fused, q + kv, kv)
    gate_up = params[f"{mlp}gate_up_proj.weight"]
    out[f"{mlp}gate_proj.weight"] = _Target(gate_up, 0, inter)
    out[f"{mlp}up_proj.weight"] = _Target(gate_up, inter, inter)
    whole = [
        f"{attn}o_proj.weight",
        f"{mlp}down_proj.weight",
        f"{prefix}input_layernorm.weight",
        f"{prefix}post_attention_layernorm.weight",
    ]
    if config.qk_norm:
        whole += [f"{attn}q_norm.weight", f"{attn}k_norm.weight"]
    out.update({name: _whole(params[name]) for name in whole})
    return out


def _whole(param: torch.Tensor) -> _Target:
    return _Target(param, 0, param.shape[0])
