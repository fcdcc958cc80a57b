"""Pinned prefixes now live with the cache they hold blocks of: `prefixcache.cache.pins` (the
simulator replays pins too). This module keeps the old import path working."""

from prefixcache.cache.pins import MAX_TTL_S, TTLS, Pin, PinTable, ttl_seconds

__all__ = ["MAX_TTL_S", "TTLS", "Pin", "PinTable", "ttl_seconds"]
