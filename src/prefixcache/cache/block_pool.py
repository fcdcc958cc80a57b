"""The block pool: every KV block, its ref count, the free queue and the digest -> block map.

Boundary: the pool knows block ids, ref counts, digests and the token bytes a digest stands for.
It knows nothing about sequences, block tables, hashing or tensors; a prefix cache
(``hash_cache.py``) drives it, and the runner learns about physical work only through the
zero-on-reuse list.

- Blocks are created once (``__slots__``) and never allocated again.
- The free queue is an intrusive doubly-linked list threaded through the blocks, between a head
  and a tail sentinel: popleft, append, appendleft and remove-from-the-middle are O(1) and
  allocate nothing. Its order is the eviction order (the head is evicted first).
- A free block keeps its digest and stays hittable until it is popped for reuse (lazy eviction).
- ``epoch`` counts the moments a digest was dropped (eviction, reset): a hit found at the current
  epoch is still valid without re-checking each block.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prefixcache.cache.events import AllBlocksCleared, BlockRemoved, EventBuffer, KVCacheEvent
from prefixcache.cache.stats import CacheStats

__all__ = ["DEFAULT_MAX_EVENTS", "BlockPool", "KVBlock", "check_invariant"]

DEFAULT_MAX_EVENTS = 100_000


class KVBlock:
    """One physical KV block. ``digest`` is None unless the block is full, committed and mapped.

    ``prev``/``next`` are the free-queue links (meaningful only while ``ref_cnt == 0``);
    ``owner_root`` is the namespace root of the last sequence that held it (zero-on-reuse).
    """

    __slots__ = ("block_id", "ref_cnt", "digest", "token_bytes", "prev", "next", "owner_root")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.digest: bytes | None = None
        self.token_bytes: bytes | None = None
        self.prev: KVBlock = self
        self.next: KVBlock = self
        self.owner_root: bytes | None = None

    def __repr__(self) -> str:
        digest = self.digest.hex()[:8] if self.digest is not None else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, digest={digest})"


class BlockPool:
    """``num_blocks`` blocks with ids ``0..num_blocks-1``; the initial free queue is ``0, 1, 2...``.

    ``cached`` maps a digest to the one block that carries it. Counters go to ``stats``.
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
        self.cached: dict[bytes, KVBlock] = {}
        self.num_free = num_blocks
        self.epoch = 0
        self._to_zero: list[int] = []
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._link_all()

    def _link_all(self) -> None:
        chain = [self._head, *self.blocks, self._tail]
        for left, right in zip(chain, chain[1:], strict=False):
            left.next = right
            right.prev = left

    # -- the free queue -------------------------------------------------------------------------

    def free_block_ids(self) -> list[int]:
        """The free queue from head (evicted first) to tail."""
        out = []
        block, tail = self._head.next, self._tail
        while block is not tail:
            out.append(block.block_id)
            block = block.next
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on each block, pulling free ones out of the queue (no eviction)."""
        num_free = self.num_free
        for block in blocks:
            ref_cnt = block.ref_cnt
            if not ref_cnt:
                prev = block.prev
                nxt = block.next
                prev.next = nxt
                nxt.prev = prev
                num_free -= 1
            block.ref_cnt = ref_cnt + 1
        self.num_free = num_free
        self._note_watermark()

    def take(self, num: int, owner_root: bytes | None = None) -> list[KVBlock]:
        """Pop ``num`` blocks from the queue head with ``ref_cnt = 1``, evicting their digests.

        The caller checked ``num <= num_free``. ``owner_root`` is the new owner's namespace root
        (used only with zero-on-reuse).
        """
        if num > self.num_free:
            raise RuntimeError(f"take({num}) with only {self.num_free} free blocks")
        if num <= 0:
            return []
        out = []
        evicted = False
        block = self._head.next
        for _ in range(num):
            if block.digest is not None:
                evicted = True
            block.ref_cnt = 1
            out.append(block)
            block = block.next
        self._head.next = block
        block.prev = self._head
        self.num_free -= num
        if evicted:
            self._evict(out)
        if self.zero_on_reuse:
            self._note_owner(out, owner_root)
        self._note_watermark()
        return out

    def _evict(self, blocks: list[KVBlock]) -> None:
        cached = self.cached
        digests, ids = [], []
        for block in blocks:
            digest = block.digest
            if digest is None:
                continue
            if cached.get(digest) is block:
                del cached[digest]
            block.digest = None
            block.token_bytes = None
            digests.append(digest)
            ids.append(block.block_id)
        self.epoch += 1
        self.stats.num_evictions += len(digests)
        self.emit(BlockRemoved(block_hashes=digests, block_ids=ids))

    def _note_owner(self, blocks: list[KVBlock], owner_root: bytes | None) -> None:
        for block in blocks:
            if owner_root is None or block.owner_root != owner_root:
                self._to_zero.append(block.block_id)
            block.owner_root = owner_root

    def _note_watermark(self) -> None:
        stats = self.stats
        if stats.min_free_blocks < 0 or self.num_free < stats.min_free_blocks:
            stats.min_free_blocks = self.num_free

    def release(self, blocks_in_order: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order (callers pass a table reversed).

        A block reaching ``ref_cnt == 0`` goes to the queue tail if it has a digest (it stays
        hittable) or to the head if not (it is worth nothing).
        """
        head = self._head
        last = self._tail.prev
        released = 0
        for block in blocks_in_order:
            ref_cnt = block.ref_cnt - 1
            block.ref_cnt = ref_cnt
            if ref_cnt:
                continue
            released += 1
            if block.digest is None:
                first = head.next
                block.next = first
                first.prev = block
                block.prev = head
                head.next = block
                if last is head:
                    last = block
            else:
                last.next = block
                block.prev = last
                last = block
        last.next = self._tail
        self._tail.prev = last
        self.num_free += released

    # -- the digest map -------------------------------------------------------------------------

    def store(self, block: KVBlock, digest: bytes, token_bytes: bytes) -> bool:
        """Make ``block`` hittable under ``digest``; False (nothing changed) if already mapped."""
        cached = self.cached
        if digest in cached:
            return False
        cached[digest] = block
        block.digest = digest
        block.token_bytes = token_bytes
        return True

    def reset(self) -> bool:
        """Drop every digest. Refuses (False, nothing changed) while any block is in use."""
        if self.num_free != self.num_blocks:
            return False
        for block in self.blocks:
            block.digest = None
            block.token_bytes = None
        self.cached.clear()
        self.epoch += 1
        self.stats.num_resets += 1
        self.emit(AllBlocksCleared())
        return True

    # -- side channels: events and zero-on-reuse ------------------------------------------------

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
        self._check_queue()
        self._check_map()

    def _check_queue(self) -> None:
        seen: set[int] = set()
        prev, block = self._head, self._head.next
        while block is not self._tail:
            check_invariant(
                block.block_id not in seen, "free queue holds each block once: {!r}", block
            )
            check_invariant(block.prev is prev, "free queue links consistent at {!r}", block)
            check_invariant(block.ref_cnt == 0, "no block is both free and in use: {!r}", block)
            seen.add(block.block_id)
            check_invariant(len(seen) <= self.num_blocks, "free queue is not a cycle")
            prev, block = block, block.next
        check_invariant(self._tail.prev is prev, "free queue links consistent at the tail")
        num_zero = sum(1 for b in self.blocks if b.ref_cnt == 0)
        check_invariant(len(seen) == num_zero, "free queue holds exactly the ref-0 blocks")
        check_invariant(
            self.num_free == num_zero, "num_free {} != {} free blocks", self.num_free, num_zero
        )

    def _check_map(self) -> None:
        for digest, block in self.cached.items():
            check_invariant(
                block.digest == digest, "map entry points to a block with its digest: {!r}", block
            )
            check_invariant(
                block.token_bytes is not None, "mapped block keeps its tokens: {!r}", block
            )
        for block in self.blocks:
            if block.digest is not None:
                check_invariant(
                    self.cached.get(block.digest) is block,
                    "a block with a digest is the map's block for it: {!r}",
                    block,
                )
            else:
                check_invariant(
                    block.token_bytes is None, "undigested block keeps no tokens: {!r}", block
                )


def check_invariant(condition: bool, invariant: str, *args: object) -> None:
    """Raise AssertionError naming ``invariant`` unless ``condition`` holds.

    ``invariant`` is a ``str.format`` template filled with ``args`` only on failure, so checking
    after every operation costs no string building.
    """
    if not condition:
        raise AssertionError("integrity: " + (invariant.format(*args) if args else invariant))
