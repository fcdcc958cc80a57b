"""Continuous batching, torch-free: the scheduler that the engine drives with a model and the
simulator drives on a cost model's clock.

    from prefixcache.sched import Scheduler, SchedRequest
"""

from __future__ import annotations

from prefixcache.sched.config import SchedulerConfig
from prefixcache.sched.fairness import DomainLimits, blocks_needed, fair_order
from prefixcache.sched.request import (
    FINISH_REASONS,
    RequestStatus,
    SchedRequest,
    ScheduledChunk,
    SchedulerOutput,
)
from prefixcache.sched.scheduler import SCHEDULE_POLICIES, Scheduler

__all__ = [
    "FINISH_REASONS", "SCHEDULE_POLICIES", "DomainLimits", "RequestStatus", "SchedRequest",
    "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "blocks_needed",
    "fair_order",
]  # fmt: skip
