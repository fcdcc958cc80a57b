"""One simulated configuration (`RunSpec`) and how to build its caches from the registry.

Capacity is the total over replicas, in blocks; ``None`` means unlimited (sized so that nothing
is ever evicted). Knows the cache registry, not the replay.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any

from prefixcache.cache import PREFIX_CACHES, PrefixCache, make_prefix_cache
from prefixcache.sim.trace import Trace

POLICIES = ("lru", "lfu")


@dataclass(frozen=True, slots=True)
class RunSpec:
    """A point of the sweep: implementation, policy, total capacity, replicas and router."""

    prefix_cache: str = "hash"
    policy: str = "lru"
    capacity_blocks: int | None = None
    replicas: int = 1
    router: str = "round-robin"

    def __post_init__(self) -> None:
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"unknown prefix cache {self.prefix_cache!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {POLICIES}")
        if self.policy != "lru" and self.prefix_cache != "radix":
            raise ValueError(f"policy {self.policy!r} exists only on the radix cache")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.capacity_blocks is not None and self.capacity_blocks < self.replicas:
            raise ValueError(f"capacity {self.capacity_blocks} blocks < {self.replicas} replicas")

    @property
    def capacity_label(self) -> str:
        return "inf" if self.capacity_blocks is None else format_blocks(self.capacity_blocks)


def format_blocks(n: int) -> str:
    """1000 -> '1k', 50000 -> '50k', 1500 -> '1500'."""
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


def unlimited_blocks(trace: Trace, with_output: bool, n: int = 1) -> int:
    """Blocks enough that one replica never evicts: every distinct block plus all live ones
    (with output: each of ``n`` choices' output blocks and a copy of the last prompt block)."""
    bs = trace.block_size
    if with_output:
        per_choice = [math.ceil(r.output_length / bs) + 1 for r in trace.requests]
        prompts = [math.ceil((r.input_length + r.output_length) / bs) for r in trace.requests]
        return sum(prompts) + (n - 1) * sum(per_choice) + 1
    distinct = {h for r in trace.requests for h in r.hash_ids[: r.num_full_blocks(bs)]}
    largest = max((math.ceil(r.input_length / bs) for r in trace.requests), default=0)
    return len(distinct) + largest + 1


def build_cache(
    spec: RunSpec, num_blocks: int, block_size: int, with_events: bool, hash_algo: str = "sha256"
) -> PrefixCache:
    """A cache for one replica, passing only the keyword arguments the implementation takes."""
    wanted: dict[str, Any] = {
        "enable_kv_events": with_events,
        "events_with_tokens": False,
        "eviction_policy": spec.policy,
    }
    accepted = _accepted_kwargs(spec.prefix_cache)
    kwargs = {k: v for k, v in wanted.items() if k in accepted}
    if spec.policy != "lru" and "eviction_policy" not in kwargs:
        raise ValueError(f"{spec.prefix_cache} cache has no eviction_policy option")
    return make_prefix_cache(
        spec.prefix_cache,
        num_blocks=num_blocks,
        block_size=block_size,
        hash_algo=hash_algo,
        **kwargs,
    )


def _accepted_kwargs(kind: str) -> set[str]:
    module_name, class_name = PREFIX_CACHES[kind].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return set(inspect.signature(cls.__init__).parameters)
