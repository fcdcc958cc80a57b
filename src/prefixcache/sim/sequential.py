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

from prefixcache.cache import BlockRemoved, BlockStored, KVCacheEvent, PrefixCache, Sequence, adopt
from prefixcache.cache.pins import PinTable
from prefixcache.sim.config import RunSpec, build_cache, unlimited_blocks
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.replica_costs import ReplicaCosts
from prefixcache.sim.report import ReplayResult, Tally, ideal_hit_ratio, percentile
from prefixcache.sim.router import Router, make_router
from prefixcache.sim.tiers import SimTier, TierSpec
from prefixcache.sim.tokens import TokenSource
from prefixcache.sim.trace import Trace, TraceRequest
from prefixcache.tiers import TIERS

Progress = Callable[[int], None]


class _Replica:
    """One cache, its lower tiers (nearest first), its pins (on the trace's clock), the finish
    times of the requests it is serving, and the seconds and blocks of its tier reads."""

    __slots__ = ("cache", "tally", "in_flight", "tiers", "pins", "now", "reads")

    def __init__(self, cache: PrefixCache, max_pinned_blocks: int | None = None) -> None:
        self.cache = cache
        self.tally = Tally()
        self.in_flight: list[float] = []
        self.tiers: list[SimTier] = []
        self.now = 0.0
        self.pins: PinTable | None = None
        if max_pinned_blocks is not None:
            self.pins = PinTable(cache, max_pinned_blocks, clock=lambda: self.now)
        self.reads: dict[str, tuple[float, int]] = {}  # per tier: seconds, blocks

    def costs(self, prefill_s_per_block: float) -> ReplicaCosts:
        """What a serving replica reports: its prefill time per block and each tier's read
        time per block it served (no queue: sequential replay has none)."""
        loads = {TIERS[name].medium: seconds / blocks
                 for name, (seconds, blocks) in self.reads.items() if blocks}
        return ReplicaCosts(prefill_s_per_block, loads)

    def load(self, now: float) -> int:
        in_flight = self.in_flight
        while in_flight and in_flight[0] <= now:
            heapq.heappop(in_flight)
        return len(in_flight)


