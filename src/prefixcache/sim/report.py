"""What a replay measured: `ReplayResult`, the ideal (unlimited-cache) hit ratio, percentiles.

`Tally` is the running counter a replay bumps per request; `ReplayResult` is the finished row the
table, JSON, CSV and plots read. Knows nothing about caches beyond their stats numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from prefixcache.sim.trace import Trace


def ideal_hit_ratio(trace: Trace) -> float:
    """Token-weighted hit ratio of an unlimited cache, computed from the hash ids alone.

    A request reuses its longest run of leading complete blocks seen before, capped (as the
    cache does) so that at least one prompt token is computed; its complete blocks then stay.
    """
    bs, seen = trace.block_size, set()
    num_hit = num_total = 0
    for request in trace.requests:
        cap = (request.input_length - 1) // bs
        n = 0
        for h in request.hash_ids[:cap]:
            if h not in seen:
                break
            n += 1
        num_hit += n * bs
        num_total += request.input_length
        seen.update(request.hash_ids[: request.num_full_blocks(bs)])
    return num_hit / num_total if num_total else 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of unsorted values; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


@dataclass(slots=True)
class Tally:
    """Per-run counters, bumped once per finished request."""

    num_requests: int = 0
    num_rejected: int = 0  # larger than a replica's whole cache: counted as all-miss
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_preemptions: int = 0
    peak_usage: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    tier_tokens: dict[str, int] = field(default_factory=dict)  # hit tokens a lower tier served
    tenant_tokens: dict[str, list[int]] = field(default_factory=dict)  # tenant -> [queried, hit]
    num_pins: int = 0  # pins made (a breakpoint whose prefix was already pinned refreshes it)

    def add(self, num_tokens: int, num_hit: int, ttft_s: float, tenant: str | None = None) -> None:
        """One request; ``tenant``: also count it under that tenant (None: not split)."""
        self.num_requests += 1
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit
        self.ttft_s.append(ttft_s)
        if tenant is not None:
            counts = self.tenant_tokens.setdefault(tenant, [0, 0])
            counts[0] += num_tokens
            counts[1] += num_hit

    @property
    def hit_ratio(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


@dataclass(slots=True)
class ReplayResult:
    """One configuration's outcome: the row of the table, JSON and CSV."""

    trace: str
    mode: str
    prefix_cache: str
    eviction_policy: str
    capacity_blocks: int  # total over replicas
    capacity_label: str
    replicas: int
    router: str
    block_size: int
    num_requests: int
    num_rejected: int
    hit_ratio: float
    ideal_hit_ratio: float
    prefill_tokens_saved: int
    prefill_seconds_saved: float
    ttft_p50_s: float
    ttft_p99_s: float
    num_evictions: int
    peak_usage: float
    num_preemptions: int
    replica_requests: list[int]
    replica_hit_ratios: list[float]
    wall_s: float
    # the share of queried tokens each source served: ram (the pool's own hits), disk, valkey
    tier_hit_ratios: dict[str, float] = field(default_factory=dict)
    # a trace with tenants or pins: each tenant's hit ratio ("" the untenanted requests)
    tenant_hit_ratios: dict[str, float] = field(default_factory=dict)
    num_pins: int = 0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def load_imbalance(self) -> float:
        """Busiest replica's requests over the mean (1.0 = perfectly even)."""
        mean = sum(self.replica_requests) / len(self.replica_requests)
        return max(self.replica_requests) / mean if mean else 1.0
