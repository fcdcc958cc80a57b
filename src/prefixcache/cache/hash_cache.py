"""The hash-chain prefix cache (vLLM-style): per-sequence block tables over the block pool.

Boundary: this module owns the sequences' block tables and the rules of the contract API
(match, allocate, commit, free, fork, reset); the pool (``block_pool.py``) owns the blocks, ref
counts, the free queue and the digest map. Neither knows about tensors.

A lookup walks the sequence's chained digests (``block_hash.py``) through the digest map and stops
at the first miss; each hit is verified against the block's stored token bytes, so a digest
collision can cost a miss, never wrong KV.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from operator import attrgetter

from prefixcache.cache.base import CacheHit, PrefixCache, Sequence
from prefixcache.cache.block_hash import BlockHasher
from prefixcache.cache.block_pool import DEFAULT_MAX_EVENTS, BlockPool, KVBlock, check_invariant
from prefixcache.cache.events import BlockStored, KVCacheEvent
from prefixcache.cache.stats import CacheStats

__all__ = ["HashPrefixCache"]

_block_id = attrgetter("block_id")


@dataclass(slots=True)
class _Table:
    """A live sequence's blocks. ``num_committed_blocks`` blocks have committed KV;
    tokens ``[num_computed_tokens, num_alloc_tokens)`` are allocated and about to be written."""

    seq: Sequence
    blocks: list[KVBlock]
    block_ids: list[int]
    num_computed_tokens: int
    num_alloc_tokens: int
    num_committed_blocks: int


@dataclass(slots=True)
class _HitHandle:
    """What `match` found, so `allocate` can skip re-validation when nothing was evicted since."""

    pool: BlockPool
    epoch: int
    digests: list[bytes]
    block_ids: list[int]
    blocks: list[KVBlock] = field(default_factory=list)


class HashPrefixCache(PrefixCache):
    """vLLM-style prefix cache: a digest -> block map over a pool of ``num_blocks`` blocks.

    ``model_id`` roots every namespace; ``zero_on_reuse`` queues a block for zeroing when it
    changes namespace; ``enable_kv_events`` buffers `BlockStored`/`BlockRemoved`/
    `AllBlocksCleared` for `take_events`.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_algo: str = "sha256",
        *,
        enable_caching: bool = True,
        model_id: str = "",
        zero_on_reuse: bool = False,
        enable_kv_events: bool = True,
        events_with_tokens: bool = True,
        max_events: int = DEFAULT_MAX_EVENTS,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.model_id = model_id
        self.events_with_tokens = events_with_tokens
        self.hasher = BlockHasher(block_size, hash_algo)
        self.stats = CacheStats()
        self.pool = BlockPool(
            num_blocks,
            block_size,
            stats=self.stats,
            enable_kv_events=enable_kv_events,
            max_events=max_events,
            zero_on_reuse=zero_on_reuse,
        )
        self._tables: dict[str, _Table] = {}
        self._copies: list[tuple[int, int]] = []

    def __repr__(self) -> str:
        return (
            f"HashPrefixCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.pool.num_free}, cached={len(self.pool.cached)})"
        )

    # -- match ----------------------------------------------------------------------------------

    def _lookup(self, seq: Sequence) -> CacheHit:
        num_tokens = len(seq.token_ids)
        digests = seq.digests(self.hasher, self.model_id)
        blocks = self._walk(digests, seq.block_token_bytes)
        num_matched = len(blocks)
        cap = max(0, (num_tokens - 1) // self.block_size)
        if num_matched > cap:
            del blocks[cap:]
        block_ids = list(map(_block_id, blocks))
        handle = _HitHandle(self.pool, self.pool.epoch, digests, block_ids, blocks)
        return CacheHit(
            num_tokens=len(blocks) * self.block_size,
            block_ids=block_ids,
            first_miss_block=len(blocks),
            num_matched_blocks=num_matched,
            handle=handle,
        )

    def _walk(self, digests: list[bytes], chunks: list[bytes]) -> list[KVBlock]:
        """Blocks of the longest run of ``digests`` that are mapped and hold the same tokens."""
        get = self.pool.cached.get
        blocks: list[KVBlock] = []
        append = blocks.append
        for digest, token_bytes in zip(digests, chunks, strict=True):
            block = get(digest)
            if block is None or block.token_bytes != token_bytes:
                break
            append(block)
        return blocks

    # -- allocate -------------------------------------------------------------------------------

    def _state_of(self, seq_id: str) -> _Table | None:
        return self._tables.get(seq_id)

    def _allocate_first(
        self, seq: Sequence, num_new_tokens: int, hit: CacheHit | None
    ) -> list[int] | None:
        hit_blocks = self._checked_hit(seq, hit)
        num_hit = len(hit_blocks)
        computed = num_hit * self.block_size
        end = computed + num_new_tokens
        num_new = -(-end // self.block_size) - num_hit
        pool = self.pool
        if num_new + num_hit > pool.num_free:
            num_reused = sum(1 for b in hit_blocks if b.ref_cnt == 0)
            if num_new + num_reused > pool.num_free:
                return None
        pool.touch(hit_blocks)
        new_blocks = pool.take(num_new, self._owner_root(seq))
        blocks = hit_blocks + new_blocks
        block_ids = (hit.block_ids if hit is not None else []) + list(map(_block_id, new_blocks))
        seq.num_computed_tokens = computed
        self._tables[seq.seq_id] = _Table(seq, blocks, block_ids, computed, end, num_hit)
        return list(block_ids)

    def _checked_hit(self, seq: Sequence, hit: CacheHit | None) -> list[KVBlock]:
        """The hit's blocks, verified to still carry the digests ``seq`` expects."""
        if hit is None or not hit.block_ids:
            return []
        if not (self.enable_caching and seq.use_cache):
            raise ValueError("a cache hit was given for a sequence that does not use the cache")
        block_ids = hit.block_ids
        num_hit = len(block_ids)
        if hit.num_tokens != num_hit * self.block_size:
            raise ValueError(f"hit.num_tokens {hit.num_tokens} != {num_hit} blocks")
        if num_hit > (len(seq.token_ids) - 1) // self.block_size:
            raise ValueError(f"hit of {num_hit} blocks leaves no prompt token to compute")
        digests = seq.digests(self.hasher, self.model_id)
        handle = hit.handle
        if (
            isinstance(handle, _HitHandle)
            and handle.pool is self.pool
            and handle.epoch == self.pool.epoch
            and handle.digests is digests
            and handle.block_ids is block_ids
            and len(handle.blocks) == num_hit
        ):
            return handle.blocks
        return self._validated_blocks(block_ids, digests)

    def _validated_blocks(self, block_ids: list[int], digests: list[bytes]) -> list[KVBlock]:
        pool_blocks = self.pool.blocks
        blocks = []
        for i, block_id in enumerate(block_ids):
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"hit block id {block_id} is not in this cache")
            block = pool_blocks[block_id]
            if block.digest is None or block.digest != digests[i]:
                raise ValueError(f"stale cache hit: block {block_id} no longer holds block {i}")
            blocks.append(block)
        return blocks

    def _allocate_more(self, table: _Table, num_new_tokens: int) -> list[int] | None:
        bs = self.block_size
        computed = table.num_computed_tokens
        end = computed + num_new_tokens
        blocks = table.blocks
        num_new = max(0, -(-end // bs) - len(blocks))
        shared = [
            i
            for i in range(computed // bs, min(len(blocks), -(-end // bs)))
            if blocks[i].ref_cnt > 1
        ]
        if num_new + len(shared) > self.pool.num_free:
            return None
        root = self._owner_root(table.seq)
        for i in shared:
            self._copy_on_write(table, i, copy=i * bs < computed, owner_root=root)
        if num_new:
            new_blocks = self.pool.take(num_new, root)
            blocks.extend(new_blocks)
            table.block_ids.extend(map(_block_id, new_blocks))
        table.num_alloc_tokens = max(table.num_alloc_tokens, end)
        return list(table.block_ids)

    def _copy_on_write(
        self, table: _Table, index: int, *, copy: bool, owner_root: bytes | None
    ) -> None:
        """Give ``table`` its own block at ``index``; a shared block is never written."""
        src = table.blocks[index]
        (dst,) = self.pool.take(1, owner_root)
        if copy:
            self._copies.append((src.block_id, dst.block_id))
            self.pool.cancel_zero(dst.block_id)  # the copy overwrites the whole block
        self.pool.release((src,))
        table.blocks[index] = dst
        table.block_ids[index] = dst.block_id

    def _owner_root(self, seq: Sequence) -> bytes | None:
        if not self.pool.zero_on_reuse:
            return None
        if seq.use_cache and self.enable_caching:
            return seq.root_digest(self.hasher, self.model_id)
        return self.hasher.root(seq.namespace(self.model_id))

    # -- commit ---------------------------------------------------------------------------------

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        table = self._live_table(seq)
        if not table.num_computed_tokens <= num_computed_tokens <= table.num_alloc_tokens:
            raise ValueError(
                f"commit({seq.seq_id!r}, {num_computed_tokens}): must lie between the computed "
                f"{table.num_computed_tokens} and the allocated {table.num_alloc_tokens} tokens"
            )
        if num_computed_tokens > len(seq.token_ids):
            raise ValueError(
                f"commit({seq.seq_id!r}, {num_computed_tokens}): only {len(seq.token_ids)} tokens"
            )
        seq.num_computed_tokens = table.num_computed_tokens = num_computed_tokens
        start = table.num_committed_blocks
        end = num_computed_tokens // self.block_size
        if end <= start:
            return
        table.num_committed_blocks = end
        if self.enable_caching and seq.use_cache:
            self._store_blocks(table, start, end)

    def _live_table(self, seq: Sequence) -> _Table:
        table = self._tables.get(seq.seq_id)
        if table is None or table.seq is not seq:
            raise ValueError(f"sequence {seq.seq_id!r} holds no blocks in this cache")
        return table

    def _store_blocks(self, table: _Table, start: int, end: int) -> None:
        """Blocks ``start..end-1`` of ``table`` are full and computed: make them hittable."""
        seq = table.seq
        digests = seq.digests(self.hasher, self.model_id)
        chunks = seq.block_token_bytes
        store = self.pool.store
        blocks = table.blocks
        run_start = -1
        num_stored = num_dups = 0
        for i in range(start, end):
            block = blocks[i]
            digest = digests[i]
            if block.digest == digest:
                stored = False
            elif store(block, digest, chunks[i]):
                stored = True
                num_stored += 1
            else:
                stored = False
                num_dups += 1
            if stored and run_start < 0:
                run_start = i
            elif not stored and run_start >= 0:
                self._emit_stored(table, run_start, i)
                run_start = -1
        if run_start >= 0:
            self._emit_stored(table, run_start, end)
        self.stats.num_committed_blocks += num_stored
        self.stats.num_duplicate_blocks += num_dups

    def _emit_stored(self, table: _Table, start: int, end: int) -> None:
        if not self.pool.enable_kv_events:
            return
        seq = table.seq
        digests = seq.block_digests
        bs = self.block_size
        parent = digests[start - 1] if start else seq.root_digest(self.hasher, self.model_id)
        token_ids = seq.token_ids[start * bs : end * bs] if self.events_with_tokens else []
        self.pool.emit(
            BlockStored(
                block_hashes=digests[start:end],
                parent_block_hash=parent,
                token_ids=token_ids,
                block_size=bs,
                block_ids=table.block_ids[start:end],
            )
        )

    # -- free, fork, reset ----------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        table = self._tables.get(seq.seq_id)
        if table is None or table.seq is not seq:
            return
        del self._tables[seq.seq_id]
        self.pool.release(reversed(table.blocks))

    def fork(self, seq: Sequence, child_id: str) -> Sequence:
        table = self._live_table(seq)
        if child_id in self._tables:
            raise ValueError(f"sequence id {child_id!r} is already live in this cache")
        # shared blocks are never written: pending writes must be re-allocated (copy-on-write)
        table.num_alloc_tokens = table.num_computed_tokens
        child = seq.fork(child_id)
        child.num_computed_tokens = table.num_computed_tokens
        self.pool.touch(table.blocks)
        self._tables[child_id] = _Table(
            child,
            list(table.blocks),
            list(table.block_ids),
            table.num_computed_tokens,
            table.num_computed_tokens,
            table.num_committed_blocks,
        )
        return child

    def reset(self) -> bool:
        return self.pool.reset()

    # -- views and drains -----------------------------------------------------------------------

    def block_table(self, seq: Sequence) -> list[int]:
        table = self._tables.get(seq.seq_id)
        if table is None or table.seq is not seq:
            return []
        return list(table.block_ids)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that are hittable now (held or free)."""
        return len(self.pool.cached)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (evicted first) to tail."""
        return self.pool.free_block_ids()

    def take_events(self) -> list[KVCacheEvent]:
        return self.pool.take_events()

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def take_blocks_to_zero(self) -> list[int]:
        return self.pool.take_blocks_to_zero()

    # -- invariants -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        refs: Counter[int] = Counter()
        for table in self._tables.values():
            refs.update(table.block_ids)
        self.pool.check_integrity(refs)
        for seq_id, table in self._tables.items():
            self._check_table(seq_id, table)

    def _check_table(self, seq_id: str, table: _Table) -> None:
        bs = self.block_size
        blocks = table.blocks
        check_invariant(table.seq.seq_id == seq_id, "table of {!r} belongs to its sequence", seq_id)
        check_invariant(
            [b.block_id for b in blocks] == table.block_ids,
            "block ids of {!r} match its blocks",
            seq_id,
        )
        check_invariant(
            table.num_committed_blocks == table.num_computed_tokens // bs
            and table.num_computed_tokens <= table.num_alloc_tokens <= len(blocks) * bs,
            "computed <= allocated <= table size for {!r}",
            seq_id,
        )
        self._check_digests(table)
        first_write = table.num_computed_tokens // bs
        last_write = -(-table.num_alloc_tokens // bs)
        if table.num_alloc_tokens == table.num_computed_tokens:
            last_write = first_write
        for block in blocks[first_write:last_write]:
            check_invariant(
                block.ref_cnt == 1, "a shared block is never a write target: {!r}", block
            )

    def _check_digests(self, table: _Table) -> None:
        seq = table.seq
        committed = table.num_committed_blocks
        for block in table.blocks[committed:]:
            check_invariant(
                block.digest is None, "no digest on uncommitted KV: {!r} of {!r}", block, seq
            )
        if not any(b.digest is not None for b in table.blocks[:committed]):
            return
        digests = seq.digests(self.hasher, self.model_id)
        chunks = seq.block_token_bytes
        for i, block in enumerate(table.blocks[:committed]):
            if block.digest is not None:
                check_invariant(
                    block.digest == digests[i] and block.token_bytes == chunks[i],
                    "block {} of {!r} carries that sequence's digest and tokens",
                    i,
                    seq,
                )
