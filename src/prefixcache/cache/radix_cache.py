"""The radix-tree prefix cache (SGLang RadixAttention-style): the contract (``base.py``) over
the block pool, with a radix tree of block runs as its index.

Shape of the tree::

    root ─► namespace node (key: the namespace root digest, no blocks)
              ─► node (key: digest of its first block) owns a run of block ids, ...

A node owns a run of full, committed blocks: their ids, chained digests (`block_hash.py`) and
token bytes. Children are keyed by the digest of their first block; digests chain from the
namespace root and fold in block extras, so two namespaces never share a node; a hit also
compares the token bytes, so a digest collision costs a miss, never wrong KV.

A block is free in the pool's queue, or in the tree (evictable: *parked*; or protected: its node
is locked), or held by sequences outside the tree (the uncommitted tail of a table). The tree
holds the one reference of each of its blocks (``ref_cnt`` 1, handed over from the table that
committed it and on to the table that evicts it; the node keeps the digests). ``lock_ref``
counts the live sequences whose locked path (deepest node to the root) runs through a node; a
table starts with exactly its locked path, held through the locks. ``num_parked`` counts the
blocks of unlocked nodes (the pool reads it), kept by `_lock` incrementally. Eviction takes the tail
blocks of the least recently (``lfu``: least frequently) used unlocked leaf, from a heap with
lazy invalidation; a parent becomes a candidate once its last child is gone.

A sequence that computed blocks another one inserted meanwhile (both missed) gets the tree's
blocks in its table at commit and releases its duplicates at once (as SGLang does). Nodes split
only when a run is shared partially: on insert, and when a hit that ends inside a node is
admitted, so that a sequence's locked path covers exactly its hit blocks.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain

from prefixcache.cache.base import PrefixCache
from prefixcache.cache.block_pool import BlockPool, KVBlock, check_invariant
from prefixcache.cache.config import EVICTION_POLICIES
from prefixcache.cache.identity import CacheIdentity
from prefixcache.cache.index import CacheHit, Inserted, PrefixIndex, SeqBlocks
from prefixcache.cache.sequence import Sequence

__all__ = ["EVICTION_POLICIES", "RadixIndex", "RadixPrefixCache"]


class RadixPrefixCache(PrefixCache):
    """SGLang-style prefix cache: unlocked cached blocks stay in the tree and are evicted leaf
    first; ``eviction_policy`` is ``lru`` (default) or ``lfu`` (hit count, then recency)."""

    kind = "radix"
    index: RadixIndex

    def _make_index(self) -> PrefixIndex:
        return RadixIndex(self.pool, self.identity, self.eviction_policy)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no live sequence locks (reusable after eviction)."""
        return self.index.num_parked

    @property
    def num_protected_blocks(self) -> int:
        """Blocks live sequences use: on locked paths, or held outside the tree."""
        return self.num_blocks - self.pool.num_free

    @property
    def num_nodes(self) -> int:
        """Tree nodes that own blocks."""
        return self.index.num_nodes


