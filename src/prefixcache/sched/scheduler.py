"""Continuous batching over a prefix cache: who runs this step, with how many tokens.

The scheduler is the only part that talks to both the cache (through `Sequence` and block ids)
and the runner (through `SchedulerOutput`); it never sees tensors or hashes' meaning.

One step spends at most ``max_num_batched_tokens`` tokens over at most ``max_num_seqs`` sequences:

1. Running requests first, in admission order: a decode token, or their next prefill chunk. When
   the cache has no block for one, the most recently admitted running request is preempted (freed,
   its committed blocks stay cached, requeued at the front) until it fits — possibly itself.
2. Waiting requests next (none if this step preempted): ``match`` + ``allocate``, admitted only if
   the blocks fit; a prompt longer than the remaining budget is prefilled in chunks.
3. In-batch dedup: a waiting request whose first uncached block is being computed in this step by
   another request waits a step, so it hits instead of computing the same block twice.

With several domains, waiting requests are taken round-robin across them, and a
domain over its equal share waits and is preempted first (``fairness.py``); with one, inert.
The scheduler hands the cache the same shares as its ``protection`` (`fairness.QuietDomains`).

The waiting queue's order is the policy's (``policy.py``: ``fcfs``, ``lpm``).

After the runner: `update_from_step` commits the computed tokens (full blocks become hittable;
the cache advances each sequence's ``num_computed_tokens``), and forks ``n - 1`` children off a
request whose prompt just finished. Lookups are pure (`PrefixCache.match`): ordering a queue
costs no statistics, and an admitted request's lookup is counted once, by the cache.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar, cast

from prefixcache.cache import CacheHit, PrefixCache
from prefixcache.sched.config import SCHEDULE_POLICIES, SchedulerConfig
from prefixcache.sched.dedup import InBatchDedup
from prefixcache.sched.fairness import DomainLimits, QuietDomains, Shares, fair_order
from prefixcache.sched.policy import make_policy
from prefixcache.sched.request import RequestStatus, SchedRequest, ScheduledChunk, SchedulerOutput

__all__ = ["SCHEDULE_POLICIES", "Scheduler"]

R = TypeVar("R", bound=SchedRequest)


class Scheduler(Generic[R]):
    """Decides each step's batch; owns the waiting queue and the running list. Generic over the
    driver's request type ``R`` (a `SchedRequest`): the engine's, the simulator's."""

    def __init__(
        self, cache: PrefixCache, config: SchedulerConfig | None = None, **settings: Any
    ) -> None:
        """``config``, or its fields as keywords (`SchedulerConfig.from_kwargs`)."""
        if config is None:
            config = SchedulerConfig.from_kwargs(**settings)
        elif settings:
            raise TypeError("give a SchedulerConfig or keyword settings, not both")
        self.config = config
        self.cache = cache
        self.policy = make_policy(config.schedule_policy, config.lpm_max_wait_steps)
        self.protection = QuietDomains(cache)  # the cache evicts by the same shares
        cache.protection = self.protection
        self.dedup = InBatchDedup(cache, config.dedup)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.waiting: deque[R] = deque()
        self.running: list[R] = []
        self.step_index = 0
        self.num_preemptions = 0
        self.num_fairness_preemptions = 0  # of those, to let an under-share domain start
        self.num_deferred = 0
        self.num_block_copies = 0
        self._domains: Counter[str] = Counter()  # unfinished requests per domain
        self._seqs: Counter[str] = Counter()  # sequences the running requests reserve, per domain

    def limits_for(self, domain: str) -> DomainLimits:
        """The hard caps of ``domain``: its own entry, else the default."""
        return self.config.domain_limits.get(domain, self.config.default_domain_limits)

    # ---- queue management -------------------------------------------------------------------

    def add(self, request: R) -> None:
        request.status = RequestStatus.WAITING
        request.arrival_step = self.step_index
        self.waiting.append(request)
        self._domains[request.domain] += 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: R, status: RequestStatus) -> None:
        """End ``request`` (stopped, length or aborted): its blocks go back to the cache."""
        queued = True
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._seqs[request.domain] -= request.reserved_seqs
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            queued = False
        if queued:
            self._domains[request.domain] -= 1
            if not self._domains[request.domain]:
                del self._domains[request.domain]
        self.cache.free(request.seq)
        request.status = status

    # ---- scheduling -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step=self.step_index)
        shares = self._shares() if len(self._domains) > 1 else None
        if shares is not None:
            self._preempt_for_fairness(out, shares)
        num_fair = len(out.preempted)
        budget = self._schedule_running(out, self.max_num_batched_tokens, shares)
        if len(out.preempted) == num_fair:  # no sequence ran out of blocks this step
            self._schedule_waiting(out, budget, shares)
        out.admission_blocked = bool(self.waiting) and not out.num_admitted
        out.block_copies = self.cache.take_block_copies()
        out.blocks_to_zero = self.cache.take_blocks_to_zero()
        self.num_block_copies += len(out.block_copies)
        self.step_index += 1
        return out

    def _shares(self) -> Shares:
        return Shares.of(self._domains, self._seqs, self.cache, self.max_num_seqs,
                         self.max_num_batched_tokens)

    def _schedule_running(self, out: SchedulerOutput, budget: int, shares: Shares | None) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_uncomputed_tokens, budget)
            if shares is not None:  # 0: its domain spent its share of this step's prefill tokens
                num_new = shares.cap_tokens(request.domain, num_new)
            if num_new:
                table = self._allocate_or_preempt(request, num_new, out, i, shares)
                if table is None:
                    break  # it preempted itself: nothing after it is left
                chunk = ScheduledChunk(request, request.num_computed_tokens, num_new, table)
                out.chunks.append(chunk)
                budget -= num_new
                if shares is not None:
                    shares.spend_tokens(request.domain, num_new)
            i += 1
        return budget

    def _allocate_or_preempt(
        self, request: R, num_new: int, out: SchedulerOutput, index: int, shares: Shares | None
    ) -> list[int] | None:
        """Allocate, preempting not-yet-scheduled running requests (from ``index`` on) until it
        fits: the newest of the domain most over its share, else the newest of all."""
        while True:
            table = self.cache.allocate(request.seq, num_new)
            if table is not None:
                return table
            candidates = self.running[index:]
            over = shares.most_over_share({r.domain for r in candidates}) if shares else None
            victim = next((r for r in reversed(candidates) if r.domain == over), candidates[-1])
            self._preempt(victim, out)
            if victim is request:
                return None

    def _preempt_for_fairness(self, out: SchedulerOutput, shares: Shares) -> None:
        """Let each under-share domain's first waiting request start: preempt the newest
        sequences of over-share domains until it has a sequence slot and blocks for its first
        chunk, or no domain is over its share."""
        firsts: dict[str, R] = {}
        for request in self.waiting:
            firsts.setdefault(request.domain, request)
        for domain, request in firsts.items():
            if shares.is_over(domain):
                continue
            while not self._could_start(request):
                over = shares.most_over_share({r.domain for r in self.running} - {domain})
                if over is None:
                    break
                self._preempt(next(r for r in reversed(self.running) if r.domain == over), out)
                self.num_fairness_preemptions += 1

    def _could_start(self, request: R) -> bool:
        if sum(self._seqs.values()) + request.reserved_seqs > self.max_num_seqs:
            return False
        hit = self.cache.match(request.seq)
        first_chunk = min(request.num_tokens - hit.num_tokens, self.max_num_batched_tokens)
        return self.cache.num_free_blocks >= -(-first_chunk // self.cache.block_size)

    def _preempt(self, request: R, out: SchedulerOutput) -> None:
        """Free a running request's blocks (its committed ones stay cached) and requeue it first."""
        self.running.remove(request)
        self._seqs[request.domain] -= request.reserved_seqs
        self.cache.free(request.seq)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, shares: Shares | None) -> None:
        in_flight = self.dedup.in_flight(out.chunks)
        num_seqs = sum(self._seqs.values())
        blocked: set[str] = set()  # domains whose next request cannot start this step
        waiting_domains = {r.domain for r in self.waiting}
        for request, hit in self._waiting_in_fair_order(shares):
            if budget <= 0:
                break
            domain = request.domain
            if domain in blocked or not _adapter_fits(request, self.running, self.config):
                continue  # no overtaking inside a domain; max_loras adapters run already
            num_new = 0
            if num_seqs + request.reserved_seqs <= self.max_num_seqs and self._within_limits(
                request, shares, waiting_domains
            ):
                first_miss = self.dedup.first_miss(request, hit)
                if first_miss is not None and first_miss in in_flight and out.chunks:
                    out.num_deferred += 1
                    continue
                cap = budget if shares is None else shares.cap_tokens(domain, budget)
                num_new = self._admit(request, hit, cap, out) if cap > 0 else 0
            if num_new == 0:  # no room (seqs, blocks, caps or its token share): its later wait too
                blocked.add(domain)
                if len(blocked) == len(waiting_domains):
                    break  # every domain waits: look nothing else up
                continue
            if shares is not None:
                shares.spend_tokens(domain, num_new)
            budget -= num_new
            num_seqs += request.reserved_seqs
            in_flight.update(self.dedup.written_by(out.chunks[-1]))
        self.num_deferred += out.num_deferred

    def _within_limits(
        self, request: R, shares: Shares | None, waiting_domains: set[str]
    ) -> bool:
        """The domain's hard caps allow one more request, and (several domains having work)
        it is not at or over its share while another domain waits."""
        domain = request.domain
        if not self.limits_for(domain).admit(self._seqs[domain], request.reserved_seqs,
                                             self.cache.blocks_held(domain)):
            return False
        if shares is None or not waiting_domains - {domain}:
            return True
        return not shares.is_over(domain, at_share=True)

    def _waiting_in_fair_order(self, shares: Shares | None) -> Iterable[tuple[R, CacheHit]]:
        """Policy order, interleaved across domains (one domain: exactly the policy's)."""
        ordered = self.policy.order(self.waiting, self.cache.match, self.step_index)
        if shares is None or len({r.domain for r in self.waiting}) < 2:
            return ordered
        if self.policy.steady:  # its order is the queue's: fair order, the cache peeked lazily
            fair = fair_order(list(self.waiting), self._seqs)
            return ((r, self.cache.match(r.seq)) for r in fair)
        ordered = list(ordered)
        hits = {id(r): hit for r, hit in ordered}
        return [(r, hits[id(r)]) for r in fair_order([r for r, _ in ordered], self._seqs)]

    def _admit(self, request: R, hit: CacheHit, budget: int, out: SchedulerOutput) -> int:
        """Allocate with ``hit`` (looked up again only if blocks were evicted since); returns the
        tokens scheduled (0: nothing fits, nothing changed)."""
        if not self.cache.is_current(hit):
            hit = self.cache.match(request.seq)
        num_new = min(request.num_tokens - hit.num_tokens, budget)
        table = self.cache.allocate(request.seq, num_new, hit)
        if table is None:
            return 0
        self.waiting.remove(request)
        out.num_admitted += 1
        request.status = RequestStatus.RUNNING
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = hit.num_tokens
        self.running.append(request)
        self._seqs[request.domain] += request.reserved_seqs
        out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new, table))
        return num_new

    # ---- after the runner ---------------------------------------------------------------------

    def update_from_step(self, out: SchedulerOutput) -> list[tuple[R, int]]:
        """Mark the chunks computed and commit them. Returns ``(request, row)`` for every
        sequence to sample, ``row`` indexing the step's logits (forked children share a row)."""
        targets: list[tuple[R, int]] = []
        for row, chunk in enumerate(out.chunks):
            request = cast(R, chunk.request)
            self.cache.commit(request.seq, chunk.num_computed_tokens + chunk.num_new_tokens)
            if not chunk.samples:
                continue
            targets.append((request, row))
            if request.n > 1 and not request.forked:
                targets.extend((child, row) for child in self._fork(request))
        return targets

    def repeatable_steps(self, out: SchedulerOutput) -> int:
        """How many more steps would schedule exactly ``out``'s decode-only batch again (after
        each running request got its sampled token): nothing can be admitted, nobody changes
        blocks. 0 when the next step may differ. A steady policy (FCFS) with one domain only:
        LPM's aging and fairness reorder the queue from step to step."""
        if (
            not self.policy.steady
            or out.preempted
            or out.num_admitted
            or out.num_deferred
            or (self.waiting and not out.admission_blocked)
            or len(out.chunks) != len(self.running)
            or len(self._domains) > 1
        ):
            return 0
        bs = self.cache.block_size
        room = None
        for chunk, request in zip(out.chunks, self.running, strict=True):
            if chunk.request is not request or chunk.num_new_tokens != 1 or chunk.is_prefill:
                return 0
            if request.num_uncomputed_tokens != 1:
                return 0
            left = len(self.cache.block_table(request.seq)) * bs - request.num_computed_tokens
            room = left if room is None else min(room, left)
        return room or 0

    def repeat_steps(self, num_steps: int, extend: Callable[[R, int], None]) -> None:
        """Run ``num_steps`` (<= `repeatable_steps`) steps of the last batch at once: each
        running request computes its pending token and the ``num_steps - 1`` tokens that
        ``extend(request, num_steps - 1)`` appends. Afterwards the caller samples one token per
        request, as after `update_from_step`."""
        for request in self.running:
            extend(request, num_steps - 1)
            if self.cache.allocate(request.seq, num_steps) is None:
                raise RuntimeError("repeat_steps beyond repeatable_steps: a block was needed")
            self.cache.commit(request.seq, request.num_computed_tokens + num_steps)
        self.step_index += num_steps

    def _fork(self, parent: R) -> list[R]:
        parent.forked = True
        children = [
            cast(R, parent.spawn(index, self.cache.fork(parent.seq, f"{parent.seq_id}#{index}")))
            for index in range(1, parent.n)
        ]
        parent.children = list(children)
        self._domains[parent.domain] += len(children)
        position = self.running.index(parent) + 1
        self.running[position:position] = children
        return children


def _adapter_fits(request: SchedRequest, running: list[R], config: SchedulerConfig) -> bool:
    """Whether ``request`` may join a step whose running requests are ``running`` under
    ``config.max_loras``: it runs under no adapter, or one of theirs, or they leave room."""
    adapter, limit = request.seq.adapter, config.max_loras
    if adapter is None or limit is None:
        return True
    running_adapters = {r.seq.adapter for r in running} - {None}
    return adapter in running_adapters or len(running_adapters) < limit
