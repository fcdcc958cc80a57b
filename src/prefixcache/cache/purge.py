"""A tenant's purge: every free cached block of its domain evicted from the RAM
cache, counted and announced as evictions."""

from __future__ import annotations

from prefixcache.cache.base import PrefixCache

__all__ = ["evict_domain"]


def evict_domain(cache: PrefixCache, domain: str) -> list[int]:
    """Evict every free cached block of ``domain`` from ``cache``; blocks live sequences hold
    stay until they are freed. Returns the evicted blocks' ids (their KV is still in the
    tensors: the caller may zero it)."""
    pool = cache.pool
    free_cached = pool.free_cached_by_domain()
    num = free_cached.get(domain, 0)
    if not num:
        return []
    others = frozenset(d for d in free_cached if d != domain)
    # take hands out uncached free blocks first: take them too, and give them all back
    num_uncached = pool.num_free - sum(free_cached.values())
    taken = cache.allocator.take(num_uncached + num, None, others, domain=None)
    pool.release(reversed(taken.blocks))
    return taken.evicted_ids
