"""The radix-tree prefix cache (SGLang RadixAttention-style): per-sequence block tables over the
block pool, with a radix tree of block runs as its index (``radix_index.py``)."""

from __future__ import annotations

from prefixcache.cache.index import PrefixIndex
from prefixcache.cache.manager import PrefixCache
from prefixcache.cache.radix_index import EVICTION_POLICIES, RadixIndex

__all__ = ["EVICTION_POLICIES", "RadixPrefixCache"]


class RadixPrefixCache(PrefixCache):
    """SGLang-style prefix cache: unlocked cached blocks stay in the tree and are evicted leaf
    first; ``eviction_policy`` is ``lru`` (default) or ``lfu`` (hit count, then recency)."""

    kind = "radix"
    index: RadixIndex

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
