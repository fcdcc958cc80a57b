"""Fair sharing of a step's sequences and KV blocks across isolation domains (tenants, groups).

A domain is the tenant or trusted group a request belongs to ("" for single-tenant use). While
several domains have work, each is entitled to an equal share of ``max_num_seqs`` and of the KV
pool; one holding more than its share is *over share*: it is admitted nothing while another
domain waits, and its newest sequences are the ones preempted, both when a running sequence needs
a block and when an under-share domain's request cannot otherwise start. Alone, a domain may use
everything, so single-tenant scheduling is unchanged. ``DomainLimits`` adds hard caps per domain
(flags, tenants file); a request that could never fit its domain's caps is refused when added.

This module is plain arithmetic over requests; the scheduler applies it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from prefixcache.sched.request import SchedRequest

R = TypeVar("R", bound=SchedRequest)

__all__ = ["DomainLimits", "blocks_needed", "fair_order"]


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
