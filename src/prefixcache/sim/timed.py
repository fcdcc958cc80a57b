"""Timed replay: arrivals on simulated time into one or more replicas behind a router.

Each replica runs the engine's own scheduler (`prefixcache.sched.Scheduler`: token budget,
``max_num_seqs``, chunked prefill, preemption, in-batch dedup, n > 1 forks, ``fcfs`` or ``lpm``)
over a real prefix cache; only the model is replaced, by the cost model's clock and unique filler
tokens for the generated output. Blocks held by running requests are really held, so they cannot
be evicted and can make a waiting request wait. Runs of identical decode-only steps (nothing can
be admitted, no block boundary, no finish, no arrival) are advanced in one go with
`Scheduler.repeat_steps`, which is exactly the same as stepping one by one.

Before each arrival every replica runs up to that moment and publishes its KV events and its
costs (prefill time per block, prompt tokens queued: `ReplicaCosts`); the router then picks a
replica from the request's digests and the replicas' loads (waiting + running requests). One
replica with any router is exactly single mode.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from prefixcache.cache import PrefixCache, Sequence
from prefixcache.cache.pins import PinTable
from prefixcache.sched import (
    RequestStatus,
    SchedRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from prefixcache.sim.config import RunSpec, build_cache, unlimited_blocks
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.replica_costs import ReplicaCosts
from prefixcache.sim.report import ReplayResult, Tally, ideal_hit_ratio
from prefixcache.sim.router import Router, make_router
from prefixcache.sim.sequential import Progress, summarize
from prefixcache.sim.tokens import TokenSource
from prefixcache.sim.trace import Trace, TraceRequest

__all__ = ["ReplicaConfig", "TimedReplica", "replay_timed"]


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """How every simulated replica schedules: `prefixcache.sched.SchedulerConfig`'s fields,
    plus ``store_decode=False`` to keep generated tokens out of the cache (prompt-only replay:
    a request leaves the scheduler once its prompt is computed, its decode steps still count in
    the step time) and ``n`` choices per request."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 128
    store_decode: bool = True
    schedule_policy: str = "fcfs"
    lpm_max_wait_steps: int = 16
    dedup: bool = True
    n: int = 1

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        self.scheduler_config()  # validates the rest

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            schedule_policy=self.schedule_policy,
            lpm_max_wait_steps=self.lpm_max_wait_steps,
            dedup=self.dedup,
        )


@dataclass(slots=True, eq=False)
class _SimRequest(SchedRequest):
    """A trace request inside a replica: the scheduler's state plus how much it generated."""

    trace: TraceRequest | None = field(default=None, kw_only=True)
    num_generated: int = field(default=0, kw_only=True)
    counted: bool = field(default=False, kw_only=True)  # its first token is in the tally

    def spawn(self, index: int, seq: Sequence) -> SchedRequest:
        return _SimRequest(
            self.request_id, seq, trace=self.trace, **SchedRequest.child_fields(self, index)
        )

    @property
    def output_length(self) -> int:
        assert self.trace is not None
        return self.trace.output_length

    @property
    def arrival_s(self) -> float:
        assert self.trace is not None
        return self.trace.arrival_s


