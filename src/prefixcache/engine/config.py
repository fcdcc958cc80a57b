"""`EngineConfig`: one frozen, validated description of an engine, built once from the CLI
flags, the server's flags or the offline `LLM(...)` keywords and passed down: the cache gets
`EngineConfig.cache`, the scheduler `EngineConfig.scheduler`, the loader the model part.

    config = EngineConfig.from_kwargs("tiny", block_size=16, max_num_seqs=8)
    engine = LLMEngine(config=config)
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from prefixcache.cache import CacheConfig
from prefixcache.cache.block_hash import HASH_ALGOS
from prefixcache.cache.config import CACHE_KINDS, EVICTION_POLICIES
from prefixcache.catalog import (
    DTYPE_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    WEIGHT_DTYPE_CHOICES,
    model_help,
)
from prefixcache.engine.sampling_params import LOGPROBS_MODES
from prefixcache.sched import SCHEDULE_POLICIES, SchedulerConfig
from prefixcache.sched.fairness import DomainLimits
from prefixcache.tiers import TIERS, TierConfig

__all__ = ["DEFAULT_KV_MEMORY_BYTES", "EngineConfig", "LoraConfig", "add_engine_arguments"]

DEFAULT_KV_MEMORY_BYTES = 256 * 1024 * 1024

# an engine buffers KV events only for a consumer that drains them, and token ids (tenant data)
# only when asked
_ENGINE_CACHE = CacheConfig(enable_kv_events=False, events_with_tokens=False)

# flat keyword -> (part, field); the spellings `LLMEngine(...)` and `LLM(...)` have always taken
_CACHE_KEYS = {
    "prefix_cache": "kind",
    "num_kv_blocks": "num_blocks",
    "block_size": "block_size",
    "hash_algo": "hash_algo",
    "enable_prefix_caching": "enable_prefix_caching",
    "zero_on_reuse": "zero_on_reuse",
    "kv_events": "enable_kv_events",
    "kv_events_with_tokens": "events_with_tokens",
    "eviction_policy": "eviction_policy",
}
_SCHEDULER_KEYS = {
    "max_num_seqs", "max_num_batched_tokens", "schedule_policy", "lpm_max_wait_steps",
    "dedup", "domain_limits", "default_domain_limits",
}  # fmt: skip
# the tiers' own settings are their flags' destinations (`TIERS`); these are the writer's
_OFFLOAD_KEYS = {
    "kv_offload_decode", "kv_offload_max_pending_blocks", "kv_offload_max_pending_bytes",
}  # fmt: skip
_TIER_SETTINGS = {dest for kind in TIERS.values() for dest in kind.dests}
_LORA_KEYS = {"enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"}
MAX_LORA_RANK = 512  # the kernel's (prefixcache/native/lora.h)


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """LoRA adapters (vLLM's settings): ``enable_lora``; at most ``max_loras`` adapters in one
    step, of rank at most ``max_lora_rank``; at most ``max_cpu_loras`` held in memory (None:
    ``max(max_loras, 8)``)."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got "
                             f"{self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        """Adapters held in memory at most."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else max(self.max_loras, 8)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """``model``: a built-in name, a checkpoint directory, a .gguf file or a `LoadedModel`.
    ``cache.num_blocks=None`` sizes the pool from ``kv_cache_memory_bytes`` (capped at what
    ``max_num_seqs`` full-length sequences could use). ``check_integrity`` verifies every cache
    invariant after each step (tests). ``logprobs_mode``: what reported log-probabilities are
    of (`prefixcache.engine.sampler`). ``tiers``: the lower KV tiers (disk, Valkey) under the
    pool; none by default. ``kv_cache_dtype``: the paged KV cache's layout
    (`prefixcache.model.kv_choice`)."""

    model: Any = "tiny"
    dtype: str = "float32"
    weight_dtype: str = "auto"  # how a float32 model keeps its projection weights
    kv_cache_dtype: str = "auto"
    seed: int = 0
    cache: CacheConfig = _ENGINE_CACHE
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache_memory_bytes: int = DEFAULT_KV_MEMORY_BYTES
    check_integrity: bool = False
    logprobs_mode: str = "raw_logprobs"
    tiers: TierConfig = field(default_factory=TierConfig)
    max_pinned_blocks: int | None = None  # per domain; None: a quarter of the pool
    pin_budgets: Mapping[str, int] | None = None  # per domain, replacing max_pinned_blocks
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"unknown logprobs_mode {self.logprobs_mode!r}; choose one of "
                             f"{list(LOGPROBS_MODES)}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {list(DTYPE_CHOICES)}")
        if self.weight_dtype not in WEIGHT_DTYPE_CHOICES:
            raise ValueError(f"unknown weight_dtype {self.weight_dtype!r}; choose one of "
                             f"{list(WEIGHT_DTYPE_CHOICES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of "
                             f"{list(KV_CACHE_DTYPE_CHOICES)}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}"
            )
        if self.max_pinned_blocks is not None and self.max_pinned_blocks < 0:
            raise ValueError(f"max_pinned_blocks must be >= 0, got {self.max_pinned_blocks}")

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @classmethod
    def from_kwargs(cls, model: Any = "tiny", **settings: Any) -> EngineConfig:
        """From the flat keywords of `LLMEngine(...)` / `LLM(...)`: ``block_size``,
        ``num_kv_blocks``, ``kv_cache_memory_bytes``, ``enable_prefix_caching``, ``prefix_cache``,
        ``hash_algo``, ``eviction_policy``, ``zero_on_reuse``, ``kv_events``,
        ``kv_events_with_tokens``, ``max_num_seqs``, ``max_num_batched_tokens``,
        ``schedule_policy``, ``lpm_max_wait_steps``, ``dedup``, ``domain_limits``,
        ``default_domain_limits``, ``seed``, ``dtype``, ``weight_dtype``, ``kv_cache_dtype``,
        ``check_integrity``,
        ``logprobs_mode``, the tiers' flags (`prefixcache.tiers.TIERS`: ``kv_disk``,
        ``kv_disk_gib``, ``kv_valkey``, ``kv_valkey_ttl``), ``kv_offload_decode``,
        ``kv_offload_max_pending_blocks``, ``kv_offload_max_pending_bytes``, ``enable_lora``,
        ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``."""
        cache = {_CACHE_KEYS[k]: settings.pop(k) for k in list(settings) if k in _CACHE_KEYS}
        scheduler = {k: settings.pop(k) for k in list(settings) if k in _SCHEDULER_KEYS}
        lora = LoraConfig(**{k: v for k in list(settings) if k in _LORA_KEYS
                             if (v := settings.pop(k)) is not None})  # fmt: skip
        if lora.enable_lora:  # the scheduler keeps a step's adapters to max_loras
            scheduler["max_loras"] = lora.max_loras
        offload = {k: v for k in list(settings) if k in _OFFLOAD_KEYS
                   if (v := settings.pop(k)) is not None}  # fmt: skip  # None: the default
        tier_settings = {k: v for k in list(settings) if k in _TIER_SETTINGS
                         if (v := settings.pop(k)) is not None}  # fmt: skip
        known = {"dtype", "weight_dtype", "kv_cache_dtype", "seed", "kv_cache_memory_bytes",
                 "check_integrity", "logprobs_mode", "max_pinned_blocks", "pin_budgets"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(unknown)}")
        return cls(
            model=model,
            cache=replace(_ENGINE_CACHE, **cache),
            scheduler=SchedulerConfig.from_kwargs(**scheduler),
            tiers=TierConfig(tier_settings, **offload),
            lora=lora,
            **settings,
        )

    @classmethod
    def from_args(
        cls,
        args: argparse.Namespace,
        *,
        domain_limits: Mapping[str, DomainLimits] | None = None,
        default_domain_limits: DomainLimits | None = None,
        pin_budgets: Mapping[str, int] | None = None,
    ) -> EngineConfig:
        """From the flags `add_engine_arguments` defines (``serve``, ``generate``): a flag's
        destination is its `from_kwargs` keyword; ``--prefix-cache off`` turns caching off."""
        flags = {dest: value for dest in _engine_flags()
                 if (value := getattr(args, dest, None)) is not None}  # fmt: skip
        kind = flags.pop("prefix_cache", "hash")
        flags.update(prefix_cache="hash" if kind == "off" else kind,
                     enable_prefix_caching=kind != "off")
        return cls.from_kwargs(flags.pop("model"), domain_limits=domain_limits,
                               default_domain_limits=default_domain_limits,
                               pin_budgets=pin_budgets, **flags)


def _engine_flags() -> list[str]:
    """The destinations of every flag `add_engine_arguments` defines."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    return [action.dest for action in parser._actions]


