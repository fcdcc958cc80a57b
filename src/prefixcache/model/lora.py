"""LoRA adapters as peft saves them: ``adapter_config.json`` beside
``adapter_model.safetensors``, read, checked against a model's shapes, and named by content.

    adapter = load_adapter("path/to/adapter", loaded.config, max_rank=16)
    adapter.identity      # "lora:<sha256>": the update's scales and the weight file's bytes
    adapter.targets       # {(layer, "q_proj"): LoraTarget(a [r, in], b [out, r], scale)}

The update of a target projection is peft's ``lora_B(lora_A(x)) * scaling``, with ``scaling``
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), per module where
``rank_pattern`` / ``alpha_pattern`` say so. Targets: the q, k, v, o, gate, up and down
projections of any layer. What changes the computation otherwise (DoRA, trained biases,
``modules_to_save``, embedding or LM-head LoRA, ...) is refused by name, never half applied. The
identity does not depend on the adapter's name or path: the same files are the same adapter,
and a file changed under the same name is another one. Knows nothing of batches or the cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from prefixcache.model.config import ModelConfig

__all__ = ["TARGETS", "LoraAdapter", "AdapterConfig", "LoraError", "LoraTarget", "load_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the projections an adapter may target, as transformers names them
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_TENSOR = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight$"
)
# config fields that would change the computation, and the value that leaves it unchanged
_UNSUPPORTED: dict[str, tuple[object, str]] = {
    "use_dora": (False, "DoRA (use_dora)"),
    "bias": ("none", "trained biases (bias)"),
    "lora_bias": (False, "a bias on lora_B (lora_bias)"),
    "modules_to_save": (None, "fully trained modules (modules_to_save)"),
    "fan_in_fan_out": (False, "transposed (Conv1D) weights (fan_in_fan_out)"),
    "layer_replication": (None, "layer replication"),
    "target_parameters": (None, "LoRA on parameters (target_parameters)"),
    "trainable_token_indices": (None, "trained token embeddings (trainable_token_indices)"),
    "alora_invocation_tokens": (None, "activated LoRA (alora_invocation_tokens)"),
    "use_qalora": (False, "QA-LoRA (use_qalora)"),
}


class LoraError(ValueError):
    """A bad adapter: says what is wrong with which file; nothing of it was loaded."""


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What of ``adapter_config.json`` changes the update: rank, alpha, rsLoRA and the
    per-module patterns; ``target_modules`` as written (a list of names, or a pattern)."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()
    rank_pattern: Mapping[str, int] | None = None
    alpha_pattern: Mapping[str, float] | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AdapterConfig:
        """From the parsed file; raises `LoraError` for what is not a LoRA we can run."""
        if data.get("peft_type", "LORA") != "LORA":
            raise LoraError(f"peft_type {data.get('peft_type')!r} is not LoRA")
        for name, (neutral, what) in _UNSUPPORTED.items():
            value = data.get(name, neutral)
            if value != neutral and value not in (None, [], {}, False):
                raise LoraError(f"{what} is not supported ({name}={value!r})")
        r, alpha = data.get("r"), data.get("lora_alpha", 8)  # peft's defaults
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise LoraError(f"r must be a positive integer, got {r!r}")
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            raise LoraError(f"lora_alpha must be a number, got {alpha!r}")
        targets = data.get("target_modules") or ()
        if not isinstance(targets, str):
            targets = tuple(sorted(str(t) for t in targets))
            unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGETS]
            if unknown:
                raise LoraError(f"target module(s) {', '.join(unknown)}: only the "
                                f"{'/'.join(t[:-5] for t in TARGETS)} projections can be "
                                "adapted (not the embedding or the LM head)")
        return cls(r, float(alpha), bool(data.get("use_rslora", False)), targets,
                   dict(data.get("rank_pattern") or {}), dict(data.get("alpha_pattern") or {}))

    def scale(self, module: str, rank: int) -> float:
        """peft's ``scaling`` of ``module`` ("model.layers.3.self_attn.q_proj") of ``rank``."""
        alpha = self.lora_alpha
        for key, value in (self.alpha_pattern or {}).items():
            if re.match(rf"(.*\.)?({key})$", module):
                alpha = float(value)
                break
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


