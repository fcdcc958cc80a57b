"""`ModelConfig`: the decoder's shape and numerics, read from a checkpoint's config.json.

Reads both the transformers 4 layout (``rope_theta``, ``rope_scaling``) and the transformers 5
layout (``rope_parameters``); eos ids come from generation_config.json, else config.json; what
config.json leaves to the architecture comes from its `prefixcache.model.arch` entry.
Knows nothing about weights or tokenizers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixcache.model.arch import ARCHITECTURES, Architecture, by_model_type

__all__ = ["ConfigError", "ModelConfig", "RopeConfig"]

_ROPE_TYPES = ("default", "llama3")


class ConfigError(ValueError):
    """A config.json this runtime cannot serve, with the reason."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding settings; llama3 scaling uses the four extra fields."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope type {self.rope_type!r} (supported: {', '.join(_ROPE_TYPES)})"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ConfigError(f"invalid rope settings: theta={self.theta}, factor={self.factor}")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> RopeConfig:
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "llama3":
            return cls(
                theta=float(theta),
                rope_type="llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        return cls(theta=float(theta), rope_type=str(rope_type))


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Validated decoder configuration."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        _registered(self.architecture)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")

    @property
    def family(self) -> str:
        """The decoder family (`Architecture.family`): "llama" for Llama and Mistral."""
        return ARCHITECTURES[self.architecture].family

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly (a sliding window caps it: no windowed attention)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read config.json (and generation_config.json when present) from a checkpoint."""
        path = Path(path)
        raw = _read_json(path / "config.json", required=True)
        generation = _read_json(path / "generation_config.json", required=False)
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        arch = _registered(_architecture_name(raw))
        try:
            return cls._from_fields(raw, generation or {}, arch)
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"config.json has an invalid value: {exc}") from None

    @classmethod
    def _from_fields(
        cls, raw: dict[str, Any], generation: dict[str, Any], arch: Architecture
    ) -> ModelConfig:
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"unsupported hidden_act {act!r} (only 'silu')")
        if float(raw.get("partial_rotary_factor", 1.0)) != 1.0 or raw.get("mlp_bias"):
            raise ConfigError("unsupported: partial_rotary_factor != 1 or mlp_bias")
        heads = int(raw["num_attention_heads"])
        use_window = raw.get("use_sliding_window", arch.sliding_window_by_default)
        return cls(
            architecture=arch.name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch.attention_bias)),
            qk_norm=arch.qk_norm,
            sliding_window=int(raw["sliding_window"])
            if use_window and raw.get("sliding_window")
            else None,
            eos_token_ids=_eos_ids(generation, raw),
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )


def _registered(name: str) -> Architecture:
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise ConfigError(
            f"unsupported architecture {name!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    return arch


def _architecture_name(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    if archs:
        return str(archs[0])
    model_type = raw.get("model_type")
    arch = by_model_type(model_type) if isinstance(model_type, str) else None
    if arch is not None:
        return arch.name
    if model_type:
        supported = ", ".join(a.model_type for a in ARCHITECTURES.values())
        raise ConfigError(
            f"config.json has no 'architectures' and an unsupported model_type {model_type!r} "
            f"(supported: {supported})"
        )
    raise ConfigError("config.json has neither 'architectures' nor 'model_type'")


def _eos_ids(generation: dict[str, Any], raw: dict[str, Any]) -> tuple[int, ...]:
    value = generation.get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(int(v) for v in values)


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ConfigError(f"{path} not found")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data
