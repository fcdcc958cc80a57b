"""The prefix index: the one part where the hash and radix caches differ.

The block pool (`block_pool.py`) owns every block; the `PrefixCache` (`manager.py`) owns the
sequences' block tables and the contract's rules. An index answers "which cached blocks does this
sequence start with?" and decides which committed blocks become hittable and which cached block
is evicted next. It sees blocks and tables, never tensors.

Two ways to hold a free cached block, chosen by the index:

- ``parks_blocks = False`` (hash): a cached block with ``ref_cnt == 0`` waits in the pool's free
  queue, which is the eviction order; the pool tells the index through `forget` when it pops one.
- ``parks_blocks = True`` (radix): the index keeps its cached blocks itself; a table's first
  ``num_path`` blocks are held through the index (radix: the locks of its tree path), not
  through per-block ref counts; unlocked ones are "parked" (``pool.num_parked``) and given up
  through `evict`, in the index's own order (leaves first, LRU or LFU).
"""

from __future__ import annotations

import abc
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixcache.cache.block_pool import KVBlock
    from prefixcache.cache.sequence import Sequence

__all__ = ["CacheHit", "PrefixIndex", "SeqBlocks"]


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

    Tokens ``[0, num_computed_tokens)`` have written KV; ``[num_computed_tokens,
    num_alloc_tokens)`` are allocated and about to be written. ``num_committed_blocks`` full
    blocks were handed to the index by `commit`. ``num_path`` leading blocks and ``node`` are
    the index's place for this sequence (radix: the locked tree path; hash: unused).
    """

    seq: Sequence
    blocks: list[KVBlock]
    block_ids: list[int]
    num_computed_tokens: int
    num_alloc_tokens: int
    num_committed_blocks: int
    num_path: int = 0
    node: object = None


class PrefixIndex(abc.ABC):
    """What the hash and radix indexes implement for the `PrefixCache` written over them."""

    parks_blocks: bool = False

    @abc.abstractmethod
    def lookup(self, seq: Sequence) -> CacheHit:
        """The longest cached prefix of ``seq`` (capped to leave one prompt token). Pure."""

    @abc.abstractmethod
    def checked_hit(self, seq: Sequence, hit: CacheHit) -> list[KVBlock]:
        """The blocks of a non-empty ``hit``, verified to still be cached for ``seq``; raises
        ValueError for a stale or forged hit."""

    def num_free_in(self, hit: CacheHit, blocks: list[KVBlock]) -> int:
        """How many of ``hit``'s ``blocks`` are free now (admitting the hit consumes them)."""
        return sum(1 for b in blocks if b.ref_cnt == 0)

    def admit(self, table: SeqBlocks, hit: CacheHit) -> None:  # noqa: B027 - optional hook
        """``table`` starts with ``hit``'s blocks (radix: lock the path, set ``num_path``); the
        cache then references ``blocks[num_path:]`` of them."""

    @abc.abstractmethod
    def insert(self, table: SeqBlocks, start: int, end: int) -> None:
        """``table``'s blocks ``start..end-1`` are full and computed: make them hittable (or
        adopt the copies already cached, releasing the duplicates)."""

    def fork(self, parent: SeqBlocks, child: SeqBlocks) -> None:  # noqa: B027 - optional hook
        """``child`` shares every block of ``parent`` (ref counts already raised)."""

    def release(self, table: SeqBlocks) -> None:  # noqa: B027 - optional hook
        """``table`` let go of its blocks (radix: unlock the path)."""

    def evict(
        self, num: int, protected: frozenset[str] = frozenset()
    ) -> tuple[list[KVBlock], list[bytes]]:
        """Give up ``num`` parked blocks in eviction order, with their digests, none of the
        ``protected`` domains' (only when ``parks_blocks``); the pool clears them."""
        raise NotImplementedError

    def evictable_by_domain(self) -> dict[str, int]:
        """Parked (evictable) blocks per domain (only when ``parks_blocks``)."""
        raise NotImplementedError

    def evictable_domains(self) -> Collection[str]:
        """The domains that may have parked blocks (only when ``parks_blocks``)."""
        raise NotImplementedError

    def forget(self, blocks: list[KVBlock]) -> None:  # noqa: B027 - optional hook
        """The pool is reusing these queued cached blocks: drop them from the index."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Drop everything (the pool holds no block in use)."""

    @abc.abstractmethod
    def check(self, tables: dict[str, SeqBlocks]) -> None:
        """Raise AssertionError naming the first broken invariant of the index."""
