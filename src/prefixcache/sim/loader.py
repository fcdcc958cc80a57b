"""Pick the reader for a trace argument: a file, a directory, or ``synthetic:<name>``.

Formats: ``mooncake`` (JSONL, hash ids per ``block_size`` tokens), ``agentic`` (WEKA JSON, one
file or a directory), ``record`` (our recorded-traffic JSONL) and ``synthetic:<name>`` whose
parameters come as ``key=value,...`` in place of a path. Also re-times arrivals from a rate.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from prefixcache.sim.agentic import read_agentic
from prefixcache.sim.errors import TraceFormatError
from prefixcache.sim.mooncake import MOONCAKE_BLOCK_SIZE, read_mooncake
from prefixcache.sim.record import FORMAT_NAME, read_record
from prefixcache.sim.synthetic import generate
from prefixcache.sim.trace import Trace

FORMATS = ("mooncake", "agentic", "record", "synthetic:<name>")


def load_trace(
    source: str, fmt: str | None = None, block_size: int | None = None, limit: int | None = None,
    time_unit: str = "auto",
) -> Trace:
    """Read or generate a trace; TraceFormatError for anything unreadable. ``time_unit``: of a
    mooncake-shaped trace's timestamps (`read_mooncake`)."""
    if fmt is None and source.startswith("synthetic:"):
        fmt, _, source = source.partition(":")[2].partition(":")
        fmt = "synthetic:" + fmt
    fmt = fmt or detect_format(Path(source))
    if fmt.startswith("synthetic:"):
        params = "" if source in ("", "-", "default") else source
        trace = generate(fmt.partition(":")[2], params, block_size)
    elif fmt == "mooncake":
        trace = read_mooncake(source, block_size or MOONCAKE_BLOCK_SIZE, limit, time_unit)
    elif fmt in ("agentic", "record"):
        trace = read_agentic(source) if fmt == "agentic" else read_record(source)
        _check_block_size(trace, block_size)
    else:
        raise TraceFormatError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if limit is not None:
        trace.requests = trace.requests[:limit]
    if not trace.requests:
        raise TraceFormatError(f"trace {source!r} has no requests")
    return trace


def detect_format(path: Path) -> str:
    """``agentic`` for a directory or ``.json``; for JSONL, ``record`` if it has our header."""
    if not path.exists():
        raise TraceFormatError(f"trace file {path} does not exist")
    if path.is_dir() or path.suffix == ".json":
        return "agentic"
    try:
        with path.open(encoding="utf-8") as file:
            first = file.readline()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"cannot read trace {path}: {exc}") from exc
    try:
        header = json.loads(first)
    except json.JSONDecodeError:
        return "mooncake"  # let the reader report the bad line
    return (
        "record" if isinstance(header, dict) and header.get("format") == FORMAT_NAME else "mooncake"
    )


def _check_block_size(trace: Trace, block_size: int | None) -> None:
    if block_size is not None and block_size != trace.block_size:
        raise TraceFormatError(
            f"trace {trace.name} has hash ids per {trace.block_size} tokens; "
            f"--block-size {block_size} cannot re-block it"
        )


def retime_poisson(trace: Trace, rate: float, seed: int = 0) -> None:
    """Replace arrival times with a Poisson process of ``rate`` requests/s, keeping the order."""
    if rate <= 0:
        raise TraceFormatError(f"arrival rate must be > 0, got {rate}")
    rng, t = random.Random(seed), 0.0
    for request in trace.requests:
        request.arrival_s = t
        t += rng.expovariate(rate)
