"""The radix-tree prefix cache (SGLang RadixAttention-style): per-sequence block tables over the
block pool, with a radix tree of block runs as its index (``radix_index.py``)."""

from __future__ import annotations

from prefixcache.cache.block_pool import DEFAULT_MAX_EVENTS
from prefixcache.cache.index import PrefixIndex
from prefixcache.cache.manager import PrefixCache
from prefixcache.cache.radix_index import EVICTION_POLICIES, RadixIndex

__all__ = ["EVICTION_POLICIES", "RadixPrefixCache"]


class RadixPrefixCache(PrefixCache):
    """SGLang-style prefix cache: unlocked cached blocks stay in the tree and are evicted leaf
    first; ``eviction_policy`` is ``lru`` (default) or ``lfu`` (hit count, then recency)."""

    index: RadixIndex

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_algo: str = "sha256",
        *,
        enable_caching: bool = True,
        model_id: str = "",
        zero_on_reuse: bool = False,
        enable_kv_events: bool = True,
        eviction_policy: str = "lru",
        events_with_tokens: bool = True,
        max_events: int = DEFAULT_MAX_EVENTS,
    ) -> None:
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction_policy {eviction_policy!r}; "
                f"choose one of {list(EVICTION_POLICIES)}"
            )
        self.eviction_policy = eviction_policy
        super().__init__(
            num_blocks,
            block_size,
            hash_algo,
            enable_caching=enable_caching,
            model_id=model_id,
            zero_on_reuse=zero_on_reuse,
            enable_kv_events=enable_kv_events,
            events_with_tokens=events_with_tokens,
            max_events=max_events,
        )

    def _make_index(self) -> PrefixIndex:
        return RadixIndex(self.pool, self.keys, self.eviction_policy)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no live sequence locks (reusable after eviction)."""
        return self.pool.num_parked

    @property
    def num_protected_blocks(self) -> int:
        """Blocks live sequences use: on locked paths, or held outside the tree."""
        return self.num_blocks - self.pool.num_free

    @property
    def num_nodes(self) -> int:
        """Tree nodes that own blocks."""
        return self.index.num_nodes
