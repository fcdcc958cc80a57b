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

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from itertools import chain

from prefixcache.cache.base import PrefixCache
from prefixcache.cache.block_pool import BlockPool, KVBlock
from prefixcache.cache.config import EVICTION_POLICIES
from prefixcache.cache.identity import CacheIdentity
from prefixcache.cache.index import CacheHit, Inserted, PrefixIndex, SeqBlocks
from prefixcache.cache.radix_tree import (
    EvictionHeaps,
    RadixNode,
    block_nodes,
    check_tree,
    descend,
    num_common,
    num_unlocked,
    path_ids,
)  # fmt: skip
from prefixcache.cache.sequence import Sequence

__all__ = ["EVICTION_POLICIES", "RadixIndex", "RadixPrefixCache"]


class RadixPrefixCache(PrefixCache):
    """SGLang-style prefix cache: unlocked cached blocks stay in the tree and are evicted leaf
    first; ``eviction_policy`` is ``lru`` (default) or ``lfu`` (hit count, then recency)."""

    kind = "radix"
    index: RadixIndex

    def _make_index(self) -> RadixIndex:
        index = RadixIndex(self.pool, self.identity, self.config.eviction_policy)
        self.pool.attach(index)  # it parks the free cached blocks
        return index

    def _admitted(self, table: SeqBlocks, hit: CacheHit) -> None:
        self.index.admit(table, hit)

    def _forked(self, parent: SeqBlocks, child: SeqBlocks) -> None:
        self.index.fork(parent, child)

    def _released(self, table: SeqBlocks) -> None:
        self.index.release(table)

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
class _HitHandle:
    """Where `lookup` stopped: the node holding the last hit block, the namespace root, and
    the block ids and pool epoch it found (unchanged epoch: still in the tree)."""

    index: RadixIndex
    node: RadixNode
    root: bytes
    block_ids: list[int]
    epoch: int


