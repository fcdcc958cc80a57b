"""Block identity, the block pool and the two prefix caches. Imports no torch.

    from prefixcache.cache import make_prefix_cache, Sequence
    cache = make_prefix_cache("hash", num_blocks=64, block_size=16)
"""

from __future__ import annotations

import importlib
from typing import Any

from prefixcache.cache.block_hash import BlockExtra, BlockHasher, Namespace
from prefixcache.cache.config import CacheConfig
from prefixcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from prefixcache.cache.index import CacheHit
from prefixcache.cache.manager import PrefixCache
from prefixcache.cache.sequence import Sequence
from prefixcache.cache.stats import CacheStats

__all__ = [
    "PREFIX_CACHES",
    "CacheConfig",
    "build_prefix_cache",
    "AllBlocksCleared",
    "BlockExtra",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "CacheHit",
    "CacheStats",
    "KVCacheEvent",
    "Namespace",
    "PrefixCache",
    "Sequence",
    "make_prefix_cache",
]

# name -> "module:class"; imported on demand so each implementation stays independent.
_CLASSES: dict[str, str] = {
    "hash": "prefixcache.cache.hash_cache:HashPrefixCache",
    "radix": "prefixcache.cache.radix_cache:RadixPrefixCache",
}
PREFIX_CACHES = _CLASSES  # the names, as a mapping (kept for its readers)


def make_prefix_cache(
    kind: str = "hash",
    *,
    num_blocks: int,
    block_size: int = 16,
    hash_algo: str = "sha256",
    **kwargs: Any,
) -> PrefixCache:
    """Build a prefix cache by name: ``hash`` (vLLM-style) or ``radix`` (SGLang-style).

    Keyword arguments are `CacheConfig`'s: ``enable_caching`` (default True), ``model_id`` (the
    model identity that roots every namespace), ``zero_on_reuse``, ``enable_kv_events``,
    ``events_with_tokens``, ``max_events``, ``eviction_policy`` (``lfu``: radix only).
    """
    return build_prefix_cache(
        CacheConfig(kind, num_blocks, block_size, hash_algo, **kwargs)  # validated here
    )


def build_prefix_cache(config: CacheConfig) -> PrefixCache:
    """The cache a `CacheConfig` describes."""
    module_name, class_name = _CLASSES[config.kind].split(":")
    cls: type[PrefixCache] = getattr(importlib.import_module(module_name), class_name)
    return cls.from_config(config)
