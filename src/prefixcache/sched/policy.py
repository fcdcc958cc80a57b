"""Scheduling policies: the order in which waiting requests are considered for admission.

A policy is a class here and one line in `SCHEDULE_POLICIES`; the scheduler asks it for the
waiting queue in order, each request with its (uncounted) cache hit.

- ``fcfs``: arrival order; the cache is peeked lazily, only for the requests a step reaches.
- ``lpm``: longest cached prefix first, aged: a request's score is ``hit_blocks +
  steps_waited``; once it has waited ``lpm_max_wait_steps`` steps (or was preempted) it is
  promoted, and promoted requests go before all others in arrival order. Starvation bound: a
  request is overtaken by later arrivals during at most ``lpm_max_wait_steps`` steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar, Protocol, TypeVar

from prefixcache.cache import CacheHit, Sequence
from prefixcache.sched.request import SchedRequest

__all__ = ["SCHEDULE_POLICIES", "FcfsPolicy", "LpmPolicy", "SchedulePolicy", "make_policy"]

R = TypeVar("R", bound=SchedRequest)
Match = Callable[[Sequence], CacheHit]


class SchedulePolicy(Protocol):
    """``steady``: the order of a queue that nobody joins does not change from step to step
    (the scheduler may then repeat a decode-only step without asking again)."""

    steady: ClassVar[bool]

    def order(self, waiting: Iterable[R], match: Match, step: int) -> Iterable[tuple[R, CacheHit]]:
        """``waiting`` in admission order, each with ``match(request.seq)``."""
        ...


class FcfsPolicy:
    steady: ClassVar[bool] = True

    def __init__(self, max_wait_steps: int = 0) -> None:
        del max_wait_steps  # FCFS never ages anyone

    def order(self, waiting: Iterable[R], match: Match, step: int) -> Iterable[tuple[R, CacheHit]]:
        return ((r, match(r.seq)) for r in list(waiting))


class LpmPolicy:
    steady: ClassVar[bool] = False  # aging reorders the queue every step

    def __init__(self, max_wait_steps: int) -> None:
        self.max_wait_steps = max_wait_steps

    def order(self, waiting: Iterable[R], match: Match, step: int) -> Iterable[tuple[R, CacheHit]]:
        scored = [(r, match(r.seq)) for r in waiting]
        scored.sort(key=lambda item: self._key(item[0], item[1], step))
        return scored

    def _key(self, request: SchedRequest, hit: CacheHit, step: int) -> tuple[int, int, int]:
        waited = step - request.arrival_step
        if request.num_preemptions or waited >= self.max_wait_steps:
            return (0, 0, request.arrival_index)
        return (1, -(hit.num_blocks + waited), request.arrival_index)


SCHEDULE_POLICIES: dict[str, Callable[[int], SchedulePolicy]] = {
    "fcfs": FcfsPolicy,
    "lpm": LpmPolicy,
}


def make_policy(name: str, max_wait_steps: int) -> SchedulePolicy:
    return SCHEDULE_POLICIES[name](max_wait_steps)
