"""Blocks whose KV comes from elsewhere (a lower tier), cached as if a sequence had computed
them: the tiers' way into the RAM cache, through the contract's own steps."""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.cache.base import PrefixCache
from prefixcache.cache.sequence import Sequence

__all__ = ["adopt"]


def adopt(
    cache: PrefixCache,
    seq: Sequence,
    start: int,
    num_blocks: int,
    fill: Callable[[list[int], int], None],
) -> int:
    """Cache blocks ``start .. start + num_blocks - 1`` of ``seq`` in ``cache``, computing
    nothing: the blocks from the longest cached prefix on are allocated, ``fill(block_ids,
    first)`` writes their KV (``first``: the block index of ``block_ids[0]``), and they are
    committed and released, cached and most recently used, as if a sequence had computed them.
    No lookup is counted and observers hear nothing; `BlockStored` events are emitted. Returns
    how many blocks were filled: 0 when the cached prefix stops before ``start`` (the run would
    not join it), already covers the run, or the blocks do not fit. ``seq`` itself is not
    touched (it may not be live)."""
    if not cache.writes(seq) or num_blocks <= 0:
        return 0
    bs = cache.block_size
    end = start + num_blocks
    if end > (len(seq.token_ids) - 1) // bs:
        raise ValueError(f"adopt: blocks up to {end} leave no token of {seq.seq_id!r} to compute")
    stand_in = seq.fork(f"{seq.seq_id}\x00adopt")
    stand_in.num_computed_tokens = 0
    hit = cache.index.lookup(stand_in)
    have = len(hit.block_ids)
    if not start <= have < end or stand_in.seq_id in cache.tables:
        return 0
    hit.epoch = cache.pool.epoch
    block_ids = cache.allocator.first(stand_in, (end - have) * bs, hit, counted=False)
    if block_ids is None:
        return 0
    filled = block_ids[have:end]
    for block_id in filled:  # fill writes every slot: nothing to zero first
        cache.pool.cancel_zero(block_id)
    try:
        fill(filled, have)
        cache._commit(stand_in, end * bs, notify=False)
    finally:
        cache._free(stand_in, notify=False)
    return end - have
