"""Keep freed tensor memory in the process heap instead of handing it back to the OS (glibc).

A prefill allocates and frees temporaries of a few MB in every layer (activations, the fused
projections' outputs, SDPA's buffers). glibc serves such sizes with fresh ``mmap`` regions, or
trims its heap as soon as they are freed, so the next layer faults the same pages in again.
Raising the mmap threshold to glibc's maximum (32 MiB) and the trim threshold to 256 MiB keeps
those pages mapped and reused (the effect of running under tcmalloc or jemalloc, which vLLM's
CPU backend recommends). The trade: up to the trim threshold of freed memory stays with the
process.

It changes the allocator of the whole process, so it is the application's choice, not the
library's: ``prefixcache serve`` opts in (``--no-retain-freed-memory`` keeps glibc's defaults),
the benchmarks do too, and a library user may call `retain_freed_memory()` once. Settings the
user gave through glibc's ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` environment
variables win. What it saves is measured in docs/performance.md.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

__all__ = ["retain_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's upper limit on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 256 * 1024 * 1024


@functools.cache
def retain_freed_memory() -> bool:
    """Tune glibc malloc once per process; False where it does not apply (not glibc, or the
    user already chose these settings)."""
    if not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and other libcs
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # trim first: with the mmap threshold fixed, glibc stops raising the trim threshold itself
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    )
