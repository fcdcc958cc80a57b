"""The interface of a lower KV tier, and the counters every tier keeps.

A tier stores opaque records (`prefixcache.tiers.record`) under a block digest, within one
identity it was opened for. Calls are batched and synchronous; the engine makes them from its
own worker threads (`prefixcache.engine.offload`), so the step never waits on a tier. A tier
never raises for its storage failing: a read that fails is a miss, a write that fails is
dropped, and both are counted.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

from prefixcache.tiers.record import BlockKey

__all__ = ["KVTier", "TierStats"]


@dataclass(slots=True)
class TierStats:
    """Cumulative counters of one tier (thread-safe through ``lock``)."""

    hits: int = 0  # blocks found and returned intact
    misses: int = 0  # blocks asked for and not found
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    reads: int = 0  # batched get calls, and their total time
    read_seconds: float = 0.0
    write_errors: int = 0  # writes the storage refused (disk full, read-only, server down)
    read_errors: int = 0
    dropped: int = 0  # writes not attempted (the tier was backing off)
    quarantined: int = 0  # entries that failed their checks and were set aside
    evicted: int = 0  # entries removed to keep the capacity
    up: bool = True  # the storage answers (Valkey reachable; the disk writable)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def note_read(self, num_asked: int, num_found: int, num_bytes: int, seconds: float) -> None:
        """One batched read: ``num_found`` of ``num_asked`` blocks, from the first."""
        with self.lock:
            self.reads += 1
            self.read_seconds += seconds
            self.hits += num_found
            self.misses += num_found < num_asked
            self.bytes_read += num_bytes

    def as_dict(self) -> dict[str, float | int | bool]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}


class KVTier(Protocol):
    """A store of block records for one `TierIdentity`. ``name`` is ``disk`` or ``valkey``
    (metric labels, logs)."""

    name: str
    shared: bool  # every engine using the same storage reads it (Valkey; a disk is local)
    stats: TierStats

    def contains(self, digests: list[bytes]) -> list[bool]:
        """Which of ``digests`` this tier holds (a hint: a later read may still miss)."""
        ...

    def get_run(self, keys: list[BlockKey]) -> list[memoryview]:
        """The payloads of the longest run of ``keys``, from the first, held and intact (each
        record checked by `prefixcache.tiers.record.decode`; a bad one is discarded)."""
        ...

    def put(self, items: Sequence[tuple[BlockKey, bytes | memoryview]]) -> int:
        """Store the records of the ``(key, payload)`` pairs not held yet; returns how many
        were written."""
        ...

    def discard(self, digests: list[bytes]) -> None:
        """Drop entries the engine found unusable."""
        ...

    def purge_domain(self, domain_tag: bytes) -> int:
        """Remove every entry of one isolation domain, of any identity; returns how many."""
        ...

    def close(self) -> None: ...
