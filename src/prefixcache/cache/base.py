"""`PrefixCache`: the contract API, written once over the block pool and a prefix index.

The cache knows nothing about tensors: it hands out block ids and decides which blocks are
reusable. The scheduler is its only caller; the runner consumes the block ids (and the copy and
zero instructions drained with `take_block_copies` / `take_blocks_to_zero`).

Life of a sequence::

    hit = cache.match(seq)                      # longest cached prefix, block aligned (pure)
    table = cache.allocate(seq, n, hit)         # touch hits, then take new blocks (or None)
    ... the runner writes KV for the new tokens ...
    cache.commit(seq, num_computed_tokens)      # now-full blocks become hittable
    seq.append(token); cache.allocate(seq, 1)   # decode
    cache.free(seq)

The pool (``block_pool.py``) owns the blocks, the index (``index.py``) what is cached, the live
tables (``tables.py``) who holds what; this class owns the contract's rules, the statistics and
the KV events, all written here from what the pool and the index return. `match` is a pure
lookup: a request's lookup is counted once, when `allocate` admits it with its hit.

The features built on the contract are owners of their own that call it: lower tiers fill blocks
through `adoption.adopt`, pins hold them (``pins.py``), a tenant's purge evicts its domain
(`purge.evict_domain`), an unloaded LoRA adapter's namespaces are evicted (`evict_namespaces`),
and the scheduler hands in which domains' free cached blocks an
allocation may not evict (``protection``: fair shares live in ``sched/fairness.py``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection
from typing import Any

from prefixcache.cache.allocator import Protection, TableAllocator
from prefixcache.cache.block_hash import BlockHasher
from prefixcache.cache.block_pool import BlockPool, PoolSize
from prefixcache.cache.config import CacheConfig
from prefixcache.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    EventBuffer,
    KVCacheEvent,
    stored,
)  # fmt: skip
from prefixcache.cache.identity import CacheIdentity
from prefixcache.cache.index import NOTHING_INSERTED, CacheHit, PrefixIndex, SeqBlocks
from prefixcache.cache.observer import CacheObserver
from prefixcache.cache.sequence import Sequence
from prefixcache.cache.stats import CacheStats
from prefixcache.cache.tables import LiveTables

__all__ = ["CacheObserver", "PrefixCache", "Protection"]

_NONE: frozenset[str] = frozenset()


class PrefixCache:
    """A paged KV-cache allocator with prefix reuse over ``num_blocks`` blocks.

    Both indexes keep: only complete, committed blocks are hittable; a block with
    ``ref_cnt > 1`` (shared) is never written; allocation touches hits before taking new blocks;
    a failed allocation changes nothing; at least one prompt token is always computed.
    ``model_id`` roots every namespace; ``zero_on_reuse`` queues a block for zeroing when it
    changes namespace; ``enable_kv_events`` buffers `BlockStored`/`BlockRemoved`/
    `AllBlocksCleared` in ``events`` (at most ``max_events``; newer ones are dropped and
    counted), with token ids only if ``events_with_tokens``. ``eviction_policy`` orders the
    eviction of free cached blocks (radix: ``lru`` or ``lfu``; hash: ``lru``). The settings are
    validated once, as a `CacheConfig` (``self.config``). ``protection`` (None: none) keeps
    other domains' free cached blocks from an allocation; ``observers`` hear every admission,
    commit and free.
    """

    kind = ""  # "hash" | "radix", set by each implementation

    def __init__(
        self, num_blocks: int, block_size: int, hash_algo: str = "sha256", **settings: Any
    ) -> None:
        """``settings``: the other `CacheConfig` fields, by keyword."""
        config = self.config = CacheConfig.of(self.kind, num_blocks, block_size, hash_algo,
                                              **settings)
        self.num_blocks, self.block_size, self.model_id = num_blocks, block_size, config.model_id
        self.enable_prefix_caching = config.enable_prefix_caching
        self.identity = CacheIdentity(config.model_id, block_size, hash_algo, config.kv_layout)
        self.hasher: BlockHasher = self.identity.hasher
        self.stats = CacheStats()
        self.events = EventBuffer(config.enable_kv_events, config.max_events)
        self.pool = BlockPool(num_blocks, block_size, zero_on_reuse=config.zero_on_reuse)
        self.index = self._make_index()
        self.tables = LiveTables()
        self.observers: list[CacheObserver] = []
        self.allocator = TableAllocator(config, self.pool, self.index, self.tables, self.stats,
                                        self.events, self.identity, self.observers,
                                        self._admitted, self._evicted)

    @classmethod
    def from_config(cls, config: CacheConfig) -> PrefixCache:
        """The cache ``config`` describes (``num_blocks`` set)."""
        if config.num_blocks is None:
            raise ValueError("num_blocks must be set to build a cache")
        if cls.kind != config.kind:
            raise ValueError(f"{cls.__name__} is not a {config.kind!r} cache")
        return cls(**config.as_kwargs())  # type: ignore[arg-type]  # num_blocks is set

    def _make_index(self) -> PrefixIndex:
        raise NotImplementedError("build a cache with make_prefix_cache('hash' | 'radix', ...)")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.pool.num_free}, cached={self.index.num_cached})"
        )

    def add_observer(self, observer: CacheObserver) -> None:
        """Tell ``observer`` about every admission, commit and free from now on (once)."""
        if observer not in self.observers:
            self.observers.append(observer)

    def writes(self, seq: Sequence) -> bool:
        """Whether ``seq``'s computed blocks are cached (and its blocks namespaced)."""
        return self.enable_prefix_caching and seq.writes_cache

    # -- the index's own steps (radix: a table's path is held through the index) ----------------

    def _admitted(self, table: SeqBlocks, hit: CacheHit) -> None:
        """``table`` starts with ``hit``'s blocks; the cache then references
        ``blocks[num_path:]`` of them."""

    def _forked(self, parent: SeqBlocks, child: SeqBlocks) -> None:
        """``child`` shares every block of ``parent`` (ref counts already raised)."""

    def _released(self, table: SeqBlocks) -> None:
        """``table`` let go of its blocks."""

    def _evicted(self, digests: list[bytes]) -> None:
        """The pool reused the free cached blocks of ``digests``."""

    # -- match ----------------------------------------------------------------------------------

    def match(self, seq: Sequence) -> CacheHit:
        """Longest cached prefix of ``seq``, capped at ``num_tokens - 1`` rounded down to a block.
        Pure: changes no ref count and no statistic. Empty for a sequence that does not read
        the cache."""
        start_ns = time.perf_counter_ns()
        reads = self.enable_prefix_caching and seq.reads_cache
        hit = self.index.lookup(seq) if reads else CacheHit()
        hit.lookup_time_ns = time.perf_counter_ns() - start_ns
        hit.epoch = self.pool.epoch
        return hit

    def is_current(self, hit: CacheHit) -> bool:
        """No cached block was dropped since `match` returned ``hit``: it is still admissible
        (a lookup now may find more, never less)."""
        return hit.epoch == self.pool.epoch

    # -- allocate -------------------------------------------------------------------------------

    def allocate(
        self, seq: Sequence, num_new_tokens: int, hit: CacheHit | None = None
    ) -> list[int] | None:
        """Make ``seq``'s block table cover its computed tokens plus ``num_new_tokens``.

        On the first call, ``hit`` (from `match`) supplies the computed prefix. Returns the whole
        block table, or None when the blocks do not fit (and then nothing changed)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        table = self.tables.get(seq.seq_id)
        if table is None:
            return self.allocator.first(seq, num_new_tokens, hit)
        if table.seq is not seq:
            raise ValueError(f"sequence id {seq.seq_id!r} is already live in this cache")
        return self.allocator.more(table, num_new_tokens)

    @property
    def protection(self) -> Protection | None:
        """Which domains' free cached blocks an allocation may not evict (None: none)."""
        return self.allocator.protection

    @protection.setter
    def protection(self, protection: Protection | None) -> None:
        self.allocator.protection = protection

    # -- commit ---------------------------------------------------------------------------------

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        """The KV of ``seq``'s first ``num_computed_tokens`` tokens is written: full blocks among
        them become hittable."""
        self._commit(seq, num_computed_tokens, notify=True)

    def _commit(self, seq: Sequence, num_computed_tokens: int, *, notify: bool) -> None:
        table = self.tables.live(seq)
        top = min(table.num_alloc_tokens, len(seq.token_ids))
        if not table.num_computed_tokens <= num_computed_tokens <= top:
            raise ValueError(
                f"commit({seq.seq_id!r}, {num_computed_tokens}): must lie between the computed "
                f"{table.num_computed_tokens} and the allocated {table.num_alloc_tokens} tokens "
                f"(of {len(seq.token_ids)})"
            )
        seq.num_computed_tokens = num_computed_tokens
        start = table.num_committed_blocks
        end = num_computed_tokens // self.block_size
        table.num_committed_blocks = end
        if not self.writes(seq):
            return
        inserted = self.index.insert(table, start, end)
        if inserted is not NOTHING_INSERTED:
            stats = self.stats
            stats.num_committed_blocks += inserted.num_stored
            stats.num_duplicate_blocks += inserted.num_duplicates
            if self.events.enabled:
                for run_start, run_end in inserted.runs:
                    self.events.emit(stored(table, run_start, run_end, self.identity,
                                            self.config.events_with_tokens))
        if end > start and notify:
            for observer in self.observers:
                observer.on_commit(seq, start, end, table.block_ids[start:end])

    # -- free, fork, reset ----------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, deepest first; committed ones stay cached until evicted."""
        self._free(seq, notify=True)

    def _free(self, seq: Sequence, *, notify: bool) -> None:
        table = self.tables.of(seq)
        if table is None:
            return
        self.tables.remove(table)
        if len(table.blocks) > table.num_path:  # radix holds its path through the index
            self.pool.release(reversed(table.blocks[table.num_path :]))
        if table.node is not None:
            self._released(table)
        seq.num_computed_tokens = 0
        if notify:
            for observer in self.observers:
                observer.on_free(seq, len(table.blocks))

    def fork(self, seq: Sequence, child_id: str) -> Sequence:
        """A child sharing every block of ``seq`` (ref counts up), for n > 1 sampling."""
        table = self.tables.live(seq)
        if child_id in self.tables:
            raise ValueError(f"sequence id {child_id!r} is already live in this cache")
        # shared blocks are never written: pending writes must be re-allocated (copy-on-write)
        table.num_alloc_tokens = table.num_computed_tokens
        child = seq.fork(child_id)
        self.pool.touch(table.blocks[table.num_path :])
        child_table = SeqBlocks(
            child, list(table.blocks), list(table.block_ids), table.num_computed_tokens,
            table.num_committed_blocks, table.num_path, table.node,
        )  # fmt: skip
        if table.node is not None:
            self._forked(table, child_table)
        self.tables.add(child_table)
        return child

    def reset(self) -> bool:
        """Drop every cached block. Refuses (False, nothing changed) while any block is in use."""
        if not self.pool.reset():
            return False
        self.index.clear()
        if self.allocator.fates is not None:
            self.allocator.fates.reset()
        self.stats.num_resets += 1
        self.events.emit(AllBlocksCleared())
        return True

    def evict_namespaces(self, roots: Collection[bytes]) -> list[int]:
        """Evict every free cached block under these namespace roots (an unloaded LoRA
        adapter's, in each namespace its requests used), counted and announced as evictions;
        blocks that live sequences or pins hold stay until they are freed. The evicted ids."""
        blocks, digests = self.index.take_free_under(roots)
        if not blocks:
            return []
        self.pool.epoch += 1  # hits looked up before are stale
        self.stats.num_evictions += len(digests)
        ids = [block.block_id for block in blocks]
        if self.allocator.fates is not None:
            self.allocator.fates.evicted(digests, None)
        self.events.emit(BlockRemoved(block_hashes=digests, block_ids=ids))
        self.pool.release(reversed(blocks))
        return ids

    # -- views and drains -----------------------------------------------------------------------

    def block_table(self, seq: Sequence) -> list[int]:
        """The current block table of ``seq`` (empty if it holds none)."""
        table = self.tables.of(seq)
        return list(table.block_ids) if table is not None else []

    def blocks_held(self, domain: str = "") -> int:
        """Blocks in the live block tables of ``domain``'s sequences."""
        return self.tables.held(domain)

    def size(self) -> PoolSize:
        """The pool's counts in one value: free, queued, parked, cached, held."""
        return self.pool.size(self.index.num_cached)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, or cached and evictable)."""
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that are hittable now (held or free)."""
        return self.index.num_cached

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (0.0 – 1.0)."""
        return 1.0 - self.pool.num_free / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free queue, head (evicted first) to tail."""
        return self.pool.free_block_ids()

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the KV events since the last call."""
        return self.events.take()

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Drain pending copy-on-write instructions ``(src_block_id, dst_block_id)``; the runner
        performs them before the step's KV writes."""
        return self.pool.take_block_copies()

    def take_blocks_to_zero(self) -> list[int]:
        """Drain blocks whose KV must be zeroed before reuse (zero-on-reuse mode)."""
        return self.pool.take_blocks_to_zero()

    # -- invariants -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        refs: Counter[int] = Counter(self.index.held_block_ids())
        self.tables.check(refs, self.block_size)  # each table's references but its path
        self.pool.check_integrity(refs)
        self.index.check(self.tables.tables)
