"""What a load from each KV tier costs a replica, as the replica measures it and its router reads.

A block a replica holds in a lower tier saves the prefill of that block and costs its load from
the tier, so a cache-aware router credits it with ``1 - load / prefill`` of a block held in the
KV pool, clamped to ``[0, 1]``: the pool's blocks count 1 (nothing to load), a tier that reads a
block no faster than the replica computes one counts 0. Both times are the replica's own: its
prefill time per block (what its steps take per prompt token computed, decode tokens riding
along included, so a busy replica computes slower) and each tier's read time per block served.
Until a replica has measured both, a tier's block counts `DEFAULT_TIER_WEIGHT`. ``backlog_s`` is
the prefill work queued ahead of a new request there. A serving replica exports these in its
routing stats (`prefixcache.cluster.costs`); a simulated one takes them from the cost model and
its simulated reads. Knows nothing about routing rules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_TIER_WEIGHT", "ReplicaCosts"]

# a lower tier's block before the replica has measured its loads: half a block of the pool's
DEFAULT_TIER_WEIGHT = 0.5


@dataclass(frozen=True, slots=True)
class ReplicaCosts:
    """One replica's measured costs: ``prefill_s_per_block`` (None until measured), per tier
    medium (``"DISK"``, ``"VALKEY"``) ``load_s_per_block``, and ``backlog_s``."""

    prefill_s_per_block: float | None = None
    load_s_per_block: Mapping[str, float] = field(default_factory=dict)
    backlog_s: float = 0.0

    def weight(self, medium: str | None) -> float:
        """A block held in ``medium`` (None: the KV pool), in blocks of prefill saved."""
        if medium is None:
            return 1.0
        load, prefill = self.load_s_per_block.get(medium), self.prefill_s_per_block
        if load is None or not prefill:
            return DEFAULT_TIER_WEIGHT
        return min(1.0, max(0.0, 1.0 - load / prefill))

    def as_dict(self) -> dict[str, Any]:
        return {"prefill_s_per_block": self.prefill_s_per_block,
                "load_s_per_block": dict(self.load_s_per_block), "backlog_s": self.backlog_s}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaCosts:
        """`as_dict`'s form back; values that are not finite non-negative numbers are left
        out (a replica's report never breaks its router)."""
        loads = data.get("load_s_per_block")
        return cls(
            prefill_s_per_block=_seconds(data.get("prefill_s_per_block")) or None,
            load_s_per_block={str(m): s for m, v in loads.items()
                              if (s := _seconds(v)) is not None} if isinstance(loads, Mapping)
            else {},
            backlog_s=_seconds(data.get("backlog_s")) or 0.0,
        )  # fmt: skip


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None
