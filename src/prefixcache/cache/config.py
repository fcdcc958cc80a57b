"""`CacheConfig`: every setting of a prefix cache, validated once.

`make_prefix_cache` (the contract's factory) and the engine build caches from it; each
implementation reads only what it uses.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass

from prefixcache.cache.block_hash import HASH_ALGOS
from prefixcache.cache.events import DEFAULT_MAX_EVENTS

__all__ = ["CACHE_KINDS", "EVICTION_POLICIES", "CacheConfig", "one_of"]

CACHE_KINDS = ("hash", "radix")
EVICTION_POLICIES = ("lru", "lfu")  # radix: least recently used leaf, or least hit, then LRU


def one_of(name: str, value: object, choices: Collection[str]) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {sorted(choices)}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """``kind``: ``hash`` (vLLM-style) or ``radix`` (SGLang-style). ``num_blocks=None`` only
    inside an engine's configuration: the engine sizes the pool from its memory budget.
    ``model_id`` roots every namespace, with ``kv_layout`` where the KV is stored otherwise than
    in the model's dtype; ``eviction_policy`` ``lfu`` exists on radix only."""

    kind: str = "hash"
    num_blocks: int | None = None
    block_size: int = 16
    hash_algo: str = "sha256"
    enable_prefix_caching: bool = True
    model_id: str = ""
    zero_on_reuse: bool = False
    enable_kv_events: bool = True
    events_with_tokens: bool = True
    max_events: int = DEFAULT_MAX_EVENTS
    eviction_policy: str = "lru"
    kv_layout: str | None = None

    def __post_init__(self) -> None:
        one_of("prefix cache", self.kind, CACHE_KINDS)
        one_of("hash_algo", self.hash_algo, HASH_ALGOS)
        one_of("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        if self.eviction_policy != "lru" and self.kind != "radix":
            raise ValueError(f"eviction_policy {self.eviction_policy!r} exists only on radix")
        for name in ("num_blocks", "block_size", "max_events"):
            value, least = getattr(self, name), 0 if name == "max_events" else 1
            if value is not None and value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")

    @classmethod
    def of(cls, kind: str, num_blocks: int | None, block_size: int, hash_algo: str,
           **settings: object) -> CacheConfig:
        """From keyword settings (the other fields)."""
        return cls(kind, num_blocks, block_size, hash_algo, **settings)  # type: ignore[arg-type]

    def as_kwargs(self) -> dict[str, object]:
        """The settings as `PrefixCache` keyword arguments (without ``kind``)."""
        out = asdict(self)
        del out["kind"]
        return out
