"""The hash-chain prefix cache (vLLM-style): per-sequence block tables over the block pool, with
a digest -> block map as its index (``hash_index.py``)."""

from __future__ import annotations

from prefixcache.cache.hash_index import HashIndex
from prefixcache.cache.index import PrefixIndex
from prefixcache.cache.manager import PrefixCache

__all__ = ["HashPrefixCache"]


class HashPrefixCache(PrefixCache):
    """vLLM-style prefix cache: lookups walk the digest chain and stop at the first miss; free
    cached blocks wait in the pool's LRU free queue."""

    kind = "hash"

    def _make_index(self) -> PrefixIndex:
        return HashIndex(self.pool, self.keys)
