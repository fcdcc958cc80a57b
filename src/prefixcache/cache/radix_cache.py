"""The radix-tree prefix cache (SGLang RadixAttention-style) behind the `PrefixCache` contract.

Boundary: this module owns the tree of cached block runs, the sequences' block tables and the
free list. It knows nothing about tensors; the runner learns about physical work only through
`take_block_copies` and `take_blocks_to_zero`.

Shape of the tree::

    root ─► namespace node (key: the namespace root digest, no blocks)
              ─► node (key: digest of its first block) owns a run of block ids, ...

A node owns a run of full, committed blocks: their ids, their chained digests (`block_hash.py`)
and their token bytes. Children are keyed by the digest of their first block; since digests chain
from the namespace root and fold in block extras, two namespaces never share a node, and a hit
also compares the stored token bytes, so a digest collision costs a miss, never wrong KV.

Every block is in exactly one of three places:

- free: never cached (or dropped by `reset`), in ``_free``, handed out from the left;
- in the tree: *evictable* when its node's ``lock_ref`` is 0, else *protected*;
- held by sequences outside the tree (``_refs[b] > 0``): the uncommitted tail of a table.
  Counted as protected.

A sequence that computed blocks another sequence inserted meanwhile (both missed) gets the tree's
blocks in its table at commit and releases its duplicates at once (as SGLang does): the KV is
the same, and a live sequence then never pins two copies of one block.

``lock_ref`` of a node counts the live sequences whose locked path runs through it (a sequence
locks the path from its deepest node to the root), so ``free + evictable + protected == total``
is kept incrementally. Eviction takes the tail blocks of the least recently (or, with ``lfu``,
least frequently) used unlocked leaf, from a heap with lazy invalidation; a parent becomes a
candidate once its last child is gone.

Nodes split only when a run is shared partially: on insert (commit), and when `allocate` locks a
hit that ends inside a node, so that a sequence's locked path covers exactly its hit blocks.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from prefixcache.cache.base import CacheHit, PrefixCache, Sequence
from prefixcache.cache.block_hash import BlockHasher
from prefixcache.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBuffer,
    KVCacheEvent,
)
from prefixcache.cache.stats import CacheStats

__all__ = ["EVICTION_POLICIES", "RadixPrefixCache"]

EVICTION_POLICIES = ("lru", "lfu")
DEFAULT_MAX_EVENTS = 100_000


@dataclass(slots=True, eq=False)
class _Node:
    """A run of cached blocks ``[start, start + len(block_ids))`` of every sequence through it.

    The root and the namespace nodes own no blocks. ``stamp`` names the node's current eviction
    heap entry (older entries are stale).
    """

    parent: _Node | None
    key: bytes
    start: int
    block_ids: list[int]
    digests: list[bytes]
    tokens: list[bytes]
    children: dict[bytes, _Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    hit_count: int = 0
    stamp: int = 0
    attached: bool = True

    @property
    def end(self) -> int:
        return self.start + len(self.block_ids)


@dataclass(slots=True, eq=False)
class _SeqState:
    """A live sequence: its block table and the tree path it locks.

    ``table[:num_path]`` is exactly the locked path's blocks; ``table[num_path:]`` is held
    through ``_refs`` (shared with forks, copied before a write).
    Tokens ``[seq.num_computed_tokens, num_alloc_tokens)`` are allocated and about to be written.
    """

    seq: Sequence
    table: list[int]
    node: _Node | None
    num_path: int
    num_alloc_tokens: int


@dataclass(slots=True, eq=False)
class _HitHandle:
    """Where `match` stopped: the node holding the last hit block, and the namespace root."""

    cache: object
    node: _Node
    num_blocks: int
    root: bytes


class RadixPrefixCache(PrefixCache):
    """SGLang-style prefix cache: a radix tree of block runs over ``num_blocks`` blocks.

    ``model_id`` roots every namespace; ``zero_on_reuse`` queues a block for zeroing when it
    changes namespace; ``enable_kv_events`` buffers KV events (at most ``max_events``, newer ones
    are dropped and counted); ``eviction_policy`` is ``lru`` (default) or ``lfu`` (hit count,
    then recency).
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
        eviction_policy: str = "lru",
        events_with_tokens: bool = True,
        max_events: int = DEFAULT_MAX_EVENTS,
    ) -> None:
        _check_args(num_blocks, block_size, eviction_policy)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.model_id = model_id
        self.zero_on_reuse = zero_on_reuse
        self._events = EventBuffer(enable_kv_events, max_events)
        self.events_with_tokens = events_with_tokens
        self.eviction_policy = eviction_policy
        self.hasher = BlockHasher(block_size, hash_algo)
        self.stats = CacheStats()
        self._lfu = eviction_policy == "lfu"
        self._root = _Node(None, b"", 0, [], [], [])
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._owner: list[bytes | None] = [None] * num_blocks
        self._num_held = 0
        self._num_evictable = 0
        self._num_nodes = 0
        self._seqs: dict[str, _SeqState] = {}
        self._heap: list[tuple[int, int, int, _Node]] = []
        self._clock = 0
        self._stamp = 0
        self._copies: list[tuple[int, int]] = []
        self._to_zero: list[int] = []
        self._evicted_ids: list[int] = []
        self._evicted_digests: list[bytes] = []

    def __repr__(self) -> str:
        return (
            f"RadixPrefixCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={len(self._free)}, evictable={self._num_evictable}, nodes={self._num_nodes})"
        )

    # -- match ----------------------------------------------------------------------------------

    def _lookup(self, seq: Sequence) -> CacheHit:
        digests = seq.digests(self.hasher, self.model_id)
        root = seq.root_digest(self.hasher, self.model_id)
        ns = self._root.children.get(root)
        if ns is None:
            return CacheHit()
        path, num_matched = _descend(ns, digests, seq.block_token_bytes, len(digests))
        num_hit = min(num_matched, max(0, (len(seq.token_ids) - 1) // self.block_size))
        block_ids: list[int] = []
        last = ns
        for node in path:
            if node.start >= num_hit:
                break
            block_ids += node.block_ids[: num_hit - node.start]
            last = node
        handle = _HitHandle(self, last, num_hit, root) if num_hit else None
        return CacheHit(num_hit * self.block_size, block_ids, num_hit, num_matched, handle)

    # -- allocate -------------------------------------------------------------------------------

    def _state_of(self, seq_id: str) -> _SeqState | None:
        return self._seqs.get(seq_id)

    def _allocate_first(
        self, seq: Sequence, num_new_tokens: int, hit: CacheHit | None
    ) -> list[int] | None:
        node = self._checked_hit(seq, hit)
        hit_ids = hit.block_ids if hit is not None and node is not None else []
        num_hit = len(hit_ids)
        end = num_hit * self.block_size + num_new_tokens
        num_new = -(-end // self.block_size) - num_hit
        consumed = self._num_unlocked_on_path(node, num_hit) if node is not None else 0
        if num_new + consumed > len(self._free) + self._num_evictable:
            return None
        state = _SeqState(seq, list(hit_ids), None, 0, end)
        if node is not None:
            state.node = self._split(node, num_hit)
            state.num_path = num_hit
            self._lock(state.node, count_hit=True)
        seq.num_computed_tokens = num_hit * self.block_size
        self._seqs[seq.seq_id] = state
        self._take(state, num_new)
        return list(state.table)

    def _checked_hit(self, seq: Sequence, hit: CacheHit | None) -> _Node | None:
        """The node holding the hit's last block, verified to be still in the tree."""
        if hit is None or not hit.block_ids:
            return None
        if not (self.enable_caching and seq.use_cache):
            raise ValueError("a cache hit was given for a sequence that does not use the cache")
        num_hit = len(hit.block_ids)
        if hit.num_tokens != num_hit * self.block_size:
            raise ValueError(f"hit.num_tokens {hit.num_tokens} != {num_hit} blocks")
        if num_hit > (len(seq.token_ids) - 1) // self.block_size:
            raise ValueError(f"hit of {num_hit} blocks leaves no prompt token to compute")
        handle = hit.handle
        root = seq.root_digest(self.hasher, self.model_id)
        if not isinstance(handle, _HitHandle) or handle.cache is not self or handle.root != root:
            raise ValueError("the hit was not produced by this cache's match() for this sequence")
        node = handle.node
        while node.attached and node.start >= num_hit:  # a split moved the prefix upward
            node = node.parent  # type: ignore[assignment]
        if not (node.attached and node.end >= num_hit and self._path_holds(node, hit.block_ids)):
            raise ValueError("stale cache hit: its blocks were evicted since match()")
        return node

    def _path_holds(self, node: _Node, block_ids: list[int]) -> bool:
        num_hit = len(block_ids)
        while node.block_ids:
            start = node.start
            stop = min(node.end, num_hit)
            if node.block_ids[: stop - start] != block_ids[start:stop]:
                return False
            node = node.parent  # type: ignore[assignment]
        return True

    def _num_unlocked_on_path(self, node: _Node, num_hit: int) -> int:
        """Hit blocks that are evictable now and become protected once the path is locked."""
        count = 0
        while node.block_ids and not node.lock_ref:
            count += min(node.end, num_hit) - node.start
            node = node.parent  # type: ignore[assignment]
        return count

    def _allocate_more(self, state: _SeqState, num_new_tokens: int) -> list[int] | None:
        bs = self.block_size
        table = state.table
        computed = state.seq.num_computed_tokens
        end = computed + num_new_tokens
        num_new = max(0, -(-end // bs) - len(table))
        refs = self._refs
        shared = [
            i for i in range(computed // bs, min(len(table), -(-end // bs))) if refs[table[i]] > 1
        ]
        if num_new + len(shared) > len(self._free) + self._num_evictable:
            return None
        for i in shared:
            self._copy_on_write(state, i, copy=i * bs < computed)
        self._take(state, num_new)
        state.num_alloc_tokens = max(state.num_alloc_tokens, end)
        return list(table)

    def _copy_on_write(self, state: _SeqState, index: int, *, copy: bool) -> None:
        """Give ``state`` its own block at ``index``: a shared block is never written."""
        src = state.table[index]
        (dst,) = self._take_ids(1, self._owner_root(state.seq))
        if copy:
            self._copies.append((src, dst))
            if self._to_zero and self._to_zero[-1] == dst:
                self._to_zero.pop()  # the copy overwrites the whole block
        self._refs[src] -= 1
        self._refs[dst] = 1
        self._num_held += 1
        state.table[index] = dst
        self._flush_evictions()

    def _take(self, state: _SeqState, num: int) -> None:
        """Append ``num`` new blocks to ``state``'s table: free ones first, then evicted ones."""
        if num > 0:
            block_ids = self._take_ids(num, self._owner_root(state.seq))
            refs = self._refs
            for block_id in block_ids:
                refs[block_id] = 1
            state.table += block_ids
            self._num_held += num
            self._flush_evictions()
        self._note_watermark()

    def _take_ids(self, num: int, owner_root: bytes | None) -> list[int]:
        """``num`` blocks out of the free list, then out of the cache (the caller checked)."""
        free = self._free
        popleft = free.popleft
        block_ids = [popleft() for _ in range(min(num, len(free)))]
        if len(block_ids) < num:
            self._evict(num - len(block_ids), block_ids)
        if self.zero_on_reuse:
            owners, to_zero = self._owner, self._to_zero
            for block_id in block_ids:
                if owner_root is None or owners[block_id] != owner_root:
                    to_zero.append(block_id)
                owners[block_id] = owner_root
        return block_ids

    def _owner_root(self, seq: Sequence) -> bytes | None:
        if not self.zero_on_reuse:
            return None
        if seq.use_cache and self.enable_caching:
            return seq.root_digest(self.hasher, self.model_id)
        return self.hasher.root(seq.namespace(self.model_id))

    def _note_watermark(self) -> None:
        num_free = len(self._free) + self._num_evictable
        stats = self.stats
        if stats.min_free_blocks < 0 or num_free < stats.min_free_blocks:
            stats.min_free_blocks = num_free

    # -- eviction -------------------------------------------------------------------------------

    def _evict(self, num: int, out: list[int]) -> None:
        """Drop ``num`` cached blocks, leaf tails first in policy order, appending their ids."""
        heap = self._heap
        while num:
            node = self._candidate()
            block_ids, digests = node.block_ids, node.digests
            cut = max(0, len(block_ids) - num)
            taken = block_ids[cut:]
            taken.reverse()  # the deepest block goes first
            dropped = digests[cut:]
            dropped.reverse()
            out += taken
            self._evicted_ids += taken
            self._evicted_digests += dropped
            del block_ids[cut:], digests[cut:], node.tokens[cut:]
            self._num_evictable -= len(taken)
            num -= len(taken)
            if not block_ids:
                heapq.heappop(heap)
                self._detach(node)

    def _candidate(self) -> _Node:
        """The first valid entry of the eviction heap (stale entries are dropped on the way)."""
        heap = self._heap
        while True:
            node = heap[0][3]
            if (
                heap[0][2] == node.stamp
                and node.attached
                and not node.lock_ref
                and not node.children
                and node.block_ids
            ):
                return node
            heapq.heappop(heap)

    def _detach(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        node.attached = False
        self._num_nodes -= 1
        if parent.children:
            return
        if not parent.block_ids:  # an empty namespace node
            del self._root.children[parent.key]
            parent.attached = False
        elif not parent.lock_ref:
            self._push(parent)

    def _push(self, node: _Node) -> None:
        self._stamp += 1
        node.stamp = self._stamp
        freq = node.hit_count if self._lfu else 0
        heap = self._heap
        heapq.heappush(heap, (freq, node.last_access, self._stamp, node))
        if len(heap) > 4 * self._num_nodes + 1024:
            self._compact_heap()

    def _compact_heap(self) -> None:
        self._heap = [e for e in self._heap if e[2] == e[3].stamp and e[3].attached]
        heapq.heapify(self._heap)

    def _flush_evictions(self) -> None:
        if not self._evicted_ids:
            return
        ids, digests = self._evicted_ids, self._evicted_digests
        self._evicted_ids, self._evicted_digests = [], []
        self.stats.num_evictions += len(ids)
        self._emit(BlockRemoved(block_hashes=digests, block_ids=ids))

    # -- locks ----------------------------------------------------------------------------------

    def _lock(self, node: _Node, stop: _Node | None = None, *, count_hit: bool = False) -> None:
        """Add one lock on every node from ``node`` up to ``stop`` or the namespace, exclusive."""
        self._clock += 1
        clock = self._clock
        while node is not stop and node.block_ids:
            if not node.lock_ref:
                self._num_evictable -= len(node.block_ids)
            node.lock_ref += 1
            node.last_access = clock
            if count_hit:
                node.hit_count += 1
            node = node.parent  # type: ignore[assignment]

    def _unlock(self, node: _Node) -> None:
        """Drop one lock on every node from ``node`` up to its namespace node."""
        self._clock += 1
        clock = self._clock
        while node.block_ids:
            node.lock_ref -= 1
            node.last_access = clock
            if not node.lock_ref:
                self._num_evictable += len(node.block_ids)
                if not node.children and node.block_ids:
                    self._push(node)
            node = node.parent  # type: ignore[assignment]

    # -- commit ---------------------------------------------------------------------------------

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        state = self._live_state(seq)
        computed = seq.num_computed_tokens
        if not computed <= num_computed_tokens <= state.num_alloc_tokens:
            raise ValueError(
                f"commit({seq.seq_id!r}, {num_computed_tokens}): must lie between the computed "
                f"{computed} and the allocated {state.num_alloc_tokens} tokens"
            )
        if num_computed_tokens > len(seq.token_ids):
            raise ValueError(
                f"commit({seq.seq_id!r}, {num_computed_tokens}): only {len(seq.token_ids)} tokens"
            )
        seq.num_computed_tokens = num_computed_tokens
        num_full = num_computed_tokens // self.block_size
        if num_full > state.num_path and self.enable_caching and seq.use_cache:
            self._insert(state, num_full)

    def _live_state(self, seq: Sequence) -> _SeqState:
        state = self._seqs.get(seq.seq_id)
        if state is None or state.seq is not seq:
            raise ValueError(f"sequence {seq.seq_id!r} holds no blocks in this cache")
        return state

    def _insert(self, state: _SeqState, num_full: int) -> None:
        """Put blocks ``num_path..num_full-1`` of ``state`` into the tree and move its lock.

        Runs already in the tree (another sequence inserted them meanwhile) are walked, not
        copied: the sequence's table switches to the tree's blocks and its duplicates go free.
        """
        seq = state.seq
        digests = seq.digests(self.hasher, self.model_id)
        tokens = seq.block_token_bytes
        start = state.node or self._namespace(seq.root_digest(self.hasher, self.model_id))
        node, i = start, state.num_path
        while i < num_full:
            child = node.children.get(digests[i])
            if child is None:
                node, i = self._add_node(state, node, i, num_full)
                break
            num_common = _num_common(child, digests, tokens, i, num_full)
            if not num_common:
                break  # digest collision: these blocks stay private to the sequence
            node = self._split(child, i + num_common)
            self._adopt(state, node, i)
            i = node.end
        if node is not start:
            # the sequence's lock moves down: the nodes above ``start`` keep the one it had
            self._lock(node, start)
            state.node = node
            state.num_path = i

    def _namespace(self, root: bytes) -> _Node:
        node = self._root.children.get(root)
        if node is None:
            node = _Node(self._root, root, 0, [], [], [])
            self._root.children[root] = node
        return node

    def _add_node(
        self, state: _SeqState, parent: _Node, start: int, stop: int
    ) -> tuple[_Node, int]:
        """A new child of ``parent`` owning ``state``'s blocks ``start..stop-1`` (held by it)."""
        table, refs = state.table, self._refs
        end = start
        while end < stop and refs[table[end]] == 1:  # a shared block is never cached
            end += 1
        if end == start:
            return parent, start
        seq = state.seq
        digests = seq.block_digests
        node = _Node(
            parent,
            digests[start],
            start,
            table[start:end],
            digests[start:end],
            seq.block_token_bytes[start:end],
        )
        parent.children[node.key] = node
        for block_id in node.block_ids:
            refs[block_id] = 0
        self._num_held -= end - start
        self._num_evictable += end - start  # unlocked until the caller locks it
        self._num_nodes += 1
        self.stats.num_committed_blocks += end - start
        self._emit_stored(state, parent, start, end)
        return node, end

    def _emit_stored(self, state: _SeqState, parent: _Node, start: int, end: int) -> None:
        if not self.enable_kv_events:
            return
        seq = state.seq
        bs = self.block_size
        digests = seq.block_digests
        token_ids = seq.token_ids[start * bs : end * bs] if self.events_with_tokens else []
        self._emit(
            BlockStored(
                block_hashes=digests[start:end],
                parent_block_hash=digests[start - 1] if start else parent.key,
                token_ids=token_ids,
                block_size=bs,
                block_ids=state.table[start:end],
            )
        )

    def _adopt(self, state: _SeqState, node: _Node, start: int) -> None:
        """``node``'s run was already cached by another sequence: point the table at it and
        release the sequence's duplicates (the insert "reports" them by this count)."""
        table = state.table
        dups = table[start : node.end]
        table[start : node.end] = node.block_ids[start - node.start :]
        self._release(reversed(dups))
        self.stats.num_duplicate_blocks += len(dups)

    def _split(self, node: _Node, num_blocks: int) -> _Node:
        """Make the first ``num_blocks - node.start`` blocks of ``node`` a node of their own.

        Returns the node whose run ends at block ``num_blocks``; the new parent inherits the
        locks, recency and hit count, so no block changes between evictable and protected.
        """
        cut = num_blocks - node.start
        if cut >= len(node.block_ids):
            return node
        parent = node.parent
        assert parent is not None
        head = _Node(
            parent,
            node.key,
            node.start,
            node.block_ids[:cut],
            node.digests[:cut],
            node.tokens[:cut],
            {node.digests[cut]: node},
            node.lock_ref,
            node.last_access,
            node.hit_count,
        )
        parent.children[head.key] = head
        del node.block_ids[:cut], node.digests[:cut], node.tokens[:cut]
        node.parent = head
        node.key = node.digests[0]
        node.start = num_blocks
        self._num_nodes += 1
        return head

    # -- free, fork, reset ----------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        state = self._seqs.get(seq.seq_id)
        if state is None or state.seq is not seq:
            return
        del self._seqs[seq.seq_id]
        self._release(reversed(state.table[state.num_path :]))
        if state.node is not None:
            self._unlock(state.node)

    def _release(self, block_ids: Iterable[int]) -> None:
        """Drop one hold on each block; unheld ones go to the head of the free list."""
        refs, free = self._refs, self._free
        for block_id in block_ids:
            refs[block_id] -= 1
            if not refs[block_id]:
                self._num_held -= 1
                free.appendleft(block_id)

    def fork(self, seq: Sequence, child_id: str) -> Sequence:
        state = self._live_state(seq)
        if child_id in self._seqs:
            raise ValueError(f"sequence id {child_id!r} is already live in this cache")
        # shared blocks are never written: pending writes must be re-allocated (copy-on-write)
        state.num_alloc_tokens = seq.num_computed_tokens
        child = seq.fork(child_id)
        refs = self._refs
        for block_id in state.table[state.num_path :]:
            refs[block_id] += 1
        if state.node is not None:
            self._lock(state.node)
        self._seqs[child_id] = _SeqState(
            child,
            list(state.table),
            state.node,
            state.num_path,
            state.num_alloc_tokens,
        )
        return child

    def reset(self) -> bool:
        if self._seqs:
            return False
        for node in self._nodes():
            node.attached = False  # hits found before the reset are stale
        self._root.children.clear()
        self._free = deque(range(self.num_blocks))
        self._heap.clear()
        self._num_evictable = 0
        self._num_nodes = 0
        self.stats.num_resets += 1
        self._emit(AllBlocksCleared())
        return True

    # -- views and drains -----------------------------------------------------------------------

    def block_table(self, seq: Sequence) -> list[int]:
        state = self._seqs.get(seq.seq_id)
        if state is None or state.seq is not seq:
            return []
        return list(state.table)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self._num_evictable

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no live sequence locks (reusable after eviction)."""
        return self._num_evictable

    @property
    def num_protected_blocks(self) -> int:
        """Blocks live sequences use: on locked paths, or held outside the tree."""
        return self.num_blocks - len(self._free) - self._num_evictable

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that are hittable now (locked or not)."""
        return self.num_blocks - len(self._free) - self._num_held

    @property
    def num_nodes(self) -> int:
        """Tree nodes that own blocks."""
        return self._num_nodes

    @property
    def enable_kv_events(self) -> bool:
        return self._events.enabled

    @property
    def num_dropped_events(self) -> int:
        return self._events.num_dropped

    def _emit(self, event: KVCacheEvent) -> None:
        self._events.emit(event)

    def take_events(self) -> list[KVCacheEvent]:
        return self._events.take()

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def take_blocks_to_zero(self) -> list[int]:
        ids, self._to_zero = self._to_zero, []
        return ids

    # -- invariants -----------------------------------------------------------------------------

    def _nodes(self) -> list[_Node]:
        """Every block-owning node, parents before children."""
        out: list[_Node] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.block_ids:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        self._check_tree()
        tree_ids = self._check_blocks()
        locks = self._check_sequences(tree_ids)
        self._check_locks(locks)
        self._check_accounting()
        self._check_heap()

    def _check_tree(self) -> None:
        num_nodes = 0
        for root, ns in self._root.children.items():
            check_invariant(
                ns.key == root and ns.parent is self._root and ns.attached and not ns.block_ids,
                "namespace node {} is keyed by its root and owns no blocks",
                root.hex()[:8],
            )
            check_invariant(not ns.lock_ref, "namespace nodes are never locked")
        for node in self._nodes():
            num_nodes += 1
            parent = node.parent
            check_invariant(
                node.attached and parent is not None and parent.children.get(node.key) is node,
                "node links consistent at block {}",
                node.start,
            )
            assert parent is not None
            check_invariant(
                len(node.block_ids) == len(node.digests) == len(node.tokens)
                and node.key == node.digests[0],
                "node at block {} keeps one digest and token run per block, keyed by its first",
                node.start,
            )
            check_invariant(
                node.start == parent.end,
                "node at block {} starts where its parent ends",
                node.start,
            )
            check_invariant(node.lock_ref >= 0, "lock_ref >= 0 at block {}", node.start)
        check_invariant(num_nodes == self._num_nodes, "node count kept incrementally")

    def _check_blocks(self) -> set[int]:
        """Every block is free, in the tree, or held by sequences: exactly one of them, once."""
        tree_ids: list[int] = []
        for node in self._nodes():
            tree_ids += node.block_ids
        tree = set(tree_ids)
        free = set(self._free)
        check_invariant(len(tree) == len(tree_ids), "a block is in the tree at most once")
        check_invariant(len(free) == len(self._free), "the free list holds each block once")
        check_invariant(not tree & free, "no block is both free and cached")
        for block_id, ref in enumerate(self._refs):
            in_tree_or_free = block_id in tree or block_id in free
            check_invariant(
                (ref > 0) != in_tree_or_free,
                "block {} is exactly one of free, cached or held (refs {})",
                block_id,
                ref,
            )
        return tree

    def _check_sequences(self, tree: set[int]) -> Counter[_Node]:
        held: Counter[int] = Counter()
        locks: Counter[_Node] = Counter()
        for seq_id, state in self._seqs.items():
            self._check_state(seq_id, state)
            held.update(state.table[state.num_path :])
            if state.node is not None:
                locks[state.node] += 1
        for block_id, ref in enumerate(self._refs):
            check_invariant(
                ref == held[block_id],
                "block {}: refs {} == {} holders",
                block_id,
                ref,
                held[block_id],
            )
        check_invariant(not tree & set(held), "a held block is never in the tree")
        return locks

    def _check_state(self, seq_id: str, state: _SeqState) -> None:
        bs = self.block_size
        seq = state.seq
        check_invariant(seq.seq_id == seq_id, "state of {!r} belongs to its sequence", seq_id)
        check_invariant(
            state.num_path * bs
            <= seq.num_computed_tokens
            <= state.num_alloc_tokens
            <= len(state.table) * bs,
            "locked path <= computed <= allocated <= table size for {!r}",
            seq_id,
        )
        path: list[int] = []
        node = state.node
        while node is not None and node.block_ids:
            check_invariant(node.attached, "{!r} locks only nodes in the tree", seq_id)
            path[:0] = node.block_ids
            node = node.parent
        check_invariant(len(path) == state.num_path, "{!r}'s locked path covers num_path", seq_id)
        check_invariant(
            state.table[: state.num_path] == path,
            "{!r}'s table starts with its locked path",
            seq_id,
        )
        refs = self._refs
        first, last = seq.num_computed_tokens // bs, -(-state.num_alloc_tokens // bs)
        if state.num_alloc_tokens == seq.num_computed_tokens:
            last = first  # nothing is about to be written
        for block_id in state.table[first:last]:
            check_invariant(
                refs[block_id] == 1, "a shared block is never a write target: {}", block_id
            )

    def _check_locks(self, locks: Counter[_Node]) -> None:
        for node in reversed(self._nodes()):  # children before parents
            expected = locks[node] + sum(c.lock_ref for c in node.children.values())
            check_invariant(
                node.lock_ref == expected,
                "lock_ref {} at block {} == sequences through it ({})",
                node.lock_ref,
                node.start,
                expected,
            )

    def _check_accounting(self) -> None:
        evictable = protected = 0
        for node in self._nodes():
            if node.lock_ref:
                protected += len(node.block_ids)
            else:
                evictable += len(node.block_ids)
        num_held = sum(1 for ref in self._refs if ref)
        check_invariant(num_held == self._num_held, "held count {} == {}", self._num_held, num_held)
        check_invariant(
            self.num_cached_blocks == evictable + protected, "cached count == blocks in the tree"
        )
        check_invariant(
            evictable == self._num_evictable,
            "evictable count {} == {} unlocked cached blocks",
            self._num_evictable,
            evictable,
        )
        check_invariant(
            len(self._free) + evictable + protected + num_held == self.num_blocks,
            "free + evictable + protected == total",
        )

    def _check_heap(self) -> None:
        current = {entry[2] for entry in self._heap if entry[2] == entry[3].stamp}
        for node in self._nodes():
            if not node.lock_ref and not node.children:
                check_invariant(
                    node.stamp in current, "unlocked leaf at block {} is in the heap", node.start
                )


def check_invariant(condition: bool, invariant: str, *args: object) -> None:
    """Raise AssertionError naming ``invariant`` unless ``condition`` holds.

    ``invariant`` is a ``str.format`` template filled with ``args`` only on failure, so checking
    after every operation costs no string building.
    """
    if not condition:
        raise AssertionError("integrity: " + (invariant.format(*args) if args else invariant))


def _check_args(num_blocks: int, block_size: int, eviction_policy: str) -> None:
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if eviction_policy not in EVICTION_POLICIES:
        raise ValueError(
            f"unknown eviction_policy {eviction_policy!r}; choose one of {list(EVICTION_POLICIES)}"
        )


def _descend(
    node: _Node, digests: list[bytes], tokens: list[bytes], limit: int
) -> tuple[list[_Node], int]:
    """The nodes along the longest cached prefix of ``digests[:limit]`` and its length in blocks.

    A whole run is compared with two list comparisons (one slice each); only the node where the
    walk stops is compared block by block.
    """
    path: list[_Node] = []
    i = 0
    while i < limit:
        child = node.children.get(digests[i])
        if child is None:
            break
        size = len(child.digests)
        stop = i + size
        if stop > limit or child.digests != digests[i:stop] or child.tokens != tokens[i:stop]:
            size = _num_common(child, digests, tokens, i, limit)
            if size:
                path.append(child)
            return path, i + size
        path.append(child)
        node = child
        i = stop
    return path, i


def _num_common(node: _Node, digests: list[bytes], tokens: list[bytes], i: int, limit: int) -> int:
    """How many leading blocks of ``node`` equal blocks ``i..limit-1`` (digest and tokens)."""
    own_digests, own_tokens = node.digests, node.tokens
    size = min(len(own_digests), limit - i)
    k = 0
    while k < size and own_digests[k] == digests[i + k] and own_tokens[k] == tokens[i + k]:
        k += 1
    return k