@dataclass(frozen=True, slots=True)
class LoraTarget:
    """One projection's update: ``a`` [rank, in_features], ``b`` [out_features, rank] (float32)
    and ``scale``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """An adapter read from ``path``: its targets by (layer, projection name) and its
    ``identity`` (content, not name)."""

    path: Path
    config: AdapterConfig
    identity: str
    targets: Mapping[tuple[int, str], LoraTarget]

    @property
    def max_rank(self) -> int:
        return max(t.rank for t in self.targets.values())

    @property
    def num_params(self) -> int:
        return sum(t.a.numel() + t.b.numel() for t in self.targets.values())


def target_shape(config: ModelConfig, name: str) -> tuple[int, int]:
    """(in_features, out_features) of the projection ``name`` (one of `TARGETS`)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, config.q_size), "k_proj": (hidden, config.kv_size),
        "v_proj": (hidden, config.kv_size), "o_proj": (config.q_size, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }[name]  # fmt: skip


def load_adapter(
    path: str | Path, model: ModelConfig, max_rank: int | None = None
) -> LoraAdapter:
    """Read and check the adapter in directory ``path`` for a model of ``model``'s shapes;
    ``max_rank``: refuse a rank above it. Raises `LoraError` naming what is wrong."""
    root = Path(path).expanduser()
    config = _read_config(root)
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        extra = " (adapter_model.bin, a pickle, is not read)" if (
            root / "adapter_model.bin").is_file() else ""  # fmt: skip
        raise LoraError(f"no {WEIGHTS_FILE} in {root}{extra}")
    data = weights.read_bytes()  # one read: the identity names exactly what is loaded
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise LoraError(f"{weights} is not a readable safetensors file ({exc})") from None
    targets = _targets(tensors, config, model, max_rank)
    scales = {f"{layer}.{name}": t.scale for (layer, name), t in sorted(targets.items())}
    hasher = hashlib.sha256(b"prefixcache-lora-v1\0")
    hasher.update(json.dumps(scales, sort_keys=True).encode() + b"\0")
    hasher.update(data)
    return LoraAdapter(root, config, f"lora:{hasher.hexdigest()}", targets)


def _read_config(root: Path) -> AdapterConfig:
    if not root.is_dir():
        raise LoraError(f"adapter directory {root} does not exist")
    file = root / CONFIG_FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoraError(f"no {CONFIG_FILE} in {root}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"{file} is not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise LoraError(f"{file} is not a JSON object")
    return AdapterConfig.from_json(data)


def _targets(
    tensors: Mapping[str, torch.Tensor], config: AdapterConfig, model: ModelConfig,
    max_rank: int | None,
) -> dict[tuple[int, str], LoraTarget]:  # fmt: skip
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise LoraError(_unexpected(key))
        layer, name, which = int(match[1]), match[2], match[3]
        if name not in TARGETS:
            raise LoraError(f"tensor {key}: {name} is not a projection of this model")
        if layer >= model.num_hidden_layers:
            raise LoraError(f"tensor {key}: layer {layer}, but the model has "
                            f"{model.num_hidden_layers} layers")
        pairs.setdefault((layer, name), {})[which] = tensor
    if not pairs:
        raise LoraError("the adapter holds no LoRA weights")
    return {key: _target(key, pair, config, model, max_rank) for key, pair in pairs.items()}


def _target(
    key: tuple[int, str], pair: Mapping[str, torch.Tensor], config: AdapterConfig,
    model: ModelConfig, max_rank: int | None,
) -> LoraTarget:  # fmt: skip
    layer, name = key
    where = f"{name} of layer {layer}"
    if set(pair) != {"A", "B"}:
        raise LoraError(f"{where}: lora_{'B' if 'A' in pair else 'A'} is missing")
    a, b = pair["A"], pair["B"]
    in_features, out_features = target_shape(model, name)
    rank = a.shape[0] if a.dim() == 2 else -1
    if a.shape != (rank, in_features) or b.shape != (out_features, rank):
        raise LoraError(f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not "
                        f"fit the model's [{out_features}, {in_features}] projection (an adapter "
                        "of another base model?)")
    if max_rank is not None and rank > max_rank:
        raise LoraError(f"{where}: rank {rank} exceeds the maximum LoRA rank {max_rank} "
                        "(--max-lora-rank)")
    a, b = a.to(torch.float32).contiguous(), b.to(torch.float32).contiguous()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoraError(f"{where}: the weights hold NaN or infinite values")
    scale = config.scale(f"model.layers.{layer}.{'self_attn' if name[0] in 'qkvo' else 'mlp'}"
                         f".{name}", rank)
    return LoraTarget(a, b, scale)


def _unexpected(key: str) -> str:
    if "embed_tokens" in key or "lora_embedding" in key:
        return f"tensor {key}: LoRA on the embedding is not supported"
    if "lm_head" in key:
        return f"tensor {key}: LoRA on the LM head is not supported"
    if "lora_magnitude_vector" in key:
        return f"tensor {key}: DoRA is not supported"
    return f"tensor {key} is not a LoRA weight of a q/k/v/o/gate/up/down projection"
