"""The prefix index: the one part where the hash and radix caches differ, and what both share.

The block pool (``block_pool.py``) owns every block; the `PrefixCache` (``base.py``) owns the
sequences' block tables, the contract's rules, the statistics and the events. An index answers
"which cached blocks does this sequence start with?", decides which committed blocks become
hittable, and owns its own maps and counts: nothing else edits them, and it writes no counter,
statistic or event of anyone else's (what it did comes back as return values). It sees blocks
and tables, never tensors. To the pool it is an `Evictor` (the interface the pool defines).

- hash: a free cached block waits in the pool's queues, whose order is the eviction order; when
  the pool reuses one, the cache tells the index to `forget` its digest.
- radix: the index keeps its cached blocks itself (the pool's `Evictor`), holding one reference
  on each; a table's first ``num_path`` blocks are held through the index (the locks of its tree
  path), not through ref counts of their own; unlocked ones are parked and given up through
  `evict`, in the index's own order.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping

    from prefixcache.cache.block_pool import KVBlock
    from prefixcache.cache.sequence import Sequence

__all__ = ["NOTHING_INSERTED", "CacheHit", "Inserted", "PrefixIndex", "SeqBlocks"]


@dataclass(slots=True)
class CacheHit:
    """The longest reusable prefix of a sequence: ``num_tokens == len(block_ids) * block_size``.

    ``first_miss_block`` is the index of the block where the walk stopped (== len(block_ids)),
    ``num_matched_blocks`` counts matched blocks before the ``num_prompt_tokens - 1`` cap.
    ``handle`` is the index's own data (hash: the blocks; radix: the matched node).
    ``lookup_time_ns`` is how long the lookup took; it is counted when the hit is admitted.
    ``epoch`` is the pool's epoch at the lookup (see `PrefixCache.is_current`).
    """

    num_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    first_miss_block: int = 0
    num_matched_blocks: int = 0
    handle: object = None
    lookup_time_ns: int = 0
    epoch: int = -1

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(slots=True, eq=False)
class SeqBlocks:
    """A live sequence's block table.

    Tokens ``[0, num_computed_tokens)`` have written KV (the count is the sequence's, set by the
    cache); ``[num_computed_tokens, num_alloc_tokens)`` are allocated and about to be written.
    ``num_committed_blocks`` full blocks were handed to the index by `commit`. ``num_path``
    leading blocks and ``node`` are the index's place for this sequence (radix: the locked tree
    path; hash: unused).
    """

    seq: Sequence
    blocks: list[KVBlock]
    block_ids: list[int]
    num_alloc_tokens: int
    num_committed_blocks: int
    num_path: int = 0
    node: object = None

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens


@dataclass(slots=True)
class Inserted:
    """What `PrefixIndex.insert` did: the runs ``[start, end)`` of the table's blocks that became
    hittable, in order, and how many computed blocks were duplicates of cached ones."""

    runs: list[tuple[int, int]] = field(default_factory=list)
    num_duplicates: int = 0

    @property
    def num_stored(self) -> int:
        return sum(end - start for start, end in self.runs)


NOTHING_INSERTED = Inserted()  # shared: never mutated


class PrefixIndex(abc.ABC):
    """What both indexes implement for the `PrefixCache` written over them. Each kind adds its
    own steps, called by its own cache: the hash index `forget`s digests the pool reused; the
    radix index is the pool's `Evictor` and holds a table's path (``admit``/``fork``/
    ``release``)."""

    @property
    @abc.abstractmethod
    def num_cached(self) -> int:
        """Blocks that are hittable now (held or free)."""

    @abc.abstractmethod
    def lookup(self, seq: Sequence) -> CacheHit:
        """The longest cached prefix of ``seq`` (capped to leave one prompt token). Pure."""

    @abc.abstractmethod
    def checked_hit(self, seq: Sequence, hit: CacheHit) -> list[KVBlock]:
        """The blocks of a non-empty ``hit``, verified to still be cached for ``seq`` (a list
        the caller keeps); raises ValueError for a stale or forged hit."""

    def num_free_in(self, hit: CacheHit, blocks: list[KVBlock]) -> int:
        """How many of ``hit``'s ``blocks`` are free now (admitting the hit consumes them)."""
        return sum(1 for b in blocks if b.ref_cnt == 0)

    @abc.abstractmethod
    def insert(self, table: SeqBlocks, start: int, end: int) -> Inserted:
        """``table``'s blocks ``start..end-1`` are full and computed: make them hittable (or
        adopt the copies already cached, releasing the duplicates)."""

    @abc.abstractmethod
    def take_free_under(self, roots: Collection[bytes]) -> tuple[list[KVBlock], list[bytes]]:
        """Every free cached block under these namespace roots, cached no more, each handed
        over with one reference (the pool's ``release`` lets it go), and their digests."""

    @abc.abstractmethod
    def held_block_ids(self) -> list[int]:
        """Blocks the index itself holds a reference on (radix: its tree's)."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Drop everything (the pool holds no block in use)."""

    @abc.abstractmethod
    def check(self, tables: Mapping[str, SeqBlocks]) -> None:
        """Raise AssertionError naming the first broken invariant of the index."""
