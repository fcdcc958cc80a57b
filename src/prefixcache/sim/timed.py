"""Timed replay: arrivals on simulated time into one or more `TimedReplica`s behind a router.

Before each arrival every replica runs its scheduler up to that moment and publishes its KV
events; the router then picks a replica from the request's digests and the replicas' loads
(waiting + running requests). One replica with any router is exactly single mode.
"""

from __future__ import annotations

import math
import time

from prefixcache.cache import Sequence
from prefixcache.sim.config import RunSpec, build_cache, unlimited_blocks
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.report import ReplayResult, ideal_hit_ratio
from prefixcache.sim.router import Router, make_router
from prefixcache.sim.scheduler import SchedulerConfig, TimedReplica
from prefixcache.sim.sequential import Progress, summarize
from prefixcache.sim.tokens import TokenSource
from prefixcache.sim.trace import Trace


def replay_timed(
    trace: Trace,
    spec: RunSpec,
    cost: CostModel | None = None,
    config: SchedulerConfig | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """Replay ``trace`` through one configuration with the scheduler on simulated time."""
    started = time.perf_counter()
    cost = cost or CostModel()
    config = config or SchedulerConfig()
    router = make_router(spec.router, spec.replicas)
    total = spec.capacity_blocks
    per_replica = (
        unlimited_blocks(trace, config.store_decode) if total is None else total // spec.replicas
    )
    source = TokenSource(trace)
    replicas = [
        TimedReplica(
            build_cache(spec, per_replica, trace.block_size, router.wants_events),
            cost,
            config,
            source,
        )
        for _ in range(spec.replicas)
    ]
    hasher, model_id = replicas[0].cache.hasher, replicas[0].cache.model_id
    for request in trace.requests:
        _advance(replicas, router, request.arrival_s)
        seq = Sequence(request.request_id, source.prompt(request), copy=False)
        digests = seq.digests(hasher, model_id)
        index = router.choose(digests, [r.load for r in replicas]) if len(replicas) > 1 else 0
        replicas[index].add(request, seq)
        if progress is not None:
            progress(1)
    _advance(replicas, router, math.inf)
    return summarize(
        spec,
        trace,
        ideal_hit_ratio(trace),
        "timed",
        cost,
        [(r.cache, r.tally) for r in replicas],
        time.perf_counter() - started,
    )


def _advance(replicas: list[TimedReplica], router: Router, t: float) -> None:
    for index, replica in enumerate(replicas):
        replica.run_until(t)
        events = replica.cache.take_events()
        if events and router.wants_events:
            router.observe(index, events)
