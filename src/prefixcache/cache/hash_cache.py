"""The hash-chain prefix cache (vLLM-style): the contract (``base.py``) over the block pool,
with a digest -> block map as its index.

A lookup walks the sequence's chained digests (``block_hash.py``) through the map and stops at the
first miss; each hit is verified against the block's stored token bytes, so a digest collision can
cost a miss, never wrong KV. Free cached blocks wait in the pool's LRU queues (lazy eviction);
when the pool reuses one, the cache tells the index to `forget` its digest. The map is the index's
alone.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from operator import attrgetter

from prefixcache.cache.base import PrefixCache
from prefixcache.cache.block_pool import BlockPool, KVBlock, check_invariant
from prefixcache.cache.identity import CacheIdentity
from prefixcache.cache.index import (
    NOTHING_INSERTED,
    CacheHit,
    Inserted,
    PrefixIndex,
    SeqBlocks,
)  # fmt: skip
from prefixcache.cache.sequence import PUBLIC_DOMAIN, Sequence

__all__ = ["HashIndex", "HashPrefixCache"]

_block_id = attrgetter("block_id")


class HashPrefixCache(PrefixCache):
    """vLLM-style prefix cache: lookups walk the digest chain and stop at the first miss; free
    cached blocks wait in the pool's LRU free queue."""

    kind = "hash"
    index: HashIndex

    def _make_index(self) -> HashIndex:
        return HashIndex(self.pool, self.identity)

    def _evicted(self, digests: list[bytes]) -> None:
        self.index.forget(digests)


@dataclass(slots=True)
class _HitHandle:
    """What `lookup` found, so admission can skip re-validation when nothing was evicted since."""

    pool: BlockPool
    epoch: int
    digests: list[bytes]
    block_ids: list[int]
    blocks: list[KVBlock] = field(default_factory=list)


class HashIndex(PrefixIndex):
    """``digest_map`` maps a digest to the one block that carries it; a duplicate stays out."""

    def __init__(self, pool: BlockPool, identity: CacheIdentity) -> None:
        self.pool = pool
        self.identity = identity
        self.digest_map: dict[bytes, KVBlock] = {}

    @property
    def num_cached(self) -> int:
        return len(self.digest_map)

    def lookup(self, seq: Sequence) -> CacheHit:
        digests = self.identity.block_digests(seq)
        get = self.digest_map.get
        blocks: list[KVBlock] = []
        append = blocks.append
        for digest, token_bytes in zip(digests, seq.block_token_bytes, strict=True):
            block = get(digest)
            if block is None or block.token_bytes != token_bytes:
                break
            append(block)
        num_matched = len(blocks)
        bs = self.pool.block_size
        del blocks[max(0, (len(seq.token_ids) - 1) // bs) :]
        block_ids = list(map(_block_id, blocks))
        handle = _HitHandle(self.pool, self.pool.epoch, digests, block_ids, blocks)
        return CacheHit(len(blocks) * bs, block_ids, len(blocks), num_matched, handle)

    def checked_hit(self, seq: Sequence, hit: CacheHit) -> list[KVBlock]:
        digests = self.identity.block_digests(seq)
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

    def insert(self, table: SeqBlocks, start: int, end: int) -> Inserted:
        if start >= end:
            return NOTHING_INSERTED
        seq = table.seq
        digests = self.identity.block_digests(seq)
        chunks = seq.block_token_bytes
        cached = self.digest_map
        domain, num_public = seq.domain, seq.public_blocks
        root, tail_root = self.identity.root(seq), self.identity.tail_root(seq)
        blocks = table.blocks
        runs: list[tuple[int, int]] = []
        num_dups = 0
        run_start = -1  # the first block of the current run of newly stored blocks
        for i in range(start, end):
            block = blocks[i]
            digest = digests[i]
            if block.digest == digest:
                stored = False
            elif digest in cached:
                num_dups += 1  # the same blocks computed twice: this copy stays out
                stored = False
            else:
                cached[digest] = block
                if i < num_public:
                    block.cache(digest, chunks[i], PUBLIC_DOMAIN)
                    block.owner_root = root  # its namespace (`take_free_under`, zeroing)
                else:
                    block.cache(digest, chunks[i], domain)
                    block.owner_root = tail_root
                stored = True
            if stored != (run_start >= 0):
                if stored:
                    run_start = i
                else:
                    runs.append((run_start, i))
                    run_start = -1
        if run_start >= 0:
            runs.append((run_start, end))
        return Inserted(runs, num_dups)

    def forget(self, digests: list[bytes]) -> None:
        """The pool reused the free cached blocks of ``digests``: they are cached no more."""
        pop = self.digest_map.pop
        for digest in digests:
            pop(digest, None)

    def take_free_under(self, roots: Collection[bytes]) -> tuple[list[KVBlock], list[bytes]]:
        """The pool's free cached blocks that a sequence under one of ``roots`` cached."""
        roots = set(roots)
        blocks = [b for b in self.pool.blocks
                  if not b.ref_cnt and b.digest is not None and b.owner_root in roots]  # fmt: skip
        self.pool.touch(blocks)  # out of their queues, one reference each
        digests = [b.digest for b in blocks if b.digest is not None]
        for block in blocks:
            block.uncache()
        self.forget(digests)
        return blocks, digests

    def held_block_ids(self) -> list[int]:
        return []  # the blocks are the pool's: every reference is a table's

    def clear(self) -> None:
        self.digest_map.clear()

    def check(self, tables: Mapping[str, SeqBlocks]) -> None:
        for digest, block in self.digest_map.items():
            check_invariant(
                block.digest == digest, "map entry points to a block with its digest: {!r}", block
            )
        num_with_digest = sum(1 for b in self.pool.blocks if b.digest is not None)
        check_invariant(
            len(self.digest_map) == num_with_digest, "every block with a digest is in the map"
        )
        bs = self.pool.block_size
        for seq_id, table in tables.items():
            seq, committed = table.seq, table.num_committed_blocks
            check_invariant(
                committed == table.num_computed_tokens // bs
                and all(b.digest is None for b in table.blocks[committed:]),
                "committed blocks of {!r} follow its computed tokens; no digest on uncommitted KV",
                seq_id,
            )
            if any(b.digest is not None for b in table.blocks[:committed]):
                digests, chunks = self.identity.block_digests(seq), seq.block_token_bytes
                for i, block in enumerate(table.blocks[:committed]):
                    check_invariant(
                        block.digest is None
                        or (block.digest == digests[i] and block.token_bytes == chunks[i]),
                        "block {} of {!r} carries that sequence's digest and tokens",
                        i,
                        seq,
                    )
