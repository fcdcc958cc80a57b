"""Structured JSON logs, and an opt-in log of every cache decision that carries no secrets.

`JsonFormatter` renders each log record as one JSON object per line. `CacheDecisionLog` wraps a
prefix cache (`attach(engine)` installs it on a running engine) and, at DEBUG level on the
``prefixcache.cache.decisions`` logger, records for each block a lookup or commit touches: the
namespace digest (short), block index, parent digest (short), token count, hit/miss, ref count and
physical block id. It never logs prompt text, token ids, salts or keys: only digests and counts.

Enable with ``PREFIXCACHE_LOG=json`` (see `configure_from_env`) or by calling `configure` and
`attach` directly. Nothing here runs unless it was installed: the engine's hot path is unchanged.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any

from prefixcache.errors import code_location

if TYPE_CHECKING:  # the engine pulls in torch; this module is imported by torch-free tools too
    from prefixcache.cache import CacheHit, PrefixCache, Sequence
    from prefixcache.engine.llm_engine import LLMEngine

__all__ = [
    "DECISION_LOGGER",
    "LOG_ENV",
    "CacheDecisionLog",
    "JsonFormatter",
    "attach",
    "configure",
    "configure_from_env",
    "short",
]

_SERVER_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "fastapi")
LOG_ENV = "PREFIXCACHE_LOG"  # "json": JSON lines on stderr plus cache decisions at DEBUG
DECISION_LOGGER = "prefixcache.cache.decisions"
SHORT_DIGEST_CHARS = 12
_STANDARD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

logger = logging.getLogger(DECISION_LOGGER)


def short(digest: bytes | None) -> str | None:
    """A digest's first 12 hex characters: enough to correlate, useless to invert."""
    return None if digest is None else digest.hex()[:SHORT_DIGEST_CHARS]


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message and any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info and record.exc_info[0] is not None:
            # type and code location only, never the message or traceback text: both may
            # echo a tenant's input
            out["exc_type"] = record.exc_info[0].__name__
            out["exc_where"] = code_location(record.exc_info[2])
        return json.dumps(out, default=str)


def configure(fmt: str = "json", level: str = "info", decisions: bool = True) -> logging.Handler:
    """Route the root logger to stderr in ``fmt`` ("json" or "text"); ``decisions`` turns the
    cache-decision log on (DEBUG on its own logger)."""
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be 'json' or 'text', got {fmt!r}")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in _SERVER_LOGGERS:  # uvicorn installs its own plain-text handlers: route them here
        server_logger = logging.getLogger(name)
        server_logger.handlers[:] = []
        server_logger.propagate = True
    logger.setLevel(logging.DEBUG if decisions else logging.NOTSET)
    return handler


def json_logging_enabled() -> bool:
    """Whether ``PREFIXCACHE_LOG=json`` asks for JSON logs."""
    return os.environ.get(LOG_ENV, "").lower() == "json"


def configure_from_env(engine: LLMEngine | None = None) -> bool:
    """``PREFIXCACHE_LOG=json``: JSON logs, and the decision log attached to ``engine``."""
    if not json_logging_enabled():
        return False
    configure("json")
    if engine is not None:
        attach(engine)
    return True


class CacheDecisionLog:
    """A `CacheObserver` that logs a cache's decisions: per admitted request, each hit block
    and the first miss; each committed block; each free. Digests, counts and block ids only."""

    def __init__(self, cache: PrefixCache) -> None:
        self._cache = cache
        cache.add_observer(self)

    def on_admit(self, seq: Sequence, hit: CacheHit | None, block_ids: list[int]) -> None:
        if not logger.isEnabledFor(logging.DEBUG):
            return
        if not self._cache.writes(seq):
            logger.debug("lookup skipped", extra={"event": "lookup", "cache": False})
            return
        root, digests = self._chain(seq)
        hit_ids = hit.block_ids if hit is not None else []
        for index, block_id in enumerate(hit_ids):
            fields = self._block_fields(root, digests, index)
            fields.update(
                event="lookup", hit=True, block_id=block_id, ref_cnt=self._ref_count(block_id)
            )
            logger.debug("block hit", extra=fields)
        fields = self._block_fields(root, digests, len(hit_ids))
        fields.update(
            event="lookup",
            hit=False,
            block_id=None,
            ref_cnt=None,
            hit_tokens=hit.num_tokens if hit is not None else 0,
            lookup_us=(hit.lookup_time_ns if hit is not None else 0) // 1000,
        )
        logger.debug("first miss", extra=fields)

    def on_commit(self, seq: Sequence, start: int, end: int, block_ids: list[int]) -> None:
        if not logger.isEnabledFor(logging.DEBUG):
            return
        root, digests = self._chain(seq)
        for index in range(start, min(end, len(digests), start + len(block_ids))):
            block_id = block_ids[index - start]
            fields = self._block_fields(root, digests, index)
            fields.update(event="commit", block_id=block_id, ref_cnt=self._ref_count(block_id))
            logger.debug("block committed", extra=fields)

    def on_free(self, seq: Sequence, num_blocks: int) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("free", extra={"event": "free", "num_blocks": num_blocks})

    def _chain(self, seq: Sequence) -> tuple[bytes, list[bytes]]:
        identity = self._cache.identity
        return identity.root(seq), identity.block_digests(seq)

    def _block_fields(self, root: bytes, digests: list[bytes], index: int) -> dict[str, Any]:
        parent = digests[index - 1] if index > 0 else root
        return {
            "namespace": short(root),
            "block_index": index,
            "digest": short(digests[index]) if index < len(digests) else None,
            "parent": short(parent),
            "num_tokens": self._cache.block_size,
        }

    def _ref_count(self, block_id: int) -> int | None:
        blocks = self._cache.pool.blocks
        return int(blocks[block_id].ref_cnt) if 0 <= block_id < len(blocks) else None


def attach(engine: LLMEngine) -> CacheDecisionLog:
    """Log ``engine``'s cache decisions (through the cache's observer hook); idempotent."""
    cache = engine.inspect().cache
    for observer in cache.observers:
        if isinstance(observer, CacheDecisionLog):
            return observer
    return CacheDecisionLog(cache)