class TimedReplica:
    """A replica's cache, scheduler and clock."""

    def __init__(
        self, cache: PrefixCache, cost: CostModel, config: ReplicaConfig, source: TokenSource,
        max_pinned_blocks: int | None = None, split_tenants: bool = False,
    ) -> None:
        """``max_pinned_blocks``: honour the requests' pins with this budget per tenant."""
        self.cache = cache
        self.cost = cost
        self.config = config
        self.source = source
        self.scheduler: Scheduler[_SimRequest] = Scheduler(cache, config.scheduler_config())
        self.tally = Tally()
        self.clock = 0.0
        self.decoding: list[list[int]] = []  # store_decode=False: [steps left] per choice
        self._num_added = 0
        self.split_tenants = split_tenants
        self.pins: PinTable | None = None
        if max_pinned_blocks is not None:
            self.pins = PinTable(cache, max_pinned_blocks, clock=lambda: self.clock)

    @property
    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running) + len(self.decoding)

    def costs(self) -> ReplicaCosts:
        """What a serving replica would report to its router: its prefill time per block and
        the prompt tokens queued ahead of a new request, at that speed (no lower tier here)."""
        tps = self.cost.prefill_tokens_per_s
        queued = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0)
                     for queue in (self.scheduler.waiting, self.scheduler.running)
                     for r in queue)  # fmt: skip
        return ReplicaCosts(self.cache.block_size / tps, backlog_s=queued / tps)

    def add(self, request: TraceRequest, seq: Sequence) -> None:
        """Queue a request that arrives now (the clock is at or past its arrival)."""
        bs = self.cache.block_size
        num_output = request.output_length if self.config.store_decode else 0
        num_blocks = -(-(request.input_length + num_output) // bs)
        if num_blocks + (self.config.n - 1) * (-(-num_output // bs) + 1) > self.cache.num_blocks:
            self.tally.num_rejected += 1  # can never fit: served uncached, elsewhere
            self.tally.add(request.input_length, 0, self.cost.prefill_seconds(request.input_length),
                           self._tenant(request))
            return
        if self.pins is not None:
            self.pins.refresh(seq)  # a request through a pinned prefix extends the pin
        self._num_added += 1
        self.scheduler.add(
            _SimRequest(
                request.request_id,
                seq,
                n=self.config.n,
                arrival_index=self._num_added,
                trace=request,
            )
        )

    def _tenant(self, request: TraceRequest) -> str | None:
        return request.tenant if self.split_tenants else None

    def run_until(self, t: float) -> None:
        """Run steps while there is work and the clock is before ``t`` (a step may end past it)."""
        while self.clock < t and (self.scheduler.has_unfinished() or self.decoding):
            self._step(t)
        if self.clock < t and t != math.inf:
            self.clock = t

    def _step(self, horizon: float) -> None:
        if self.pins is not None:
            self.pins.expire()
        out = self.scheduler.schedule()
        if out.is_empty and not self.decoding:
            raise RuntimeError("scheduler made no progress (a request larger than the cache?)")
        num_prefill = sum(c.num_new_tokens for c in out.chunks if c.is_prefill)
        num_decode = len(out.chunks) - sum(1 for c in out.chunks if c.is_prefill)
        step_s = self.cost.step_seconds(num_prefill, num_decode + len(self.decoding))
        self.clock += step_s
        for request, _row in self.scheduler.update_from_step(out):
            self._sampled(request, 1)
        self._decoded(1)
        if not num_prefill:
            self._repeat(out, step_s, horizon)
        usage = self.cache.usage
        if usage > self.tally.peak_usage:
            self.tally.peak_usage = usage
        self.tally.num_preemptions = self.scheduler.num_preemptions

    def _repeat(self, out: SchedulerOutput, step_s: float, horizon: float) -> None:
        """Advance identical decode-only steps at once, up to a block boundary, a finish or
        the next arrival."""
        running = self.scheduler.running
        k: float = self.scheduler.repeatable_steps(out) if running else 0
        if not running and self.decoding and not self.scheduler.waiting:
            k = math.inf
        if horizon != math.inf:
            k = min(k, math.ceil((horizon - self.clock) / step_s))
        for request in running:
            k = min(k, request.output_length - request.num_generated)
        for steps_left in self.decoding:
            k = min(k, steps_left[0])
        if k < 1 or k == math.inf:
            return
        num = int(k)
        unique = self.source.unique
        self.scheduler.repeat_steps(num, lambda r, n: r.seq.token_ids.extend(unique(n)))
        self.clock += step_s * num
        for request in list(running):
            self._sampled(request, num)
        self._decoded(num)

    def _sampled(self, request: _SimRequest, num: int) -> None:
        """``request`` sampled ``num`` tokens (its first one ends its prompt's prefill)."""
        request.num_generated += num
        if not request.counted and request.index == 0:
            request.counted = True
            ttft = self.clock - request.arrival_s
            trace = request.trace
            assert trace is not None
            self.tally.add(request.num_prompt_tokens, max(request.num_cached_tokens, 0), ttft,
                           self._tenant(trace))
            pins = self.pins
            if pins is not None and trace.pins:  # the prompt is committed: pin it
                for num_tokens, ttl_s in trace.pins:
                    pins.pin(request.seq, min(num_tokens, request.num_prompt_tokens - 1), ttl_s)
                self.tally.num_pins = pins.num_made
        done = request.num_generated >= request.output_length
        if not self.config.store_decode:
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            if not done:
                self.decoding.append([request.output_length - request.num_generated])
        elif done:
            self.scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
        else:
            request.seq.token_ids.extend(self.source.unique(1))

    def _decoded(self, num: int) -> None:
        if self.decoding:
            for steps_left in self.decoding:
                steps_left[0] -= num
            self.decoding = [s for s in self.decoding if s[0] > 0]


def replay_timed(
    trace: Trace,
    spec: RunSpec,
    cost: CostModel | None = None,
    config: ReplicaConfig | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """Replay ``trace`` through one configuration with the scheduler on simulated time."""
    if spec.has_tiers:
        raise ValueError("the lower tiers (--kv-<tier>-gib) are modelled in sequential mode "
                         "only")
    started = time.perf_counter()
    cost = cost or CostModel()
    config = config or ReplicaConfig()
    router = make_router(spec.router, spec.replicas)
    total = spec.capacity_blocks
    per_replica = (
        unlimited_blocks(trace, config.store_decode, config.n)
        if total is None
        else total // spec.replicas
    )
    source = TokenSource(trace)
    pinned = None
    if spec.pins and any(r.pins for r in trace.requests):
        pinned = per_replica // 4 if spec.max_pinned_blocks is None else spec.max_pinned_blocks
    replicas = [
        TimedReplica(
            build_cache(spec, per_replica, trace.block_size, router.wants_events),
            cost,
            config,
            source,
            pinned,
            trace.has_cache_control,
        )
        for _ in range(spec.replicas)
    ]
    identity = replicas[0].cache.identity
    for request in trace.requests:
        _advance(replicas, router, request.arrival_s)
        seq = Sequence(request.request_id, source.prompt(request), request.tenant or None,
                       copy=False, domain=request.tenant, adapter=request.adapter or None)
        digests = identity.block_digests(seq)
        loads = [r.load for r in replicas]
        for i, replica in enumerate(replicas if router.wants_events else ()):
            router.set_costs(i, replica.costs())
        index = (router.choose_for(digests, request.recorded_digests, loads)
                 if len(replicas) > 1 else 0)
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
