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
(`purge.evict_domain`), and the scheduler hands in which domains' free cached blocks an
allocation may not evict (``protection``: fair shares live in ``sched/fairness.py``).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Protocol

from prefixcache.cache.block_hash import BlockHasher
from prefixcache.cache.block_pool import BlockPool, KVBlock, PoolSize, Taken
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
from prefixcache.cache.sequence import Sequence
from prefixcache.cache.stats import CacheStats
from prefixcache.cache.tables import LiveTables

__all__ = ["CacheObserver", "PrefixCache", "Protection"]

_NONE: frozenset[str] = frozenset()


class CacheObserver(Protocol):
    """Told about a cache's decisions as they happen (logging, tracing); adds nothing to the
    cache's own work when none is attached. Must not call back into the cache's mutators."""

    def on_admit(self, seq: Sequence, hit: CacheHit | None, block_ids: list[int]) -> None:
        """``seq`` was admitted with ``hit``; ``block_ids`` is its new block table."""

    def on_commit(self, seq: Sequence, start: int, end: int, block_ids: list[int]) -> None:
        """Blocks ``start..end-1`` of ``seq`` (table ``block_ids``) are full and computed."""

    def on_free(self, seq: Sequence, num_blocks: int) -> None:
        """``seq`` let go of its ``num_blocks`` blocks."""


class Protection(Protocol):
    """Which domains' free cached blocks ``domain`` may not evict to take ``num_more`` more
    blocks (the scheduler's fair shares, `sched.fairness.QuietDomains`)."""

    def __call__(self, domain: str, num_more: int) -> frozenset[str]: ...


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
        self.identity = CacheIdentity(config.model_id, block_size, hash_algo)
        self.hasher: BlockHasher = self.identity.hasher
        self.stats = CacheStats()
        self.events = EventBuffer(config.enable_kv_events, config.max_events)
        self.pool = BlockPool(num_blocks, block_size, zero_on_reuse=config.zero_on_reuse)
        self.index = self._make_index()
        self.tables = LiveTables()
        self.protection: Protection | None = None
        self.observers: list[CacheObserver] = []

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
            return self._allocate_first(seq, num_new_tokens, hit)
        if table.seq is not seq:
            raise ValueError(f"sequence id {seq.seq_id!r} is already live in this cache")
        return self._allocate_more(table, num_new_tokens)

    def _allocate_first(
        self, seq: Sequence, num_new_tokens: int, hit: CacheHit | None, *, counted: bool = True
    ) -> list[int] | None:
        """``counted``: a request's admission (its lookup counted, observers told); else a
        stand-in of a pin or a tier load."""
        given, hit = hit, hit or CacheHit()
        hit_blocks = self._checked_hit(seq, hit)
        num_hit = len(hit_blocks)
        computed = num_hit * self.block_size
        end = computed + num_new_tokens
        num_new = -(-end // self.block_size) - num_hit
        protected, num_protected = self._protected(seq.domain, num_hit + num_new)
        num_free = self.pool.num_free - num_protected
        if num_new + num_hit > num_free:  # admitting a hit consumes its free blocks
            reused = self.index.num_free_in(hit, hit_blocks) if num_hit else 0
            if num_new + reused > num_free:
                return None
        seq.num_computed_tokens = computed
        table = SeqBlocks(seq, hit_blocks, list(hit.block_ids), end, num_hit)
        if num_hit:
            self._admitted(table, hit)
        # touch before allocate (radix holds its path through the index, not by references)
        taken = self._take(num_new, self._owner_root(seq), protected, hit_blocks[table.num_path :])
        table.blocks += taken.blocks
        table.block_ids += taken.block_ids
        self.tables.add(table)
        if counted:  # a request's lookup is counted once, when it is admitted
            self.stats.count_lookup(len(seq.token_ids), hit.num_blocks, self.block_size,
                                    hit.lookup_time_ns)
            for observer in self.observers:
                observer.on_admit(seq, given, list(table.block_ids))
        return list(table.block_ids)

    def _protected(self, domain: str, num_more: int) -> tuple[frozenset[str], int]:
        """The domains whose free cached blocks ``domain`` may not evict for ``num_more`` more
        blocks (``protection``'s answer), and how many blocks that keeps from it."""
        if self.protection is None or not num_more or not self.pool.other_cache_domains(domain):
            return _NONE, 0  # the common case: one domain
        protected = self.protection(domain, num_more)
        if not protected:
            return _NONE, 0
        free_cached = self.pool.free_cached_by_domain()
        return protected, sum(free_cached.get(d, 0) for d in protected)

    def _checked_hit(self, seq: Sequence, hit: CacheHit) -> list[KVBlock]:
        """The hit's blocks, verified to still be cached for ``seq``."""
        if not hit.block_ids:
            return []
        if not self.writes(seq):
            raise ValueError("a cache hit was given for a sequence that does not use the cache")
        num_hit = len(hit.block_ids)
        if hit.num_tokens != num_hit * self.block_size:
            raise ValueError(f"hit.num_tokens {hit.num_tokens} != {num_hit} blocks")
        if num_hit > (len(seq.token_ids) - 1) // self.block_size:
            raise ValueError(f"hit of {num_hit} blocks leaves no prompt token to compute")
        return self.index.checked_hit(seq, hit)

    def _allocate_more(self, table: SeqBlocks, num_new_tokens: int) -> list[int] | None:
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
        domain = table.seq.domain
        protected, num_protected = self._protected(domain, num_new)
        if num_new + len(shared) > self.pool.num_free - num_protected:
            return None
        root = self._owner_root(table.seq)
        for i in shared:  # a shared block is never written: the table gets its own copy
            (dst,) = self._take(1, root, protected).blocks
            self.pool.copy_on_write(blocks[i], dst, copy=i * bs < computed)
            blocks[i] = dst
            table.block_ids[i] = dst.block_id
        taken = self._take(num_new, root, protected)
        if taken.blocks:
            self.tables.grew(domain, len(taken.blocks))
            blocks += taken.blocks
            table.block_ids += taken.block_ids
        table.num_alloc_tokens = max(table.num_alloc_tokens, end)
        return list(table.block_ids)

    def _take(
        self,
        num: int,
        owner_root: bytes | None,
        protected: frozenset[str],
        touch: list[KVBlock] | None = None,
    ) -> Taken:
        """``num`` new blocks from the pool (after a reference on each of ``touch``); evictions
        are counted, announced and forgotten by the index here, and the free-block low watermark
        kept."""
        taken = self.pool.take(num, owner_root, protected, touch)
        if taken.evicted_digests:
            self.stats.num_evictions += len(taken.evicted_digests)
            self._evicted(taken.evicted_digests)
            if self.events.enabled:
                self.events.emit(
                    BlockRemoved(block_hashes=taken.evicted_digests, block_ids=taken.evicted_ids)
                )
        stats, num_free = self.stats, self.pool.num_free
        if stats.min_free_blocks < 0 or num_free < stats.min_free_blocks:
            stats.min_free_blocks = num_free
        return taken

    def _owner_root(self, seq: Sequence) -> bytes | None:
        if not self.config.zero_on_reuse:
            return None
        if self.writes(seq):
            return self.identity.root(seq)
        return self.hasher.root(seq.namespace(self.model_id))

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
                observer.on_commit(seq, start, end, list(table.block_ids))

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
        self.stats.num_resets += 1
        self.events.emit(AllBlocksCleared())
        return True

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