class RadixIndex(PrefixIndex):
    """A radix tree of block runs; ``eviction_policy`` is ``lru`` or ``lfu`` (hit count, then
    recency). Its cached blocks (``num_cached``) and, among them, the parked ones (``num_parked``,
    per domain in ``parked``) are counted here alone."""

    def __init__(
        self, pool: BlockPool, identity: CacheIdentity, eviction_policy: str = "lru"
    ) -> None:
        self.pool = pool
        self.identity = identity
        self.eviction_policy = eviction_policy
        self.root = RadixNode.empty(None)
        self.num_nodes = 0  # tree nodes that own blocks
        self.heaps = EvictionHeaps(eviction_policy == "lfu")
        self.parked: dict[str, int] = {}  # per domain: its parked (unlocked) blocks
        self.num_parked = 0
        self._num_cached = 0
        self._clock = 0

    @property
    def num_cached(self) -> int:
        return self._num_cached

    def parked_by_domain(self) -> dict[str, int]:
        return self.parked

    # -- lookup ---------------------------------------------------------------------------------

    def lookup(self, seq: Sequence) -> CacheHit:
        digests = self.identity.block_digests(seq)
        root = self.identity.root(seq)
        ns = self.root.children.get(root)
        if ns is None:
            return CacheHit()
        path, num_matched = descend(ns, digests, seq.block_token_bytes, len(digests))
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
        handle = self._handle(seq, hit)
        node = _resolve(handle, hit)
        if not (
            (handle.epoch == self.pool.epoch and handle.block_ids is hit.block_ids)
            or (node.attached and path_ids(node)[0][: hit.num_blocks] == hit.block_ids)
        ):
            raise ValueError("stale cache hit: its blocks were evicted since match()")
        runs, num_hit = [], len(hit.block_ids)  # the hit's blocks, node by node from the deepest
        while node.block_ids:
            runs.append(node.blocks[: num_hit - node.start])
            node = node.parent
        return runs[0] if len(runs) == 1 else list(chain.from_iterable(reversed(runs)))

    def _handle(self, seq: Sequence, hit: CacheHit) -> _HitHandle:
        """The hit's handle, checked to be this index's lookup for ``seq``."""
        handle = hit.handle
        if (
            not isinstance(handle, _HitHandle)
            or handle.index is not self
            or handle.root != self.identity.root(seq)
        ):
            raise ValueError("the hit was not produced by this cache's match() for this sequence")
        return handle

    def num_free_in(self, hit: CacheHit, blocks: list[KVBlock]) -> int:
        """Hit blocks on unlocked nodes: evictable now, protected once the path is locked."""
        assert isinstance(hit.handle, _HitHandle)  # checked_hit checked it
        return num_unlocked(_resolve(hit.handle, hit), hit.num_blocks)

    def admit(self, table: SeqBlocks, hit: CacheHit) -> None:
        table.num_path = num_hit = len(hit.block_ids)
        assert isinstance(hit.handle, _HitHandle)  # checked_hit checked it
        table.node = node = self._split(_resolve(hit.handle, hit), num_hit)
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
            node = self.heaps.next_leaf(parked, protected)
            domain = node.domain
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
                self.heaps.pop(domain)
                self._detach(node)
        return ids, dropped

    def take_free_under(self, roots: Collection[bytes]) -> tuple[list[KVBlock], list[bytes]]:
        """The namespaces' parked blocks, each node's once its children are gone."""
        blocks, digests = list[KVBlock](), list[bytes]()
        for node in reversed(block_nodes(self.root, roots)):
            if not node.lock_ref and not node.children:
                blocks += node.blocks  # with the tree's reference on each
                digests += node.digests
                self.parked[node.domain] -= len(node.blocks)
                self.num_parked -= len(node.blocks)
                self._num_cached -= len(node.blocks)
                del node.block_ids[:], node.blocks[:], node.digests[:], node.tokens[:]
                self._detach(node)
        return blocks, digests

    def _detach(self, node: RadixNode) -> None:
        parent = node.parent
        del parent.children[node.key]
        node.attached = False
        self.num_nodes -= 1
        if parent.children:
            return
        if not parent.block_ids:  # an empty namespace node
            del self.root.children[parent.key]
            parent.attached = False
        elif not parent.lock_ref:
            self.heaps.push(parent, self.num_nodes)

    def _lock(
        self, node: RadixNode, stop: RadixNode | None = None, *, count_hit: bool = False
    ) -> None:
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
            node = node.parent
        self.num_parked -= num_parked

    def _unlock(self, node: RadixNode) -> None:
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
                    self.heaps.push(node, self.num_nodes)
            node = node.parent
        self.num_parked += num_parked

    def fork(self, parent: SeqBlocks, child: SeqBlocks) -> None:
        if isinstance(parent.node, RadixNode):
            self._lock(parent.node)

    def release(self, table: SeqBlocks) -> None:
        if isinstance(table.node, RadixNode):
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
        first = table.node if isinstance(table.node, RadixNode) else self._namespace(seq)
        node, i = first, table.num_path
        while i < end:
            child = node.children.get(digests[i])
            if child is None:
                node, stop = self._add_node(table, node, i, end, result)
                if stop == i:
                    break  # a shared block: never cached
                i = stop  # the run stopped where its domain changes (public blocks first)
                continue
            common = num_common(child, digests, tokens, i, end)
            if not common:
                break  # digest collision: these blocks stay private to the sequence
            node = self._split(child, i + common)
            result.num_duplicates += self._adopt(table, node, i)
            i = node.end
        if node is not first:
            # the sequence's lock moves down: the nodes above ``first`` keep the one it had
            self._lock(node, first)
            table.node = node
            table.num_path = i
        return result

    def _namespace(self, seq: Sequence) -> RadixNode:
        root = self.identity.root(seq)
        node = self.root.children.get(root)
        if node is None:
            node = RadixNode.empty(self.root, root)
            self.root.children[root] = node
        return node

    def _add_node(
        self, table: SeqBlocks, parent: RadixNode, start: int, stop: int, result: Inserted
    ) -> tuple[RadixNode, int]:
        """A new child of ``parent`` owning ``table``'s blocks ``start..stop-1`` (held by it),
        recorded as a stored run in ``result``."""
        blocks, seq = table.blocks, table.seq
        if start < seq.public_blocks < stop:
            stop = seq.public_blocks  # a node's blocks are of one domain
        end = start
        while end < stop and blocks[end].ref_cnt == 1:  # a shared block is never cached
            end += 1
        if end == start:
            return parent, start
        digests, tokens = seq.block_digests, seq.block_token_bytes
        node = RadixNode(
            parent,
            digests[start],
            start,
            table.block_ids[start:end],
            blocks[start:end],
            digests[start:end],
            tokens[start:end],
            domain=seq.block_domain(start),  # whose churn evicts it first
        )
        parent.children[node.key] = node  # the table's references are the tree's now
        self._num_cached += end - start
        self.num_parked += end - start  # unlocked until the caller locks it
        self.parked[node.domain] = self.parked.get(node.domain, 0) + end - start
        self.num_nodes += 1
        result.runs.append((start, end))
        return node, end

    def _adopt(self, table: SeqBlocks, node: RadixNode, start: int) -> int:
        """``node``'s run was already cached by another sequence: point the table at it and
        release the sequence's duplicates; returns how many there were."""
        pool = self.pool
        cached = node.blocks[start - node.start :]
        dups = table.blocks[start : node.end]
        table.blocks[start : node.end] = cached  # held through the lock the insert moves here
        table.block_ids[start : node.end] = node.block_ids[start - node.start :]
        pool.release(reversed(dups))
        return len(dups)

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """The node whose run ends at block ``num_blocks``: ``node``, or its head split off."""
        head = node.split(num_blocks)
        self.num_nodes += head is not node
        return head

    def clear(self) -> None:
        for node in self.nodes():
            node.attached = False  # hits found before the reset are stale
        for ns in self.root.children.values():
            ns.attached = False
        self.root.children.clear()
        self.heaps.clear()
        self.parked.clear()
        self.num_parked = self._num_cached = 0
        self.num_nodes = 0

    # -- invariants -----------------------------------------------------------------------------

    def nodes(self) -> list[RadixNode]:
        """Every block-owning node, parents before children."""
        return block_nodes(self.root)

    def held_block_ids(self) -> list[int]:
        return [i for node in self.nodes() for i in node.block_ids]

    def check(self, tables: Mapping[str, SeqBlocks]) -> None:
        check_tree(self, tables)


def _resolve(handle: _HitHandle, hit: CacheHit) -> RadixNode:
    """The node holding ``hit``'s last block now (a split since may have moved it upward)."""
    node = handle.node
    num_hit = len(hit.block_ids)
    while node.attached and node.start >= num_hit:
        node = node.parent
    return node
