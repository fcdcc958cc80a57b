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

The pool (``block_pool.py``) owns the blocks, the index (``index.py``) what is cached; this class
owns the sequences' block tables, the contract's rules, the statistics and the KV events, all
written here from what the pool and the index return. `match` is a pure lookup: a request's
lookup is counted once, when `allocate` admits it with its hit.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prefixcache.cache.block_hash import BlockHasher
from prefixcache.cache.block_pool import BlockPool, KVBlock, Taken, check_invariant
from prefixcache.cache.config import CacheConfig
from prefixcache.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBuffer,
    KVCacheEvent,
)  # fmt: skip
from prefixcache.cache.identity import CacheIdentity
from prefixcache.cache.index import NOTHING_INSERTED, CacheHit, PrefixIndex, SeqBlocks
from prefixcache.cache.sequence import Sequence
from prefixcache.cache.stats import CacheStats

__all__ = ["CacheObserver", "PrefixCache"]

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


class PrefixCache:
    """A paged KV-cache allocator with prefix reuse over ``num_blocks`` blocks.

    Both indexes keep: only complete, committed blocks are hittable; a block with
    ``ref_cnt > 1`` (shared) is never written; allocation touches hits before taking new blocks;
    a failed allocation changes nothing; at least one prompt token is always computed.
    ``model_id`` roots every namespace; ``zero_on_reuse`` queues a block for zeroing when it
    changes namespace; ``enable_kv_events`` buffers `BlockStored`/`BlockRemoved`/
    `AllBlocksCleared` (at most ``max_events``; newer ones are dropped and counted) for
    `take_events`, with token ids only if ``events_with_tokens``. ``eviction_policy`` orders
    the eviction of free cached blocks (radix: ``lru`` or ``lfu``; hash: ``lru``). The settings
    are validated once, as a `CacheConfig` (``self.config``).
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
        self.eviction_policy = config.eviction_policy
        self.events_with_tokens = config.events_with_tokens
        self.identity = CacheIdentity(config.model_id, block_size, hash_algo)
        self.hasher: BlockHasher = self.identity.hasher
        self.stats = CacheStats()
        self.events = EventBuffer(config.enable_kv_events, config.max_events)
        self.pool = BlockPool(num_blocks, block_size, zero_on_reuse=config.zero_on_reuse)
        self.protect_quiet_domains = True  # `_protected_from`; lifted by `without_protection`
        self.index = self._make_index()
        self.pool.attach(self.index)
        self._index_admits = type(self.index).admit is not PrefixIndex.admit  # (radix)
        self._tables: dict[str, SeqBlocks] = {}
        self._held: dict[str, int] = {}  # per domain: blocks in live tables (not a Counter: slow)
        self._observers: list[CacheObserver] = []

    @property
    def enable_caching(self) -> bool:
        """Deprecated name of ``enable_prefix_caching``."""
        return self.enable_prefix_caching

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
        if observer not in self._observers:
            self._observers.append(observer)

    def remove_observer(self, observer: CacheObserver) -> None:
        if observer in self._observers:
            self._observers.remove(observer)

    @property
    def observers(self) -> tuple[CacheObserver, ...]:
        return tuple(self._observers)

    # -- match ----------------------------------------------------------------------------------

    def match(self, seq: Sequence) -> CacheHit:
        """Longest cached prefix of ``seq``, capped at ``num_tokens - 1`` rounded down to a block.
        Pure: changes no ref count and no statistic. Empty for a sequence that does not read
        the cache."""
        start_ns = time.perf_counter_ns()
        reads = self.enable_prefix_caching and seq.use_cache and seq.read_cache
        hit = self.index.lookup(seq) if reads else CacheHit()
        hit.lookup_time_ns = time.perf_counter_ns() - start_ns
        hit.epoch = self.pool.epoch
        return hit

    def is_current(self, hit: CacheHit) -> bool:
        """No cached block was dropped since `match` returned ``hit``: it is still admissible
        (a lookup now may find more, never less)."""
        return hit.epoch == self.pool.epoch

    def _count_lookup(self, seq: Sequence, hit: CacheHit) -> None:
        """``seq`` was admitted with ``hit``: count its lookup (once per admission)."""
        stats = self.stats
        num_hit_blocks = len(hit.block_ids)
        stats.num_requests += 1
        stats.num_queried_tokens += len(seq.token_ids)
        stats.lookup_time_ns += hit.lookup_time_ns
        stats.num_hit_requests += num_hit_blocks > 0
        stats.num_hit_tokens += num_hit_blocks * self.block_size
        misses = stats.first_miss_blocks
        misses[num_hit_blocks] = misses.get(num_hit_blocks, 0) + 1

    # -- allocate -------------------------------------------------------------------------------

    def allocate(
        self, seq: Sequence, num_new_tokens: int, hit: CacheHit | None = None
    ) -> list[int] | None:
        """Make ``seq``'s block table cover its computed tokens plus ``num_new_tokens``.

        On the first call, ``hit`` (from `match`) supplies the computed prefix. Returns the whole
        block table, or None when the blocks do not fit (and then nothing changed)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        table = self._tables.get(seq.seq_id)
        if table is None:
            return self._allocate_first(seq, num_new_tokens, hit)
        if table.seq is not seq:
            raise ValueError(f"sequence id {seq.seq_id!r} is already live in this cache")
        return self._allocate_more(table, num_new_tokens)

    def _allocate_first(
        self, seq: Sequence, num_new_tokens: int, hit: CacheHit | None, *, counted: bool = True
    ) -> list[int] | None:
        given, hit = hit, hit or CacheHit()
        hit_blocks = self._checked_hit(seq, hit)
        num_hit = len(hit_blocks)
        computed = num_hit * self.block_size
        end = computed + num_new_tokens
        num_new = -(-end // self.block_size) - num_hit
        protected, num_protected = _NONE, 0
        if self.pool.other_cache_domains(seq.domain):  # else, the common case: nothing protected
            protected, num_protected = self._protected_from(seq.domain, num_hit + num_new)
        num_free = self.pool.num_free - num_protected
        if num_new + num_hit > num_free:  # admitting a hit consumes its free blocks
            reused = self.index.num_free_in(hit, hit_blocks) if num_hit else 0
            if num_new + reused > num_free:
                return None
        seq.num_computed_tokens = computed
        table = SeqBlocks(seq, hit_blocks, list(hit.block_ids), end, num_hit)
        if num_hit and self._index_admits:
            self.index.admit(table, hit)
        # touch before allocate (radix holds its path through the index, not by references)
        touch = hit_blocks[table.num_path :] if table.num_path else hit_blocks
        taken = self._take(num_new, self._owner_root(seq), protected, touch)
        table.blocks += taken.blocks
        table.block_ids += taken.block_ids
        self._tables[seq.seq_id] = table
        self._add_held(seq.domain, len(table.blocks))
        if counted:
            self._count_lookup(seq, hit)
            for observer in self._observers:
                observer.on_admit(seq, given, list(table.block_ids))
        return list(table.block_ids)

    def _protected_from(self, domain: str, num_more: int) -> tuple[frozenset[str], int]:
        """The domains whose free cached blocks ``domain`` may not evict for ``num_more`` more
        blocks, and how many blocks that keeps from it: while several domains use the pool, a
        domain that would hold more than its equal share (held + free cached blocks) evicts only
        from domains at or over theirs, so its churn cannot take a quiet tenant's cache; it gets
        None and the scheduler preempts its newest sequence instead. With one domain (or under
        its share) nothing is protected."""
        if not num_more or not self.protect_quiet_domains or not self.pool.other_cache_domains(
                domain):  # common: one domain
            return _NONE, 0
        free_cached = self.pool.free_cached_by_domain()
        usage = Counter(self._held)
        usage.update(free_cached)
        share = self.num_blocks / len(usage.keys() | {domain})
        if usage[domain] + num_more <= share:
            return _NONE, 0
        protected = [d for d in free_cached if d != domain and usage[d] <= share]
        return frozenset(protected), sum(free_cached[d] for d in protected)

    @contextlib.contextmanager
    def without_protection(self) -> Iterator[None]:
        """Allocations inside evict any free cached block, the quiet domains' too: for a caller
        that knows nobody contends (nothing running, a request that cannot start otherwise)."""
        before, self.protect_quiet_domains = self.protect_quiet_domains, False
        try:
            yield
        finally:
            self.protect_quiet_domains = before

    def _add_held(self, domain: str, num: int) -> None:
        held = self._held.get(domain, 0) + num
        if held:
            self._held[domain] = held
        else:
            del self._held[domain]

    def _checked_hit(self, seq: Sequence, hit: CacheHit) -> list[KVBlock]:
        """The hit's blocks, verified to still be cached for ``seq``."""
        if not hit.block_ids:
            return []
        if not (self.enable_prefix_caching and seq.use_cache):
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
        protected, num_protected = self._protected_from(domain, num_new)
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
            self._add_held(domain, len(taken.blocks))
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
            self.index.forget(taken.evicted_digests)
            if self.events.enabled:
                self.events.emit(
                    BlockRemoved(block_hashes=taken.evicted_digests, block_ids=taken.evicted_ids)
                )
        self._note_watermark()
        return taken

    def _note_watermark(self) -> None:
        stats = self.stats
        num_free = self.pool.num_free
        if stats.min_free_blocks < 0 or num_free < stats.min_free_blocks:
            stats.min_free_blocks = num_free

    def _owner_root(self, seq: Sequence) -> bytes | None:
        if not self.config.zero_on_reuse:
            return None
        if seq.use_cache and self.enable_prefix_caching:
            return self.identity.root(seq)
        return self.hasher.root(seq.namespace(self.model_id))

    # -- commit ---------------------------------------------------------------------------------

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        """The KV of ``seq``'s first ``num_computed_tokens`` tokens is written: full blocks among
        them become hittable."""
        self._commit(seq, num_computed_tokens, notify=True)

    def _commit(self, seq: Sequence, num_computed_tokens: int, *, notify: bool) -> None:
        table = self._tables.get(seq.seq_id)
        if table is None or table.seq is not seq:
            table = self._live_table(seq)  # raises
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
        if self.enable_prefix_caching and seq.use_cache:
            inserted = self.index.insert(table, start, end)
            if inserted is not NOTHING_INSERTED:
                stats = self.stats
                stats.num_committed_blocks += inserted.num_stored
                stats.num_duplicate_blocks += inserted.num_duplicates
                if self.events.enabled:
                    for run_start, run_end in inserted.runs:
                        self._emit_stored(table, run_start, run_end)
            if end > start and notify:
                for observer in self._observers:
                    observer.on_commit(seq, start, end, list(table.block_ids))

    def _emit_stored(self, table: SeqBlocks, start: int, end: int) -> None:
        """`BlockStored` for ``table``'s blocks ``start..end-1``, now hittable (token ids only
        if ``events_with_tokens``: they are tenant data)."""
        seq = table.seq
        bs = self.block_size
        digests = seq.block_digests
        self.events.emit(
            BlockStored(
                block_hashes=digests[start:end],
                parent_block_hash=digests[start - 1] if start else self.identity.root(seq),
                token_ids=seq.token_ids[start * bs : end * bs] if self.events_with_tokens else [],
                block_size=bs,
                block_ids=table.block_ids[start:end],
            )
        )

    def _table_of(self, seq: Sequence) -> SeqBlocks | None:
        table = self._tables.get(seq.seq_id)
        return table if table is not None and table.seq is seq else None

    def _live_table(self, seq: Sequence) -> SeqBlocks:
        table = self._table_of(seq)
        if table is None:
            raise ValueError(f"sequence {seq.seq_id!r} holds no blocks in this cache")
        return table

    # -- free, fork, reset ----------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, deepest first; committed ones stay cached until evicted."""
        self._free(seq, notify=True)

    def _free(self, seq: Sequence, *, notify: bool) -> None:
        table = self._tables.get(seq.seq_id)
        if table is None or table.seq is not seq:
            return
        del self._tables[seq.seq_id]
        self._add_held(seq.domain, -len(table.blocks))
        if len(table.blocks) > table.num_path:  # radix holds its path through the index
            held = table.blocks[table.num_path :] if table.num_path else table.blocks
            self.pool.release(reversed(held))
        if table.node is not None:  # the index's place for it (radix: its locked path)
            self.index.release(table)
        seq.num_computed_tokens = 0
        if notify:
            for observer in self._observers:
                observer.on_free(seq, len(table.blocks))

    def adopt(
        self, seq: Sequence, start: int, num_blocks: int, fill: Callable[[list[int], int], None]
    ) -> int:
        """Cache blocks ``start .. start + num_blocks - 1`` of ``seq`` whose KV comes from
        elsewhere (a lower tier), computing nothing: the blocks from the longest cached prefix
        on are allocated, ``fill(block_ids, first)`` writes their KV (``first``: the block index
        of ``block_ids[0]``), and they are committed and released, cached and most recently
        used, as if a sequence had computed them. No lookup is counted and observers hear
        nothing; `BlockStored` events are emitted. Returns how many blocks were filled: 0 when
        the cached prefix stops before ``start`` (the run would not join it), already covers the
        run, or the blocks do not fit. ``seq`` itself is not touched (it may not be live)."""
        if not (self.enable_prefix_caching and seq.use_cache) or num_blocks <= 0:
            return 0
        bs = self.block_size
        end = start + num_blocks
        if end > (len(seq.token_ids) - 1) // bs:
            raise ValueError(f"adopt: blocks up to {end} leave no token of {seq.seq_id!r} to "
                             "compute")
        stand_in = seq.fork(f"{seq.seq_id}\x00adopt")
        stand_in.num_computed_tokens = 0
        hit = self.index.lookup(stand_in)
        have = len(hit.block_ids)
        if not start <= have < end or stand_in.seq_id in self._tables:
            return 0
        hit.epoch = self.pool.epoch
        block_ids = self._allocate_first(stand_in, (end - have) * bs, hit, counted=False)
        if block_ids is None:
            return 0
        filled = block_ids[have:end]
        for block_id in filled:  # fill writes every slot: nothing to zero first
            self.pool.cancel_zero(block_id)
        try:
            fill(filled, have)
            self._commit(stand_in, end * bs, notify=False)
        finally:
            self._free(stand_in, notify=False)
        return end - have

    def hold(self, seq: Sequence, num_blocks: int) -> int:
        """Take a reference on the cached blocks among ``seq``'s first ``num_blocks`` (from the
        first, as far as they are cached), computing nothing and counting no lookup: a pin.
        ``seq`` is then live, its blocks out of every free queue; `free` lets them go. Returns
        how many blocks it holds (0: none cached, or ``seq`` is live already)."""
        if not (self.enable_prefix_caching and seq.use_cache) or seq.seq_id in self._tables:
            return 0
        if num_blocks > (len(seq.token_ids) - 1) // self.block_size:
            raise ValueError(f"hold: {num_blocks} blocks leave no token of {seq.seq_id!r}")
        hit = self.index.lookup(seq)
        if not hit.block_ids:
            return 0
        if len(hit.block_ids) > num_blocks:  # a longer sequence than the blocks asked for
            raise ValueError(f"hold: give {seq.seq_id!r} num_blocks * block_size + 1 tokens")
        hit.epoch = self.pool.epoch
        block_ids = self._allocate_first(seq, 0, hit, counted=False)
        return 0 if block_ids is None else len(block_ids)

    def fork(self, seq: Sequence, child_id: str) -> Sequence:
        """A child sharing every block of ``seq`` (ref counts up), for n > 1 sampling."""
        table = self._live_table(seq)
        if child_id in self._tables:
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
            self.index.fork(table, child_table)
        self._tables[child_id] = child_table
        self._add_held(child.domain, len(child_table.blocks))
        return child

    def drop_domain(self, domain: str) -> list[int]:
        """Evict every free cached block of isolation domain ``domain`` (a tenant's purge);
        blocks live sequences hold stay until they are freed. Returns the evicted blocks' ids
        (their KV is still in the tensors: the caller may zero it). Counted and announced as
        evictions."""
        free_cached = self.pool.free_cached_by_domain()
        num = free_cached.get(domain, 0)
        if not num:
            return []
        others = frozenset(d for d in free_cached if d != domain)
        # take hands out uncached free blocks first: take them too, and give them all back
        num_uncached = self.pool.num_free - sum(free_cached.values())
        taken = self._take(num_uncached + num, None, others)
        self.pool.release(reversed(taken.blocks))
        return taken.evicted_ids

    def reset(self) -> bool:
        """Drop every cached block. Refuses (False, nothing changed) while any block is in use."""
        if not self.pool.reset():
            return False
        self.stats.num_resets += 1
        self.events.emit(AllBlocksCleared())
        return True

    # -- views and drains -----------------------------------------------------------------------

    def block_table(self, seq: Sequence) -> list[int]:
        """The current block table of ``seq`` (empty if it holds none)."""
        table = self._table_of(seq)
        return list(table.block_ids) if table is not None else []

    def blocks_held(self, domain: str = "") -> int:
        """Blocks in the live block tables of ``domain``'s sequences."""
        return self._held.get(domain, 0)

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

    @property
    def zero_on_reuse(self) -> bool:
        return self.pool.zero_on_reuse

    @property
    def enable_kv_events(self) -> bool:
        return self.events.enabled

    @property
    def num_dropped_events(self) -> int:
        return self.events.num_dropped

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
        held: Counter[str] = Counter()
        for seq_id, table in self._tables.items():
            refs.update(table.block_ids[table.num_path :])  # the path is held by the index
            held[table.seq.domain] += len(table.blocks)
            self._check_table(seq_id, table)
        self.pool.check_integrity(refs)
        held = +held  # without domains holding nothing
        check_invariant(held == self._held, "blocks held per domain {} == {}", self._held, held)
        self.index.check(self._tables)

    def _check_table(self, seq_id: str, table: SeqBlocks) -> None:
        bs = self.block_size
        blocks = table.blocks
        check_invariant(
            table.seq.seq_id == seq_id and [b.block_id for b in blocks] == table.block_ids,
            "table of {!r} belongs to its sequence; its block ids match its blocks",
            seq_id,
        )
        computed, allocated = table.num_computed_tokens, table.num_alloc_tokens
        check_invariant(
            computed <= allocated <= len(blocks) * bs,
            "computed <= allocated <= table size for {!r}",
            seq_id,
        )
        # the blocks about to be written (none when nothing is pending)
        for block in blocks[computed // bs : -(-allocated // bs) if allocated > computed else 0]:
            check_invariant(block.ref_cnt == 1, "a shared block is never a write target", block)
