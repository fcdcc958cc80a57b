"""Lower KV tiers in the simulator: a disk per replica and one Valkey shared by all of them.

Each tier is an LRU of block digests with a capacity in blocks (its GiB over the KV bytes of a
block, `CostModel.kv_bytes_per_token`). As in the engine (`prefixcache.engine.offload`): a request
whose prompt runs past the RAM hit reads the longest run of its next blocks from the disk, then
Valkey, and the run is adopted into the replica's cache (`PrefixCache.adopt`, the engine's own
call); the blocks a request computed are written to every tier; a tier's read refreshes what it
served. Reading a run costs ``latency + blocks * block bytes / read bandwidth`` per tier, added
to the request's time to first token. A cache-aware router hears of each tier's stores and
evictions as the engine announces them (KV events with the tier's medium).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["SimTier", "TierSpec"]


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier: ``name`` (disk | valkey), capacity, read bandwidth and per-read latency."""

    name: str
    capacity_blocks: int
    read_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if self.capacity_blocks < 1:
            raise ValueError(f"the {self.name} tier holds no block: capacity "
                             f"{self.capacity_blocks} blocks (give it more GiB)")
        if self.read_bytes_per_s <= 0 or self.latency_s < 0:
            raise ValueError(f"the {self.name} tier needs a bandwidth > 0 and a latency >= 0")


class SimTier:
    """The digests one tier holds, least recently used first."""

    __slots__ = ("spec", "blocks", "num_read_blocks")

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.num_read_blocks = 0

    @property
    def name(self) -> str:
        return self.spec.name

    def read_run(self, digests: list[bytes], start: int, stop: int) -> int:
        """How many of ``digests[start:stop]``, from the first, this tier holds (each one read
        becomes the most recently used)."""
        blocks = self.blocks
        n = start
        while n < stop and digests[n] in blocks:
            blocks.move_to_end(digests[n])
            n += 1
        self.num_read_blocks += n - start
        return n - start

    def store(self, digests: list[bytes]) -> list[bytes]:
        """Write ``digests`` (already held ones are left where they are, as the engine skips
        them), then evict down to the capacity; returns the digests evicted."""
        blocks = self.blocks
        for digest in digests:
            if digest not in blocks:
                blocks[digest] = None
        evicted = []
        while len(blocks) > self.spec.capacity_blocks:
            evicted.append(blocks.popitem(last=False)[0])
        return evicted

    def read_seconds(self, num_blocks: int, block_bytes: float) -> float:
        if not num_blocks:
            return 0.0
        return self.spec.latency_s + num_blocks * block_bytes / self.spec.read_bytes_per_s
