"""One simulated configuration (`RunSpec`) and how to build its caches from the registry.

Capacity is the total over replicas, in blocks; ``None`` means unlimited (sized so that nothing
is ever evicted). A KV layout (``--kv-cache-dtype``) sizes it from a memory budget and scales
the bytes a tier stores and reads per block (`KV_BYTES_SCALE`). Knows the cache registry, not
the replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixcache.cache import PREFIX_CACHES, CacheConfig, PrefixCache, make_prefix_cache
from prefixcache.cache.config import EVICTION_POLICIES
from prefixcache.sched.fairness import QuietDomains
from prefixcache.sim.trace import Trace
from prefixcache.tiers import TIERS

# KV bytes of each layout against bfloat16's (the cost model's ``kv_bytes_per_token``): the
# engine's `prefixcache.attention.kv_format` rows (int8 and fp8: 34 bytes per 32 values, int4
# 18), as a torch-free table
KV_BYTES_SCALE = {
    "float32": 2.0, "bfloat16": 1.0, "int8": 34 / 64, "int4": 18 / 64, "fp8": 34 / 64,
    "fp8_e4m3": 34 / 64, "fp8_e5m2": 34 / 64,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class RunSpec:
    """A point of the sweep: implementation, eviction policy, total capacity, replicas, router."""

    prefix_cache: str = "hash"
    eviction_policy: str = "lru"
    capacity_blocks: int | None = None
    replicas: int = 1
    router: str = "round-robin"
    # (tier name, GiB), nearest first (sequential mode): a tier of `prefixcache.tiers.TIERS`,
    # one per replica, or one shared by the replicas if every engine reads it (Valkey)
    tier_gib: tuple[tuple[str, float], ...] = ()
    pins: bool = True  # honour the trace's cache breakpoints (sequential mode)
    max_pinned_blocks: int | None = None  # per tenant and replica; None: a quarter of a replica
    kv_cache_dtype: str = ""  # the KV layout (`KV_BYTES_SCALE`); "": the cost model's bytes

    def __post_init__(self) -> None:
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"unknown prefix cache {self.prefix_cache!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction policy {self.eviction_policy!r}; "
                f"choose one of {EVICTION_POLICIES}"
            )
        if self.eviction_policy != "lru" and self.prefix_cache != "radix":
            raise ValueError(
                f"eviction policy {self.eviction_policy!r} exists only on the radix cache"
            )
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        for name, gib in self.tier_gib:
            if name not in TIERS:
                raise ValueError(f"unknown tier {name!r}; choose among {sorted(TIERS)}")
            if not gib > 0:
                raise ValueError(f"--kv-{name}-gib must be > 0, got {gib}")
        if self.max_pinned_blocks is not None and self.max_pinned_blocks < 0:
            raise ValueError(f"--max-pinned-blocks must be >= 0, got {self.max_pinned_blocks}")
        if self.kv_cache_dtype and self.kv_cache_dtype not in KV_BYTES_SCALE:
            raise ValueError(f"unknown KV cache dtype {self.kv_cache_dtype!r}; choose among "
                             f"{sorted(KV_BYTES_SCALE)}")
        if self.capacity_blocks is not None and self.capacity_blocks < self.replicas:
            raise ValueError(f"capacity {self.capacity_blocks} blocks < {self.replicas} replicas")

    @property
    def capacity_label(self) -> str:
        label = "inf" if self.capacity_blocks is None else format_blocks(self.capacity_blocks)
        tiers = "".join(f"+{name[0]}" for name, _ in self.tier_gib)
        layout = f"@{self.kv_cache_dtype}" if self.kv_cache_dtype else ""
        return label + tiers + layout + ("" if self.pins else "-nopin")

    @property
    def kv_bytes_scale(self) -> float:
        """This layout's KV bytes against the cost model's (bfloat16's)."""
        return KV_BYTES_SCALE[self.kv_cache_dtype] if self.kv_cache_dtype else 1.0

    @property
    def has_tiers(self) -> bool:
        return bool(self.tier_gib)


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
    """A cache for one replica (events only for a router that reads them, never token ids),
    keeping quiet tenants' cache from a flood as the engine's scheduler does."""
    cache = make_prefix_cache(
        CacheConfig(
            spec.prefix_cache,
            num_blocks,
            block_size,
            hash_algo,
            enable_kv_events=with_events,
            events_with_tokens=False,
            eviction_policy=spec.eviction_policy,
        )
    )
    cache.protection = QuietDomains(cache)
    return cache
