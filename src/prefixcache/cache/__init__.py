"""Block identity, the block pool and the two prefix caches. Imports no torch.

    from prefixcache.cache import make_prefix_cache, Sequence
    cache = make_prefix_cache("hash", num_blocks=64, block_size=16)
"""

from __future__ import annotations

import importlib
from typing import Any

from prefixcache.cache.block_hash import BlockExtra, BlockHasher, Namespace
from prefixcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from prefixcache.cache.index import CacheHit
from prefixcache.cache.manager import PrefixCache
from prefixcache.cache.sequence import Sequence
from prefixcache.cache.stats import CacheStats

__all__ = [
    "PREFIX_CACHES",
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
PREFIX_CACHES: dict[str, str] = {
    "hash": "prefixcache.cache.hash_cache:HashPrefixCache",
    "radix": "prefixcache.cache.radix_cache:RadixPrefixCache",
}


def make_prefix_cache(
    kind: str = "hash",
    *,
    num_blocks: int,
    block_size: int = 16,
    hash_algo: str = "sha256",
    **kwargs: Any,
) -> PrefixCache:
    """Build a prefix cache by name: ``hash`` (vLLM-style) or ``radix`` (SGLang-style).

    Common keyword arguments: ``enable_caching`` (default True), ``model_id`` (the model identity
    that roots every namespace), ``zero_on_reuse``; radix also takes ``eviction_policy``.
    """
    if kind not in PREFIX_CACHES:
        raise ValueError(f"unknown prefix cache {kind!r}; choose one of {sorted(PREFIX_CACHES)}")
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    module_name, class_name = PREFIX_CACHES[kind].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    cache: PrefixCache = cls(
        num_blocks=num_blocks, block_size=block_size, hash_algo=hash_algo, **kwargs
    )
    return cache
