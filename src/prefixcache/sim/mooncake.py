"""Reader for the Mooncake trace format (FAST'25 release) and its kin: one JSON object per line.

``{"timestamp": ms, "input_length": int, "output_length": int, "hash_ids": [int, ...]}`` with
one hash id per ``block_size`` (512 in the published traces) prompt tokens. Traces in the same
shape from other tools (LMCache's LMBench) write the timestamp as a string of nanoseconds and
hash ids as arbitrary 32-bit integers: numbers given as decimal strings are accepted, and the
time unit is ``time_unit`` (``s``, ``ms``, ``us``, ``ns``) or, with ``auto``, detected from the
largest timestamp (>= 1e17: ns, >= 1e14: us, else ms). Arrivals are shifted to start at 0.
A line may also carry ``tenant`` and ``pins`` (`trace.read_cache_fields`) and ``adapter`` (the LoRA
adapter it ran under: `trace.read_adapter`). Reads files only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from prefixcache.sim.errors import TraceFormatError
from prefixcache.sim.trace import Trace, TraceRequest, read_adapter, read_cache_fields

MOONCAKE_BLOCK_SIZE = 512
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def read_mooncake(
    path: str | Path, block_size: int = MOONCAKE_BLOCK_SIZE, limit: int | None = None,
    time_unit: str = "auto",
) -> Trace:
    """Read a Mooncake-shaped JSONL trace; ``limit`` keeps only the first requests."""
    if time_unit != "auto" and time_unit not in TIME_UNITS:
        raise TraceFormatError(f"unknown time unit {time_unit!r}; choose auto or one of "
                               f"{', '.join(TIME_UNITS)}")
    path = Path(path)
    trace = Trace(path.stem, block_size)
    with _open(path) as lines:
        for line_no, raw in enumerate(lines, 1):
            if limit is not None and len(trace.requests) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(f"{path}:{line_no}: not UTF-8 text (byte {exc.start} of "
                                       "the line)") from None
            if line.strip():
                trace.requests.append(_parse_line(line, f"{path}:{line_no}"))
    _to_seconds(trace, time_unit)
    trace.sort_by_arrival()
    return trace


def _to_seconds(trace: Trace, time_unit: str) -> None:
    """Timestamps (read raw) to seconds from the first arrival."""
    if not trace.requests:
        return
    raw = [r.arrival_s for r in trace.requests]
    if time_unit == "auto":
        top = max(raw)
        time_unit = "ns" if top >= 1e17 else "us" if top >= 1e14 else "ms"
    scale, start = TIME_UNITS[time_unit], min(raw)
    for request, value in zip(trace.requests, raw, strict=True):
        request.arrival_s = (value - start) * scale


def _open(path: Path) -> Any:
    try:
        return path.open("rb")  # lines decoded one by one: an error names its line
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {path}: {exc.strerror}") from exc


def _parse_line(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    tenant, pins = read_cache_fields(obj, where)
    try:
        return TraceRequest(
            request_id=where.rsplit(":", 1)[-1],
            arrival_s=_number(obj, "timestamp", where),  # raw: `_to_seconds` scales it
            input_length=int(_number(obj, "input_length", where)),
            output_length=int(_number(obj, "output_length", where)),
            hash_ids=hash_id_list(obj.get("hash_ids"), where),
            tenant=tenant,
            pins=pins,
            adapter=read_adapter(obj, where),
        )
    except TraceFormatError:
        raise  # already says where
    except ValueError as exc:
        raise TraceFormatError(f"{where}: {exc}") from exc


def _number(obj: dict[str, Any], key: str, where: str) -> float:
    """A finite numeric field: a JSON number, or a decimal string of one (LMBench's
    timestamps)."""
    value = obj.get(key)
    number = None
    if isinstance(value, str):
        try:
            number = float(int(value)) if value.strip().lstrip("-").isdigit() else float(value)
        except (ValueError, OverflowError):
            pass
    elif not isinstance(value, bool) and isinstance(value, int | float):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any float
            pass
    if number is None or not math.isfinite(number):
        raise TraceFormatError(f"{where}: field {key!r} must be a number, got "
                               f"{str(value)[:40]!r}")
    return number


def hash_id_list(value: object, where: str) -> list[int]:
    """Validate a ``hash_ids`` field: a list of non-negative integers."""
    if not isinstance(value, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in value
    ):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of non-negative integers")
    return value
