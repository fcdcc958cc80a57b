"""The prefix-cache contract's types, under the names they have always had here.

`PrefixCache` (``manager.py``) is the contract written once over the block pool and a prefix
index; `CacheHit` comes from ``index.py``, `Sequence` from ``sequence.py``.
"""

from __future__ import annotations

from prefixcache.cache.index import CacheHit
from prefixcache.cache.manager import PrefixCache
from prefixcache.cache.sequence import Sequence

__all__ = ["CacheHit", "PrefixCache", "Sequence"]
