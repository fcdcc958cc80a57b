"""The block pool, the only allocator: every KV block, its ref count, the free queues, the owner
roots for zero-on-reuse, and the copy-on-write and zeroing lists.

The pool knows block ids, ref counts and whether a block is cached (its digest and the token bytes
the digest stands for); not sequences, block tables, hashing, statistics or tensors. A
`PrefixCache` (``base.py``) drives it and counts what its calls return; the prefix index decides
which blocks are cached and is seen here only through `Evictor`, the interface the pool defines.

- Blocks are created once (``__slots__``). Free blocks wait in intrusive doubly-linked queues
  (`FreeBlockQueue`: pop, append, remove from the middle in O(1), no allocation): one of uncached
  blocks, handed out first (they are worth nothing), and per domain one of its cached
  blocks, least recently used first. Eviction takes from the domain with the most free cached
  blocks, so one tenant's churn evicts its own cache before a quiet tenant's prefix. With one
  domain this is one LRU queue: uncached blocks, then cached ones in release order.
- A free cached block stays hittable until it is reused (lazy eviction): queued (hash), or
  parked in the index (radix: the index keeps its free cached blocks and gives them up through
  `Evictor.evict`, in its own order).
- ``num_free`` = queued + parked: what can be handed out now. ``epoch`` counts the moments a
  digest was dropped (eviction, reset): a hit found at the current epoch is still valid.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol

__all__ = [
    "BlockPool", "Evictor", "FreeBlockQueue", "KVBlock", "PoolSize", "Taken", "check_invariant",
]  # fmt: skip

_NONE: frozenset[str] = frozenset()
_count = attrgetter("count")


class KVBlock:
    """One physical KV block. ``digest`` is None unless the block is full, committed and cached.

    ``prev``/``next`` are the free-queue links (meaningful only while ``ref_cnt == 0``: in the
    uncached queue if ``digest`` is None, else in ``domain``'s); ``owner_root`` is the namespace
    root of the last sequence that held it (zero-on-reuse); ``domain`` the domain that
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

    def cache(self, digest: bytes, token_bytes: bytes, domain: str) -> None:
        """The block's KV is block ``digest`` (tokens ``token_bytes``) of ``domain``: hittable."""
        self.digest = digest
        self.token_bytes = token_bytes
        self.domain = domain

    def uncache(self) -> None:
        """The block holds nothing hittable any more (evicted, or the cache was reset)."""
        self.digest = self.token_bytes = None

    def __repr__(self) -> str:
        digest = self.digest.hex()[:8] if self.digest is not None else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, digest={digest})"


class Evictor(Protocol):
    """A prefix index that keeps its free cached blocks itself (radix), ``num_parked`` of them,
    ``parked_by_domain()`` per domain, and hands them over through `evict`; the pool imports
    nothing of the indexes. A pool with no evictor attached (hash) queues every free block
    itself."""

    num_parked: int

    def parked_by_domain(self) -> Mapping[str, int]: ...

    def evict(
        self, num: int, out: list[KVBlock], protected: frozenset[str]
    ) -> tuple[list[int], list[bytes]]:
        """Append ``num`` parked blocks (none of ``protected`` domains') to ``out`` in eviction
        order, handing over the index's reference on each; returns their ids and digests."""
        ...


class _NoEvictor:
    """No index parks blocks: every free block is queued in the pool (hash)."""

    num_parked = 0

    def parked_by_domain(self) -> Mapping[str, int]:
        return {}

    def evict(
        self, num: int, out: list[KVBlock], protected: frozenset[str]
    ) -> tuple[list[int], list[bytes]]:
        raise RuntimeError("no index parks blocks in this pool")


@dataclass(frozen=True, slots=True)
class PoolSize:
    """A pool's counts at one moment: ``num_free`` blocks can be handed out now, ``num_queued``
    of them wait in the pool's queues and ``num_parked`` in the index (radix); ``num_cached``
    are hittable (held or free); ``num_held`` are in use."""

    num_blocks: int
    num_free: int
    num_queued: int
    num_parked: int
    num_cached: int
    num_held: int

    @property
    def usage(self) -> float:
        return self.num_held / self.num_blocks


