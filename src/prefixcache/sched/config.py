"""`SchedulerConfig`: the continuous-batching scheduler's settings, validated once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prefixcache.cache.config import one_of
from prefixcache.sched.fairness import DomainLimits
from prefixcache.sched.policy import SCHEDULE_POLICIES

__all__ = ["SCHEDULE_POLICIES", "SchedulerConfig"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """One step spends at most ``max_num_batched_tokens`` over at most ``max_num_seqs``
    sequences. ``schedule_policy``: ``fcfs`` or ``lpm`` (longest cached prefix first, aged:
    promoted after ``lpm_max_wait_steps`` steps). ``dedup``: hold back a request whose first
    uncached block another request computes in this step. Per-domain hard caps:
    ``domain_limits`` by domain, ``default_domain_limits`` for the others. ``max_loras``: LoRA
    adapters (`Sequence.adapter`) in one step at most (None: no limit)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    schedule_policy: str = "fcfs"
    lpm_max_wait_steps: int = 16
    dedup: bool = True
    domain_limits: Mapping[str, DomainLimits] = field(default_factory=dict)
    default_domain_limits: DomainLimits = field(default_factory=DomainLimits)
    max_loras: int | None = None

    def __post_init__(self) -> None:
        one_of("scheduling policy", self.schedule_policy, SCHEDULE_POLICIES)
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.lpm_max_wait_steps < 0:
            raise ValueError(
                "max_num_seqs and max_num_batched_tokens must be >= 1 and lpm_max_wait_steps "
                f">= 0, got {self.max_num_seqs}, {self.max_num_batched_tokens}, "
                f"{self.lpm_max_wait_steps}"
            )

    @classmethod
    def from_kwargs(cls, **settings: Any) -> SchedulerConfig:
        """From keyword settings; None means "the default"."""
        return cls(**{k: v for k, v in settings.items() if v is not None})
