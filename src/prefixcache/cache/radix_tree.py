"""The radix tree under `RadixIndex`: its nodes, the per-domain eviction heaps, the walks down
a sequence's digests, and the tree's invariants. Blocks and digests only; no pool edits."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from prefixcache.cache.block_pool import BlockPool, KVBlock, check_invariant
from prefixcache.cache.index import SeqBlocks

__all__ = [
    "EvictionHeaps", "RadixNode", "block_nodes", "check_tree", "descend", "num_common",
    "num_unlocked", "path_ids",
]  # fmt: skip


@dataclass(slots=True, eq=False)
class RadixNode:
    """A run of cached blocks ``[start, start + len(block_ids))`` of every sequence through it.

    The root and the namespace nodes own no blocks; the root is its own parent. ``stamp`` names
    the node's current eviction heap entry (older entries are stale); each domain's nodes have
    their own heap.
    """

    parent: RadixNode
    key: bytes
    start: int
    block_ids: list[int]
    blocks: list[KVBlock]  # the pool's blocks of ``block_ids``
    digests: list[bytes]
    tokens: list[bytes]
    children: dict[bytes, RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    hit_count: int = 0
    stamp: int = 0
    attached: bool = True
    domain: str = ""  # the domain whose sequence cached it

    @classmethod
    def empty(cls, parent: RadixNode | None, key: bytes = b"") -> RadixNode:
        """A node owning no blocks: the root (``parent`` None) or a namespace."""
        node = cls(parent, key, 0, [], [], [], [])  # type: ignore[arg-type]  # set below
        if parent is None:
            node.parent = node
        return node

    @property
    def end(self) -> int:
        return self.start + len(self.block_ids)

    def split(self, num_blocks: int) -> RadixNode:
        """Make the first ``num_blocks - start`` blocks a node of their own, this node's new
        parent; returns the node whose run ends at block ``num_blocks`` (this one if it already
        does). The head inherits the locks, recency and hit count, so no block changes between
        evictable and protected."""
        cut = num_blocks - self.start
        if cut >= len(self.block_ids):
            return self
        parent = self.parent
        head = RadixNode(
            parent, self.key, self.start, self.block_ids[:cut], self.blocks[:cut],
            self.digests[:cut], self.tokens[:cut], {self.digests[cut]: self}, self.lock_ref,
            self.last_access, self.hit_count, domain=self.domain,
        )  # fmt: skip
        parent.children[head.key] = head
        del self.block_ids[:cut], self.blocks[:cut], self.digests[:cut], self.tokens[:cut]
        self.parent = head
        self.key = self.digests[0]
        self.start = num_blocks
        return head


class EvictionHeaps:
    """Per domain, a heap of its unlocked leaves in eviction order (``lfu``: hit count
    first), with lazy invalidation: an entry whose stamp is not its node's is stale."""

    def __init__(self, lfu: bool) -> None:
        self.lfu = lfu
        self.heaps: dict[str, list[tuple[int, int, int, RadixNode]]] = {}
        self._stamp = 0

    def push(self, node: RadixNode, num_nodes: int) -> None:
        """``node`` became an unlocked leaf (its older entries go stale)."""
        self._stamp += 1
        node.stamp = self._stamp
        freq = node.hit_count if self.lfu else 0
        heap = self.heaps.setdefault(node.domain, [])
        heapq.heappush(heap, (freq, node.last_access, self._stamp, node))
        if len(heap) > 4 * num_nodes + 1024:
            heap[:] = [e for e in heap if e[2] == e[3].stamp and e[3].attached]
            heapq.heapify(heap)

    def first(self, domain: str) -> RadixNode | None:
        """``domain``'s next leaf to evict (stale entries are dropped on the way); None where
        none of its parked nodes is a leaf (public blocks, say, parents of tenants' runs)."""
        heap = self.heaps.get(domain, [])
        while heap:
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
        return None

    def next_leaf(self, parked: Mapping[str, int], protected: frozenset[str]) -> RadixNode:
        """The next leaf to evict: of the domain with the most ``parked`` blocks (none of the
        ``protected``) that has a parked leaf. A domain whose parked nodes all have children
        (the public one's, under tenants' runs) waits until those children go."""
        if len(parked) == 1 and not protected:
            node = self.first(next(iter(parked)))
        else:
            domains = sorted((d for d in parked if d not in protected), key=parked.__getitem__,
                             reverse=True)  # stable: ties keep the parked order
            node = next(filter(None, map(self.first, domains)), None)
        assert node is not None, "parked blocks but no parked leaf"  # check_tree's invariants
        return node

    def pop(self, domain: str) -> None:
        heapq.heappop(self.heaps[domain])

    def clear(self) -> None:
        self.heaps.clear()


class Tree(Protocol):
    """What `check_tree` reads of the index that keeps a tree (`RadixIndex`)."""

    pool: BlockPool
    root: RadixNode
    heaps: EvictionHeaps
    parked: dict[str, int]
    num_parked: int
    num_nodes: int

    @property
    def num_cached(self) -> int: ...

    def nodes(self) -> list[RadixNode]: ...