def _no_kv(block_ids: list[int], first: int) -> None:
    """The simulator's blocks hold no KV: an adopted run has nothing to write."""


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
        self.split_tenants = trace.has_cache_control
        pinned = None
        if spec.pins and any(r.pins for r in trace.requests):
            pinned = per_replica // 4 if spec.max_pinned_blocks is None else spec.max_pinned_blocks
        self.replicas = [
            _Replica(build_cache(spec, per_replica, trace.block_size, with_events), pinned)
            for _ in range(spec.replicas)
        ]
        model = cost.model
        self.block_bytes = model.kv_bytes_per_token * trace.block_size * spec.kv_bytes_scale
        for name, gib in spec.tier_gib:  # nearest first; a shared tier is one for them all
            tier_spec = TierSpec(name, int(gib * (1 << 30) // self.block_bytes), *model.reads(name))
            shared = SimTier(tier_spec) if TIERS[name].shared else None
            for replica in self.replicas:
                replica.tiers.append(shared or SimTier(tier_spec))
        self.prefill_s_per_block = trace.block_size / model.prefill_tokens_per_s
        for i, replica in enumerate(self.replicas):
            self.router.set_costs(i, replica.costs(self.prefill_s_per_block))
        self.wall_s = 0.0

    def feed(self, request: TraceRequest, seq: Sequence, digests: list[bytes]) -> None:
        started = time.perf_counter()
        now = request.arrival_s
        loads = [replica.load(now) for replica in self.replicas]
        index = (self.router.choose_for(digests, request.recorded_digests, loads)
                 if len(self.replicas) > 1 else 0)
        replica = self.replicas[index]
        mine = seq.fork(seq.seq_id)
        if replica.pins is not None:
            replica.now = now
            replica.pins.expire()
            replica.pins.refresh(mine)  # a request through a pinned prefix extends the pin
        load_s = self._load(replica, mine, digests) if replica.tiers else 0.0
        num_hit = self._serve(replica, request, mine)
        events = replica.cache.take_events()
        if replica.tiers and num_hit < request.input_length:
            bs = replica.cache.block_size
            start = num_hit // bs
            events += _stored(replica.tiers, digests, start, request.num_full_blocks(bs), bs)
        if events and self.router.wants_events:
            self.router.observe(index, events)
            if replica.tiers:
                self.router.set_costs(index, replica.costs(self.prefill_s_per_block))
        prefill_s = self.cost.model.prefill_seconds(request.input_length - num_hit) + load_s
        replica.tally.add(request.input_length, num_hit, prefill_s,
                          request.tenant if self.split_tenants else None)
        finish = now + prefill_s + request.output_length * self.cost.decode_token_s
        heapq.heappush(replica.in_flight, finish)
        self.wall_s += time.perf_counter() - started

    def _load(self, replica: _Replica, seq: Sequence, digests: list[bytes]) -> float:
        """Extend the RAM hit with the tiers' longest run (adopted into the cache, as the engine
        does); returns the time the reads take."""
        cache = replica.cache
        have = len(cache.match(seq).block_ids)
        top = min((seq.num_tokens - 1) // cache.block_size, len(digests))
        runs = []
        start = have
        for tier in replica.tiers:
            n = tier.read_run(digests, start, top)
            runs.append((tier, n))
            start += n
        if start == have or not adopt(cache, seq, have, start - have, _no_kv):
            return 0.0
        seconds = 0.0
        tally = replica.tally.tier_tokens
        for tier, n in runs:
            if n:
                tally[tier.name] = tally.get(tier.name, 0) + n * cache.block_size
                read_s = tier.read_seconds(n, self.block_bytes)
                total_s, total_n = replica.reads.get(tier.name, (0.0, 0))
                replica.reads[tier.name] = (total_s + read_s, total_n + n)
                seconds += read_s
        return seconds

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
        pins = replica.pins
        if pins is not None:
            for num_tokens, ttl_s in request.pins:  # as the engine: once the prompt is committed
                pins.pin(seq, min(num_tokens, request.input_length - 1), ttl_s)
            replica.tally.num_pins = pins.num_made
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


def _stored(
    tiers: list[SimTier], digests: list[bytes], start: int, stop: int, block_size: int
) -> list[KVCacheEvent]:
    """Write blocks ``start .. stop - 1`` to every tier; the events an engine announces for
    them, with each tier's medium: stored, then what a replica's own tier (its disk) evicted
    to make room (a shared tier, Valkey, evicts without telling the engine)."""
    events: list[KVCacheEvent] = []
    computed = digests[start:stop]
    if not computed:
        return events
    parent = digests[start - 1] if start else b""
    for tier in tiers:
        kind = TIERS[tier.name]
        evicted = tier.store(computed)
        events.append(BlockStored(computed, parent, [], block_size, medium=kind.medium))
        if evicted and not kind.shared:
            events.append(BlockRemoved(evicted, medium=kind.medium))
    return events


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
        eviction_policy=spec.eviction_policy,
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
        tier_hit_ratios=_tier_ratios(tallies, num_hit, num_tokens) if spec.has_tiers else {},
        tenant_hit_ratios=_tenant_ratios(tallies),
        num_pins=sum(t.num_pins for t in tallies),
    )


def _tenant_ratios(tallies: list[Tally]) -> dict[str, float]:
    """Each tenant's hit ratio over every replica (empty when the trace names no tenant)."""
    totals: dict[str, list[int]] = {}
    for tally in tallies:
        for tenant, (queried, hit) in tally.tenant_tokens.items():
            total = totals.setdefault(tenant, [0, 0])
            total[0] += queried
            total[1] += hit
    return {t: round(hit / queried, 6) if queried else 0.0
            for t, (queried, hit) in sorted(totals.items())}


def _tier_ratios(tallies: list[Tally], num_hit: int, num_tokens: int) -> dict[str, float]:
    """The share of queried tokens the pool's own hits and each tier served."""
    if not num_tokens:
        return {}
    per_tier: dict[str, int] = {}
    for tally in tallies:
        for name, n in tally.tier_tokens.items():
            per_tier[name] = per_tier.get(name, 0) + n
    out = {"ram": (num_hit - sum(per_tier.values())) / num_tokens}
    out.update({name: n / num_tokens for name, n in sorted(per_tier.items())})
    return out


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
    for request in trace.requests:  # a tenant's blocks live in its own namespace
        seq = Sequence(request.request_id, source.prompt(request), request.tenant or None,
                       copy=False, domain=request.tenant, adapter=request.adapter or None)
        digests = identity.block_digests(seq)
        for run in runs:
            run.feed(request, seq, digests)
        if progress is not None:
            progress(1)
    ideal = ideal_hit_ratio(trace)
    return [run.result(trace, ideal) for run in runs]
