"""prefixcache.sim: replay traces through the real prefix caches, with simulated time.

Readers turn trace files into `TraceRequest`s (per-block hash ids, never text); generators build
synthetic workloads of the same shape; the replays feed them to ``make_prefix_cache`` instances,
alone or behind a router, and report hit ratios, TTFT, evictions and usage. Imports no torch.
"""

from __future__ import annotations

from prefixcache.sim.trace import Trace, TraceRequest

__all__ = ["Trace", "TraceRequest"]
