"""KV-cache events, in the shape of vLLM's: what a router needs to mirror a replica's cache.

Digests are the chained block digests of `block_hash.py`, so the same blocks give the same events
whichever prefix-cache implementation produced them. Events carry no tenant text; token ids are
only included when the cache was built with ``events_with_tokens=True`` (a router inside the trust
boundary may want them; logs never get them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixcache.cache.identity import CacheIdentity
    from prefixcache.cache.index import SeqBlocks


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became hittable, in chain order: ``block_hashes[0]``'s parent is
    ``parent_block_hash`` (the namespace root for a first block). ``medium`` (vLLM's field):
    None for the replica's own KV pool, else the lower tier now holding them, by its
    `TierKind.medium` (``"DISK"``: this replica's; ``"VALKEY"``: a shared tier, whose blocks
    every replica can load). ``lora_id``, ``lora_name`` (vLLM's): the LoRA adapter of the
    request that computed them (its identity is in the digests), None for the base model."""

    block_hashes: list[bytes]
    parent_block_hash: bytes
    token_ids: list[int]
    block_size: int
    block_ids: list[int] = field(default_factory=list)
    medium: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks that stopped being hittable in one ``medium`` (as `BlockStored`'s: None for the
    KV pool, evicted for reuse; a tier's name for what that tier dropped). A block leaving the
    pool may still be held by a tier, and the other way round."""

    block_hashes: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def stored(
    table: SeqBlocks, start: int, end: int, identity: CacheIdentity, with_tokens: bool
) -> BlockStored:
    """`BlockStored` for ``table``'s blocks ``start..end-1``, now hittable (token ids only
    ``with_tokens``: they are tenant data)."""
    seq = table.seq
    bs = identity.block_size
    digests = seq.block_digests
    lora_id, lora_name = seq.lora or (None, None)
    return BlockStored(
        block_hashes=digests[start:end],
        parent_block_hash=digests[start - 1] if start else identity.root(seq),
        token_ids=seq.token_ids[start * bs : end * bs] if with_tokens else [],
        block_size=bs,
        block_ids=table.block_ids[start:end],
        lora_id=lora_id,
        lora_name=lora_name,
    )


DEFAULT_MAX_EVENTS = 100_000
DEFAULT_MAX_EVENT_BYTES = 64 * 1024 * 1024


def event_size(event: KVCacheEvent) -> int:
    """Approximate bytes an event keeps alive: its digests, token ids and block ids."""
    if isinstance(event, BlockStored):
        return 64 + 33 * len(event.block_hashes) + 8 * (len(event.token_ids) + len(event.block_ids))
    if isinstance(event, BlockRemoved):
        return 64 + 33 * len(event.block_hashes) + 8 * len(event.block_ids)
    return 64


class EventBuffer:
    """Buffered KV events, bounded in count and in bytes: beyond ``max_events`` undrained events
    or ``max_bytes`` of them, new ones are dropped and counted in ``num_dropped`` (a consumer
    that never drains cannot grow memory). Disabled, it keeps nothing."""

    __slots__ = ("enabled", "max_events", "max_bytes", "num_dropped", "num_bytes", "_events")

    def __init__(
        self,
        enabled: bool = True,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        self.enabled = enabled
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.num_dropped = 0
        self.num_bytes = 0
        self._events: list[KVCacheEvent] = []

    def emit(self, event: KVCacheEvent) -> None:
        if not self.enabled:
            return
        size = event_size(event)
        if len(self._events) >= self.max_events or self.num_bytes + size > self.max_bytes:
            self.num_dropped += 1
            return
        self._events.append(event)
        self.num_bytes += size

    def take(self) -> list[KVCacheEvent]:
        """Drain the buffered events, oldest first."""
        events, self._events = self._events, []
        self.num_bytes = 0
        return events

    def __len__(self) -> int:
        return len(self._events)
