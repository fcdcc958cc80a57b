"""The block pool, the only allocator: every KV block, its ref count, the free queue, the
owner roots for zero-on-reuse, the copy-on-write and zeroing lists, and the KV event buffer.

Boundary: the pool knows block ids, ref counts and whether a block is cached (its digest and the
token bytes the digest stands for). It knows nothing about sequences, block tables, hashing or
tensors. A `PrefixCache` (``manager.py``) drives it; its prefix index (``index.py``) decides which
blocks are cached and, for an index that parks its free cached blocks, which one goes next.

- Blocks are created once (``__slots__``) and never allocated again.
- Free blocks wait in queues, intrusive doubly-linked lists threaded through the blocks between
  a head and a tail sentinel (popleft, append, appendleft, remove-from-the-middle: O(1), no
  allocation): one of uncached blocks, handed out first (they are worth nothing), and per
  isolation domain one of its cached blocks, least recently used first. Eviction takes from the
  domain with the most free cached blocks, so a tenant's churn evicts its own cache before a
  quiet tenant's prefix. With one domain this is exactly one LRU queue: uncached blocks, then
  cached ones in release order (the head is evicted first).
- A free cached block stays hittable until it is reused (lazy eviction): it waits in the queue
  (hash index), or the index keeps it (radix: its tree holds the block, the node's locks stand
  for the sequences using it, ``ref_cnt`` stays 0) and gives it up through ``evict`` when no
  sequence locks it. ``num_parked`` counts those evictable blocks, kept by the index.
- ``num_free`` = queued + parked: what can be handed out now.
- ``epoch`` counts the moments a digest was dropped (eviction, reset): a hit found at the current
  epoch is still valid without re-checking each block.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from prefixcache.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    EventBuffer,
    KVCacheEvent,
)
from prefixcache.cache.stats import CacheStats

if TYPE_CHECKING:
    from prefixcache.cache.index import PrefixIndex

__all__ = ["DEFAULT_MAX_EVENTS", "BlockPool", "KVBlock", "check_invariant"]

DEFAULT_MAX_EVENTS = 100_000


class KVBlock:
    """One physical KV block. ``digest`` is None unless the block is full, committed and mapped.

    ``prev``/``next`` are the free-queue links and ``queue`` the queue they are in (meaningful
    only while ``ref_cnt == 0``); ``owner_root`` is the namespace root of the last sequence that
    held it (zero-on-reuse); ``domain`` the isolation domain that cached it.
    """

    __slots__ = (
        "block_id", "ref_cnt", "digest", "token_bytes", "prev", "next", "queue", "owner_root",
        "domain",
    )  # fmt: skip

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.digest: bytes | None = None
        self.token_bytes: bytes | None = None
        self.prev: KVBlock = self
        self.next: KVBlock = self
        self.queue: _Queue | None = None
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

    def ids(self) -> list[int]:
        out = []
        block, tail = self.head.next, self.tail
        while block is not tail:
            out.append(block.block_id)
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
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.stats = stats if stats is not None else CacheStats()
        self.events = EventBuffer(enable_kv_events, max_events)
        self.zero_on_reuse = zero_on_reuse
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.index: PrefixIndex | None = None
        self.num_queued = num_blocks  # free blocks in the queue
        self.num_parked = 0  # evictable cached blocks the index keeps (it maintains this count)
        self.num_cached = 0  # blocks with a digest (hittable), held or free
        self.epoch = 0
        self._parks = False
        self._to_zero: list[int] = []
        self._copies: list[tuple[int, int]] = []
        self._free = _Queue()  # free uncached blocks: handed out first
        self._lru: dict[str, _Queue] = {}  # per domain: its free cached blocks, LRU first
        self._link_all(self.blocks)

    def attach(self, index: PrefixIndex) -> None:
        """``index`` caches blocks of this pool (before any block is cached)."""
        self.index = index
        self._parks = index.parks_blocks

    def _link_all(self, blocks: list[KVBlock]) -> None:
        """Every block free and uncached, queued in the order of ``blocks``."""
        queue = self._free
        chain = [queue.head, *blocks, queue.tail]
        for left, right in zip(chain, chain[1:], strict=False):
            left.next = right
            right.prev = left
        for block in blocks:
            block.queue = queue
        queue.count = self.num_queued = len(blocks)
        self._lru.clear()

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: queued, or parked and evictable."""
        return self.num_queued + self.num_parked

    # -- the free queue -------------------------------------------------------------------------

    def free_block_ids(self) -> list[int]:
        """The free queues, in the order they are handed out with one domain: uncached blocks,
        then each domain's cached ones, least recently used first; parked blocks are not here."""
        out = self._free.ids()
        for queue in self._lru.values():
            out += queue.ids()
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on each block, pulling free ones out of the queue (no eviction)."""
        num_queued = 0
        queue: _Queue | None = None  # the queue of the last run of free blocks, and its length
        run = 0
        for block in blocks:
            ref_cnt = block.ref_cnt
            if not ref_cnt:
                prev = block.prev
                nxt = block.next
                prev.next = nxt
                nxt.prev = prev
                if block.queue is not queue:
                    if queue is not None:
                        queue.count -= run
                    queue, run = block.queue, 0
                run += 1
                num_queued += 1
            block.ref_cnt = ref_cnt + 1
        if queue is not None:
            queue.count -= run
        self.num_queued -= num_queued
        self._note_watermark()

    def take(
        self, num: int, owner_root: bytes | None = None, protected: frozenset[str] = frozenset()
    ) -> list[KVBlock]:
        """``num`` blocks with ``ref_cnt = 1``: the queue's head first, then parked ones the index
        evicts; a cached block taken loses its digest (an eviction).

        The caller checked ``num <= num_free`` (less the free cached blocks of the ``protected``
        domains, which are not evicted). ``owner_root`` is the new owner's namespace root (used
        only with zero-on-reuse).
        """
        if num > self.num_free:
            raise RuntimeError(f"take({num}) with only {self.num_free} free blocks")
        out: list[KVBlock] = []
        if num > 0:
            evicted = self._pop_queued(min(num, self._num_takeable(protected)), out, protected)
            if len(out) < num:
                assert self.index is not None
                parked, digests = self.index.evict(num - len(out), protected)
                self.num_parked -= len(parked)
                for block in parked:
                    block.ref_cnt = 1
                    block.digest = block.token_bytes = None
                self._dropped(parked, digests)
                out += parked
            if evicted:
                self._evict(out)
            if self.zero_on_reuse:
                self._note_owner(out, owner_root)
        self._note_watermark()
        return out

    def _num_takeable(self, protected: frozenset[str]) -> int:
        if not protected:
            return self.num_queued
        return self.num_queued - sum(q.count for d, q in self._lru.items() if d in protected)

    def other_cache_domains(self, domain: str) -> bool:
        """Whether a domain other than ``domain`` may have free cached blocks (cheap; may say
        True for a domain whose count dropped to 0)."""
        keys = self.index.evictable_domains() if self._parks else self._lru.keys()  # type: ignore[union-attr]
        return len(keys) > 1 or (len(keys) == 1 and domain not in keys)

    def free_cached_by_domain(self) -> dict[str, int]:
        """Free (evictable) cached blocks per domain."""
        if self._parks:
            assert self.index is not None
            return self.index.evictable_by_domain()
        return {d: q.count for d, q in self._lru.items() if q.count}

    def _pop_queued(
        self, num: int, out: list[KVBlock], protected: frozenset[str] = frozenset()
    ) -> bool:
        """Pop ``num`` queued blocks into ``out``: uncached ones first, then cached ones from the
        domain with the most of them (its least recently used first), so one domain's churn
        evicts its own cached blocks before another's. True if any carries a digest."""
        left = num - self._pop(self._free, num, out)
        evicted = left > 0
        if evicted:
            for domain in [d for d, q in self._lru.items() if not q.count]:
                del self._lru[domain]  # empty: no block refers to it
        while left:
            if len(self._lru) == 1 and not protected:
                left -= self._pop(next(iter(self._lru.values())), left, out)
                break
            # several domains compete: the one with the most free cached blocks gives one up
            queue = max(
                (q for d, q in self._lru.items() if d not in protected), key=_count
            )
            left -= self._pop(queue, 1, out)
            if not queue.count:
                del self._lru[queue.domain]
        self.num_queued -= num
        return evicted

    @staticmethod
    def _pop(queue: _Queue, num: int, out: list[KVBlock]) -> int:
        num = min(num, queue.count)
        block = queue.head.next
        for _ in range(num):
            block.ref_cnt = 1
            out.append(block)
            block = block.next
        queue.head.next = block
        block.prev = queue.head
        queue.count -= num
        return num

    def _evict(self, blocks: list[KVBlock]) -> None:
        """Queued blocks just taken: those still cached lose their digest (lazy eviction)."""
        cached = [b for b in blocks if b.digest is not None]
        if self.index is not None:
            self.index.forget(cached)
        digests: list[bytes] = []
        for block in cached:
            digests.append(block.digest)  # type: ignore[arg-type]  # cached: not None
            block.digest = None
            block.token_bytes = None
        self._dropped(cached, digests)

    def _dropped(self, blocks: list[KVBlock], digests: list[bytes]) -> None:
        """``blocks`` (with these ``digests``) stopped being cached: count and announce it."""
        if not blocks:
            return
        self.num_cached -= len(blocks)
        self.epoch += 1
        self.stats.num_evictions += len(blocks)
        if self.events.enabled:
            self.emit(BlockRemoved(block_hashes=digests, block_ids=[b.block_id for b in blocks]))

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
        """Drop one reference on each block, in the given order (callers pass a table reversed).

        A block reaching ``ref_cnt == 0`` goes to the queue tail if it is cached (it stays
        hittable) or to the head if not (worth nothing).
        """
        free = self._free
        head = free.head
        num_free = num_queued = 0
        # the LRU queue cached blocks of the current run join, its last block, and the run's size
        lru: _Queue | None = None
        lru_domain: str | None = None
        last = head
        run = 0
        for block in blocks_in_order:
            ref_cnt = block.ref_cnt - 1
            block.ref_cnt = ref_cnt
            if ref_cnt:
                continue
            num_queued += 1
            if block.digest is None:
                first = head.next
                block.next = first
                first.prev = block
                block.prev = head
                head.next = block
                block.queue = free
                num_free += 1
                continue
            domain = block.domain
            if domain is not lru_domain and domain != lru_domain:
                if lru is not None:
                    last.next = lru.tail
                    lru.tail.prev = last
                    lru.count += run
                lru, lru_domain, run = self._lru_of(domain), domain, 0
                last = lru.tail.prev
            last.next = block
            block.prev = last
            block.queue = lru
            last = block
            run += 1
        if lru is not None:
            last.next = lru.tail
            lru.tail.prev = last
            lru.count += run
        free.count += num_free
        self.num_queued += num_queued

    def _lru_of(self, domain: str) -> _Queue:
        queue = self._lru.get(domain)
        if queue is None:
            queue = self._lru[domain] = _Queue(domain)
        return queue

    def copy_on_write(
        self,
        src: KVBlock,
        owner_root: bytes | None,
        *,
        copy: bool,
        protected: frozenset[str] = frozenset(),
    ) -> KVBlock:
        """A private block to write instead of the shared ``src`` (whose reference is dropped);
        ``copy``: its KV must be copied from ``src`` first (queued for the runner)."""
        (dst,) = self.take(1, owner_root, protected)
        if copy:
            self._copies.append((src.block_id, dst.block_id))
            self.cancel_zero(dst.block_id)  # the copy overwrites the whole block
        self.release((src,))
        return dst

    # -- cached blocks --------------------------------------------------------------------------

    def mark_cached(
        self, block: KVBlock, digest: bytes, token_bytes: bytes, domain: str = ""
    ) -> None:
        """``block`` (held) now carries ``digest``: the index made it hittable for ``domain``."""
        block.digest = digest
        block.token_bytes = token_bytes
        block.domain = domain
        self.num_cached += 1

    def reset(self) -> bool:
        """Drop every digest. Refuses (False, nothing changed) while any block is in use."""
        if self.num_free != self.num_blocks:
            return False
        for block in self.blocks:
            block.digest = None
            block.token_bytes = None
        if self.index is not None:
            self.index.clear()
        if self._parks:
            self._link_all(self.blocks)  # parked blocks rejoin the queue, in id order
            self.num_parked = 0
        else:  # the queue order stays: uncached blocks, then each domain's, LRU first
            queued = self.free_block_ids()
            self._link_all([self.blocks[i] for i in queued])
        self.num_cached = 0
        self.epoch += 1
        self.stats.num_resets += 1
        self.emit(AllBlocksCleared())
        return True

    # -- side channels: events, copies and zero-on-reuse ----------------------------------------

    @property
    def enable_kv_events(self) -> bool:
        return self.events.enabled

    @property
    def num_dropped_events(self) -> int:
        return self.events.num_dropped

    def emit(self, event: KVCacheEvent) -> None:
        """Buffer a KV event (bounded: beyond ``max_events`` new events are dropped and counted)."""
        self.events.emit(event)

    def take_events(self) -> list[KVCacheEvent]:
        return self.events.take()

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
            check_invariant(
                block.block_id == i, "block count conserved: slot {} holds {!r}", i, block
            )
            expected = table_refs.get(i, 0)
            check_invariant(
                block.ref_cnt == expected,
                "ref count equals live table references: {!r} has {}",
                block,
                expected,
            )
            check_invariant(
                (block.digest is None) == (block.token_bytes is None),
                "a block keeps its tokens exactly while it has a digest: {!r}",
                block,
            )
        self._check_queue()
        num_cached = sum(1 for b in blocks if b.digest is not None)
        check_invariant(num_cached == self.num_cached, "cached count {} kept", num_cached)

    def _check_queue(self) -> None:
        seen: set[int] = set()
        for queue in [self._free, *self._lru.values()]:
            prev, block, count = queue.head, queue.head.next, 0
            while block is not queue.tail:
                check_invariant(
                    block.block_id not in seen, "free queue holds each block once: {!r}", block
                )
                check_invariant(block.prev is prev, "free queue links consistent at {!r}", block)
                check_invariant(block.ref_cnt == 0, "no block is both free and in use: {!r}", block)
                check_invariant(block.queue is queue, "a free block knows its queue: {!r}", block)
                check_invariant(
                    (block.digest is None) == (queue is self._free)
                    and (queue is self._free or self._lru.get(block.domain) is queue),
                    "uncached blocks queue together, cached ones in their domain's: {!r}",
                    block,
                )
                seen.add(block.block_id)
                count += 1
                check_invariant(len(seen) <= self.num_blocks, "free queue is not a cycle")
                prev, block = block, block.next
            check_invariant(queue.tail.prev is prev, "free queue links consistent at the tail")
            check_invariant(queue.count == count, "queue length {} kept", count)
        free = [b for b in self.blocks if b.ref_cnt == 0]
        kept = sum(1 for b in free if self._parks and b.digest is not None)  # the index's
        check_invariant(len(seen) == len(free) - kept, "free queue holds the free blocks")
        check_invariant(
            self.num_queued == len(seen), "queued count {} == {}", self.num_queued, len(seen)
        )


def check_invariant(condition: bool, invariant: str, *args: object) -> None:
    """Raise AssertionError naming ``invariant`` unless ``condition`` holds.

    ``invariant`` is a ``str.format`` template filled with ``args`` only on failure, so checking
    after every operation costs no string building.
    """
    if not condition:
        raise AssertionError("integrity: " + (invariant.format(*args) if args else invariant))


def _count(queue: _Queue) -> int:
    return queue.count
