"""`CacheConfig`: every setting of a prefix cache, validated once.

`make_prefix_cache` (the contract's factory) and the engine build caches from it; each
implementation reads only what it uses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from prefixcache.cache.block_hash import HASH_ALGOS
from prefixcache.cache.block_pool import DEFAULT_MAX_EVENTS

__all__ = ["CACHE_KINDS", "EVICTION_POLICIES", "CacheConfig"]

CACHE_KINDS = ("hash", "radix")
EVICTION_POLICIES = ("lru", "lfu")  # radix: least recently used leaf, or least hit, then LRU


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """``kind``: ``hash`` (vLLM-style) or ``radix`` (SGLang-style). ``num_blocks=None`` only
    inside an engine's configuration: the engine sizes the pool from its memory budget.
    ``model_id`` roots every namespace; ``eviction_policy`` ``lfu`` exists on radix only."""

    kind: str = "hash"
    num_blocks: int | None = None
    block_size: int = 16
    hash_algo: str = "sha256"
    enable_caching: bool = True
    model_id: str = ""
    zero_on_reuse: bool = False
    enable_kv_events: bool = True
    events_with_tokens: bool = True
    max_events: int = DEFAULT_MAX_EVENTS
    eviction_policy: str = "lru"

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise ValueError(f"unknown prefix cache {self.kind!r}; choose one of {CACHE_KINDS}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"unknown hash_algo {self.hash_algo!r}; choose one of {sorted(HASH_ALGOS)}"
            )
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction_policy {self.eviction_policy!r}; "
                f"choose one of {list(EVICTION_POLICIES)}"
            )
        if self.eviction_policy != "lru" and self.kind != "radix":
            raise ValueError(f"eviction_policy {self.eviction_policy!r} exists only on radix")
        if self.max_events < 0:
            raise ValueError(f"max_events must be >= 0, got {self.max_events}")

    def as_kwargs(self) -> dict[str, object]:
        """The settings as `PrefixCache` keyword arguments (without ``kind``)."""
        out = asdict(self)
        del out["kind"]
        return out
