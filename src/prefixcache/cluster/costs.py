"""A replica's routing costs (`prefixcache.sim.replica_costs.ReplicaCosts`) from what its engine
measures, for the cache-aware router: the prefill time per block (`EngineSnapshot`'s
``prefill_s_per_token``, the recent steps' time per prompt token computed, times the block size),
each lower tier's read time per block it served (its ``read_seconds`` over its ``hits``, from
`LLMEngine.tier_stats`), and the backlog (the prompt tokens queued there, at that speed). The
replica reports them in its routing stats under ``kv_costs``; the router reads them with each
choice (`prefixcache.cluster.routing`). Imports no Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prefixcache.sim.replica_costs import ReplicaCosts

if TYPE_CHECKING:
    from prefixcache.engine.outputs import EngineSnapshot

__all__ = ["replica_costs"]


def replica_costs(
    snapshot: EngineSnapshot, tier_stats: Mapping[str, Any] | None, block_size: int
) -> ReplicaCosts:
    """The costs an engine with ``snapshot`` and ``tier_stats`` (None: no tier) reports."""
    per_token = snapshot.prefill_s_per_token
    loads: dict[str, float] = {}
    tiers = (tier_stats or {}).get("tiers") or {}
    for name, stats in tiers.items():
        hits, seconds = stats.get("hits") or 0, stats.get("read_seconds") or 0.0
        if hits > 0:
            loads[str(name).upper()] = seconds / hits
    return ReplicaCosts(
        prefill_s_per_block=per_token * block_size if per_token > 0 else None,
        load_s_per_block=loads,
        backlog_s=snapshot.queued_prefill_tokens * per_token,
    )