@dataclass(slots=True, eq=False)
class _Node:
    """A run of cached blocks ``[start, start + len(block_ids))`` of every sequence through it.

    The root and the namespace nodes own no blocks. ``stamp`` names the node's current eviction
    heap entry (older entries are stale); each domain's nodes have their own heap.
    """

    parent: _Node | None
    key: bytes
    start: int
    block_ids: list[int]
    blocks: list[KVBlock]  # the pool's blocks of ``block_ids``
    digests: list[bytes]
    tokens: list[bytes]
    children: dict[bytes, _Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    hit_count: int = 0
    stamp: int = 0
    attached: bool = True
    domain: str = ""  # the isolation domain whose sequence cached it

    @property
    def end(self) -> int:
        return self.start + len(self.block_ids)


@dataclass(slots=True, eq=False)
class _HitHandle:
    """Where `lookup` stopped: the node holding the last hit block, the namespace root, and
    the block ids and pool epoch it found (unchanged epoch: still in the tree)."""

    index: object
    node: _Node
    root: bytes
    block_ids: list[int]
    epoch: int


class RadixIndex(PrefixIndex):
    """A radix tree of block runs; ``eviction_policy`` is ``lru`` or ``lfu`` (hit count, then
    recency). Its cached blocks (``num_cached``) and, among them, the parked ones (``num_parked``,
    per domain in ``parked``) are counted here alone."""

    keeps_free_blocks = True

    def __init__(
        self, pool: BlockPool, identity: CacheIdentity, eviction_policy: str = "lru"
    ) -> None:
        self.pool = pool
        self.identity = identity
        self.eviction_policy = eviction_policy
        self._lfu = eviction_policy == "lfu"
        self._root = _Node(None, b"", 0, [], [], [], [])
        self._num_nodes = 0
        # per isolation domain: its eviction heap and its parked (unlocked) blocks
        self._heaps: dict[str, list[tuple[int, int, int, _Node]]] = {}
        self.parked: dict[str, int] = {}
        self.num_parked = 0
        self._num_cached = 0
        self._clock = 0
        self._stamp = 0

    @property
    def num_nodes(self) -> int:
        """Tree nodes that own blocks."""
        return self._num_nodes

    @property
    def num_cached(self) -> int:
        return self._num_cached

    def parked_by_domain(self) -> dict[str, int]:
        return self.parked

    # -- lookup ---------------------------------------------------------------------------------

    def lookup(self, seq: Sequence) -> CacheHit:
        digests = self.identity.block_digests(seq)
        root = self.identity.root(seq)
        ns = self._root.children.get(root)
        if ns is None:
            return CacheHit()
        path, num_matched = _descend(ns, digests, seq.block_token_bytes, len(digests))
        num_hit = min(num_matched, max(0, (len(seq.token_ids) - 1) // self.pool.block_size))
        block_ids: list[int] = []
        last = ns
        for node in path:
            if node.start >= num_hit:
                break
            block_ids += node.block_ids[: num_hit - node.start]
            last = node
        handle = _HitHandle(self, last, root, block_ids, self.pool.epoch) if num_hit else None
        return CacheHit(num_hit * self.pool.block_size, block_ids, num_hit, num_matched, handle)

    def checked_hit(self, seq: Sequence, hit: CacheHit) -> list[KVBlock]:
        node = self._hit_node(seq, hit)
        handle: _HitHandle = hit.handle  # type: ignore[assignment]  # checked by _hit_node
        if not (
            (handle.epoch == self.pool.epoch and handle.block_ids is hit.block_ids)
            or (node.attached and _path_ids(node)[0][: hit.num_blocks] == hit.block_ids)
        ):
            raise ValueError("stale cache hit: its blocks were evicted since match()")
        runs, num_hit = [], len(hit.block_ids)  # the hit's blocks, node by node from the deepest
        while node.block_ids:
            runs.append(node.blocks[: num_hit - node.start])
            node = node.parent  # type: ignore[assignment]
        return runs[0] if len(runs) == 1 else list(chain.from_iterable(reversed(runs)))

    def _hit_node(self, seq: Sequence, hit: CacheHit) -> _Node:
        """The node holding the hit's last block (a split since may have moved it upward)."""
        handle = hit.handle
        if (
            not isinstance(handle, _HitHandle)
            or handle.index is not self
            or handle.root != self.identity.root(seq)
        ):
            raise ValueError("the hit was not produced by this cache's match() for this sequence")
        return _resolve(hit)

    def num_free_in(self, hit: CacheHit, blocks: list[KVBlock]) -> int:
        """Hit blocks on unlocked nodes: evictable now, protected once the path is locked."""
        node = _resolve(hit)
        count = 0
        while node.block_ids and not node.lock_ref:
            count += min(node.end, hit.num_blocks) - node.start
            node = node.parent  # type: ignore[assignment]
        return count

    def admit(self, table: SeqBlocks, hit: CacheHit) -> None:
        table.num_path = num_hit = len(hit.block_ids)
        table.node = node = self._split(_resolve(hit), num_hit)  # checked_hit checked the handle
        self._lock(node, count_hit=True)

    # -- eviction -------------------------------------------------------------------------------

    def evict(
        self, num: int, out: list[KVBlock], protected: frozenset[str]
    ) -> tuple[list[int], list[bytes]]:
        """Leaf tails first in policy order (the deepest block first), from the domain with the
        most parked blocks: one domain's churn evicts its own cached blocks before another's."""
        parked = self.parked
        ids: list[int] = []
        dropped: list[bytes] = []
        while num:
            if len(parked) == 1 and not protected:
                domain = next(iter(parked))
            else:
                domain = max((d for d in parked if d not in protected), key=parked.__getitem__)
            heap = self._heaps[domain]
            node = self._candidate(heap)
            block_ids, digests = node.block_ids, node.digests
            cut = max(0, len(block_ids) - num)
            taken = block_ids[cut:]
            taken.reverse()
            out += reversed(node.blocks[cut:])  # the tree's reference goes with each
            ids += taken
            dropped += reversed(digests[cut:])
            num -= len(taken)
            parked[domain] -= len(taken)
            self.num_parked -= len(taken)
            self._num_cached -= len(taken)
            del block_ids[cut:], node.blocks[cut:], digests[cut:], node.tokens[cut:]
            if not block_ids:
                heapq.heappop(heap)
                self._detach(node)
        return ids, dropped

    def _candidate(self, heap: list[tuple[int, int, int, _Node]]) -> _Node:
        """The first valid entry of an eviction heap (stale entries are dropped on the way)."""
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
        heap = self._heaps.setdefault(node.domain, [])
        heapq.heappush(heap, (freq, node.last_access, self._stamp, node))
        if len(heap) > 4 * self._num_nodes + 1024:
            heap[:] = [e for e in heap if e[2] == e[3].stamp and e[3].attached]
            heapq.heapify(heap)

    # -- locks ----------------------------------------------------------------------------------

    def _lock(self, node: _Node, stop: _Node | None = None, *, count_hit: bool = False) -> None:
        """Add one lock on every node from ``node`` up to ``stop`` (exclusive) or the namespace."""
        self._clock += 1
        clock, parked, num_parked = self._clock, self.parked, 0
        while node is not stop and node.block_ids:
            if not node.lock_ref:
                num_parked += len(node.block_ids)
                parked[node.domain] -= len(node.block_ids)
            node.lock_ref += 1
            node.last_access = clock
            if count_hit:
                node.hit_count += 1
            node = node.parent  # type: ignore[assignment]
        self.num_parked -= num_parked

    def _unlock(self, node: _Node) -> None:
        """Drop one lock on every node from ``node`` up: one left unlocked is parked."""
        self._clock += 1
        clock, parked, num_parked = self._clock, self.parked, 0
        while node.block_ids:
            node.lock_ref -= 1
            node.last_access = clock
            if not node.lock_ref:
                num_parked += len(node.block_ids)
                parked[node.domain] = parked.get(node.domain, 0) + len(node.block_ids)
                if not node.children:
                    self._push(node)
            node = node.parent  # type: ignore[assignment]
        self.num_parked += num_parked

    def fork(self, parent: SeqBlocks, child: SeqBlocks) -> None:
        if isinstance(parent.node, _Node):
            self._lock(parent.node)

    def release(self, table: SeqBlocks) -> None:
        if isinstance(table.node, _Node):
            self._unlock(table.node)

    # -- insert ---------------------------------------------------------------------------------

    def insert(self, table: SeqBlocks, start: int, end: int) -> Inserted:
        """Put blocks ``num_path..end-1`` of ``table`` into the tree and move its lock.

        Runs already in the tree (another sequence inserted them meanwhile) are walked, not
        copied: the table switches to the tree's blocks and its duplicates go free.
        """
        result = Inserted()
        if end <= table.num_path:
            return result
        seq = table.seq
        digests = self.identity.block_digests(seq)
        tokens = seq.block_token_bytes
        first = table.node if isinstance(table.node, _Node) else self._namespace(seq)
        node, i = first, table.num_path
        while i < end:
            child = node.children.get(digests[i])
            if child is None:
                node, i = self._add_node(table, node, i, end, result)
                break
            num_common = _num_common(child, digests, tokens, i, end)
            if not num_common:
                break  # digest collision: these blocks stay private to the sequence
            node = self._split(child, i + num_common)
            result.num_duplicates += self._adopt(table, node, i)
            i = node.end
        if node is not first:
            # the sequence's lock moves down: the nodes above ``first`` keep the one it had
            self._lock(node, first)
            table.node = node
            table.num_path = i
        return result

    def _namespace(self, seq: Sequence) -> _Node:
        root = self.identity.root(seq)
        node = self._root.children.get(root)
        if node is None:
            node = _Node(self._root, root, 0, [], [], [], [])
            self._root.children[root] = node
        return node

    def _add_node(
        self, table: SeqBlocks, parent: _Node, start: int, stop: int, result: Inserted
    ) -> tuple[_Node, int]:
        """A new child of ``parent`` owning ``table``'s blocks ``start..stop-1`` (held by it),
        recorded as a stored run in ``result``."""
        blocks = table.blocks
        end = start
        while end < stop and blocks[end].ref_cnt == 1:  # a shared block is never cached
            end += 1
        if end == start:
            return parent, start
        seq = table.seq
        digests, tokens = seq.block_digests, seq.block_token_bytes
        node = _Node(
            parent,
            digests[start],
            start,
            table.block_ids[start:end],
            blocks[start:end],
            digests[start:end],
            tokens[start:end],
            domain=seq.domain,  # whose churn evicts it first
        )
        parent.children[node.key] = node  # the table's references are the tree's now
        self._num_cached += end - start
        self.num_parked += end - start  # unlocked until the caller locks it
        self.parked[node.domain] = self.parked.get(node.domain, 0) + end - start
        self._num_nodes += 1
        result.runs.append((start, end))
        return node, end

    def _adopt(self, table: SeqBlocks, node: _Node, start: int) -> int:
        """``node``'s run was already cached by another sequence: point the table at it and
        release the sequence's duplicates; returns how many there were."""
        pool = self.pool
        cached = node.blocks[start - node.start :]
        dups = table.blocks[start : node.end]
        table.blocks[start : node.end] = cached  # held through the lock the insert moves here
        table.block_ids[start : node.end] = node.block_ids[start - node.start :]
        pool.release(reversed(dups))
        return len(dups)

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
            node.blocks[:cut],
            node.digests[:cut],
            node.tokens[:cut],
            {node.digests[cut]: node},
            node.lock_ref,
            node.last_access,
            node.hit_count,
            domain=node.domain,
        )
        parent.children[head.key] = head
        del node.block_ids[:cut], node.blocks[:cut], node.digests[:cut], node.tokens[:cut]
        node.parent = head
        node.key = node.digests[0]
        node.start = num_blocks
        self._num_nodes += 1
        return head

    def clear(self) -> None:
        for node in self._nodes():
            node.attached = False  # hits found before the reset are stale
        for ns in self._root.children.values():
            ns.attached = False
        self._root.children.clear()
        self._heaps.clear()
        self.parked.clear()
        self.num_parked = self._num_cached = 0
        self._num_nodes = 0

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

    def held_block_ids(self) -> list[int]:
        return [i for node in self._nodes() for i in node.block_ids]

    def check(self, tables: dict[str, SeqBlocks]) -> None:
        for root, ns in self._root.children.items():
            check_invariant(
                ns.key == root and ns.parent is self._root and ns.attached and not ns.block_ids
                and not ns.lock_ref,
                "namespace node {} is keyed by its root, owns no blocks and is never locked",
                root.hex()[:8],
            )  # fmt: skip
        locks = Counter(t.node for t in tables.values() if isinstance(t.node, _Node))
        in_heap = {e[2] for d, heap in self._heaps.items() for e in heap if e[3].domain == d}
        nodes = self._nodes()
        tree: set[int] = set()
        parked: Counter[str] = Counter()
        for node in reversed(nodes):  # children before parents
            parent = node.parent
            check_invariant(
                node.attached and parent is not None and parent.children.get(node.key) is node
                and node.start == parent.end and node.key == node.digests[0]
                and len(node.block_ids) == len(node.digests) == len(node.tokens)
                and [b.block_id for b in node.blocks] == node.block_ids,
                "node at block {} is linked, starts where its parent ends, keeps one block, "
                "digest and token run per block and is keyed by its first",
                node.start,
            )  # fmt: skip
            expected = locks[node] + sum(c.lock_ref for c in node.children.values())
            check_invariant(
                node.lock_ref == expected,
                "lock_ref {} at block {} == sequences through it ({})",
                node.lock_ref,
                node.start,
                expected,
            )
            if not node.lock_ref:
                parked[node.domain] += len(node.block_ids)
                check_invariant(
                    bool(node.children) or node.stamp in in_heap,
                    "unlocked leaf at block {} is in the heap",
                    node.start,
                )
            for block_id in node.block_ids:
                block = self.pool.blocks[block_id]
                check_invariant(
                    block_id not in tree and block.ref_cnt == 1 and block.digest is None,
                    "a tree block is in the tree once, held by the tree alone; its node keeps "
                    "the digest: {!r}",
                    block,
                )
                tree.add(block_id)
        check_invariant(len(nodes) == self._num_nodes, "node count kept incrementally")
        check_invariant(len(tree) == self._num_cached, "cached count kept (tree blocks)")
        num_parked = sum(parked.values())
        check_invariant(
            num_parked == self.num_parked and parked == +Counter(self.parked),
            "parked (evictable) blocks {} == {} unlocked cached blocks, per domain {} == {}",
            self.num_parked,
            num_parked,
            self.parked,
            parked,
        )
        for seq_id, table in tables.items():
            path, attached = _path_ids(table.node) if isinstance(table.node, _Node) else ([], True)
            check_invariant(
                attached and table.block_ids[: table.num_path] == path
                and len(path) == table.num_path
                and table.num_path * self.pool.block_size <= table.num_computed_tokens,
                "{!r} locks only nodes in the tree; its table starts with its locked path, "
                "num_path long, all computed",
                seq_id,
            )  # fmt: skip
            held = table.block_ids[table.num_path :]
            check_invariant(tree.isdisjoint(held), "{!r}'s held blocks are not in the tree", seq_id)


def _path_ids(node: _Node) -> tuple[list[int], bool]:
    """The block ids from the namespace down to ``node``'s last, and whether every node on the
    way is still in the tree."""
    path: list[int] = []
    attached = True
    while node.block_ids:
        path[:0] = node.block_ids
        attached = attached and node.attached
        node = node.parent  # type: ignore[assignment]
    return path, attached


def _resolve(hit: CacheHit) -> _Node:
    """The node holding ``hit``'s last block now (a split since may have moved it upward)."""
    node: _Node = hit.handle.node  # type: ignore[attr-defined]
    num_hit = len(hit.block_ids)
    while node.attached and node.start >= num_hit:
        node = node.parent  # type: ignore[assignment]
    return node


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
