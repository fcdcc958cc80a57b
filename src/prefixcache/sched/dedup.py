"""In-batch dedup: a waiting request whose first uncached block another request computes in this
step waits a step, so that it hits the block instead of computing it a second time."""

from __future__ import annotations

from prefixcache.cache import CacheHit, PrefixCache
from prefixcache.sched.request import SchedRequest, ScheduledChunk

__all__ = ["InBatchDedup"]


class InBatchDedup:
    """The block digests a step computes, and which waiting request would compute one of them
    again. Off (``enabled`` False) for a cache that caches nothing."""

    def __init__(self, cache: PrefixCache, enabled: bool) -> None:
        self.cache = cache
        self.enabled = enabled and cache.enable_prefix_caching

    def first_miss(self, request: SchedRequest, hit: CacheHit) -> bytes | None:
        """The digest of the block ``request`` would compute first (None: it never waits)."""
        seq = request.seq
        if not (self.enabled and seq.reads_cache):
            return None  # a sequence that reads no hit gains nothing by waiting
        digests = self.cache.identity.block_digests(seq)
        return digests[hit.num_blocks] if hit.num_blocks < len(digests) else None

    def in_flight(self, chunks: list[ScheduledChunk]) -> set[bytes]:
        if not self.enabled:
            return set()
        return {digest for chunk in chunks for digest in self.written_by(chunk)}

    def written_by(self, chunk: ScheduledChunk) -> list[bytes]:
        """Digests of the complete blocks this chunk writes into (empty for decodes)."""
        seq = chunk.request.seq
        if not (self.enabled and seq.writes_cache) or chunk.num_new_tokens == 1:
            return []
        bs = self.cache.block_size
        digests = self.cache.identity.block_digests(seq)
        first = chunk.num_computed_tokens // bs
        last = (chunk.num_computed_tokens + chunk.num_new_tokens - 1) // bs
        return digests[first : last + 1]
