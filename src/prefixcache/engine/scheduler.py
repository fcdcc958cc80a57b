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

Policies: ``fcfs`` (arrival order) and ``lpm`` (longest cached prefix first, aged). Under ``lpm`` a
request's score is ``hit_blocks + steps_waited``; once it has waited ``lpm_max_wait_steps`` steps
it is promoted, and promoted requests go before all others in arrival order. Starvation bound: a
request is overtaken by later arrivals during at most ``lpm_max_wait_steps`` steps; after that it
waits only for earlier arrivals (as under FCFS) — and for blocks to free up.

After the runner: `update_from_step` marks the computed tokens, commits them (full blocks become
hittable), and forks ``n - 1`` children off a request whose prompt just finished.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from prefixcache.cache import CacheHit, PrefixCache
from prefixcache.engine.request import Request, RequestStatus
from prefixcache.engine.sampler import derive_seed, make_generator

__all__ = ["POLICIES", "ScheduledChunk", "Scheduler", "SchedulerOutput"]

POLICIES = ("fcfs", "lpm")


@dataclass(slots=True)
class ScheduledChunk:
    """``num_new_tokens`` tokens of ``request`` after its ``num_computed_tokens`` computed ones."""

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_table: list[int]
    # the chunk reaches the end of the sequence: its last logits give the next token
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        end = self.num_computed_tokens + self.num_new_tokens
        self.samples = end == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.request.seq.token_ids[start : start + self.num_new_tokens]


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: chunks in batch order, plus block copies/zeroing to do before it."""

    step: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_zero: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_deferred: int = 0  # waiting requests held back by in-batch dedup

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Decides each step's batch; owns the waiting queue and the running list."""

    def __init__(
        self,
        cache: PrefixCache,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        policy: str = "fcfs",
        lpm_max_wait_steps: int = 16,
        dedup: bool = True,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {POLICIES}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or lpm_max_wait_steps < 0:
            raise ValueError(
                "max_num_seqs and max_num_batched_tokens must be >= 1 and lpm_max_wait_steps "
                f">= 0, got {max_num_seqs}, {max_num_batched_tokens}, {lpm_max_wait_steps}"
            )
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.lpm_max_wait_steps = lpm_max_wait_steps
        self.dedup = dedup
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_index = 0
        self.num_preemptions = 0
        self.num_deferred = 0
        self.num_block_copies = 0

    # ---- queue management -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.arrival_step = self.step_index
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End ``request`` (stopped, length or aborted): its blocks go back to the cache."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.free(request.seq)
        request.status = status

    # ---- scheduling -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step=self.step_index)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.block_copies = self.cache.take_block_copies()
        out.blocks_to_zero = self.cache.take_blocks_to_zero()
        self.num_block_copies += len(out.block_copies)
        self.step_index += 1
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_uncomputed_tokens, budget)
            table = self._allocate_or_preempt(request, num_new, out)
            if table is None:
                break  # it preempted itself: nothing after it is left
            out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new, table))
            budget -= num_new
            i += 1
        return budget

    def _allocate_or_preempt(
        self, request: Request, num_new: int, out: SchedulerOutput
    ) -> list[int] | None:
        while True:
            table = self.cache.allocate(request.seq, num_new)
            if table is not None:
                return table
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.cache.free(request.seq)
        request.seq.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        in_flight = self._digests_in_flight(out.chunks)
        num_seqs = sum(_reserved_seqs(r) for r in self.running)
        for request, hit in self._waiting_in_order():
            if budget <= 0 or num_seqs + _reserved_seqs(request) > self.max_num_seqs:
                break
            first_miss = self._first_miss_digest(request, hit)
            if first_miss is not None and first_miss in in_flight and out.chunks:
                out.num_deferred += 1
                continue
            num_new = self._admit(request, budget, out)
            if num_new == 0:
                break  # blocks do not fit: later requests wait too (no overtaking)
            budget -= num_new
            num_seqs += _reserved_seqs(request)
            in_flight.update(self._chunk_digests(out.chunks[-1]))
        self.num_deferred += out.num_deferred

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Match + allocate; returns the tokens scheduled (0: nothing fits, nothing changed)."""
        snapshot = _stats_snapshot(self.cache)
        hit = self.cache.match(request.seq)  # counted only if it admits the request
        num_new = min(request.num_tokens - hit.num_tokens, budget)
        table = self.cache.allocate(request.seq, num_new, hit)
        if table is None:
            _stats_restore(self.cache, snapshot)
            return 0
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = hit.num_tokens
        self.running.append(request)
        out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new, table))
        return num_new

    def _waiting_in_order(self) -> Iterable[tuple[Request, CacheHit]]:
        """Waiting requests in policy order, each with its (uncounted) cache hit."""
        if self.policy == "fcfs":
            return ((r, self._peek(r)) for r in list(self.waiting))
        scored = [(r, self._peek(r)) for r in self.waiting]
        scored.sort(key=lambda item: self._lpm_key(*item))
        return scored

    def _lpm_key(self, request: Request, hit: CacheHit) -> tuple[int, int, int]:
        waited = self.step_index - request.arrival_step
        if request.num_preemptions or waited >= self.lpm_max_wait_steps:
            return (0, 0, request.arrival_index)
        return (1, -(hit.num_blocks + waited), request.arrival_index)

    def _peek(self, request: Request) -> CacheHit:
        """``match`` without counting a lookup in the cache's stats."""
        snapshot = _stats_snapshot(self.cache)
        hit = self.cache.match(request.seq)
        _stats_restore(self.cache, snapshot)
        return hit

    # ---- in-batch dedup ----------------------------------------------------------------------

    def _first_miss_digest(self, request: Request, hit: CacheHit) -> bytes | None:
        if not (self.dedup and self.cache.enable_caching and request.seq.use_cache):
            return None
        digests = request.seq.digests(self.cache.hasher, self.cache.model_id)
        return digests[hit.num_blocks] if hit.num_blocks < len(digests) else None

    def _digests_in_flight(self, chunks: list[ScheduledChunk]) -> set[bytes]:
        if not (self.dedup and self.cache.enable_caching):
            return set()
        digests: set[bytes] = set()
        for chunk in chunks:
            digests.update(self._chunk_digests(chunk))
        return digests

    def _chunk_digests(self, chunk: ScheduledChunk) -> list[bytes]:
        """Digests of the complete blocks this chunk writes into (empty for decodes)."""
        seq = chunk.request.seq
        if not (self.dedup and seq.use_cache) or chunk.num_new_tokens == 1:
            return []
        bs = self.cache.block_size
        digests = seq.digests(self.cache.hasher, self.cache.model_id)
        first = chunk.num_computed_tokens // bs
        last = (chunk.num_computed_tokens + chunk.num_new_tokens - 1) // bs
        return digests[first : last + 1]

    # ---- after the runner ---------------------------------------------------------------------

    def update_from_step(self, out: SchedulerOutput) -> list[tuple[Request, int]]:
        """Mark the chunks computed and commit them. Returns ``(request, row)`` for every
        sequence to sample, ``row`` indexing the step's logits (forked children share a row)."""
        targets: list[tuple[Request, int]] = []
        for row, chunk in enumerate(out.chunks):
            request = chunk.request
            request.seq.num_computed_tokens = chunk.num_computed_tokens + chunk.num_new_tokens
            self.cache.commit(request.seq, request.seq.num_computed_tokens)
            if not chunk.samples:
                continue
            targets.append((request, row))
            if request.params.n > 1 and not request.forked:
                targets.extend((child, row) for child in self._fork(request))
        return targets

    def _fork(self, parent: Request) -> list[Request]:
        parent.forked = True
        children = []
        for index in range(1, parent.params.n):
            seq = self.cache.fork(parent.seq, f"{parent.seq_id}#{index}")
            seed = derive_seed(parent.base_seed, index)
            child = Request(
                request_id=parent.request_id,
                seq=seq,
                params=parent.params,
                generator=None if parent.params.greedy else make_generator(seed),
                index=index,
                base_seed=parent.base_seed,
                parent=parent,
                forked=True,
                arrival_index=parent.arrival_index,
                arrival_step=parent.arrival_step,
                status=RequestStatus.RUNNING,
                num_cached_tokens=parent.num_cached_tokens,
            )
            child.timing.arrival_time = parent.timing.arrival_time
            child.timing.first_scheduled_time = parent.timing.first_scheduled_time
            children.append(child)
        parent.children = children
        position = self.running.index(parent) + 1
        self.running[position:position] = children
        return children


def _reserved_seqs(request: Request) -> int:
    """Sequences a request will occupy: a request with n > 1 reserves room for its children."""
    return 1 if request.forked else request.params.n


def _stats_snapshot(cache: PrefixCache) -> dict[str, object]:
    stats = cache.stats
    snap: dict[str, object] = {f.name: getattr(stats, f.name) for f in fields(stats)}
    snap["first_miss_blocks"] = dict(stats.first_miss_blocks)
    return snap


def _stats_restore(cache: PrefixCache, snapshot: dict[str, object]) -> None:
    """Undo the counters of lookups that admitted nothing (peeks, failed admissions)."""
    stats = cache.stats
    for name, value in snapshot.items():
        if name == "first_miss_blocks":
            stats.first_miss_blocks.clear()
            stats.first_miss_blocks.update(value)  # type: ignore[call-overload]
        else:
            setattr(stats, name, value)
