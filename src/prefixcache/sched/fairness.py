"""Fair sharing of a step's sequences and KV blocks across domains (tenants, trusted groups).

A domain is the tenant or trusted group a request belongs to ("" for single-tenant use). While
several domains have work, each is entitled to an equal share of ``max_num_seqs`` and of the KV
pool; one holding more than its share is *over share*: it is admitted nothing while another
domain waits, and its newest sequences are the ones preempted, both when a running sequence needs
a block and when an under-share domain's request cannot otherwise start. Alone, a domain may use
everything, so single-tenant scheduling is unchanged. ``DomainLimits`` adds hard caps per domain
(flags, tenants file); a request that could never fit its domain's caps is refused when added.

The cache obeys the same shares for what it caches: while several domains use the pool, a
domain that would hold more than its equal share (held + free cached blocks) may evict only from
domains at or over theirs (`QuietDomains`, handed to the cache as its ``protection``), so its
churn cannot take a quiet tenant's cache; it gets no block and the scheduler preempts its newest
sequence instead.

This module is plain arithmetic over requests and counts; the scheduler applies it.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from prefixcache.cache import PrefixCache
from prefixcache.sched.request import SchedRequest

R = TypeVar("R", bound=SchedRequest)

__all__ = [
    "DomainLimits", "QuietDomains", "Shares", "blocks_needed", "equal_share", "fair_order",
]  # fmt: skip

_NONE: frozenset[str] = frozenset()


def equal_share(total: float, domains: int) -> float:
    """A domain's share of ``total`` while ``domains`` domains contend for it."""
    return total / max(1, domains)


@dataclass(frozen=True, slots=True)
class DomainLimits:
    """Hard caps for one domain: running sequences and KV blocks held (None: no cap)."""

    max_seqs: int | None = None
    max_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")

    def admit(self, seqs_held: int, more_seqs: int, blocks_held: int) -> bool:
        """A domain holding ``seqs_held`` sequences and ``blocks_held`` blocks may start a
        request of ``more_seqs`` sequences."""
        if self.max_seqs is not None and seqs_held + more_seqs > self.max_seqs:
            return False
        return self.max_blocks is None or blocks_held < self.max_blocks


def fair_order(candidates: list[R], seqs_held: Mapping[str, int]) -> list[R]:
    """``candidates`` (already in policy order) interleaved across domains: round-robin, the
    domain holding the fewest sequences first (ties: the earliest candidate's). One domain's
    own order is kept, so a single domain's order is exactly the input."""
    queues: dict[str, list[R]] = {}
    for request in candidates:
        queues.setdefault(request.domain, []).append(request)
    if len(queues) < 2:
        return list(candidates)
    domains = sorted(queues, key=lambda d: seqs_held.get(d, 0))  # stable: first seen wins ties
    out: list[R] = []
    for depth in range(max(len(q) for q in queues.values())):
        out.extend(queues[d][depth] for d in domains if depth < len(queues[d]))
    return out


def blocks_needed(num_prompt: int, max_tokens: int, n: int, block_size: int) -> int:
    """Most KV blocks a request can hold: its prompt's blocks (shared by its ``n`` choices) plus,
    per choice, its output's blocks and a copy-on-write copy of the last prompt block."""
    prompt_blocks = -(-num_prompt // block_size)
    return prompt_blocks + n * (-(-max_tokens // block_size) + 1)


@dataclass(slots=True)
class Shares:
    """A step's equal shares while several domains have work: of the sequences, of the KV pool,
    and of the step's prefill tokens (a decode token, one per sequence, always goes: a flood's
    long prefills cannot make every step slow). What a domain holds is read live: its
    sequences from ``seqs`` (the scheduler's), its blocks from the cache."""

    seqs: Counter[str]
    cache: PrefixCache
    fair_seqs: float
    fair_blocks: float
    tokens_left: dict[str, int]

    @classmethod
    def of(cls, domains: Mapping[str, int], seqs: Counter[str], cache: PrefixCache,
           max_num_seqs: int, max_num_batched_tokens: int) -> Shares:  # fmt: skip
        """The shares among ``domains`` (those with unfinished requests)."""
        k = len(domains)
        tokens = max(1, int(equal_share(max_num_batched_tokens, k)))
        return cls(seqs, cache, equal_share(max_num_seqs, k), equal_share(cache.num_blocks, k),
                   dict.fromkeys(domains, tokens))

    def cap_tokens(self, domain: str, num_new: int) -> int:
        """``num_new`` limited to the domain's prefill share left; one token always passes."""
        return num_new if num_new <= 1 else max(0, min(num_new, self.tokens_left.get(domain, 0)))

    def spend_tokens(self, domain: str, num_new: int) -> None:
        if num_new > 1:
            self.tokens_left[domain] = self.tokens_left.get(domain, 0) - num_new

    def is_over(self, domain: str, at_share: bool = False) -> bool:
        """Holding more than its share (``at_share``: or exactly its share) of either."""
        seqs, blocks = self.seqs[domain], self.cache.blocks_held(domain)
        if at_share:
            return seqs >= self.fair_seqs or blocks >= self.fair_blocks
        return seqs > self.fair_seqs or blocks > self.fair_blocks

    def most_over_share(self, domains: set[str]) -> str | None:
        """Of ``domains``, the one furthest over its share (by its larger ratio), if any."""
        return max((d for d in domains if self.is_over(d)), key=self._ratio, default=None)

    def _ratio(self, domain: str) -> float:
        blocks = self.cache.blocks_held(domain)
        return max(self.seqs[domain] / self.fair_seqs, blocks / self.fair_blocks)


class QuietDomains:
    """The cache's ``protection``: the domains whose free cached blocks an allocation of
    ``domain`` may not evict. A domain's usage is its blocks held plus its free cached ones;
    one that would go over its equal share of the pool evicts only from domains at or over
    theirs. With one domain (or under its share) nothing is protected. `lifted` suspends it."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.active = True

    def __call__(self, domain: str, num_more: int) -> frozenset[str]:
        if not self.active:
            return _NONE
        free_cached = self.cache.pool.free_cached_by_domain()
        usage = Counter(self.cache.tables.held_by_domain())
        usage.update(free_cached)
        share = equal_share(self.cache.num_blocks, len(usage.keys() | {domain}))
        if usage[domain] + num_more <= share:
            return _NONE
        return frozenset(d for d in free_cached if d != domain and usage[d] <= share)

    @contextlib.contextmanager
    def lifted(self) -> Iterator[None]:
        """Allocations inside evict any free cached block, the quiet domains' too: for a caller
        that knows nobody contends (nothing running, a request that cannot start otherwise)."""
        before, self.active = self.active, False
        try:
            yield
        finally:
            self.active = before