def check_tree(index: Tree, tables: Mapping[str, SeqBlocks]) -> None:
    """Raise AssertionError naming the first broken invariant of ``index``'s tree."""
    for root, ns in index.root.children.items():
        check_invariant(
            ns.key == root and ns.parent is index.root and ns.attached and not ns.block_ids
            and not ns.lock_ref,
            "namespace node {} is keyed by its root, owns no blocks and is never locked",
            root.hex()[:8],
        )  # fmt: skip
    locks = Counter(t.node for t in tables.values() if isinstance(t.node, RadixNode))
    in_heap = {e[2] for d, heap in index.heaps.heaps.items() for e in heap if e[3].domain == d}
    nodes = index.nodes()
    tree: set[int] = set()
    parked: Counter[str] = Counter()
    for node in reversed(nodes):  # children before parents
        _check_node(node, locks[node], in_heap)
        if not node.lock_ref:
            parked[node.domain] += len(node.block_ids)
        for block_id in node.block_ids:
            block = index.pool.blocks[block_id]
            check_invariant(
                block_id not in tree and block.ref_cnt == 1 and block.digest is None,
                "a tree block is in the tree once, held by the tree alone; its node keeps "
                "the digest: {!r}",
                block,
            )
            tree.add(block_id)
    check_invariant(len(nodes) == index.num_nodes, "node count kept incrementally")
    check_invariant(len(tree) == index.num_cached, "cached count kept (tree blocks)")
    num_parked = sum(parked.values())
    check_invariant(
        num_parked == index.num_parked and parked == +Counter(index.parked),
        "parked (evictable) blocks {} == {} unlocked cached blocks, per domain {} == {}",
        index.num_parked,
        num_parked,
        index.parked,
        parked,
    )
    _check_tables(tables, tree, index.pool.block_size)


def _check_node(node: RadixNode, num_locks: int, in_heap: set[int]) -> None:
    """``node`` is linked, holds its runs, counts the sequences through it (``num_locks`` end
    there) and, an unlocked leaf, waits in its heap."""
    parent = node.parent
    check_invariant(
        node.attached and parent.children.get(node.key) is node
        and node.start == parent.end and node.key == node.digests[0]
        and len(node.block_ids) == len(node.digests) == len(node.tokens)
        and [b.block_id for b in node.blocks] == node.block_ids,
        "node at block {} is linked, starts where its parent ends, keeps one block, "
        "digest and token run per block and is keyed by its first",
        node.start,
    )  # fmt: skip
    expected = num_locks + sum(c.lock_ref for c in node.children.values())
    check_invariant(
        node.lock_ref == expected,
        "lock_ref {} at block {} == sequences through it ({})",
        node.lock_ref,
        node.start,
        expected,
    )
    if not node.lock_ref:
        check_invariant(
            bool(node.children) or node.stamp in in_heap,
            "unlocked leaf at block {} is in the heap",
            node.start,
        )


def _check_tables(tables: Mapping[str, SeqBlocks], tree: set[int], block_size: int) -> None:
    """Each table starts with its locked path and holds nothing else of the tree's."""
    for seq_id, table in tables.items():
        path, attached = path_ids(table.node) if isinstance(table.node, RadixNode) else ([], True)
        check_invariant(
            attached and table.block_ids[: table.num_path] == path
            and len(path) == table.num_path
            and table.num_path * block_size <= table.num_computed_tokens,
            "{!r} locks only nodes in the tree; its table starts with its locked path, "
            "num_path long, all computed",
            seq_id,
        )  # fmt: skip
        held = table.block_ids[table.num_path :]
        check_invariant(tree.isdisjoint(held), "{!r}'s held blocks are not in the tree", seq_id)

def block_nodes(root: RadixNode, roots: Collection[bytes] | None = None) -> list[RadixNode]:
    """Every block-owning node under ``root`` (under the namespaces ``roots`` alone, where
    given), parents before children."""
    children = root.children
    stack = list(children.values() if roots is None else
                 (children[r] for r in roots if r in children))  # fmt: skip
    out: list[RadixNode] = []
    while stack:
        node = stack.pop()
        if node.block_ids:
            out.append(node)
        stack.extend(node.children.values())
    return out


def num_unlocked(node: RadixNode, num_blocks: int) -> int:
    """Of the first ``num_blocks`` blocks of the path ending at ``node``, those on unlocked
    nodes (evictable now)."""
    count = 0
    while node.block_ids and not node.lock_ref:
        count += min(node.end, num_blocks) - node.start
        node = node.parent
    return count


def path_ids(node: RadixNode) -> tuple[list[int], bool]:
    """The block ids from the namespace down to ``node``'s last, and whether every node on the
    way is still in the tree."""
    path: list[int] = []
    attached = True
    while node.block_ids:
        path[:0] = node.block_ids
        attached = attached and node.attached
        node = node.parent
    return path, attached


def descend(
    node: RadixNode, digests: list[bytes], tokens: list[bytes], limit: int
) -> tuple[list[RadixNode], int]:
    """The nodes along the longest cached prefix of ``digests[:limit]`` and its length in blocks.

    A whole run is compared with two list comparisons (one slice each); only the node where the
    walk stops is compared block by block.
    """
    path: list[RadixNode] = []
    i = 0
    while i < limit:
        child = node.children.get(digests[i])
        if child is None:
            break
        size = len(child.digests)
        stop = i + size
        if stop > limit or child.digests != digests[i:stop] or child.tokens != tokens[i:stop]:
            size = num_common(child, digests, tokens, i, limit)
            if size:
                path.append(child)
            return path, i + size
        path.append(child)
        node = child
        i = stop
    return path, i


def num_common(
    node: RadixNode, digests: list[bytes], tokens: list[bytes], i: int, limit: int
) -> int:
    """How many leading blocks of ``node`` equal blocks ``i..limit-1`` (digest and tokens)."""
    own_digests, own_tokens = node.digests, node.tokens
    size = min(len(own_digests), limit - i)
    k = 0
    while k < size and own_digests[k] == digests[i + k] and own_tokens[k] == tokens[i + k]:
        k += 1
    return k
