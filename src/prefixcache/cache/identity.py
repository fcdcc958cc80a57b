"""`CacheIdentity`: what names a cache's blocks, so everyone who must name them alike can.

A block's digest chains from its namespace root (`block_hash.py`), which folds in the model
identity, and is cut at the block size by the hash. The cache, its indexes, the scheduler's
in-batch dedup, the engine's trace recorder, the simulator and a cluster's ingress (which names a
prompt's blocks before any replica sees it) all take a sequence's digests from one of these, so
none of them pairs a hasher with a model id by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixcache.cache.block_hash import BlockHasher
from prefixcache.cache.sequence import Sequence

__all__ = ["CacheIdentity"]


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """``model_id`` (and ``kv_layout``, where the KV is not stored in the model's dtype) roots
    every namespace; ``block_size`` and ``hash_algo`` cut and hash the chain. Two caches with
    equal identities give a sequence the same digests."""

    model_id: str
    block_size: int
    hash_algo: str = "sha256"
    kv_layout: str | None = None
    hasher: BlockHasher = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hasher", BlockHasher(self.block_size, self.hash_algo))

    def block_digests(self, seq: Sequence) -> list[bytes]:
        """``seq``'s digest chain (every complete block), extended incrementally."""
        return seq.digests(self.hasher, self.model_id, self.kv_layout)

    def root(self, seq: Sequence) -> bytes:
        """The namespace root: the parent of ``seq``'s first block (the public root where the
        sequence starts with public blocks)."""
        return seq.root_digest(self.hasher, self.model_id, self.kv_layout)

    def tail_root(self, seq: Sequence) -> bytes:
        """The root ``seq``'s own (salted) blocks chain from: `root`, unless public blocks
        come first."""
        return seq.tail_root(self.hasher, self.model_id, self.kv_layout)

    def roots(self, seq: Sequence) -> set[bytes]:
        """Every root ``seq``'s blocks chain from: `root` and `tail_root`."""
        return {self.root(seq), self.tail_root(seq)}

    def as_dict(self) -> dict[str, Any]:
        """The identity as plain data (what a replica reports to an ingress)."""
        return {"model_id": self.model_id, "block_size": self.block_size,
                "hash_algo": self.hash_algo, "kv_layout": self.kv_layout}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheIdentity:
        layout = data.get("kv_layout")
        return cls(str(data["model_id"]), int(data["block_size"]), str(data["hash_algo"]),
                   None if layout is None else str(layout))
