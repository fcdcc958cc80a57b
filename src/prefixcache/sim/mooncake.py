"""Reader for the Mooncake trace format (FAST'25 release): one JSON object per line.

``{"timestamp": ms, "input_length": int, "output_length": int, "hash_ids": [int, ...]}`` with
one hash id per ``block_size`` (512 in the published traces) prompt tokens. Reads files only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefixcache.sim.errors import TraceFormatError
from prefixcache.sim.trace import Trace, TraceRequest

MOONCAKE_BLOCK_SIZE = 512


def read_mooncake(
    path: str | Path, block_size: int = MOONCAKE_BLOCK_SIZE, limit: int | None = None
) -> Trace:
    """Read a Mooncake JSONL trace; ``limit`` keeps only the first requests."""
    path = Path(path)
    trace = Trace(path.stem, block_size)
    with _open(path) as lines:
        for line_no, line in enumerate(lines, 1):
            if limit is not None and len(trace.requests) >= limit:
                break
            if line.strip():
                trace.requests.append(_parse_line(line, f"{path}:{line_no}"))
    trace.sort_by_arrival()
    return trace


def _open(path: Path) -> Any:
    try:
        return path.open(encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {path}: {exc.strerror}") from exc


def _parse_line(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    try:
        return TraceRequest(
            request_id=where.rsplit(":", 1)[-1],
            arrival_s=_number(obj, "timestamp", where) / 1000.0,
            input_length=int(_number(obj, "input_length", where)),
            output_length=int(_number(obj, "output_length", where)),
            hash_ids=hash_id_list(obj.get("hash_ids"), where),
        )
    except ValueError as exc:
        raise TraceFormatError(f"{where}: {exc}") from exc


def _number(obj: dict[str, Any], key: str, where: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceFormatError(f"{where}: field {key!r} must be a number, got {value!r}")
    return float(value)


def hash_id_list(value: object, where: str) -> list[int]:
    """Validate a ``hash_ids`` field: a list of non-negative integers."""
    if not isinstance(value, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in value
    ):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of non-negative integers")
    return value
