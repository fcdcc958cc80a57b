"""One simulated replica with a scheduler: token budget, concurrency limit, chunked prefill,
decode, preemption, all on simulated time from the cost model.

Each step mirrors the engine's: running requests first (one decode token, or the next prefill
chunk), then waiting ones (``match`` + ``allocate``) while the token budget and ``max_num_seqs``
allow. Blocks held by running requests are really held in the cache, so they cannot be evicted
and can make a waiting request wait. When a running request cannot grow, the most recently
admitted one is preempted (freed; it restarts from its prompt and hits its own cached blocks).
Steps with nothing to admit and only decodes are fast-forwarded in one go, up to the next block
boundary, the next finish or the next arrival, which is exactly the same as stepping one by one.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from prefixcache.cache import PrefixCache, Sequence
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.report import Tally
from prefixcache.sim.tokens import TokenSource
from prefixcache.sim.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """``store_decode=False`` keeps generated tokens out of the cache (prompt-only replay)."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 128
    store_decode: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


class _Live:
    """A request inside a replica: its sequence and progress."""

    __slots__ = ("request", "seq", "num_computed", "num_generated", "num_hit", "admitted")

    def __init__(self, request: TraceRequest, seq: Sequence) -> None:
        self.request = request
        self.seq = seq
        self.num_computed = 0  # tokens whose KV is written
        self.num_generated = 0
        self.num_hit = -1  # hit tokens at first admission; -1 before
        self.admitted = False

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.request.input_length


class TimedReplica:
    """A replica's cache, queues and clock."""

    def __init__(
        self, cache: PrefixCache, cost: CostModel, config: SchedulerConfig, source: TokenSource
    ) -> None:
        self.cache = cache
        self.cost = cost
        self.config = config
        self.source = source
        self.tally = Tally()
        self.clock = 0.0
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self._blocked = False  # admission stopped on budget or blocks in the last schedule

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: TraceRequest, seq: Sequence) -> None:
        """Queue a request that arrives now (the clock is at or past its arrival)."""
        bs = self.cache.block_size
        num_output = request.output_length if self.config.store_decode else 0
        kv_tokens = request.input_length + num_output
        if math.ceil(kv_tokens / bs) > self.cache.num_blocks:
            self.tally.num_rejected += 1  # can never fit: served uncached, elsewhere
            self.tally.add(request.input_length, 0, self.cost.prefill_seconds(request.input_length))
            return
        self.waiting.append(_Live(request, seq))

    def run_until(self, t: float) -> None:
        """Run steps while there is work and the clock is before ``t`` (a step may end past it)."""
        while self.clock < t and (self.waiting or self.running):
            self._step(t)
        if self.clock < t and t != math.inf:
            self.clock = t

    def _step(self, horizon: float) -> None:
        plan = self._schedule()
        if not plan:
            raise RuntimeError("scheduler made no progress (a request larger than the cache?)")
        num_prefill = sum(n for live, n in plan if live.in_prefill)
        num_decode = sum(1 for live, _ in plan if not live.in_prefill)
        step_s = self.cost.step_seconds(num_prefill, num_decode)
        settled = not num_prefill and (self._blocked or not self._can_admit())
        repeat = self._repeats(plan, step_s, horizon) if settled else 1
        self.clock += step_s * repeat
        for live, n in plan:
            self._complete(live, n if live.in_prefill else repeat)
        usage = self.cache.usage
        if usage > self.tally.peak_usage:
            self.tally.peak_usage = usage

    def _can_admit(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    def _schedule(self) -> list[tuple[_Live, int]]:
        budget = self.config.max_num_batched_tokens
        plan: list[tuple[_Live, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            live = self.running[i]
            n = min(live.request.input_length - live.num_computed, budget) if live.in_prefill else 1
            if not self._grow(live, n):
                continue  # ``live`` itself was preempted
            plan.append((live, n))
            budget -= n
            i += 1
        self._blocked = budget == 0
        while budget > 0 and self._can_admit():
            n = self._admit(self.waiting[0], budget)
            if n == 0:
                self._blocked = True  # out of blocks: stays so until a request finishes
                break
            plan.append((self.running[-1], n))
            budget -= n
        return plan

    def _grow(self, live: _Live, n: int) -> bool:
        """Allocate ``n`` more tokens for a running request, preempting the newest if needed."""
        if not live.in_prefill and not self.config.store_decode:
            return True
        while self.cache.allocate(live.seq, n) is None:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is live:
                return False
        return True

    def _admit(self, live: _Live, budget: int) -> int:
        hit = self.cache.match(live.seq)
        n = min(live.request.input_length - hit.num_tokens, budget)
        if self.cache.allocate(live.seq, n, hit) is None:
            return 0
        self.waiting.popleft()
        self.running.append(live)
        live.num_computed = hit.num_tokens
        if live.num_hit < 0:
            live.num_hit = hit.num_tokens
        return n

    def _preempt(self, live: _Live) -> None:
        self.running.remove(live)
        self.cache.free(live.seq)
        self.tally.num_preemptions += 1
        request = live.request
        prompt = live.seq.token_ids[: request.input_length]
        fresh = _Live(request, Sequence(request.request_id, prompt, copy=False))
        fresh.num_hit = live.num_hit
        fresh.admitted = live.admitted
        self.waiting.appendleft(fresh)

    def _repeats(self, plan: list[tuple[_Live, int]], step_s: float, horizon: float) -> int:
        """How many identical decode steps can run before anything changes."""
        bs = self.cache.block_size
        k = math.inf if horizon == math.inf else max(1, math.ceil((horizon - self.clock) / step_s))
        for live, _ in plan:
            k = min(k, live.request.output_length - live.num_generated)
            if self.config.store_decode:
                k = min(k, bs - live.num_computed % bs)
        k = max(1, int(k))
        if k > 1 and self.config.store_decode:
            for live, _ in plan:
                if self.cache.allocate(live.seq, k) is None:  # same block: cannot fail
                    raise RuntimeError("decode fast-forward could not extend within a block")
        return k

    def _complete(self, live: _Live, n: int) -> None:
        """The step computed ``n`` tokens of ``live`` (a prefill chunk, or ``n`` decode steps)."""
        if live.in_prefill:
            live.num_computed += n
            self.cache.commit(live.seq, live.num_computed)
            if live.in_prefill:
                return
            self._first_token(live)
            n = 1
        else:
            self._decoded(live, n)
        if live.num_generated >= live.request.output_length:
            self._finish(live)

    def _first_token(self, live: _Live) -> None:
        live.num_generated = 1
        if not live.admitted:
            live.admitted = True
            ttft = self.clock - live.request.arrival_s
            self.tally.add(live.request.input_length, live.num_hit, ttft)
        if self.config.store_decode and live.request.output_length > 1:
            live.seq.token_ids.extend(self.source.unique(1))

    def _decoded(self, live: _Live, n: int) -> None:
        live.num_generated += n
        if self.config.store_decode:
            # n steps wrote KV for n tokens and sampled n more (the last one has no KV yet)
            if live.num_generated < live.request.output_length:
                live.seq.token_ids.extend(self.source.unique(n))
            else:
                live.seq.token_ids.extend(self.source.unique(n - 1))
            live.num_computed += n
            self.cache.commit(live.seq, live.num_computed)

    def _finish(self, live: _Live) -> None:
        self.running.remove(live)
        self.cache.free(live.seq)
