"""What the kernels' sizes are derived from: this machine's caches and memory.

`caches()` reads the cache sizes the kernel reports (``/sys/devices/system/cpu/cpu0/cache``);
`memory()` measures, once per CPU and cached under ``cache_dir()/machine``, the latency of a load
that misses every cache and the rate one core streams memory at (`machine_probe.c`: a pointer
chase through a random cycle of 64 MiB, and a sum over 64 MiB). The sizes that follow from them
are written where they are used, each with its rule: the GEMMs' prefetch distance
(`prefetch_bytes`, here), the MLP's row chunk (`prefixcache.model.tuning.mlp_chunk_rows`), the
prefill attention's tile (`prefixcache.attention.native_attention.tile_tokens`). Rules and
figures: docs/performance.md ("Sizes from the machine").
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefixcache.paths import cache_dir

__all__ = [
    "Caches",
    "Memory",
    "caches",
    "measured_once",
    "memory",
    "prefetch_bytes",
    "prefetch_distance",
]

log = logging.getLogger(__name__)

_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
# What a machine that reports nothing is taken to have (a common x86 core of the last years)
_DEFAULT_CACHES = {"l1d": 32 << 10, "l2": 1 << 20, "l3": 8 << 20, "line": 64}
# Bounds of the prefetch distance: at least a few lines ahead, at most what L1 holds in flight
_PREFETCH_RANGE = (512, 8192)
_DEFAULT_PREFETCH = 2048  # where the memory cannot be measured (no compiler)
PROBE_BYTES = 64 << 20  # well past any L3 this project runs on per core
PROBE_VERSION = 1


@dataclass(frozen=True)
class Caches:
    """Bytes of the data caches one core sees: its L1d and L2, and the L3 it shares."""

    l1d: int
    l2: int
    l3: int
    line: int


@dataclass(frozen=True)
class Memory:
    """One core against memory: nanoseconds per dependent load that misses every cache, and
    bytes per nanosecond (GB/s) it reads streaming."""

    latency_ns: float
    bytes_per_ns: float


def _size(text: str) -> int:
    """'32K', '1024K', '1M' as sysfs writes them, in bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


@functools.cache
def caches() -> Caches:
    """The cache sizes the kernel reports for cpu0; a size it does not report takes the
    default (`_DEFAULT_CACHES`), said in the log."""
    found: dict[str, int] = {}
    for index in sorted(_SYSFS.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = _size((index / "size").read_text())
            line = int((index / "coherency_line_size").read_text())
        except (OSError, ValueError):
            continue
        if kind == "Instruction":
            continue
        found.setdefault({1: "l1d", 2: "l2", 3: "l3"}.get(level, "other"), size)
        found.setdefault("line", line)
    missing = [name for name in _DEFAULT_CACHES if name not in found]
    if missing:
        log.info("cache sizes not reported (%s): defaults used", ", ".join(missing))
    return Caches(**{name: found.get(name, default) for name, default in _DEFAULT_CACHES.items()})


def measured_once(path: Path, measure: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """The JSON object cached at ``path``, else ``measure()``'s, written there: (object, whether
    it was measured now). One measurement per machine at a time (a lock file beside it):
    processes starting together would otherwise time each other's load, and then disagree."""

    def read() -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    cached = read()
    if cached is not None:
        return cached, False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = read()
        if cached is not None:
            return cached, False
        data = measure()
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps(data, indent=1))
        os.replace(staging, path)
    return data, True


@functools.cache
def memory() -> Memory | None:
    """This core's memory latency and streaming rate (`Memory`), measured once per CPU model and
    flags and cached; None where the probe cannot be built."""
    from prefixcache.native import cpu_signature, load_library

    key = hashlib.sha256(f"{PROBE_VERSION}\0{cpu_signature()}".encode()).hexdigest()[:20]
    library: list[ctypes.CDLL | None] = []

    def measure() -> dict[str, Any]:
        probe = load_library("machine_probe")
        library.append(probe)
        if probe is None:
            return {}
        probe.pc_memory_latency_ns.restype = ctypes.c_double
        probe.pc_memory_latency_ns.argtypes = [ctypes.c_int64, ctypes.c_int64]
        probe.pc_stream_bytes_per_ns.restype = ctypes.c_double
        probe.pc_stream_bytes_per_ns.argtypes = [ctypes.c_int64, ctypes.c_int]
        latency = float(probe.pc_memory_latency_ns(PROBE_BYTES, 1 << 21))
        rate = float(probe.pc_stream_bytes_per_ns(PROBE_BYTES, 3))
        return asdict(Memory(round(latency, 2), round(rate, 2)))

    data, fresh = measured_once(cache_dir() / "machine" / f"{key}.json", measure)
    try:
        found = Memory(float(data["latency_ns"]), float(data["bytes_per_ns"]))
    except (KeyError, TypeError, ValueError):
        return None
    if fresh:
        log.info(
            "memory: %.0f ns a load past the caches, %.1f GB/s streamed by one core",
            found.latency_ns, found.bytes_per_ns,
        )  # fmt: skip
    return found if found.latency_ns > 0 and found.bytes_per_ns > 0 else None


@functools.cache
def prefetch_bytes() -> int:
    """How far ahead of a weight stream the GEMMs prefetch on this machine (`prefetch_distance`
    of its `memory()`)."""
    return prefetch_distance(memory())


def prefetch_distance(found: Memory | None) -> int:
    """The bytes one core must have in flight to keep streaming across a load's latency
    (latency x rate, Little's law), the nearer power of two within `_PREFETCH_RANGE`; 2,048
    where the memory was not measured."""
    if found is None:
        return _DEFAULT_PREFETCH
    wanted = found.latency_ns * found.bytes_per_ns
    low, high = _PREFETCH_RANGE
    power = low
    while power < high and power * 1.5 < wanted:  # the nearer power of two
        power *= 2
    return power
