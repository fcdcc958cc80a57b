"""`CacheObserver`: what a logger or a dashboard implements to hear a cache's decisions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from prefixcache.cache.index import CacheHit
    from prefixcache.cache.sequence import Sequence

__all__ = ["CacheObserver"]


class CacheObserver(Protocol):
    """Told about a cache's decisions as they happen (logging, tracing); adds nothing to the
    cache's own work when none is attached. Must not call back into the cache's mutators."""

    def on_admit(self, seq: Sequence, hit: CacheHit | None, block_ids: list[int]) -> None:
        """``seq`` was admitted with ``hit``; ``block_ids`` is its new block table."""

    def on_commit(self, seq: Sequence, start: int, end: int, block_ids: list[int]) -> None:
        """Blocks ``start..end-1`` of ``seq`` (``block_ids``: theirs, in order) are full and
        computed. Told what the chunk committed, never the whole table: a long prompt's
        commits cost its chunks, not its length each time."""

    def on_free(self, seq: Sequence, num_blocks: int) -> None:
        """``seq`` let go of its ``num_blocks`` blocks."""
