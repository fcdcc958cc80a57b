"""The block pool, the only allocator: every KV block, its ref count, the free queues, the owner
roots for zero-on-reuse, the copy-on-write and zeroing lists, and the KV event buffer.

The pool knows block ids, ref counts and whether a block is cached (its digest and the token bytes
the digest stands for); not sequences, block tables, hashing or tensors. A `PrefixCache`
(``base.py``) drives it; its prefix index decides which blocks are cached.

- Blocks are created once (``__slots__``). Free blocks wait in intrusive doubly-linked queues
  between a head and a tail sentinel (pop, append, remove from the middle: O(1), no allocation):
  one of uncached blocks, handed out first (they are worth nothing), and per isolation domain
  one of its cached blocks, least recently used first. Eviction takes from the domain with the
  most free cached blocks, so one tenant's churn evicts its own cache before a quiet tenant's
  prefix. With one domain this is one LRU queue: uncached blocks, then cached ones in release
  order (the head goes first).
- A free cached block stays hittable until it is reused (lazy eviction): queued (hash), or
  parked in the index (radix: see ``index.py``).
- ``num_free`` = queued + parked: what can be handed out now. ``epoch`` counts the moments a
  digest was dropped (eviction, reset): a hit found at the current epoch is still valid.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from operator import attrgetter
from typing import TYPE_CHECKING

from prefixcache.cache.events import AllBlocksCleared, BlockRemoved, EventBuffer
from prefixcache.cache.stats import CacheStats

if TYPE_CHECKING:
    from prefixcache.cache.index import PrefixIndex

__all__ = ["DEFAULT_MAX_EVENTS", "BlockPool", "KVBlock", "check_invariant"]

DEFAULT_MAX_EVENTS = 100_000
_NONE: frozenset[str] = frozenset()
_count = attrgetter("count")


class KVBlock:
    """One physical KV block. ``digest`` is None unless the block is full, committed and cached.

    ``prev``/``next`` are the free-queue links (meaningful only while ``ref_cnt == 0``: in the
    uncached queue if ``digest`` is None, else in ``domain``'s); ``owner_root`` is the namespace
    root of the last sequence that held it (zero-on-reuse); ``domain`` the isolation domain that
    cached it.
    """

    __slots__ = (
        "block_id", "ref_cnt", "digest", "token_bytes", "prev", "next", "owner_root", "domain",
    )  # fmt: skip

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.digest: bytes | None = None
        self.token_bytes: bytes | None = None
        self.prev: KVBlock = self
        self.next: KVBlock = self
        self.owner_root: bytes | None = None
        self.domain = ""

    def __repr__(self) -> str:
        digest = self.digest.hex()[:8] if self.digest is not None else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, digest={digest})"


class _Queue:
    """An intrusive doubly-linked list of free blocks between two sentinels, with its length."""

    __slots__ = ("head", "tail", "count", "domain")

    def __init__(self, domain: str = "") -> None:
        self.domain = domain
        self.head = KVBlock(-1)
        self.tail = KVBlock(-2)
        self.head.next, self.tail.prev = self.tail, self.head
        self.count = 0

    def blocks(self) -> list[KVBlock]:
        out = []
        block, tail = self.head.next, self.tail
        while block is not tail:
            out.append(block)
            block = block.next
        return out


class BlockPool:
    """``num_blocks`` blocks with ids ``0..num_blocks-1``; the initial free queue is ``0, 1, 2...``.

    Counters go to ``stats``. `attach` names the prefix index that caches blocks in this pool.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        stats: CacheStats | None = None,
        enable_kv_events: bool = True,
        max_events: int = DEFAULT_MAX_EVENTS,
        zero_on_reuse: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks, block_size must be >= 1: {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.stats = stats if stats is not None else CacheStats()
        self.events = EventBuffer(enable_kv_events, max_events)
        self.zero_on_reuse = zero_on_reuse
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.index: PrefixIndex | None = None
        self.num_queued = num_blocks  # free blocks in the queues
        self.num_parked = 0  # evictable cached blocks the index keeps (it maintains this count)
        self.num_cached = 0  # blocks with a digest (hittable), held or free
        self.epoch = 0
        self._mapped: dict[bytes, KVBlock] = {}  # the index's digest map (hash)
        self._parked: dict[str, int] | None = None  # the index's parked blocks per domain (radix)
        self._to_zero: list[int] = []
        self._copies: list[tuple[int, int]] = []
        self._free = _Queue()  # free uncached blocks: handed out first
        self._lru: dict[str, _Queue] = {}  # per domain: its free cached blocks, LRU first
        self._link_all(self.blocks)

    def attach(self, index: PrefixIndex) -> None:
        """``index`` caches blocks of this pool (before any block is cached)."""
        self.index = index
        if index.digest_map is not None:
            self._mapped = index.digest_map
        self._parked = index.parked

    def _link_all(self, blocks: list[KVBlock]) -> None:
        """Every block free and uncached, queued in the order of ``blocks``."""
        queue = self._free
        chain = [queue.head, *blocks, queue.tail]
        for left, right in zip(chain, chain[1:], strict=False):
            left.next = right
            right.prev = left
        queue.count = self.num_queued = len(blocks)
        self._lru.clear()

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: queued, or parked and evictable."""
        return self.num_queued + self.num_parked

    def free_block_ids(self) -> list[int]:
        """The queues in the order they are handed out with one domain: uncached blocks, then
        each domain's cached ones, least recently used first (parked blocks are not queued)."""
        queues = [self._free, *self._lru.values()]
        return [block.block_id for queue in queues for block in queue.blocks()]

    # -- taking and releasing -------------------------------------------------------------------

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on each block, pulling free ones out of their queue (no eviction)."""
        num_uncached = num_cached = 0
        # the queue of the current run of free cached blocks, its domain, and the run's length
        queue: _Queue | None = None
        domain: str | None = None
        run = 0
        for block in blocks:
            ref_cnt = block.ref_cnt
            if not ref_cnt:
                prev = block.prev
                nxt = block.next
                prev.next = nxt
                nxt.prev = prev
                if block.digest is None:
                    num_uncached += 1
                else:
                    if block.domain is not domain:
                        if queue is not None:
                            queue.count -= run
                            num_cached += run
                        domain, run = block.domain, 0
                        queue = self._lru[domain]
                    run += 1
            block.ref_cnt = ref_cnt + 1
        if queue is not None:
            queue.count -= run
        self._free.count -= num_uncached
        self.num_queued -= num_uncached + num_cached + run
        self._note_watermark()

    def take(
        self, num: int, owner_root: bytes | None = None, protected: frozenset[str] = _NONE
    ) -> list[KVBlock]:
        """``num`` blocks with ``ref_cnt = 1`` (see `take_with_ids`)."""
        return self.take_with_ids(num, owner_root, protected)[0]

    def take_with_ids(
        self, num: int, owner_root: bytes | None = None, protected: frozenset[str] = _NONE
    ) -> tuple[list[KVBlock], list[int]]:
        """``num`` blocks with ``ref_cnt = 1``, and their ids: queued ones first, then parked
        ones the index evicts; a cached block taken loses its digest (an eviction). The caller
        checked ``num <= num_free``, less the free cached blocks of the ``protected`` domains
        (never evicted here). ``owner_root``: the new owner's namespace (zero-on-reuse)."""
        if num > self.num_free:
            raise RuntimeError(f"take({num}) with only {self.num_free} free blocks")
        out: list[KVBlock] = []
        ids: list[int] = []
        if num > 0:
            queued = self.num_queued
            if protected:
                queued -= sum(q.count for d, q in self._lru.items() if d in protected)
            if queued:
                self._take_queued(min(num, queued), out, ids, protected)
            if len(out) < num:
                assert self.index is not None
                parked_ids, digests = self.index.evict(num - len(out), out, protected)
                self.num_parked -= len(parked_ids)
                self._dropped(parked_ids, digests)
                ids += parked_ids
            if self.zero_on_reuse:
                self._note_owner(out, owner_root)
        self._note_watermark()
        return out, ids

    def _take_queued(
        self, num: int, out: list[KVBlock], ids: list[int], protected: frozenset[str]
    ) -> None:
        """``num`` queued blocks into ``out`` (their ids into ``ids``): uncached ones first,
        then cached ones from the domain with the most of them (its least recently used first)."""
        free = self._free
        left = min(num, free.count)
        block = free.head.next
        for _ in range(left):
            block.ref_cnt = 1
            out.append(block)
            ids.append(block.block_id)
            block = block.next
        free.head.next = block
        block.prev = free.head
        free.count -= left
        left = num - left
        self.num_queued -= num
        if not left:
            return
        lru = self._lru
        evicted: list[int] = []
        digests: list[bytes] = []
        if len(lru) == 1 and not protected:  # one domain: its LRU order
            left -= self._evict_queued(next(iter(lru.values())), left, out, evicted, digests)
        else:
            for domain in [d for d, q in lru.items() if not q.count]:
                del lru[domain]  # empty: no block refers to it
        while left:  # several domains compete: the one with the most free cached blocks gives one
            queue = max((q for d, q in lru.items() if d not in protected), key=_count)
            left -= self._evict_queued(queue, 1, out, evicted, digests)
            if not queue.count:
                del lru[queue.domain]
        self._dropped(evicted, digests)
        ids += evicted

    def _evict_queued(
        self, queue: _Queue, num: int, out: list[KVBlock], ids: list[int], digests: list[bytes]
    ) -> int:
        """Pop ``num`` cached blocks off ``queue``: each loses its digest and its map entry."""
        num = min(num, queue.count)
        mapped = self._mapped
        block = queue.head.next
        for _ in range(num):
            digest = block.digest
            if mapped.get(digest) is block:  # type: ignore[arg-type]  # queued cached: a digest
                del mapped[digest]  # type: ignore[arg-type]
            digests.append(digest)  # type: ignore[arg-type]
            ids.append(block.block_id)
            block.digest = block.token_bytes = None
            block.ref_cnt = 1
            out.append(block)
            block = block.next
        queue.head.next = block
        block.prev = queue.head
        queue.count -= num
        return num

    def _dropped(self, ids: list[int], digests: list[bytes]) -> None:
        """Blocks ``ids`` (with these ``digests``) stopped being cached: count and announce it."""
        if not ids:
            return
        self.num_cached -= len(ids)
        self.epoch += 1
        self.stats.num_evictions += len(ids)
        if self.events.enabled:
            self.events.emit(BlockRemoved(block_hashes=digests, block_ids=ids))

    def _note_owner(self, blocks: list[KVBlock], owner_root: bytes | None) -> None:
        for block in blocks:
            if owner_root is None or block.owner_root != owner_root:
                self._to_zero.append(block.block_id)
            block.owner_root = owner_root

    def _note_watermark(self) -> None:
        stats = self.stats
        num_free = self.num_queued + self.num_parked
        if stats.min_free_blocks < 0 or num_free < stats.min_free_blocks:
            stats.min_free_blocks = num_free

    def release(self, blocks_in_order: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order (callers pass a table reversed):
        a block reaching ``ref_cnt == 0`` goes to its domain's queue tail if it is cached (it
        stays hittable), or to the head of the uncached queue if not (worth nothing)."""
        free = self._free
        head = free.head
        num_free = num_cached = 0
        # the queue the current run of cached blocks joins, its last block, and the run's length
        lru: _Queue | None = None
        lru_domain: str | None = None
        last = head
        run = 0
        for block in blocks_in_order:
            ref_cnt = block.ref_cnt - 1
            block.ref_cnt = ref_cnt
            if ref_cnt:
                continue
            if block.digest is None:
                first = head.next
                block.next = first
                first.prev = block
                block.prev = head
                head.next = block
                num_free += 1
                continue
            domain = block.domain
            if domain is not lru_domain and domain != lru_domain:
                if lru is not None:
                    last.next = lru.tail
                    lru.tail.prev = last
                    lru.count += run
                    num_cached += run
                lru = self._lru.get(domain)
                if lru is None:
                    lru = self._lru[domain] = _Queue(domain)
                lru_domain, run, last = domain, 0, lru.tail.prev
            last.next = block
            block.prev = last
            last = block
            run += 1
        if lru is not None:
            last.next = lru.tail
            lru.tail.prev = last
            lru.count += run
        free.count += num_free
        self.num_queued += num_free + num_cached + run

    def copy_on_write(
        self, src: KVBlock, root: bytes | None, *, copy: bool, protected: frozenset[str] = _NONE
    ) -> KVBlock:
        """A private block to write instead of the shared ``src`` (whose reference is dropped);
        ``copy``: its KV must be copied from ``src`` first (queued for the runner)."""
        (dst,) = self.take(1, root, protected)
        if copy:
            self._copies.append((src.block_id, dst.block_id))
            self.cancel_zero(dst.block_id)  # the copy overwrites the whole block
        self.release((src,))
        return dst

    # -- domains --------------------------------------------------------------------------------

    def other_cache_domains(self, domain: str) -> bool:
        """Whether a domain other than ``domain`` may have free cached blocks (cheap; may say
        True for a domain whose count dropped to 0)."""
        keys = self._parked if self._parked is not None else self._lru
        return len(keys) > 1 or (len(keys) == 1 and domain not in keys)

    def free_cached_by_domain(self) -> dict[str, int]:
        """Free (evictable) cached blocks per domain."""
        if self._parked is not None:
            return {d: n for d, n in self._parked.items() if n}
        return {d: q.count for d, q in self._lru.items() if q.count}

    # -- reset, copies and zero-on-reuse ------------------------------------------------

    def reset(self) -> bool:
        """Drop every digest. Refuses (False, nothing changed) while any block is in use."""
        if self.num_free != self.num_blocks:
            return False
        # hash: the queue order stays (uncached, then each domain's, LRU first); radix: parked
        # blocks rejoin the queue, all in id order
        order = self.blocks
        if self._parked is None:
            order = [b for q in (self._free, *self._lru.values()) for b in q.blocks()]
        for block in self.blocks:  # radix: the tree's references go too
            block.digest = block.token_bytes = None
            block.ref_cnt = 0
        if self.index is not None:
            self.index.clear()
        self._link_all(order)
        self.num_parked = self.num_cached = 0
        self.epoch += 1
        self.stats.num_resets += 1
        self.events.emit(AllBlocksCleared())
        return True

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def cancel_zero(self, block_id: int) -> None:
        """``block_id`` is about to be overwritten whole (a copy-on-write target): no zeroing."""
        if block_id in self._to_zero:
            self._to_zero.remove(block_id)

    def take_blocks_to_zero(self) -> list[int]:
        ids, self._to_zero = self._to_zero, []
        return ids

    # -- invariants -----------------------------------------------------------------------------

    def check_integrity(self, table_refs: Mapping[int, int]) -> None:
        """Check the pool against ``table_refs`` (block id -> live block-table references)."""
        blocks = self.blocks
        check_invariant(len(blocks) == self.num_blocks, "block count conserved")
        for i, block in enumerate(blocks):
            check_invariant(block.block_id == i, "block count conserved: slot {} is {!r}", i, block)
            check_invariant(
                block.ref_cnt == table_refs.get(i, 0),
                "ref count equals live table references: {!r} has {}",
                block,
                table_refs.get(i, 0),
            )
            check_invariant(
                (block.digest is None) == (block.token_bytes is None),
                "a block keeps its tokens exactly while it has a digest: {!r}",
                block,
            )
        num_cached = sum(1 for b in blocks if b.digest is not None)
        if self._parked is None:  # radix: the tree's blocks carry no digest (the index checks)
            check_invariant(num_cached == self.num_cached, "cached count {} kept", num_cached)
        seen: set[int] = set()
        for queue in [self._free, *self._lru.values()]:
            prev, block, count = queue.head, queue.head.next, 0
            while block is not queue.tail and len(seen) <= self.num_blocks:
                check_invariant(block.prev is prev, "free queue links consistent at {!r}", block)
                check_invariant(
                    block.ref_cnt == 0 and block.block_id not in seen
                    and (block.digest is None) == (queue is self._free)
                    and (queue is self._free or self._lru.get(block.domain) is queue),
                    "a queued block is free and queued once: uncached ones together, cached ones "
                    "in their domain's queue: {!r}",
                    block,
                )  # fmt: skip
                seen.add(block.block_id)
                count += 1
                prev, block = block, block.next
            check_invariant(queue.tail.prev is prev, "free queue links consistent at the tail")
            check_invariant(queue.count == count, "queue length {} kept", count)
        free = sum(1 for b in blocks if b.ref_cnt == 0)
        check_invariant(
            len(seen) == self.num_queued == free,
            "the queues hold the free blocks ({} queued, {} kept, {} free)",
            len(seen),
            self.num_queued,
            free,
        )


def check_invariant(condition: bool, invariant: str, *args: object) -> None:
    """Raise AssertionError naming ``invariant`` unless ``condition`` holds. ``invariant`` is a
    ``str.format`` template filled with ``args`` only on failure (no string building per check)."""
    if not condition:
        raise AssertionError("integrity: " + (invariant.format(*args) if args else invariant))
