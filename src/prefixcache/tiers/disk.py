"""The disk tier: one file per block under a directory, kept to a capacity, rebuilt at start.

Layout under the ``--kv-disk`` directory (``docs/tiers.md``)::

    v1/<identity tag>/<first 2 hex digits of the digest>/<digest hex>.kv   one record each
    quarantine/                                                            records that failed

A file is written whole or not at all: the record goes to a temporary file in the same
directory, is fsynced, then renamed over its name, so a reader (this process or another sharing
the directory) never sees half a block. The in-memory index (digest -> size, least recently used
first) is rebuilt at start from the files' headers, oldest modification first; a hit refreshes
the file's modification time, so the order survives a restart. Files another process writes
are found by name when the index misses. Whatever the disk does, the tier never raises: a file
that fails its header or checksum is a miss, moved to ``quarantine/`` and counted; a file that
vanished (another process evicted it) is a miss; a write the disk refuses (full, read-only)
stops writes for a backoff that doubles up to a minute, with one warning per outage.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

from prefixcache.errors import CliError
from prefixcache.tiers import record
from prefixcache.tiers.base import KVTier, TierKind, TierOption, TierStats
from prefixcache.tiers.record import BadRecord, BlockKey, TierIdentity

__all__ = ["KIND", "DiskTier"]

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"
_HEADER_READ = 4096  # bytes read to parse a header (a record's header is ~400)
_STALE_TMP_S = 600.0  # a temporary file this old was left by a writer that died
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 1.0, 60.0


class DiskTier:
    """Block records under ``root`` for one ``identity``, at most ``capacity_bytes`` of them."""

    name = "disk"
    shared = False

    def __init__(self, root: str | Path, identity: TierIdentity, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"the disk tier's capacity must be >= 1 byte, got {capacity_bytes}")
        self.root = Path(root)
        self.identity = identity
        self.identity_json = identity.as_json()
        self.capacity_bytes = capacity_bytes
        self.dir = self.root / f"v{record.FORMAT_VERSION}" / identity.tag
        self.quarantine_dir = self.root / "quarantine"
        self.stats = TierStats()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # digest -> file size, LRU first
        self._bytes = 0
        self._lock = threading.Lock()
        self._retry_at = 0.0  # writes stopped until then (time.monotonic())
        self._backoff = _BACKOFF_MIN_S
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"--kv-disk {str(self.root)!r} is not a directory")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ValueError(f"--kv-disk {str(self.root)!r}: a file stands where the tier's "
                             f"directory {self.dir.relative_to(self.root)} goes") from None
        except OSError as exc:
            if not self.root.is_dir():  # nothing to read either: a wrong path, not a full disk
                raise ValueError(f"--kv-disk {str(self.root)!r} cannot be created: "
                                 f"{exc.strerror or exc}") from None
            self._write_failed(exc)  # e.g. read-only: what is there can still be read
        self._rebuild()

    def __repr__(self) -> str:
        return (f"DiskTier({str(self.root)!r}, blocks={len(self._index)}, "
                f"bytes={self._bytes}/{self.capacity_bytes})")

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def path_of(self, digest: bytes) -> Path:
        name = digest.hex()
        return self.dir / name[:2] / f"{name}{SUFFIX}"

    # -- start -------------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """The index from the files of this identity, oldest first; bad ones quarantined."""
        found: list[tuple[int, bytes, int]] = []
        now = time.time()
        try:
            subdirs = [d for d in self.dir.iterdir() if d.is_dir()]
        except OSError:
            subdirs = []
        for sub in subdirs:
            try:
                entries = list(os.scandir(sub))
            except OSError:
                continue
            for entry in entries:
                if entry.name.startswith(_TMP_PREFIX):
                    self._remove_stale_tmp(entry, now)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    digest = bytes.fromhex(entry.name[: -len(SUFFIX)])
                    stat = entry.stat()
                    with open(entry.path, "rb") as f:
                        header = record.read_header(f.read(_HEADER_READ))
                    if header.identity != self.identity_json or header.digest != digest:
                        raise BadRecord("a record of another block or identity under this name")
                    if header.header_len + header.payload_len != stat.st_size:
                        raise BadRecord("truncated record")
                except (BadRecord, ValueError) as exc:
                    self._quarantine(Path(entry.path), str(exc))
                    continue
                except OSError:
                    continue
                found.append((stat.st_mtime_ns, digest, stat.st_size))
        found.sort()
        for _, digest, size in found:
            self._index[digest] = size
            self._bytes += size
        self._evict_to(self.capacity_bytes)
        if found:
            logger.info("disk KV tier %s: %d blocks (%.1f MiB) found at start", self.dir,
                        len(self._index), self._bytes / (1 << 20))

    @staticmethod
    def _remove_stale_tmp(entry: os.DirEntry[str], now: float) -> None:
        try:
            if now - entry.stat().st_mtime > _STALE_TMP_S:
                os.unlink(entry.path)
        except OSError:
            pass

    # -- reads -------------------------------------------------------------------------------------

    def contains(self, digests: list[bytes]) -> list[bool]:
        out = []
        for digest in digests:
            with self._lock:
                held = digest in self._index
            if not held:  # another process sharing the directory may have written it
                held = self._adopt(digest)
            out.append(held)
        return out

    def _adopt(self, digest: bytes) -> bool:
        try:
            size = self.path_of(digest).stat().st_size
        except OSError:
            return False
        with self._lock:
            if digest not in self._index:
                self._index[digest] = size
                self._bytes += size
        return True

    def get_run(self, keys: list[BlockKey]) -> list[memoryview]:
        """The verified payloads of the longest run of ``keys``, from the first, held intact."""
        start = time.perf_counter()
        out: list[memoryview] = []
        num_read = 0
        for key in keys:
            digest = key.digest
            with self._lock:
                held = digest in self._index
            if not held and not self._adopt(digest):
                break
            path = self.path_of(digest)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:  # evicted by another process sharing the directory
                self._forget(digest)
                self.stats.note_removed([digest])
                break
            except OSError:
                with self.stats.lock:
                    self.stats.read_errors += 1
                break
            num_read += len(data)
            try:
                payload = record.decode(data, self.identity_json, key)
            except BadRecord as exc:
                self._forget(digest)
                self._quarantine(path, str(exc), digest)
                break
            out.append(payload)
            with self._lock:
                if digest in self._index:
                    self._index.move_to_end(digest)
            try:
                os.utime(path)  # the LRU order across restarts
            except OSError:
                pass
        self.stats.note_read(len(keys), len(out), num_read, time.perf_counter() - start)
        return out

    def _forget(self, digest: bytes) -> None:
        with self._lock:
            size = self._index.pop(digest, None)
            if size is not None:
                self._bytes -= size

    def _quarantine(self, path: Path, why: str, digest: bytes | None = None) -> None:
        """Set a bad file aside (never served again), or delete it if that fails; ``digest``:
        it was found bad when read."""
        if digest is None:
            with self.stats.lock:
                self.stats.quarantined += 1
        else:
            self.stats.note_bad(digest)
        logger.warning("disk KV tier: a record failed its checks (%s); quarantined", why)
        try:
            self.quarantine_dir.mkdir(parents=True, exist_ok=True)
            os.replace(path, self.quarantine_dir / f"{time.time_ns()}-{path.name}")
        except OSError:
            try:
                os.unlink(path)
            except OSError:
                pass

    def discard(self, digests: list[bytes]) -> None:
        for digest in digests:
            self._forget(digest)
            path = self.path_of(digest)
            if path.exists():
                self._quarantine(path, "rejected by the engine")

    # -- writes ------------------------------------------------------------------------------------

    def put(self, items: Sequence[tuple[BlockKey, bytes | memoryview]]) -> int:
        """Write the records of ``items`` not held yet; returns how many were written."""
        if time.monotonic() < self._retry_at:
            with self.stats.lock:
                self.stats.dropped += len(items)
            return 0
        written = 0
        for i, (key, payload) in enumerate(items):
            with self._lock:
                if key.digest in self._index:
                    continue
            data = record.encode(self.identity_json, key, payload)
            try:
                self._write(self.path_of(key.digest), data)
            except OSError as exc:
                self._write_failed(exc)
                with self.stats.lock:
                    self.stats.dropped += len(items) - i - 1
                break
            with self._lock:
                if key.digest not in self._index:
                    self._index[key.digest] = len(data)
                    self._bytes += len(data)
            written += 1
            with self.stats.lock:
                self.stats.bytes_written += len(data)
                self.stats.blocks_written += 1
        if written:
            self._write_ok()
            self._evict_to(self.capacity_bytes)
        return written

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _write_failed(self, exc: OSError) -> None:
        with self.stats.lock:
            self.stats.write_errors += 1
            was_up, self.stats.up = self.stats.up, False
        self._retry_at = time.monotonic() + self._backoff
        if was_up:
            logger.warning("disk KV tier %s: writes stopped (%s: %s); serving goes on, retrying "
                           "in %.0f s", self.root, type(exc).__name__, exc.strerror or exc,
                           self._backoff)
        self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S)

    def _write_ok(self) -> None:
        if not self.stats.up:
            logger.info("disk KV tier %s: writes resumed", self.root)
        self.stats.up = True
        self._backoff = _BACKOFF_MIN_S

    def _evict_to(self, capacity: int) -> None:
        """Delete least recently used files until the tier holds at most ``capacity`` bytes."""
        evicted: list[bytes] = []
        while True:
            with self._lock:
                if self._bytes <= capacity or not self._index:
                    break
                digest, size = self._index.popitem(last=False)
                self._bytes -= size
            try:
                os.unlink(self.path_of(digest))
            except OSError:
                pass
            evicted.append(digest)
        self.stats.note_evicted(evicted)

    # -- purge -------------------------------------------------------------------------------------

    def purge_domain(self, domain_tag: bytes) -> int:
        """Delete every record of one isolation domain, under every identity in ``root``."""
        removed = purge_dir(self.root, domain_tag)
        for digest in removed:
            self._forget(digest)
        self.stats.note_removed(removed)
        return len(removed)

    def close(self) -> None:
        pass


def held(root: str | Path, identity: TierIdentity, digests: list[bytes]) -> list[bool]:
    """Which of ``digests`` have a record file under a ``--kv-disk`` directory, for
    ``identity`` (by name only: nothing is read, created or indexed)."""
    base = Path(root) / f"v{record.FORMAT_VERSION}" / identity.tag
    return [(base / d.hex()[:2] / f"{d.hex()}{SUFFIX}").is_file() for d in digests]


def purge_dir(root: str | Path, domain_tag: bytes) -> list[bytes]:
    """Delete every record of one isolation domain under a ``--kv-disk`` directory, of any
    identity; returns their digests."""
    removed = []
    base = Path(root) / f"v{record.FORMAT_VERSION}"
    for path in base.glob(f"*/*/*{SUFFIX}") if base.is_dir() else ():
        try:
            with open(path, "rb") as f:
                header = record.read_header(f.read(_HEADER_READ))
        except (OSError, BadRecord):
            continue
        if header.domain_tag != domain_tag:
            continue
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(header.digest)
    return removed


def _open(location: str, identity: TierIdentity, settings: Mapping[str, object]) -> KVTier:
    gib = KIND.setting(settings, "kv_disk_gib")
    assert isinstance(gib, int | float)
    return DiskTier(Path(location), identity, int(gib * (1 << 30)))


def _purge(location: str, domain_tag: bytes) -> int:
    if not Path(location).is_dir():
        raise CliError(f"--kv-disk {location!r} is not a directory")
    return len(purge_dir(location, domain_tag))


def _check(settings: Mapping[str, object]) -> None:
    gib = settings.get("kv_disk_gib")
    if gib is not None and not (isinstance(gib, int | float) and gib > 0):
        raise ValueError(f"--kv-disk-gib must be > 0, got {gib}")


KIND = TierKind(
    name="disk", metavar="DIR",
    help="a disk tier under the KV pool: blocks written behind to DIR, read back on a RAM miss, "
         "kept across restarts (docs/tiers.md)",
    options=(TierOption("--kv-disk-gib", float, 16.0, "the disk tier's capacity in GiB "
                        "(default 16); least recently used blocks are deleted beyond it"),),
    shared=False, open=_open, purge=_purge, held=held,
    read_bytes_per_s=2e9, latency_s=1e-4,  # an NVMe drive
    check=_check,
)  # fmt: skip
