"""The scheduler lives in `prefixcache.sched` (torch-free, shared with the simulator); these
names stay importable from here."""

from __future__ import annotations

from prefixcache.sched.request import ScheduledChunk, SchedulerOutput
from prefixcache.sched.scheduler import SCHEDULE_POLICIES, Scheduler

POLICIES = SCHEDULE_POLICIES  # deprecated name: SCHEDULE_POLICIES

__all__ = ["POLICIES", "SCHEDULE_POLICIES", "ScheduledChunk", "Scheduler", "SchedulerOutput"]
