"""Our own trace format for recorded server traffic: token counts and block digests, never text.

The first line is a header, every other line one request::

    {"format": "prefixcache-trace", "version": 1, "block_size": 16, "hash_algo": "sha256"}
    {"t": 0.125, "input_length": 40, "output_length": 16, "cached_tokens": 32,
     "block_digests": ["9f2c...", "41aa..."]}

``t`` is seconds since the recorder started; ``block_digests`` are the chained digests of the
prompt's complete blocks (they already encode the namespace, so tenants stay apart without any
tenant id in the file). A request that pinned prefixes (``cache_control`` breakpoints,
``prompt_cache_retention``) adds ``"pins": [[num_tokens, ttl_s], ...]``; a request of a
tenant adds ``"tenant"``: a stable digest of its isolation domain (`tenant_label`, as
``/metrics`` labels domains with ``--metrics-domain-labels digest``), which pin budgets and the
replay's per-tenant hit ratios are counted by. The server writes it with ``--record-trace
FILE`` through `TraceRecorder`; `read_record` turns it back into a `Trace` (each distinct digest
becomes a hash id). Neither knows about caches or HTTP.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from prefixcache.sim.errors import TraceFormatError
from prefixcache.sim.trace import Trace, TraceRequest, read_adapter, read_cache_fields

FORMAT_NAME = "prefixcache-trace"
FORMAT_VERSION = 1


class TraceRecorder:
    """Appends one line per finished request; safe to call from several threads."""

    def __init__(
        self,
        path: str | Path,
        block_size: int,
        hash_algo: str = "sha256",
        clock: Callable[[], float] = time.monotonic,
        start: float | None = None,
    ) -> None:
        """``start``: the clock reading that is ``t = 0`` (default: now); several recorders
        given one wall-clock ``start`` (``clock=time.time``) write comparable times."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.path = Path(path)
        self._clock = clock
        self._start = clock() if start is None else start
        self._lock = threading.Lock()
        self._file: TextIO | None = self.path.open("w", encoding="utf-8")
        header = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "block_size": block_size,
            "hash_algo": hash_algo,
        }
        self._write(header)
        self.num_records = 0

    def record(
        self,
        input_length: int,
        output_length: int,
        block_digests: Sequence[bytes],
        cached_tokens: int = 0,
        arrival_s: float | None = None,
        pins: Sequence[tuple[int, float]] = (),
        tenant: str = "",
        adapter: str = "",
    ) -> None:
        """One request: prompt and output token counts and its prompt's block digests; with
        ``pins``, its breakpoints; ``tenant``: its `tenant_label`; ``adapter``: the identity of
        the LoRA adapter it ran under (a content digest)."""
        t = self._clock() - self._start if arrival_s is None else arrival_s
        line = {
            "t": round(t, 6),
            "input_length": input_length,
            "output_length": output_length,
            "cached_tokens": cached_tokens,
            "block_digests": [d.hex() for d in block_digests],
        }
        if pins:
            line["pins"] = [[n, ttl] for n, ttl in pins]
        if tenant:
            line["tenant"] = tenant
        if adapter:
            line["adapter"] = adapter
        self._write(line)
        self.num_records += 1

    def _write(self, obj: dict[str, Any]) -> None:
        text = json.dumps(obj, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                raise ValueError(f"trace recorder for {self.path} is closed")
            self._file.write(text)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def tenant_label(domain: str) -> str:
    """A stable, one-way label of an isolation domain (never the tenant's name)."""
    return "d:" + hashlib.sha256(domain.encode()).hexdigest()[:12]


def merge_records(parts: Sequence[str | Path], path: str | Path) -> int:
    """Write the requests of several recorded traces (one per cluster replica, same block size)
    into one trace at ``path``, in time order; returns the number of requests."""
    header: str | None = None
    lines: list[str] = []
    for part in parts:
        text = Path(part).read_text(encoding="utf-8").splitlines()
        if not text:
            continue
        _header_block_size(text[0], f"{part}:1")
        if header is not None and json.loads(text[0]) != json.loads(header):
            raise TraceFormatError(f"{part}: a different header than {parts[0]}")
        header = text[0]
        lines.extend(line for line in text[1:] if line.strip())
    lines.sort(key=lambda line: float(json.loads(line)["t"]))
    Path(path).write_text("\n".join([header or "", *lines]) + "\n", encoding="utf-8")
    return len(lines)


def read_record(path: str | Path, limit: int | None = None) -> Trace:
    """Read a recorded trace; each distinct digest becomes one hash id (first-seen order)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if not lines:
        raise TraceFormatError(f"{path}: empty file (expected a {FORMAT_NAME} header)")
    trace = Trace(path.stem, _header_block_size(lines[0], f"{path}:1"))
    ids: dict[str, int] = {}
    for line_no, line in enumerate(lines[1:], 2):
        if limit is not None and len(trace.requests) >= limit:
            break
        if line.strip():
            trace.requests.append(_parse(line, ids, f"{path}:{line_no}"))
    trace.sort_by_arrival()
    return trace


def _json_object(line: str, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    return obj


def _header_block_size(line: str, where: str) -> int:
    header = _json_object(line, where)
    if header.get("format") != FORMAT_NAME or header.get("version") != FORMAT_VERSION:
        raise TraceFormatError(f"{where}: not a {FORMAT_NAME} v{FORMAT_VERSION} header")
    block_size = header.get("block_size")
    if not isinstance(block_size, int) or block_size < 1:
        raise TraceFormatError(f"{where}: header 'block_size' must be a positive integer")
    return block_size


def _parse(line: str, ids: dict[str, int], where: str) -> TraceRequest:
    obj = _json_object(line, where)
    digests = obj.get("block_digests")
    if not isinstance(digests, list) or not all(_is_hex(d) for d in digests):
        raise TraceFormatError(f"{where}: 'block_digests' must be a list of hex strings")
    hash_ids = [ids.setdefault(d, len(ids)) for d in digests]
    tenant, pins = read_cache_fields(obj, where)
    try:
        return TraceRequest(
            where.rsplit(":", 1)[-1],
            float(obj["t"]),
            int(obj["input_length"]),
            int(obj["output_length"]),
            hash_ids,
            recorded_digests=[bytes.fromhex(d) for d in digests],
            tenant=tenant,
            pins=pins,
            adapter=read_adapter(obj, where),
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # 1e999 reads as inf
        raise TraceFormatError(f"{where}: bad request record ({exc})") from exc


def _is_hex(value: object) -> bool:
    if not isinstance(value, str) or not value:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True
