"""Growing block tables out of the pool: a sequence's first table from its hit, more blocks
as it computes, copy-on-write of shared blocks, and every block taken with its evictions
counted and announced. `PrefixCache.allocate` is its caller, and the contract's other owners
(`adoption.adopt`, `pins.hold`, `purge.evict_domain`) call it for blocks no request asked for.

``protection`` (None: none) names the domains whose free cached blocks an allocation may not
evict (the scheduler's fair shares); with one domain in the pool it is never asked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from prefixcache.cache.block_pool import BlockPool, KVBlock, Taken
from prefixcache.cache.config import CacheConfig
from prefixcache.cache.events import BlockRemoved, EventBuffer
from prefixcache.cache.fates import BlockFates
from prefixcache.cache.identity import CacheIdentity
from prefixcache.cache.index import CacheHit, PrefixIndex, SeqBlocks
from prefixcache.cache.sequence import Sequence
from prefixcache.cache.stats import CacheStats
from prefixcache.cache.tables import LiveTables

if TYPE_CHECKING:
    from prefixcache.cache.observer import CacheObserver

__all__ = ["Protection", "TableAllocator"]

_NONE: frozenset[str] = frozenset()


class Protection(Protocol):
    """Which domains' free cached blocks ``domain`` may not evict to take ``num_more`` more
    blocks (the scheduler's fair shares, `sched.fairness.QuietDomains`)."""

    def __call__(self, domain: str, num_more: int) -> frozenset[str]: ...


class TableAllocator:
    """Block tables of a cache's ``tables``, grown from its ``pool``; ``admitted`` and
    ``evicted`` are the index kind's own steps (radix: lock a hit's path; hash: forget the
    digests the pool reused)."""

    def __init__(
        self, config: CacheConfig, pool: BlockPool, index: PrefixIndex, tables: LiveTables,
        stats: CacheStats, events: EventBuffer, identity: CacheIdentity,
        observers: list[CacheObserver], admitted: Callable[[SeqBlocks, CacheHit], None],
        evicted: Callable[[list[bytes]], None],
    ) -> None:  # fmt: skip
        self.config = config
        self.block_size = config.block_size
        self.pool, self.index, self.tables = pool, index, tables
        self.stats, self.events, self.identity = stats, events, identity
        self.observers = observers
        self.admitted, self.evicted = admitted, evicted
        self.protection: Protection | None = None
        self.fates: BlockFates | None = None  # why blocks left (diagnostics); None: not kept

    def writes(self, seq: Sequence) -> bool:
        return self.config.enable_prefix_caching and seq.writes_cache

    def first(
        self, seq: Sequence, num_new_tokens: int, hit: CacheHit | None, *, counted: bool = True
    ) -> list[int] | None:
        """``counted``: a request's admission (its lookup counted, observers told); else a
        stand-in of a pin or a tier load."""
        given, hit = hit, hit or CacheHit()
        hit_blocks = self.checked_hit(seq, hit)
        num_hit = len(hit_blocks)
        computed = num_hit * self.block_size
        end = computed + num_new_tokens
        num_new = -(-end // self.block_size) - num_hit
        protected, num_protected = self.protected(seq.domain, num_hit + num_new)
        num_free = self.pool.num_free - num_protected
        if num_new + num_hit > num_free:  # admitting a hit consumes its free blocks
            reused = self.index.num_free_in(hit, hit_blocks) if num_hit else 0
            if num_new + reused > num_free:
                return None
        seq.num_computed_tokens = computed
        table = SeqBlocks(seq, hit_blocks, list(hit.block_ids), end, num_hit)
        if num_hit:
            self.admitted(table, hit)
        # touch before allocate (radix holds its path through the index, not by references)
        taken = self.take(num_new, self.owner_root(seq), protected, hit_blocks[table.num_path :],
                          domain=seq.domain)
        table.blocks += taken.blocks
        table.block_ids += taken.block_ids
        self.tables.add(table)
        if counted:  # a request's lookup is counted once, when it is admitted
            self.stats.count_lookup(len(seq.token_ids), hit.num_blocks, self.block_size,
                                    hit.lookup_time_ns)
            for observer in self.observers:
                observer.on_admit(seq, given, list(table.block_ids))
        return list(table.block_ids)

    def protected(self, domain: str, num_more: int) -> tuple[frozenset[str], int]:
        """The domains whose free cached blocks ``domain`` may not evict for ``num_more`` more
        blocks (``protection``'s answer), and how many blocks that keeps from it."""
        if self.protection is None or not num_more or not self.pool.other_cache_domains(domain):
            return _NONE, 0  # the common case: one domain
        protected = self.protection(domain, num_more)
        if not protected:
            return _NONE, 0
        free_cached = self.pool.free_cached_by_domain()
        return protected, sum(free_cached.get(d, 0) for d in protected)

    def checked_hit(self, seq: Sequence, hit: CacheHit) -> list[KVBlock]:
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

    def more(self, table: SeqBlocks, num_new_tokens: int) -> list[int] | None:
        """Grow ``table`` by ``num_new_tokens``, copying the shared blocks it is about to write
        (copy-on-write); None when the blocks do not fit (nothing changed)."""
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
        protected, num_protected = self.protected(domain, num_new)
        if num_new + len(shared) > self.pool.num_free - num_protected:
            return None
        root = self.owner_root(table.seq)
        for i in shared:  # a shared block is never written: the table gets its own copy
            (dst,) = self.take(1, root, protected, domain=domain).blocks
            self.pool.copy_on_write(blocks[i], dst, copy=i * bs < computed)
            blocks[i] = dst
            table.block_ids[i] = dst.block_id
        taken = self.take(num_new, root, protected, domain=domain)
        if taken.blocks:
            self.tables.grew(domain, len(taken.blocks))
            blocks += taken.blocks
            table.block_ids += taken.block_ids
        table.num_alloc_tokens = max(table.num_alloc_tokens, end)
        return list(table.block_ids)

    def take(
        self,
        num: int,
        owner_root: bytes | None,
        protected: frozenset[str],
        touch: list[KVBlock] | None = None,
        *,
        domain: str | None,
    ) -> Taken:
        """``num`` new blocks from the pool (after a reference on each of ``touch``) for a
        sequence of ``domain`` (None: a purge); evictions are counted, announced, recorded in
        ``fates`` and forgotten by the index here, and the free-block low watermark kept."""
        taken = self.pool.take(num, owner_root, protected, touch)
        if taken.evicted_digests:
            self.stats.num_evictions += len(taken.evicted_digests)
            self.evicted(taken.evicted_digests)
            if self.fates is not None:
                self.fates.evicted(taken.evicted_digests, domain)
            if self.events.enabled:
                self.events.emit(
                    BlockRemoved(block_hashes=taken.evicted_digests, block_ids=taken.evicted_ids)
                )
        stats, num_free = self.stats, self.pool.num_free
        if stats.min_free_blocks < 0 or num_free < stats.min_free_blocks:
            stats.min_free_blocks = num_free
        return taken

    def owner_root(self, seq: Sequence) -> bytes | None:
        if not self.config.zero_on_reuse:
            return None
        if self.writes(seq):
            return self.identity.tail_root(seq)  # a tenant's own, after any public prefix
        return self.identity.hasher.root(seq.namespace(self.config.model_id,
                                                       self.config.kv_layout))
