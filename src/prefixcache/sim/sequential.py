"""Sequential replay: each replica serves its requests one at a time, in arrival order.

Per request: route, ``match -> allocate -> commit -> free`` on the chosen replica's real cache,
and estimate TTFT as the prefill of the uncached tokens (no queueing; see `timed.py` for the
scheduler). A request's load on its replica lasts its prefill plus its decode at batch one, which
is what ``least-loaded`` and the cache-aware guard see.

Several configurations replay in lockstep: each request's tokens and digests are built once and
every configuration gets a cheap fork of that sequence.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC

from prefixcache.cache import PrefixCache, Sequence
from prefixcache.sim.config import RunSpec, build_cache, unlimited_blocks
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.report import ReplayResult, Tally, ideal_hit_ratio, percentile
from prefixcache.sim.router import Router, make_router
from prefixcache.sim.tokens import TokenSource
from prefixcache.sim.trace import Trace, TraceRequest

Progress = Callable[[int], None]


class _Replica:
    """One cache plus the finish times of the requests it is serving."""

    __slots__ = ("cache", "tally", "in_flight")

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.tally = Tally()
        self.in_flight: list[float] = []

    def load(self, now: float) -> int:
        in_flight = self.in_flight
        while in_flight and in_flight[0] <= now:
            heapq.heappop(in_flight)
        return len(in_flight)


class SequentialRun:
    """One configuration: its replicas, its router and the cost model."""

    def __init__(self, spec: RunSpec, trace: Trace, cost: SequentialCost) -> None:
        self.spec = spec
        self.trace_name = trace.name
        self.cost = cost
        total = spec.capacity_blocks
        per_replica = unlimited_blocks(trace, False) if total is None else total // spec.replicas
        self.router: Router = make_router(spec.router, spec.replicas)
        with_events = self.router.wants_events
        self.replicas = [
            _Replica(build_cache(spec, per_replica, trace.block_size, with_events))
            for _ in range(spec.replicas)
        ]
        self.wall_s = 0.0

    def feed(self, request: TraceRequest, seq: Sequence, digests: list[bytes]) -> None:
        started = time.perf_counter()
        now = request.arrival_s
        loads = [replica.load(now) for replica in self.replicas]
        index = (self.router.choose_for(digests, request.recorded_digests, loads)
                 if len(self.replicas) > 1 else 0)
        replica = self.replicas[index]
        num_hit = self._serve(replica, request, seq.fork(seq.seq_id))
        events = replica.cache.take_events()
        if events and self.router.wants_events:
            self.router.observe(index, events)
        prefill_s = self.cost.model.prefill_seconds(request.input_length - num_hit)
        replica.tally.add(request.input_length, num_hit, prefill_s)
        finish = now + prefill_s + request.output_length * self.cost.decode_token_s
        heapq.heappush(replica.in_flight, finish)
        self.wall_s += time.perf_counter() - started

    @staticmethod
    def _serve(replica: _Replica, request: TraceRequest, seq: Sequence) -> int:
        cache = replica.cache
        hit = cache.match(seq)
        if cache.allocate(seq, request.input_length - hit.num_tokens, hit) is None:
            replica.tally.num_rejected += 1  # larger than the whole cache: computed uncached
            return 0
        cache.commit(seq, request.input_length)
        usage = cache.usage
        if usage > replica.tally.peak_usage:
            replica.tally.peak_usage = usage
        cache.free(seq)
        return hit.num_tokens

    def result(self, trace: Trace, ideal: float) -> ReplayResult:
        return summarize(
            self.spec,
            trace,
            ideal,
            "sequential",
            self.cost.model,
            [(r.cache, r.tally) for r in self.replicas],
            self.wall_s,
        )


class SequentialCost:
    """The cost model plus its derived per-token decode time at batch one."""

    __slots__ = ("model", "decode_token_s")

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self.decode_token_s = model.step_seconds(0, 1)


def summarize(
    spec: RunSpec,
    trace: Trace,
    ideal: float,
    mode: str,
    cost: CostModel,
    replicas: SequenceABC[tuple[PrefixCache, Tally]],
    wall_s: float,
) -> ReplayResult:
    """Fold the replicas' tallies and cache stats into one result row."""
    tallies = [t for _, t in replicas]
    num_tokens = sum(t.num_queried_tokens for t in tallies)
    num_hit = sum(t.num_hit_tokens for t in tallies)
    ttfts = [x for t in tallies for x in t.ttft_s]
    return ReplayResult(
        trace=trace.name,
        mode=mode,
        prefix_cache=spec.prefix_cache,
        policy=spec.policy,
        capacity_blocks=sum(c.num_blocks for c, _ in replicas),
        capacity_label=spec.capacity_label,
        replicas=spec.replicas,
        router=spec.router if spec.replicas > 1 else "-",
        block_size=trace.block_size,
        num_requests=sum(t.num_requests for t in tallies),
        num_rejected=sum(t.num_rejected for t in tallies),
        hit_ratio=num_hit / num_tokens if num_tokens else 0.0,
        ideal_hit_ratio=ideal,
        prefill_tokens_saved=num_hit,
        prefill_seconds_saved=num_hit / cost.prefill_tokens_per_s,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        num_evictions=sum(c.stats.num_evictions for c, _ in replicas),
        peak_usage=max(t.peak_usage for t in tallies),
        num_preemptions=sum(t.num_preemptions for t in tallies),
        replica_requests=[t.num_requests for t in tallies],
        replica_hit_ratios=[round(t.hit_ratio, 6) for t in tallies],
        wall_s=wall_s,
    )


def replay_sequential(
    trace: Trace,
    specs: list[RunSpec],
    cost: CostModel | None = None,
    progress: Progress | None = None,
) -> list[ReplayResult]:
    """Replay ``trace`` through every configuration in ``specs`` in lockstep."""
    seq_cost = SequentialCost(cost or CostModel())
    runs = [SequentialRun(spec, trace, seq_cost) for spec in specs]
    if not runs:
        return []
    first = runs[0].replicas[0].cache
    identity = first.identity
    source = TokenSource(trace)
    for request in trace.requests:
        seq = Sequence(request.request_id, source.prompt(request), copy=False)
        digests = identity.block_digests(seq)
        for run in runs:
            run.feed(request, seq, digests)
        if progress is not None:
            progress(1)
    ideal = ideal_hit_ratio(trace)
    return [run.result(trace, ideal) for run in runs]
