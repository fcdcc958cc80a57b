"""KV-cache events, in the shape of vLLM's: what a router needs to mirror a replica's cache.

Digests are the chained block digests of `block_hash.py`, so the same blocks give the same events
whichever prefix-cache implementation produced them. Events carry no tenant text; token ids are
only included when the cache was built with ``events_with_tokens=True`` (a router inside the trust
boundary may want them; logs never get them).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became hittable, in chain order: ``block_hashes[0]``'s parent is
    ``parent_block_hash`` (the namespace root for a first block)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes
    token_ids: list[int]
    block_size: int
    block_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks that stopped being hittable (evicted for reuse)."""

    block_hashes: list[bytes]
    block_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBuffer:
    """Buffered KV events, bounded: beyond ``max_events`` undrained events, new ones are dropped
    and counted in ``num_dropped`` (a consumer that never drains cannot grow memory)."""

    __slots__ = ("enabled", "max_events", "num_dropped", "_events")

    def __init__(self, enabled: bool = True, max_events: int = 100_000) -> None:
        self.enabled = enabled
        self.max_events = max_events
        self.num_dropped = 0
        self._events: list[KVCacheEvent] = []

    def emit(self, event: KVCacheEvent) -> None:
        if not self.enabled:
            return
        if len(self._events) >= self.max_events:
            self.num_dropped += 1
            return
        self._events.append(event)

    def take(self) -> list[KVCacheEvent]:
        """Drain the buffered events, oldest first."""
        events, self._events = self._events, []
        return events
