"""Reader for the WEKA kv-cache-tester agentic-coding traces: one JSON object per conversation.

Top level: ``{id, block_size, hash_id_scope, requests: [...]}``; a request is ``{t, model, in,
out, hash_ids, ...}`` and a sub-agent is an entry with its own ``requests`` whose ``t`` counts
from the sub-agent's start. Hash ids are scoped per conversation ("local"), and KV of one model
is useless to another, so ids are re-numbered per (conversation, model): ids from different
conversations never collide. Conversations all start at t = 0. Reads files only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefixcache.sim.errors import TraceFormatError
from prefixcache.sim.mooncake import hash_id_list
from prefixcache.sim.trace import Trace, TraceRequest


class _IdScope:
    """Maps (scope, model, local hash id) to a trace-wide id, in first-seen order."""

    __slots__ = ("ids",)

    def __init__(self) -> None:
        self.ids: dict[tuple[str, str, int], int] = {}

    def remap(self, scope: str, model: str, hash_ids: list[int]) -> list[int]:
        ids = self.ids
        out = []
        for h in hash_ids:
            key = (scope, model, h)
            new_id = ids.get(key)
            if new_id is None:
                new_id = ids[key] = len(ids)
            out.append(new_id)
        return out


def read_agentic(path: str | Path, limit: int | None = None) -> Trace:
    """Read one conversation file, or every ``*.json`` in a directory (sorted by name)."""
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise TraceFormatError(f"no *.json conversation files in {path}")
    scope, block_size = _IdScope(), 0
    requests: list[TraceRequest] = []
    for file in files:
        conv = _load(file)
        block_size = _check_block_size(conv, file, block_size)
        scope_name = file.stem if conv.get("hash_id_scope", "local") == "local" else ""
        _walk(
            conv.get("requests"),
            0.0,
            str(conv.get("id", file.stem)),
            scope_name,
            scope,
            requests,
            str(file),
        )
    trace = Trace(path.stem, block_size, requests)
    trace.sort_by_arrival()
    if limit is not None:
        trace.requests = trace.requests[:limit]
    return trace


def _load(file: Path) -> dict[str, Any]:
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {file}: {exc.strerror}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("requests"), list):
        raise TraceFormatError(f"{file}: expected an object with a 'requests' list")
    return obj


def _check_block_size(conv: dict[str, Any], file: Path, seen: int) -> int:
    block_size = conv.get("block_size")
    if not isinstance(block_size, int) or block_size < 1:
        raise TraceFormatError(f"{file}: 'block_size' must be a positive integer")
    if seen and block_size != seen:
        raise TraceFormatError(f"{file}: block_size {block_size} differs from {seen}")
    return block_size


def _walk(
    entries: Any,
    t0: float,
    prefix: str,
    scope_name: str,
    scope: _IdScope,
    out: list[TraceRequest],
    where: str,
) -> None:
    if not isinstance(entries, list):
        raise TraceFormatError(f"{where}: 'requests' must be a list")
    for index, entry in enumerate(entries):
        here = f"{where}: request {prefix}/{index}"
        if not isinstance(entry, dict):
            raise TraceFormatError(f"{here}: expected an object")
        t = t0 + _seconds(entry.get("t"), here)
        if "requests" in entry:
            sub_prefix = f"{prefix}/{entry.get('agent_id', index)}"
            _walk(entry["requests"], t, sub_prefix, scope_name, scope, out, where)
        else:
            out.append(_request(entry, t, f"{prefix}/{index}", scope_name, scope, here))


def _request(
    entry: dict[str, Any], t: float, request_id: str, scope_name: str, scope: _IdScope, here: str
) -> TraceRequest:
    input_length, output_length = entry.get("in"), entry.get("out")
    if not isinstance(input_length, int) or not isinstance(output_length, int):
        raise TraceFormatError(f"{here}: 'in' and 'out' must be integers")
    model = str(entry.get("model", ""))
    hash_ids = scope.remap(scope_name, model, hash_id_list(entry.get("hash_ids"), here))
    try:
        return TraceRequest(request_id, t, input_length, output_length, hash_ids, scope_name)
    except ValueError as exc:
        raise TraceFormatError(f"{here}: {exc}") from exc


def _seconds(value: Any, here: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise TraceFormatError(f"{here}: 't' must be a non-negative number of seconds")
    return float(value)
