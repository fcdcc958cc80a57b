"""Keep freed tensor memory in the process heap instead of handing it back to the OS (glibc).

A prefill allocates and frees temporaries of a few MB in every layer (activations, the fused
projections' outputs, SDPA's buffers). glibc serves such sizes with fresh ``mmap`` regions, or
trims its heap as soon as they are freed, so the next layer faults the same pages in again.
Raising the mmap threshold to glibc's maximum (32 MiB) and the trim threshold to 256 MiB keeps
those pages mapped and reused (the effect of running under tcmalloc or jemalloc, which vLLM's
CPU backend recommends). The trade: up to the trim threshold of freed memory stays with the
process.

Kept without bound, that memory would make RSS follow the largest step the process has ever
run, and a server's steps keep finding larger shapes. So a process that retains freed memory
also hands it back every `TRIM_INTERVAL_S` (`FreedMemoryTrimmer`, called between engine steps):
``malloc_trim(0)`` returns the free pages of the heap to the OS in well under a millisecond,
and the next step faults in only what it uses. What stays reserved is what is in use plus, at
most, what the steps of the last interval freed. The process keeps one malloc arena for all its
threads (``M_ARENA_MAX`` 1): under the raised trim threshold a thread's own arena keeps the
free top of its heap resident, out of ``malloc_trim``'s reach (it trims the main arena's top
only), and what request threads free (tokenizing a long prompt) would stay there.

It changes the allocator of the whole process, so it is the application's choice, not the
library's: ``prefixcache serve`` opts in (``--no-retain-freed-memory`` keeps glibc's defaults),
the benchmarks do too, and a library user may call `retain_freed_memory()` once. Settings the
user gave through glibc's ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` environment
variables win (and ``MALLOC_ARENA_MAX`` keeps the user's arena count). What it saves is
measured in docs/performance.md.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import cast

__all__ = ["FreedMemoryTrimmer", "retain_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # malloc.h
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's upper limit on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 256 * 1024 * 1024
# the trade: a step after a trim faults its temporaries in again (page faults, no copies), once
# per interval, against RSS that tracks what is in use
TRIM_INTERVAL_S = 10.0


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
    # trim first: with the mmap threshold fixed, glibc stops raising the trim threshold itself.
    # One arena: a thread's own arena never gives back the free top of its first heap under a
    # trim threshold this high, and malloc_trim cannot reach it either (it trims the top of the
    # main arena only), so memory a tokenizer thread freed would stay resident for ever
    arena_max = "MALLOC_ARENA_MAX" in os.environ or bool(mallopt(_M_ARENA_MAX, 1))
    return (
        bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
        and arena_max
    )


class FreedMemoryTrimmer:
    """Hands retained free memory back to the OS at most once per ``interval_s``; does nothing
    in a process that has not called `retain_freed_memory` (glibc's own trimming applies)."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.num_trims = 0
        self._last = time.monotonic()
        self._malloc_trim = _malloc_trim()
        self._worked = False  # a step ran since the last trim

    @property
    def active(self) -> bool:
        """Whether this process retains freed memory, so trims have anything to hand back."""
        # (the cached answer: asks nothing of a process that never opted in)
        retaining = retain_freed_memory.cache_info().currsize and retain_freed_memory()
        return self._malloc_trim is not None and bool(retaining)

    def note_work(self) -> None:
        """A step ran: it freed temporaries that the next trim hands back."""
        self._worked = True

    def seconds_until_due(self) -> float | None:
        """How long an idle caller may wait before the next trim is due; None when nothing ran
        since the last one (an idle server wakes once to trim what its last burst freed, not
        every interval)."""
        if not (self._worked and self.active):
            return None
        return max(0.0, self._last + self.interval_s - time.monotonic())

    def maybe_trim(self) -> None:
        if not self.active:
            return
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self._worked = False
            assert self._malloc_trim is not None
            self._malloc_trim(0)
            self.num_trims += 1


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return cast(Callable[[int], int], trim)