class Taken:
    """What `BlockPool.take` handed out: ``blocks`` (``ref_cnt`` 1) and their ids, and the cached
    blocks among them that lost their digest (evicted), for the caller's counters and events.
    Uncached blocks are handed out first, so the evicted ones are the last
    ``len(evicted_digests)`` of ``blocks``."""

    __slots__ = ("blocks", "block_ids", "evicted_digests")

    def __init__(self) -> None:
        self.blocks: list[KVBlock] = []
        self.block_ids: list[int] = []
        self.evicted_digests: list[bytes] = []

    @property
    def evicted_ids(self) -> list[int]:
        num = len(self.evicted_digests)
        return self.block_ids[len(self.block_ids) - num :] if num else []


class FreeBlockQueue:
    """An intrusive doubly-linked list of free blocks between two sentinels, with its length.

    Every edit of the links happens in these methods; none allocates per block."""

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

    def link(self, blocks: list[KVBlock]) -> None:
        """The queue holds exactly ``blocks``, in order."""
        chain = [self.head, *blocks, self.tail]
        for left, right in zip(chain, chain[1:], strict=False):
            left.next = right
            right.prev = left
        self.count = len(blocks)

    @staticmethod
    def remove_free(
        blocks: Iterable[KVBlock], free: FreeBlockQueue, lru: Mapping[str, FreeBlockQueue]
    ) -> int:
        """Take a reference on each of ``blocks``, unlinking the free ones from their queue
        (``free`` for uncached blocks, else their domain's in ``lru``); returns how many were
        unlinked. Counts are kept per run of one domain, not per block."""
        num_uncached = num_cached = 0
        # the queue of the current run of free cached blocks, its domain, and the run's length
        queue: FreeBlockQueue | None = None
        domain: str | None = None
        run = 0
        for block in blocks:
            ref_cnt = block.ref_cnt
            if not ref_cnt:
                prev, nxt = block.prev, block.next
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
                        queue = lru[domain]
                    run += 1
            block.ref_cnt = ref_cnt + 1
        if queue is not None:
            queue.count -= run
        free.count -= num_uncached
        return num_uncached + num_cached + run

    def pop_front(self, num: int, out: list[KVBlock], ids: list[int]) -> None:
        """Move the first ``num`` (<= ``count``) blocks to ``out`` with ``ref_cnt`` 1 (their ids
        to ``ids``)."""
        block = self.head.next
        for _ in range(num):
            block.ref_cnt = 1
            out.append(block)
            ids.append(block.block_id)
            block = block.next
        self.head.next = block
        block.prev = self.head
        self.count -= num

    def pop_front_evicting(self, num: int, taken: Taken) -> None:
        """`pop_front` of ``num`` cached blocks into ``taken``, each losing its digest (one pass:
        evicting a run of blocks is the replay's hot loop)."""
        out, ids, digests = taken.blocks, taken.block_ids, taken.evicted_digests
        block = self.head.next
        for _ in range(num):
            block.ref_cnt = 1
            out.append(block)
            ids.append(block.block_id)
            digests.append(block.digest)  # type: ignore[arg-type]  # queued cached: a digest
            block.uncache()
            block = block.next
        self.head.next = block
        block.prev = self.head
        self.count -= num

    def push_front(self, block: KVBlock) -> None:
        first = self.head.next
        block.next = first
        first.prev = block
        block.prev = self.head
        self.head.next = block
        self.count += 1

    def append_run(self, first: KVBlock, last: KVBlock, num: int) -> None:
        """Append the ``num`` blocks already chained from ``first`` to ``last`` at the tail."""
        tail = self.tail
        before = tail.prev
        before.next = first
        first.prev = before
        last.next = tail
        tail.prev = last
        self.count += num


