"""Block identity, the block pool and the two prefix caches. Imports no torch.

    from prefixcache.cache import make_prefix_cache, Sequence
    cache = make_prefix_cache("hash", num_blocks=64, block_size=16)
"""

from __future__ import annotations

from typing import Any

from prefixcache.cache.adoption import adopt
from prefixcache.cache.base import PrefixCache, Protection
from prefixcache.cache.block_hash import BlockExtra, BlockHasher, Namespace
from prefixcache.cache.config import CacheConfig
from prefixcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from prefixcache.cache.hash_cache import HashPrefixCache
from prefixcache.cache.identity import CacheIdentity
from prefixcache.cache.index import CacheHit
from prefixcache.cache.public import PublicPrefixes
from prefixcache.cache.purge import evict_domain
from prefixcache.cache.radix_cache import RadixPrefixCache
from prefixcache.cache.sequence import PUBLIC_DOMAIN, Sequence
from prefixcache.cache.stats import CacheStats

__all__ = [
    "PREFIX_CACHES", "PUBLIC_DOMAIN", "CacheConfig", "AllBlocksCleared", "BlockExtra",
    "BlockHasher", "BlockRemoved", "BlockStored", "CacheHit", "CacheIdentity", "CacheStats",
    "HashPrefixCache", "KVCacheEvent", "Namespace", "PrefixCache", "Protection", "PublicPrefixes",
    "RadixPrefixCache", "Sequence", "adopt", "evict_domain", "make_prefix_cache",
]  # fmt: skip

PREFIX_CACHES: dict[str, type[PrefixCache]] = {"hash": HashPrefixCache, "radix": RadixPrefixCache}


def make_prefix_cache(
    kind: str | CacheConfig = "hash",
    *,
    num_blocks: int | None = None,
    block_size: int = 16,
    hash_algo: str = "sha256",
    **kwargs: Any,
) -> PrefixCache:
    """Build a prefix cache by name: ``hash`` (vLLM-style) or ``radix`` (SGLang-style); or the
    one a `CacheConfig` describes (then no other argument).

    Keyword arguments are `CacheConfig`'s: ``enable_prefix_caching`` (default True),
    ``model_id`` (the model identity that roots
    every namespace), ``zero_on_reuse``, ``enable_kv_events``, ``events_with_tokens``,
    ``max_events``, ``eviction_policy`` (``lfu``: radix only).
    """
    if isinstance(kind, CacheConfig):
        if num_blocks is not None or kwargs or (block_size, hash_algo) != (16, "sha256"):
            raise TypeError("give a CacheConfig or keyword settings, not both")
        config = kind
    else:
        config = CacheConfig.of(kind, num_blocks, block_size, hash_algo, **kwargs)  # validated
    if config.num_blocks is None:
        raise ValueError("num_blocks must be set to build a cache")
    return PREFIX_CACHES[config.kind].from_config(config)
