"""The hash-chain index (vLLM-style): a digest -> block map over the pool's LRU free queue.

A lookup walks the sequence's chained digests (``block_hash.py``) through the map and stops at the
first miss; each hit is verified against the block's stored token bytes, so a digest collision can
cost a miss, never wrong KV. Free cached blocks wait in the pool's free queue (lazy eviction): the
pool tells the index through `forget` when it reuses one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

from prefixcache.cache.block_pool import BlockPool, KVBlock, check_invariant
from prefixcache.cache.index import CacheHit, PrefixIndex, SeqBlocks
from prefixcache.cache.keys import ChainKeys
from prefixcache.cache.sequence import Sequence

__all__ = ["HashIndex"]

_block_id = attrgetter("block_id")


@dataclass(slots=True)
class _HitHandle:
    """What `lookup` found, so admission can skip re-validation when nothing was evicted since."""

    pool: BlockPool
    epoch: int
    digests: list[bytes]
    block_ids: list[int]
    blocks: list[KVBlock] = field(default_factory=list)


class HashIndex(PrefixIndex):
    """``cached`` maps a digest to the one block that carries it; a duplicate stays out."""

    parks_blocks = False

    def __init__(self, pool: BlockPool, keys: ChainKeys) -> None:
        self.pool = pool
        self.keys = keys
        self.cached: dict[bytes, KVBlock] = {}

    # -- lookup ---------------------------------------------------------------------------------

    def lookup(self, seq: Sequence) -> CacheHit:
        num_tokens = len(seq.token_ids)
        digests = self.keys.digests(seq)
        blocks = self._walk(digests, seq.block_token_bytes)
        num_matched = len(blocks)
        cap = max(0, (num_tokens - 1) // self.pool.block_size)
        if num_matched > cap:
            del blocks[cap:]
        block_ids = list(map(_block_id, blocks))
        handle = _HitHandle(self.pool, self.pool.epoch, digests, block_ids, blocks)
        return CacheHit(
            num_tokens=len(blocks) * self.pool.block_size,
            block_ids=block_ids,
            first_miss_block=len(blocks),
            num_matched_blocks=num_matched,
            handle=handle,
        )

    def _walk(self, digests: list[bytes], chunks: list[bytes]) -> list[KVBlock]:
        """Blocks of the longest run of ``digests`` that are mapped and hold the same tokens."""
        get = self.cached.get
        blocks: list[KVBlock] = []
        append = blocks.append
        for digest, token_bytes in zip(digests, chunks, strict=True):
            block = get(digest)
            if block is None or block.token_bytes != token_bytes:
                break
            append(block)
        return blocks

    def checked_hit(self, seq: Sequence, hit: CacheHit) -> list[KVBlock]:
        digests = self.keys.digests(seq)
        handle = hit.handle
        pool = self.pool
        if (
            isinstance(handle, _HitHandle)
            and handle.pool is pool
            and handle.epoch == pool.epoch
            and handle.digests is digests
            and handle.block_ids is hit.block_ids
            and len(handle.blocks) == len(hit.block_ids)
        ):
            return handle.blocks
        blocks = []
        for i, block_id in enumerate(hit.block_ids):
            if not 0 <= block_id < pool.num_blocks:
                raise ValueError(f"hit block id {block_id} is not in this cache")
            block = pool.blocks[block_id]
            if block.digest is None or block.digest != digests[i]:
                raise ValueError(f"stale cache hit: block {block_id} no longer holds block {i}")
            blocks.append(block)
        return blocks

    # -- insert ---------------------------------------------------------------------------------

    def insert(self, table: SeqBlocks, start: int, end: int) -> None:
        seq = table.seq
        digests = self.keys.digests(seq)
        chunks = seq.block_token_bytes
        cached = self.cached
        mark = self.pool.mark_cached
        domain = seq.domain
        blocks = table.blocks
        run_start = -1
        num_stored = num_dups = 0
        for i in range(start, end):
            block = blocks[i]
            digest = digests[i]
            stored = False
            if block.digest == digest:
                pass
            elif digest in cached:
                num_dups += 1  # the same blocks computed twice: this copy stays out
            else:
                cached[digest] = block
                mark(block, digest, chunks[i], domain)
                stored = True
                num_stored += 1
            if stored and run_start < 0:
                run_start = i
            elif not stored and run_start >= 0:
                self._emit_stored(table, run_start, i)
                run_start = -1
        if run_start >= 0:
            self._emit_stored(table, run_start, end)
        self.pool.stats.num_committed_blocks += num_stored
        self.pool.stats.num_duplicate_blocks += num_dups

    def _emit_stored(self, table: SeqBlocks, start: int, end: int) -> None:
        if self.pool.enable_kv_events:
            self.pool.emit(self.keys.stored_event(table, start, end))

    def forget(self, blocks: list[KVBlock]) -> None:
        cached = self.cached
        for block in blocks:
            digest = block.digest
            if digest is not None and cached.get(digest) is block:
                del cached[digest]

    def clear(self) -> None:
        self.cached.clear()

    # -- invariants -----------------------------------------------------------------------------

    def check(self, tables: dict[str, SeqBlocks]) -> None:
        for digest, block in self.cached.items():
            check_invariant(
                block.digest == digest, "map entry points to a block with its digest: {!r}", block
            )
        check_invariant(
            len(self.cached) == self.pool.num_cached, "every block with a digest is in the map"
        )
        bs = self.pool.block_size
        for seq_id, table in tables.items():
            check_invariant(
                table.num_committed_blocks == table.num_computed_tokens // bs,
                "committed blocks of {!r} follow its computed tokens",
                seq_id,
            )
            self._check_digests(table)

    def _check_digests(self, table: SeqBlocks) -> None:
        seq = table.seq
        committed = table.num_committed_blocks
        for block in table.blocks[committed:]:
            check_invariant(
                block.digest is None, "no digest on uncommitted KV: {!r} of {!r}", block, seq
            )
        if not any(b.digest is not None for b in table.blocks[:committed]):
            return
        digests = self.keys.digests(seq)
        chunks = seq.block_token_bytes
        for i, block in enumerate(table.blocks[:committed]):
            if block.digest is not None:
                check_invariant(
                    block.digest == digests[i] and block.token_bytes == chunks[i],
                    "block {} of {!r} carries that sequence's digest and tokens",
                    i,
                    seq,
                )
