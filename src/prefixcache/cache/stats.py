"""Counters a prefix cache keeps. Plain integers, bumped outside per-block loops."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class CacheStats:
    """Cumulative cache counters (since construction; `reset()` of the cache keeps them).

    ``first_miss_blocks`` is a histogram: first-miss block index -> number of lookups whose walk
    stopped there (a full hit is recorded at the capped length).
    """

    num_requests: int = 0  # lookups (one per admitted request)
    num_queried_tokens: int = 0  # prompt tokens looked up
    num_hit_tokens: int = 0  # tokens served from the cache
    num_hit_requests: int = 0  # lookups with at least one hit block
    num_evictions: int = 0  # cached blocks whose digest was dropped for reuse
    num_duplicate_blocks: int = 0  # committed blocks whose digest was already cached
    num_committed_blocks: int = 0  # blocks that became hittable
    num_resets: int = 0
    min_free_blocks: int = -1  # low watermark of free (ref 0) blocks; -1 before first use
    lookup_time_ns: int = 0  # total time spent in match()
    first_miss_blocks: dict[int, int] = field(default_factory=dict)

    def count_lookup(
        self, num_tokens: int, num_hit_blocks: int, block_size: int, lookup_time_ns: int
    ) -> None:
        """A request of ``num_tokens`` tokens was admitted with a hit of ``num_hit_blocks``."""
        self.num_requests += 1
        self.num_queried_tokens += num_tokens
        self.lookup_time_ns += lookup_time_ns
        self.num_hit_requests += num_hit_blocks > 0
        self.num_hit_tokens += num_hit_blocks * block_size
        misses = self.first_miss_blocks
        misses[num_hit_blocks] = misses.get(num_hit_blocks, 0) + 1

    @property
    def hit_rate(self) -> float:
        """Token-weighted hit rate over all lookups."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["hit_rate"] = self.hit_rate
        return out