_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def memory_bytes(text: str) -> int:
    """``4G``, ``512M``, ``64K`` (binary units, an optional trailing ``iB`` or ``B``) or plain
    bytes, >= 1; for argparse."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = _SUFFIXES.get(value[-1:], 1)
    number = value[:-1] if scale > 1 else value
    try:
        result = int(float(number) * scale) if number else 0
    except (ValueError, OverflowError):
        result = 0
    if result < 1:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4G, 512M)")
    return result


def add_engine_arguments(parser: argparse.ArgumentParser, default_model: str = "tiny") -> None:
    """The engine's flags, shared by every command that builds one."""
    parser.add_argument("--model", default=default_model, help=model_help(default_model))
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="activations and KV dtype (auto: the precision measured fastest on "
                             "this CPU for this model, once per CPU and model shape; see "
                             "--weight-dtype)")
    parser.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPE_CHOICES,
                        help="how a float32 model keeps its projection weights: bfloat16 "
                             "(widened in the GEMM), q8_0 (8-bit blocks), gguf (the GGUF file's "
                             "own quantized blocks); auto: as --dtype, or what --dtype auto "
                             "measured")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                        help="how the paged KV cache keeps K and V: float32, bfloat16, int8 "
                             "(8-bit blocks of 32 with a scale each: 3.8x float32's prefixes in "
                             "the same memory), int4 (4-bit blocks of a Hadamard-rotated head: "
                             "7.1x), fp8 / fp8_e4m3 / fp8_e5m2 (8-bit floats in scaled blocks); "
                             "auto: the activations' dtype, or under --dtype auto the smallest "
                             "layout that passes its fidelity gate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-cache", choices=(*CACHE_KINDS, "off"), default="hash",
                        help="the prefix cache: hash (vLLM-style), radix (SGLang-style) or off")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=memory_bytes, default=None,
                        help="KV cache space when --num-kv-blocks is not given, in bytes or "
                             "with a binary suffix: 4G, 512M (default 256M)")
    parser.add_argument("--hash-algo", default="sha256", choices=sorted(HASH_ALGOS),
                        help="block digest (xxh3_128: fast, not collision-resistant)")
    parser.add_argument("--eviction-policy", default="lru", choices=EVICTION_POLICIES,
                        help="order of evicting free cached blocks (lfu: radix only)")
    parser.add_argument("--zero-on-reuse", action="store_true",
                        help="zero a block's KV before another namespace reuses it")
    parser.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES,
                        help="reported logprobs: of the model's distribution, or after "
                             "penalties, logit_bias, min_tokens and temperature")
    for kind in TIERS.values():  # each tier's flags: its location and its settings
        kind.add_arguments(parser)
    parser.add_argument("--kv-offload-decode", action="store_true",
                        help="write decode blocks to the tiers too, not just prompt blocks")
    parser.add_argument("--max-pinned-blocks", type=int, default=None, metavar="N",
                        help="KV blocks each tenant may pin with cache_control or "
                             "prompt_cache_retention (default: a quarter of the pool)")
    parser.add_argument("--enable-lora", action="store_true", default=None,
                        help="serve LoRA adapters (peft's files) beside the base model")
    parser.add_argument("--max-loras", type=int, default=None, metavar="N",
                        help="LoRA adapters in one batch at most (default 1)")
    parser.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                        help="the highest LoRA rank accepted (default 16)")
    parser.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                        help="LoRA adapters kept in memory at most (default: max(--max-loras, "
                             "8))")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--schedule-policy", default="fcfs", choices=SCHEDULE_POLICIES,
                        help="admission order: fcfs, or lpm (longest cached prefix first, aged)")

