"""Where diagnostics fingerprints outlive the process: beside the lower KV tier the server runs
with, so that a request after a restart or on another replica can still be compared with the
one it names (and be told ``dtype_or_weights_changed`` when the model did change).

A fingerprint is digests and counts only (`prefixcache.server.diagnostics.Fingerprint`), stored
under the SHA-256 of its scope (the tenant) and response id: another tenant's id names another
key. With ``--kv-valkey`` the fingerprints go to that server (``SET ... EX``: shared by every
replica); else with ``--kv-disk`` to ``DIR/diagnostics/`` (one small file each, the oldest
removed past ``max_entries``). Storage failing is a miss, never an error: the answer is then
``previous_message_not_found`` / ``comparison_response_not_found``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from prefixcache.tiers import TierConfig
from prefixcache.tiers.valkey import connect, redact_url

__all__ = ["DiskFingerprints", "FingerprintStore", "ValkeyFingerprints", "open_store", "store_key"]

logger = logging.getLogger("prefixcache.server")

_PREFIX = "prefixcache:diagnostics:"
_PRUNE_EVERY = 256  # writes between two prunes of the disk store


def store_key(scope: str, response_id: str) -> str:
    """The key a fingerprint is stored under: neither the tenant nor the id in the clear."""
    return hashlib.sha256(f"{scope}\0{response_id}".encode()).hexdigest()


class FingerprintStore(Protocol):
    """A key-value store with expiry (bytes in, bytes out; thread safe)."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes, ttl_s: float) -> None: ...


class DiskFingerprints:
    """One file per fingerprint under ``root``: its expiry (a wall-clock time) on the first
    line, the fingerprint after it."""

    def __init__(self, root: Path, max_entries: int) -> None:
        self.root = root
        self.max_entries = max_entries
        self._writes = 0
        root.mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> bytes | None:
        try:
            expires, _, value = (self.root / key).read_bytes().partition(b"\n")
            return value if float(expires) > time.time() else None
        except (OSError, ValueError):
            return None

    def put(self, key: str, value: bytes, ttl_s: float) -> None:
        data = f"{time.time() + ttl_s}\n".encode() + value
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.root / key)
        except OSError as exc:
            logger.warning("diagnostics store %s: a write failed (%s)", self.root, exc)
            return
        self._writes += 1
        if self._writes % _PRUNE_EVERY == 0:
            self.prune()

    def prune(self) -> None:
        """Remove the expired fingerprints, then the oldest past ``max_entries``."""
        now = time.time()
        entries = []
        for path in self.root.iterdir():
            with contextlib.suppress(OSError):
                entries.append((path.stat().st_mtime, path))
        entries.sort()
        excess = len(entries) - self.max_entries
        for i, (_, path) in enumerate(entries):
            with contextlib.suppress(OSError, ValueError):
                if i < excess or path.name.startswith(".tmp-"):
                    path.unlink()
                    continue
                with open(path, "rb") as f:
                    if float(f.readline()) <= now:
                        path.unlink()


class ValkeyFingerprints:
    """Fingerprints in a Valkey (or Redis) server, each with its TTL."""

    def __init__(self, url: str) -> None:
        self.url = redact_url(url)
        self.client: Any = connect(url)
        import valkey

        self._errors = (valkey.exceptions.ValkeyError, OSError)

    def get(self, key: str) -> bytes | None:
        try:
            value = self.client.get(_PREFIX + key)
        except self._errors as exc:
            logger.warning("diagnostics store %s: a read failed (%s)", self.url, exc)
            return None
        return bytes(value) if value is not None else None

    def put(self, key: str, value: bytes, ttl_s: float) -> None:
        try:
            self.client.set(_PREFIX + key, value, ex=max(1, int(ttl_s)))
        except self._errors as exc:
            logger.warning("diagnostics store %s: a write failed (%s)", self.url, exc)


def open_store(tiers: TierConfig, max_entries: int) -> FingerprintStore | None:
    """The store beside ``tiers`` (None: no tier, fingerprints live in memory only)."""
    valkey_url = tiers.settings.get("kv_valkey")
    if valkey_url:
        return ValkeyFingerprints(str(valkey_url))
    disk = tiers.settings.get("kv_disk")
    if disk:
        return DiskFingerprints(Path(str(disk)) / "diagnostics", max_entries)
    return None
