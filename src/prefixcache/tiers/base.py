"""The interface of a lower KV tier, and the counters every tier keeps.

A tier stores opaque records (`prefixcache.tiers.record`) under a block digest, within one
identity it was opened for. Calls are batched and synchronous; the engine makes them from its
own worker threads (`prefixcache.engine.offload`), so the step never waits on a tier. A tier
never raises for its storage failing: a read that fails is a miss, a write that fails is
dropped, and both are counted.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

from prefixcache.tiers.record import BlockKey, TierIdentity

__all__ = ["KVTier", "TierKind", "TierOption", "TierStats"]


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
    # told the digest of each record that failed its checks when read (the cache's fates)
    on_bad: Callable[[bytes], None] | None = field(default=None, repr=False, compare=False)
    # told the digests of the records this tier stopped holding: evicted to keep the capacity,
    # purged, or failed their checks (the tier's KV events, `BlockRemoved`)
    on_removed: Callable[[list[bytes]], None] | None = field(default=None, repr=False,
                                                             compare=False)

    def note_read(self, num_asked: int, num_found: int, num_bytes: int, seconds: float) -> None:
        """One batched read: ``num_found`` of ``num_asked`` blocks, from the first."""
        with self.lock:
            self.reads += 1
            self.read_seconds += seconds
            self.hits += num_found
            self.misses += num_found < num_asked
            self.bytes_read += num_bytes

    def note_bad(self, digest: bytes) -> None:
        """A record of ``digest`` failed its checks when read (and is dropped): counted,
        ``on_bad`` and ``on_removed`` told."""
        with self.lock:
            self.quarantined += 1
        if self.on_bad is not None:
            self.on_bad(digest)
        self.note_removed([digest])

    def note_evicted(self, digests: list[bytes]) -> None:
        """``digests``' records were removed to keep the capacity: counted, ``on_removed``
        told."""
        if not digests:
            return
        with self.lock:
            self.evicted += len(digests)
        self.note_removed(digests)

    def note_removed(self, digests: list[bytes]) -> None:
        """This tier no longer holds ``digests`` (evicted, purged, or bad): ``on_removed``
        told."""
        if digests and self.on_removed is not None:
            self.on_removed(digests)

    def as_dict(self) -> dict[str, float | int | bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("lock", "on_bad", "on_removed")}


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


@dataclass(frozen=True, slots=True)
class TierOption:
    """One setting of a tier kind beside its location, as a flag (``--kv-disk-gib``) whose
    destination (``kv_disk_gib``) is also the keyword of `LLMEngine(...)`."""

    flag: str
    type: Callable[[str], object]
    default: object
    help: str
    metavar: str = "N"

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


@dataclass(frozen=True, slots=True)
class TierKind:
    """Everything the rest of the package knows of one kind of tier, in its own module and one
    line of `prefixcache.tiers.TIERS`: its flags (``--kv-<name>`` LOCATION and ``options``),
    how to ``open`` it for an engine, ``purge`` a domain and tell which blocks it ``held`` with
    no engine (``prefixcache cache purge``, ``prefixcache explain``), whether every replica reads
    it (``shared``: its blocks are announced as KV events with ``medium`` = the name in
    capitals), and the simulator's model of its reads (``read_bytes_per_s``, ``latency_s``;
    ``per_replica``: one per replica, else one shared by all)."""

    name: str
    metavar: str
    help: str
    options: tuple[TierOption, ...]
    shared: bool
    open: Callable[[str, TierIdentity, Mapping[str, object]], KVTier]
    purge: Callable[[str, bytes], int]
    held: Callable[[str, TierIdentity, list[bytes]], list[bool]]
    read_bytes_per_s: float
    latency_s: float
    check: Callable[[Mapping[str, object]], None] = lambda settings: None

    @property
    def flag(self) -> str:
        return f"--kv-{self.name}"

    @property
    def dest(self) -> str:
        return f"kv_{self.name}"

    @property
    def medium(self) -> str:
        """vLLM's ``medium`` of the KV events for blocks this tier holds."""
        return self.name.upper()

    @property
    def per_replica(self) -> bool:
        return not self.shared

    @property
    def dests(self) -> tuple[str, ...]:
        """The flags' destinations: its location, then its options."""
        return (self.dest, *(o.dest for o in self.options))

    def setting(self, settings: Mapping[str, object], dest: str) -> object:
        """``settings[dest]``, else the option's default."""
        value = settings.get(dest)
        if value is None:
            value = next((o.default for o in self.options if o.dest == dest), None)
        return value

    def add_arguments(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                      *, with_options: bool = True) -> None:  # fmt: skip
        """``--kv-<name>`` (and, ``with_options``, its settings) on ``parser``."""
        parser.add_argument(self.flag, metavar=self.metavar, default=None, help=self.help)
        for option in self.options if with_options else ():
            parser.add_argument(option.flag, type=option.type, default=None,
                                metavar=option.metavar, help=option.help)
