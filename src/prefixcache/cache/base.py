"""The prefix-cache interface, shared by the hash-chain (`hash`) and radix-tree (`radix`) caches.

The cache knows nothing about tensors: it hands out block ids and decides which blocks are
reusable. The scheduler is its only caller; the runner consumes the block ids (and the copy and
zero instructions drained with `take_block_copies` / `take_blocks_to_zero`).

Life of a sequence::

    hit = cache.match(seq)                      # longest cached prefix, block aligned
    table = cache.allocate(seq, n, hit)         # touch hits, then take new blocks (or None)
    ... the runner writes KV for the new tokens ...
    cache.commit(seq, num_computed_tokens)      # now-full blocks become hittable
    seq.append(token); cache.allocate(seq, 1)   # decode
    cache.free(seq)
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any

from prefixcache.cache.block_hash import BlockExtra, BlockHasher, Namespace
from prefixcache.cache.events import KVCacheEvent
from prefixcache.cache.stats import CacheStats

__all__ = ["CacheHit", "PrefixCache", "Sequence"]


class Sequence:
    """A token sequence as the cache sees it: ids, namespace parts, and its digest chain.

    ``salt`` is the *effective* cache salt (namespace part), ``adapter`` the LoRA name, and
    ``block_extras`` maps a block index to the extras (multimodal inputs) that change its KV.
    ``use_cache=False`` is isolation mode ``none``: the sequence neither reads nor writes the
    cache. Digests are computed incrementally by the cache that uses the sequence and kept here.
    The token ids are copied, unless ``copy=False`` and they are a list that the caller built for
    this sequence and hands over (a simulator's fresh prompt): the copy of a long prompt touches
    every int object, ~5 ns per token.
    """

    __slots__ = (
        "seq_id",
        "token_ids",
        "num_prompt_tokens",
        "salt",
        "adapter",
        "block_extras",
        "use_cache",
        "num_computed_tokens",
        "block_digests",
        "block_token_bytes",
        "_digest_key",
        "_root",
    )

    def __init__(
        self,
        seq_id: str,
        token_ids: Iterable[int],
        salt: str | bytes | None = None,
        *,
        adapter: str | None = None,
        block_extras: dict[int, SequenceABC[BlockExtra]] | None = None,
        use_cache: bool = True,
        copy: bool = True,
    ) -> None:
        self.seq_id = seq_id
        # copy=False: a list built for this sequence alone becomes its own (it is appended to)
        self.token_ids: list[int] = (
            token_ids if not copy and isinstance(token_ids, list) else list(token_ids)
        )
        self.num_prompt_tokens = len(self.token_ids)
        self.salt = salt
        self.adapter = adapter
        self.block_extras = block_extras or {}
        self.use_cache = use_cache
        self.num_computed_tokens = 0
        self.block_digests: list[bytes] = []
        # block i's token ids as u32be bytes, kept with its digest: hits compare them cheaply
        self.block_token_bytes: list[bytes] = []
        self._digest_key: tuple[object, ...] | None = None
        self._root = b""

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, num_tokens={len(self.token_ids)}, "
            f"num_computed={self.num_computed_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append(self, token_id: int) -> None:
        """Add one generated token (its KV is computed by the next step)."""
        self.token_ids.append(token_id)

    def namespace(self, model: str) -> Namespace:
        return Namespace(model=model, adapter=self.adapter, salt=self.salt)

    def digests(self, hasher: BlockHasher, model: str) -> list[bytes]:
        """Digests of every complete block, extended incrementally (never re-hashed).

        A sequence used by a cache with a different hasher or model gets a fresh chain.
        """
        key = (hasher.algo, hasher.block_size, model)
        if key != self._digest_key:
            self._digest_key = key
            self._root = hasher.root(self.namespace(model))
            self.block_digests = []
            self.block_token_bytes = []
        if len(self.token_ids) >= (len(self.block_digests) + 1) * hasher.block_size:
            extras = self.block_extras.get if self.block_extras else None
            hasher.extend(
                self.block_digests,
                self._root,
                self.token_ids,
                _no_none(extras),
                self.block_token_bytes,
            )
        return self.block_digests

    def root_digest(self, hasher: BlockHasher, model: str) -> bytes:
        """The namespace root: the parent of the first block."""
        self.digests(hasher, model)
        return self._root

    def fork(self, child_id: str) -> Sequence:
        """A copy with the same tokens, namespace and computed state (for n > 1)."""
        child = Sequence(
            child_id,
            self.token_ids,
            self.salt,
            adapter=self.adapter,
            block_extras=self.block_extras,
            use_cache=self.use_cache,
        )
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.block_digests = list(self.block_digests)
        child.block_token_bytes = list(self.block_token_bytes)
        child._digest_key = self._digest_key
        child._root = self._root
        return child


def _no_none(
    getter: Callable[[int], SequenceABC[BlockExtra] | None] | None,
) -> Callable[[int], SequenceABC[BlockExtra]] | None:
    if getter is None:
        return None
    return lambda i: getter(i) or ()


@dataclass(slots=True)
class CacheHit:
    """The longest reusable prefix of a sequence: ``num_tokens == len(block_ids) * block_size``.

    ``first_miss_block`` is the index of the block where the walk stopped (== len(block_ids)),
    ``num_matched_blocks`` counts matched blocks before the ``num_prompt_tokens - 1`` cap.
    ``handle`` is implementation data (hash: blocks; radix: the matched node).
    """

    num_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    first_miss_block: int = 0
    num_matched_blocks: int = 0
    handle: object = None

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class PrefixCache(abc.ABC):
    """A paged KV-cache allocator with prefix reuse. See the module docstring for the life cycle.

    Both implementations keep: only complete, committed blocks are hittable; a block with
    ``ref_cnt > 1`` (shared) is never written; allocation touches hits before taking new blocks;
    a failed allocation changes nothing; at least one prompt token is always computed.
    """

    num_blocks: int
    block_size: int
    enable_caching: bool
    model_id: str
    hasher: BlockHasher
    stats: CacheStats

    def match(self, seq: Sequence) -> CacheHit:
        """Longest cached prefix of ``seq``, capped at ``num_tokens - 1`` rounded down to a block.
        Changes no ref count; counts the lookup in `stats`."""
        start_ns = time.perf_counter_ns()
        stats = self.stats
        stats.num_requests += 1
        stats.num_queried_tokens += len(seq.token_ids)
        hit = self._lookup(seq) if self.enable_caching and seq.use_cache else CacheHit()
        num_hit_blocks = len(hit.block_ids)
        if num_hit_blocks:
            stats.num_hit_requests += 1
            stats.num_hit_tokens += hit.num_tokens
        misses = stats.first_miss_blocks
        misses[num_hit_blocks] = misses.get(num_hit_blocks, 0) + 1
        stats.lookup_time_ns += time.perf_counter_ns() - start_ns
        return hit

    def allocate(
        self, seq: Sequence, num_new_tokens: int, hit: CacheHit | None = None
    ) -> list[int] | None:
        """Make ``seq``'s block table cover its computed tokens plus ``num_new_tokens``.

        On the first call, ``hit`` (from `match`) supplies the computed prefix. Returns the whole
        block table, or None when the blocks do not fit (and then nothing changed)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        state = self._state_of(seq.seq_id)
        if state is None:
            return self._allocate_first(seq, num_new_tokens, hit)
        if state.seq is not seq:
            raise ValueError(f"sequence id {seq.seq_id!r} is already live in this cache")
        return self._allocate_more(state, num_new_tokens)

    @abc.abstractmethod
    def _lookup(self, seq: Sequence) -> CacheHit:
        """The uncounted walk behind `match` (caching enabled for ``seq``)."""

    @abc.abstractmethod
    def _state_of(self, seq_id: str) -> Any:
        """The per-sequence state of a live sequence (with a ``seq`` attribute), or None."""

    @abc.abstractmethod
    def _allocate_first(
        self, seq: Sequence, num_new_tokens: int, hit: CacheHit | None
    ) -> list[int] | None:
        """`allocate` for a sequence that holds no blocks yet."""

    @abc.abstractmethod
    def _allocate_more(self, state: Any, num_new_tokens: int) -> list[int] | None:
        """`allocate` for a live sequence (decode, or its next prefill chunk)."""

    @abc.abstractmethod
    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        """The KV of ``seq``'s first ``num_computed_tokens`` tokens is written: full blocks among
        them become hittable."""

    @abc.abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; committed ones stay cached until evicted."""

    @abc.abstractmethod
    def fork(self, seq: Sequence, child_id: str) -> Sequence:
        """A child sharing every block of ``seq`` (ref counts up), for n > 1 sampling."""

    @abc.abstractmethod
    def reset(self) -> bool:
        """Drop every cached block. Refuses (False, nothing changed) while any block is in use."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant."""

    @abc.abstractmethod
    def take_events(self) -> list[KVCacheEvent]:
        """Drain the KV events since the last call."""

    @abc.abstractmethod
    def take_block_copies(self) -> list[tuple[int, int]]:
        """Drain pending copy-on-write instructions ``(src_block_id, dst_block_id)``; the runner
        performs them before the step's KV writes."""

    @abc.abstractmethod
    def take_blocks_to_zero(self) -> list[int]:
        """Drain blocks whose KV must be zeroed before reuse (zero-on-reuse mode)."""

    @abc.abstractmethod
    def block_table(self, seq: Sequence) -> list[int]:
        """The current block table of ``seq`` (empty if it holds none)."""

    @property
    @abc.abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, or cached and evictable)."""

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (0.0 – 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_blocks
