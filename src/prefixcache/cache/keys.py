"""How a prefix cache names blocks: its hasher, the model identity that roots every namespace,
and what its `BlockStored` events carry. Shared by both indexes and the cache over them."""

from __future__ import annotations

from prefixcache.cache.block_hash import BlockHasher
from prefixcache.cache.events import BlockStored
from prefixcache.cache.index import SeqBlocks
from prefixcache.cache.sequence import Sequence

__all__ = ["ChainKeys"]


class ChainKeys:
    """``events_with_tokens``: stored events carry the blocks' token ids (tenant data)."""

    __slots__ = ("hasher", "model_id", "events_with_tokens")

    def __init__(self, hasher: BlockHasher, model_id: str, events_with_tokens: bool) -> None:
        self.hasher = hasher
        self.model_id = model_id
        self.events_with_tokens = events_with_tokens

    def digests(self, seq: Sequence) -> list[bytes]:
        """``seq``'s digest chain, extended incrementally."""
        return seq.digests(self.hasher, self.model_id)

    def root(self, seq: Sequence) -> bytes:
        """The namespace root: the parent of ``seq``'s first block."""
        return seq.root_digest(self.hasher, self.model_id)

    def namespace_root(self, seq: Sequence) -> bytes:
        """The namespace root without computing ``seq``'s digests (it may not use the cache)."""
        return self.hasher.root(seq.namespace(self.model_id))

    def stored_event(self, table: SeqBlocks, start: int, end: int) -> BlockStored:
        """`BlockStored` for ``table``'s blocks ``start..end-1``, now hittable."""
        seq = table.seq
        bs = self.hasher.block_size
        digests = seq.block_digests
        token_ids = seq.token_ids[start * bs : end * bs] if self.events_with_tokens else []
        return BlockStored(
            block_hashes=digests[start:end],
            parent_block_hash=digests[start - 1] if start else self.root(seq),
            token_ids=token_ids,
            block_size=bs,
            block_ids=table.block_ids[start:end],
        )
