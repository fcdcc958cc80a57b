"""Expand the command line's lists into `RunSpec`s and run them all.

The capacity sweep is every (implementation, policy, capacity) at one replica; the cluster sweep
is every (replicas, router) at one total capacity. Sequential mode replays all of them in one
lockstep pass; timed mode runs them one after another. ``lfu`` exists only on the radix cache:
``lfu x hash`` is skipped with a note.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.sim.config import RunSpec
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.report import ReplayResult
from prefixcache.sim.sequential import Progress, replay_sequential
from prefixcache.sim.timed import ReplicaConfig, replay_timed
from prefixcache.sim.trace import Trace


@dataclass(slots=True)
class SweepPlan:
    """What to run, and the notes about what was left out."""

    specs: list[RunSpec] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def plan_sweep(
    capacities: list[int | None],
    prefix_caches: list[str],
    policies: list[str],
    replicas: list[int],
    routers: list[str],
    cluster_capacity: int | None,
) -> SweepPlan:
    """The capacity sweep at one replica, then the cluster sweep (first implementation, lru)."""
    plan = SweepPlan()
    for kind in prefix_caches:
        for policy in policies:
            if policy != "lru" and kind != "radix":
                plan.notes.append(f"skipped {policy} x {kind}: {policy} exists only on radix")
                continue
            plan.specs += [RunSpec(kind, policy, c) for c in capacities]
    cluster_sizes = [n for n in replicas if n > 1]
    if cluster_sizes:
        single = RunSpec(prefix_caches[0], "lru", cluster_capacity)
        if single not in plan.specs:
            plan.specs.append(single)
        for n in cluster_sizes:
            plan.specs += [
                RunSpec(prefix_caches[0], "lru", cluster_capacity, n, r) for r in routers
            ]
    return plan


def run_sweep(
    trace: Trace,
    specs: list[RunSpec],
    mode: str,
    cost: CostModel,
    config: ReplicaConfig,
    progress: Progress | None = None,
) -> list[ReplayResult]:
    """Run every spec; sequential in one lockstep pass, timed one by one."""
    if mode == "sequential":
        return replay_sequential(trace, specs, cost, progress)
    if mode == "timed":
        return [replay_timed(trace, spec, cost, config, progress) for spec in specs]
    raise ValueError(f"unknown mode {mode!r}; choose sequential or timed")
