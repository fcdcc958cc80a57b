"""The Valkey tier: block records in a Valkey (or Redis) server, shared by every engine using it.

Keys (``docs/tiers.md``)::

    prefixcache:v1:<identity tag>:<digest hex>                  one record (a string value)
    prefixcache:v1:<identity tag>:domain:<domain tag hex>       a set of the digests of one
                                                                isolation domain (for purges)

Writes are ``SET ... NX`` (a block is written once; with ``ttl_s``, ``EX``), reads one ``MGET``
per run, all through pipelines. The server's own ``maxmemory`` eviction is expected: a missing
key is a miss. The tier never raises: while the server is unreachable, reads miss, writes are
dropped and counted, ``stats.up`` is False, one warning is logged, and the connection is
retried after a backoff that doubles up to 30 s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from prefixcache.errors import CliError
from prefixcache.tiers import record
from prefixcache.tiers.base import KVTier, TierKind, TierOption, TierStats
from prefixcache.tiers.record import BadRecord, BlockKey, TierIdentity

__all__ = ["KIND", "ValkeyTier", "connect", "held", "purge_client", "redact_url"]

logger = logging.getLogger(__name__)

KEY_PREFIX = f"prefixcache:v{record.FORMAT_VERSION}"
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.5, 30.0
_PURGE_BATCH = 512


def redact_url(url: str) -> str:
    """``url`` without its password (for logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else "***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


class ValkeyTier:
    """Block records of one ``identity`` in the server at ``url`` (``redis://`` or
    ``valkey://``, ``rediss://`` for TLS), optionally expiring after ``ttl_s`` seconds."""

    name = "valkey"
    shared = True

    def __init__(
        self,
        url: str,
        identity: TierIdentity,
        *,
        ttl_s: int | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"the Valkey tier's TTL must be >= 1 s, got {ttl_s}")
        self.url = url
        self.identity = identity
        self.identity_json = identity.as_json()
        self.ttl_s = ttl_s
        self.prefix = f"{KEY_PREFIX}:{identity.tag}:"
        self.stats = TierStats()
        self._client: Any = connect(url, timeout_s)
        import valkey

        self._errors: tuple[type[BaseException], ...] = (
            valkey.exceptions.ConnectionError, valkey.exceptions.TimeoutError, OSError,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._backoff = _BACKOFF_MIN_S
        self._check()

    def __repr__(self) -> str:
        return f"ValkeyTier({redact_url(self.url)!r}, up={self.stats.up})"

    def key_of(self, digest: bytes) -> str:
        return self.prefix + digest.hex()

    def _domain_key(self, domain_tag: bytes, identity_tag: str | None = None) -> str:
        prefix = self.prefix if identity_tag is None else f"{KEY_PREFIX}:{identity_tag}:"
        return f"{prefix}domain:{domain_tag.hex()}"

    # -- connection --------------------------------------------------------------------------------

    def _check(self) -> None:
        try:
            self._client.ping()
        except self._errors as exc:
            self._down(exc)
        else:
            self._ok()

    def _usable(self) -> bool:
        """Whether to try the server now (it is up, or its backoff has passed)."""
        return self.stats.up or time.monotonic() >= self._retry_at

    def _down(self, exc: BaseException) -> None:
        with self.stats.lock:
            was_up, self.stats.up = self.stats.up, False
        self._retry_at = time.monotonic() + self._backoff
        if was_up:
            logger.warning("Valkey KV tier %s unreachable (%s); serving goes on from RAM and "
                           "disk, reconnecting with backoff", redact_url(self.url),
                           type(exc).__name__)
        self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S)

    def _ok(self) -> None:
        if not self.stats.up:
            logger.info("Valkey KV tier %s reachable again", redact_url(self.url))
        self.stats.up = True
        self._backoff = _BACKOFF_MIN_S

    # -- reads -------------------------------------------------------------------------------------

    def contains(self, digests: list[bytes]) -> list[bool]:
        if not digests or not self._usable():
            return [False] * len(digests)
        try:
            pipe = self._client.pipeline(transaction=False)
            for digest in digests:
                pipe.exists(self.key_of(digest))
            found = pipe.execute()
        except self._errors as exc:
            self._down(exc)
            return [False] * len(digests)
        self._ok()
        return [bool(n) for n in found]

    def get_run(self, keys: list[BlockKey]) -> list[memoryview]:
        if not keys:
            return []
        if not self._usable():
            with self.stats.lock:
                self.stats.misses += 1
            return []
        start = time.perf_counter()
        try:
            values = self._client.mget([self.key_of(k.digest) for k in keys])
        except self._errors as exc:
            self._down(exc)
            with self.stats.lock:
                self.stats.read_errors += 1
                self.stats.misses += 1
            return []
        self._ok()
        out: list[memoryview] = []
        num_read = 0
        for key, value in zip(keys, values, strict=True):
            if value is None:
                break
            num_read += len(value)
            try:
                out.append(record.decode(value, self.identity_json, key))
            except BadRecord as exc:
                logger.warning("Valkey KV tier: a record failed its checks (%s); deleted", exc)
                self.stats.note_bad(key.digest)
                self.discard([key.digest])
                break
        self.stats.note_read(len(keys), len(out), num_read, time.perf_counter() - start)
        return out

    def discard(self, digests: list[bytes]) -> None:
        if not digests or not self._usable():
            return
        try:
            self._client.delete(*(self.key_of(d) for d in digests))
        except self._errors as exc:
            self._down(exc)

    # -- writes ------------------------------------------------------------------------------------

    def put(self, items: Sequence[tuple[BlockKey, bytes | memoryview]]) -> int:
        if not items:
            return 0
        if not self._usable():
            with self.stats.lock:
                self.stats.dropped += len(items)
            return 0
        records = [record.encode(self.identity_json, key, payload) for key, payload in items]
        try:
            pipe = self._client.pipeline(transaction=False)
            for (key, _), data in zip(items, records, strict=True):
                pipe.set(self.key_of(key.digest), data, nx=True, ex=self.ttl_s)
                domain_key = self._domain_key(key.domain_tag)
                pipe.sadd(domain_key, key.digest.hex())
                if self.ttl_s is not None:
                    pipe.expire(domain_key, self.ttl_s)
            replies = pipe.execute(raise_on_error=False)  # a refusal is a reply, counted
        except self._errors as exc:
            self._down(exc)
            with self.stats.lock:
                self.stats.write_errors += 1
                self.stats.dropped += len(items)
            return 0
        self._ok()
        step = 3 if self.ttl_s is not None else 2
        sets = replies[::step]
        refused = sum(isinstance(r, Exception) for r in sets)  # e.g. OOM under noeviction
        written = [bool(r) and not isinstance(r, Exception) for r in sets]
        if refused:
            logger.warning("Valkey KV tier: the server refused %d of %d writes (%s)", refused,
                           len(sets), next(r for r in sets if isinstance(r, Exception)))
        with self.stats.lock:
            self.stats.write_errors += refused > 0
            self.stats.dropped += refused
            self.stats.blocks_written += sum(written)
            self.stats.bytes_written += sum(
                len(data) for data, w in zip(records, written, strict=True) if w)
        return sum(written)

    # -- purge -------------------------------------------------------------------------------------

    def purge_domain(self, domain_tag: bytes) -> int:
        """Delete one domain's records of every identity (its sets name them)."""
        keys: list[str] = []
        try:
            removed = purge_client(self._client, domain_tag, keys)
        except self._errors as exc:
            self._down(exc)
            raise ConnectionError(f"Valkey at {redact_url(self.url)} is unreachable") from exc
        mine = self.prefix  # this identity's records: the ones its KV events named
        self.stats.note_removed([bytes.fromhex(k[len(mine):]) for k in keys
                                 if k.startswith(mine)])
        return removed

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass


def purge_client(client: Any, domain_tag: bytes, keys: list[str] | None = None) -> int:
    """Delete one isolation domain's records of every identity through ``client`` (a
    ``valkey.Valkey``); returns how many (and appends their key names to ``keys``). The
    domain's sets name its records."""
    removed = 0
    pattern = f"{KEY_PREFIX}:*:domain:{domain_tag.hex()}"
    for set_key in list(client.scan_iter(match=pattern, count=1000)):
        set_name = set_key.decode() if isinstance(set_key, bytes) else str(set_key)
        prefix = set_name[: set_name.index(":domain:") + 1]
        members = [m.decode() if isinstance(m, bytes) else str(m)
                   for m in client.smembers(set_key)]
        for i in range(0, len(members), _PURGE_BATCH):
            batch = [prefix + m for m in members[i : i + _PURGE_BATCH]]
            removed += int(client.delete(*batch))
            if keys is not None:
                keys += batch
        client.delete(set_key)
    return removed


def held(client: Any, identity: TierIdentity, digests: list[bytes]) -> list[bool]:
    """Which of ``digests`` the server at ``client`` holds a record of, for ``identity``."""
    prefix = f"{KEY_PREFIX}:{identity.tag}:"
    pipe = client.pipeline(transaction=False)
    for digest in digests:
        pipe.exists(prefix + digest.hex())
    return [bool(n) for n in pipe.execute()]


def connect(url: str, timeout_s: float = 2.0) -> Any:
    """A ``valkey.Valkey`` client for ``url`` (``redis://``, ``valkey://``, ``rediss://``)."""
    try:
        import valkey
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("--kv-valkey needs the 'valkey' client: "
                          "pip install 'prefixcache[tiers]'") from exc
    try:
        return valkey.Valkey.from_url(
            url.replace("valkey://", "redis://", 1).replace("valkeys://", "rediss://", 1),
            socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
            health_check_interval=30,
        )
    except ValueError as exc:
        raise ValueError(f"--kv-valkey {redact_url(url)!r}: {exc}") from None


def _open(location: str, identity: TierIdentity, settings: Mapping[str, object]) -> KVTier:
    ttl = settings.get("kv_valkey_ttl")
    assert ttl is None or isinstance(ttl, int)
    return ValkeyTier(location, identity, ttl_s=ttl)


def _unreachable(location: str, exc: Exception) -> CliError:
    if isinstance(exc, ImportError):
        return CliError(str(exc))
    return CliError(f"cannot reach Valkey at {redact_url(location)}: {type(exc).__name__}: {exc}")


def _purge(location: str, domain_tag: bytes) -> int:
    try:
        return purge_client(connect(location), domain_tag)
    except Exception as exc:  # noqa: BLE001 - any client failure: say so, exit non-zero
        raise _unreachable(location, exc) from None


def _held(location: str, identity: TierIdentity, digests: list[bytes]) -> list[bool]:
    try:
        return held(connect(location), identity, digests)
    except Exception as exc:  # noqa: BLE001 - any client failure: say so, exit non-zero
        raise _unreachable(location, exc) from None


def _check(settings: Mapping[str, object]) -> None:
    ttl = settings.get("kv_valkey_ttl")
    if ttl is not None and not (isinstance(ttl, int) and ttl >= 1):
        raise ValueError(f"--kv-valkey-ttl must be >= 1 s, got {ttl}")


KIND = TierKind(
    name="valkey", metavar="URL",
    help="a Valkey (or Redis) tier shared by every engine using it, e.g. "
         "redis://127.0.0.1:6379/0",
    options=(TierOption("--kv-valkey-ttl", int, None, "expire Valkey blocks after S seconds "
                        "(default: the server's maxmemory policy decides)", "S"),),
    shared=True, open=_open, purge=_purge, held=_held,
    read_bytes_per_s=1.25e9, latency_s=5e-4,  # 10 Gb/s Ethernet
    check=_check,
)  # fmt: skip