class BlockPool:
    """``num_blocks`` blocks with ids ``0..num_blocks-1``; the initial free queue is ``0, 1, 2...``.

    `attach` names the `Evictor` (the prefix index) that caches blocks in this pool.
    """

    def __init__(self, num_blocks: int, block_size: int, *, zero_on_reuse: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks, block_size must be >= 1: {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.zero_on_reuse = zero_on_reuse
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.evictor: Evictor = _NoEvictor()
        self.num_queued = num_blocks  # free blocks in the queues
        self.epoch = 0
        self._to_zero: list[int] = []
        self._copies: list[tuple[int, int]] = []
        self._free = FreeBlockQueue()  # free uncached blocks: handed out first
        self._lru: dict[str, FreeBlockQueue] = {}  # per domain: its free cached blocks, LRU first
        self._link_all(self.blocks)

    def attach(self, evictor: Evictor) -> None:
        """``evictor`` (a prefix index that parks its free cached blocks) caches blocks of this
        pool (before any block is cached)."""
        self.evictor = evictor

    def size(self, num_cached: int) -> PoolSize:
        """The counts in one value (``num_cached``: the index's)."""
        num_free = self.num_free
        return PoolSize(self.num_blocks, num_free, self.num_queued, self.evictor.num_parked,
                        num_cached, self.num_blocks - num_free)

    def _link_all(self, blocks: list[KVBlock]) -> None:
        """Every block free and uncached, queued in the order of ``blocks``."""
        self._free.link(blocks)
        self.num_queued = len(blocks)
        self._lru.clear()

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: queued, or parked and evictable."""
        return self.num_queued + self.evictor.num_parked

    def free_block_ids(self) -> list[int]:
        """The queues in the order they are handed out with one domain: uncached blocks, then
        each domain's cached ones, least recently used first (parked blocks are not queued)."""
        queues = [self._free, *self._lru.values()]
        return [block.block_id for queue in queues for block in queue.blocks()]

    # -- taking and releasing -------------------------------------------------------------------

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on each block, pulling free ones out of their queue (no eviction)."""
        self.num_queued -= FreeBlockQueue.remove_free(blocks, self._free, self._lru)

    def take(
        self,
        num: int,
        owner_root: bytes | None = None,
        protected: frozenset[str] = _NONE,
        touch: Iterable[KVBlock] | None = None,
    ) -> Taken:
        """``num`` blocks with ``ref_cnt = 1``: queued ones first, then parked ones the evictor
        hands over; a cached block taken loses its digest (an eviction, returned in `Taken`).
        ``touch``: blocks to `touch` first (a sequence's hits: never evicted for its own new
        blocks). The caller checked ``num <= num_free`` after the touch, less the free cached
        blocks of the ``protected`` domains (never evicted here). ``owner_root``: the new
        owner's namespace (zero-on-reuse)."""
        if touch:
            self.touch(touch)
        if num > self.num_free:
            raise RuntimeError(f"take({num}) with only {self.num_free} free blocks")
        taken = Taken()
        if num <= 0:
            return taken
        queued = self.num_queued
        if protected:
            queued -= sum(q.count for d, q in self._lru.items() if d in protected)
        if queued:
            self._take_queued(min(num, queued), taken, protected)
        out = taken.blocks
        if len(out) < num:
            ids, digests = self.evictor.evict(num - len(out), out, protected)
            taken.block_ids += ids
            taken.evicted_digests += digests
        if taken.evicted_digests:
            self.epoch += 1
        if self.zero_on_reuse:
            self._note_owner(out, owner_root)
        return taken

    def _take_queued(self, num: int, taken: Taken, protected: frozenset[str]) -> None:
        """``num`` queued blocks into ``taken``: uncached ones first, then cached ones from the
        domain with the most of them (its least recently used first)."""
        free = self._free
        left = min(num, free.count)
        free.pop_front(left, taken.blocks, taken.block_ids)
        left = num - left
        self.num_queued -= num
        lru = self._lru
        if left and len(lru) == 1 and not protected:  # one domain: its LRU order
            queue = next(iter(lru.values()))
            left -= self._evict_queued(queue, left, taken)
        elif left:
            for domain in [d for d, q in lru.items() if not q.count]:
                del lru[domain]  # empty: no block refers to it
        while left:  # several domains compete: the one with the most free cached blocks gives one
            queue = max((q for d, q in lru.items() if d not in protected), key=_count)
            left -= self._evict_queued(queue, 1, taken)
            if not queue.count:
                del lru[queue.domain]

    @staticmethod
    def _evict_queued(queue: FreeBlockQueue, num: int, taken: Taken) -> int:
        """Pop ``num`` cached blocks off ``queue`` into ``taken``: each loses its digest."""
        num = min(num, queue.count)
        queue.pop_front_evicting(num, taken)
        return num

    def _note_owner(self, blocks: list[KVBlock], owner_root: bytes | None) -> None:
        for block in blocks:
            if owner_root is None or block.owner_root != owner_root:
                self._to_zero.append(block.block_id)
            block.owner_root = owner_root

    def release(self, blocks_in_order: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order (callers pass a table reversed):
        a block reaching ``ref_cnt == 0`` goes to its domain's queue tail if it is cached (it
        stays hittable), or to the head of the uncached queue if not (worth nothing)."""
        free = self._free
        num_freed = 0  # counted per uncached block and per run of cached ones
        # the queue the current run of cached blocks joins, the run's ends and its length
        lru: FreeBlockQueue | None = None
        lru_domain: str | None = None
        first = last = free.head
        run = 0
        for block in blocks_in_order:
            ref_cnt = block.ref_cnt - 1
            block.ref_cnt = ref_cnt
            if ref_cnt:
                continue
            if block.digest is None:
                free.push_front(block)
                num_freed += 1
                continue
            domain = block.domain
            if domain is not lru_domain and domain != lru_domain:
                if lru is not None:
                    lru.append_run(first, last, run)
                    num_freed += run
                lru = self._lru.get(domain)
                if lru is None:
                    lru = self._lru[domain] = FreeBlockQueue(domain)
                lru_domain, run, first = domain, 0, block
            else:
                last.next = block
                block.prev = last
            last = block
            run += 1
        if lru is not None:
            lru.append_run(first, last, run)
            num_freed += run
        self.num_queued += num_freed

    def copy_on_write(self, src: KVBlock, dst: KVBlock, *, copy: bool) -> None:
        """``dst`` (just taken) replaces the shared ``src``, whose reference is dropped;
        ``copy``: its KV must be copied from ``src`` first (queued for the runner)."""
        if copy:
            self._copies.append((src.block_id, dst.block_id))
            self.cancel_zero(dst.block_id)  # the copy overwrites the whole block
        self.release((src,))

    # -- domains --------------------------------------------------------------------------------

    def other_cache_domains(self, domain: str) -> bool:
        """Whether a domain other than ``domain`` may have free cached blocks (cheap; may say
        True for a domain whose count dropped to 0)."""
        for keys in (self._lru, self.evictor.parked_by_domain()):  # queued, parked
            if len(keys) > 1 or (len(keys) == 1 and domain not in keys):
                return True
        return False

    def free_cached_by_domain(self) -> dict[str, int]:
        """Free (evictable) cached blocks per domain: queued here or parked in the evictor."""
        out = {d: q.count for d, q in self._lru.items() if q.count}
        for domain, num in self.evictor.parked_by_domain().items():
            if num:
                out[domain] = out.get(domain, 0) + num
        return out

    # -- reset, copies and zero-on-reuse ------------------------------------------------

    def reset(self) -> bool:
        """Drop every digest and every reference (the caller clears its index). Refuses (False,
        nothing changed) while any block is in use."""
        if self.num_free != self.num_blocks:
            return False
        # the queue order stays (uncached, then each domain's, LRU first); parked blocks (radix)
        # join it after them, in id order
        order = [b for q in (self._free, *self._lru.values()) for b in q.blocks()]
        if len(order) < self.num_blocks:
            queued = {b.block_id for b in order}
            order += [b for b in self.blocks if b.block_id not in queued]
        for block in self.blocks:  # radix: the tree's references go too
            block.uncache()
            block.ref_cnt = 0
        self._link_all(order)
        self.epoch += 1
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
        seen: set[int] = set()
        for queue in [self._free, *self._lru.values()]:
            self._check_queue(queue, seen)
        free = sum(1 for b in blocks if b.ref_cnt == 0)
        check_invariant(
            len(seen) == self.num_queued == free,
            "the queues hold the free blocks ({} queued, {} kept, {} free)",
            len(seen),
            self.num_queued,
            free,
        )

    def _check_queue(self, queue: FreeBlockQueue, seen: set[int]) -> None:
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


def check_invariant(condition: bool, invariant: str, *args: object) -> None:
    """Raise AssertionError naming ``invariant`` unless ``condition`` holds. ``invariant`` is a
    ``str.format`` template filled with ``args`` only on failure (no string building per check)."""
    if not condition:
        raise AssertionError("integrity: " + (invariant.format(*args) if args else invariant))
