"""Why a block stopped being hittable: `BlockFates`, a bounded record of the cache's evictions,
resets and pin releases, keyed by the blocks' chained digests (truncated), for the diagnostics
that tell a caller why its prefix missed (`prefixcache.server.diagnostics`).

A digest is salted with its tenant's namespace, so a lookup can only find the caller's own
blocks, and what it tells is only whether the room was made for the caller's own scheduling
domain or another's (never which). No token, no text. Thread safe: the engine's thread records,
the server reads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["DIGEST_BYTES", "BlockFates", "Fate", "Pressure"]

DIGEST_BYTES = 8  # of each chained digest: the key a fate is found under
DEFAULT_MAX_ENTRIES = 1 << 16
V = TypeVar("V")


class Pressure:
    """What needed the room an eviction made (the ``pressure`` of a diagnosis)."""

    SAME_TENANT = "same_tenant"  # a request of the block's own domain
    OTHER_TENANTS = "other_tenants"  # another domain's request
    PINS = "pins"  # the block's pin was released for a request that could not start beside it
    PURGE = "purge"  # its tenant's cache was purged
    RESET = "reset"  # the whole cache was reset


@dataclass(frozen=True, slots=True)
class Fate:
    """How a block left the cache: ``pressure`` (a `Pressure`), when (``at``, the record's
    clock), whether a pin held it until its TTL ran out (``pin_expired_at``) or until it was
    released for another request (``pin_yielded``), and whether a lower tier's copy of it
    failed its checks when it was read back (``tier_failed``)."""

    pressure: str
    at: float
    pin_expired_at: float | None = None
    pin_yielded: bool = False
    tier_failed: bool = False  # then a lower tier's copy failed its checks when read back


class BlockFates:
    """The fates of the last ``max_entries`` blocks that left the cache, and of the pins that
    were released (expired or yielded) on them, oldest forgotten first."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.max_entries = max_entries
        self.clock = clock
        self._gone: OrderedDict[bytes, tuple[str | None, float]] = OrderedDict()
        self._unpinned: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._bad: OrderedDict[bytes, float] = OrderedDict()
        self._reset_at: float | None = None
        self._lock = threading.Lock()

    def evicted(self, digests: Iterable[bytes], domain: str | None) -> None:
        """``digests`` were evicted to make room for a request of ``domain`` (None: a purge of
        their own domain)."""
        now = self.clock()
        with self._lock:
            for digest in digests:
                self._put(self._gone, digest[:DIGEST_BYTES], (domain, now))

    def unpinned(self, digests: Iterable[bytes], expired: bool) -> None:
        """A pin on ``digests`` ended: its TTL ran out (``expired``), or it was released for
        a request that could not start beside it."""
        now, why = self.clock(), ("expired" if expired else "yielded")
        with self._lock:
            for digest in digests:
                self._put(self._unpinned, digest[:DIGEST_BYTES], (why, now))

    def tier_failed(self, digest: bytes) -> None:
        """A lower tier's record of ``digest`` failed its checks when read (and was dropped)."""
        now = self.clock()
        with self._lock:
            self._put(self._bad, digest[:DIGEST_BYTES], now)

    def reset(self) -> None:
        """Every block left at once (the cache was reset)."""
        with self._lock:
            self._reset_at = self.clock()
            self._gone.clear()
            self._unpinned.clear()
            self._bad.clear()

    def of(self, digest: bytes, domain: str, since: float) -> Fate | None:
        """The fate of ``domain``'s block ``digest`` (truncated or whole) after ``since`` (the
        record's clock; an earlier fate is an older story), or None: none known."""
        key = digest[:DIGEST_BYTES]
        with self._lock:
            gone = self._gone.get(key)
            unpinned = self._unpinned.get(key)
            bad_at = self._bad.get(key)
            reset_at = self._reset_at
        if gone is None or gone[1] < since:
            if reset_at is not None and reset_at >= since:
                return Fate(Pressure.RESET, reset_at)
            return None
        by, at = gone
        pressure = (Pressure.PURGE if by is None else
                    Pressure.SAME_TENANT if by == domain else Pressure.OTHER_TENANTS)
        bad = bad_at is not None and bad_at >= at
        if unpinned is None or not since <= unpinned[1] <= at:
            return Fate(pressure, at, tier_failed=bad)
        why, unpinned_at = unpinned
        if why == "expired":
            return Fate(pressure, at, pin_expired_at=unpinned_at, tier_failed=bad)
        return Fate(Pressure.PINS, at, pin_yielded=True, tier_failed=bad)

    def _put(self, table: OrderedDict[bytes, V], key: bytes, value: V) -> None:
        table[key] = value
        table.move_to_end(key)
        if len(table) > self.max_entries:
            table.popitem(last=False)
