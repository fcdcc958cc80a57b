"""Unit tests of the block pool: the intrusive free queue, lazy eviction, parked blocks."""

from __future__ import annotations

import pytest

from prefixcache.cache.block_pool import BlockPool, KVBlock
from prefixcache.cache.hash_cache import HashIndex
from prefixcache.cache.identity import CacheIdentity

_INDEXES: dict[int, HashIndex] = {}  # pool id -> the hash index over it (it parks nothing)


def pool_with(num_blocks: int = 6, **kwargs: object) -> BlockPool:
    pool = BlockPool(num_blocks, 4, **kwargs)  # type: ignore[arg-type]
    _INDEXES[id(pool)] = HashIndex(pool, CacheIdentity("", 4))
    return pool


def index_of(pool: BlockPool) -> HashIndex:
    return _INDEXES[id(pool)]


def store(pool: BlockPool, block: KVBlock, digest: bytes, token_bytes: bytes) -> bool:
    """What the hash index does on commit: map the digest unless it is already mapped."""
    cached = index_of(pool).digest_map
    if digest in cached:
        return False
    cached[digest] = block
    block.cache(digest, token_bytes, "")
    return True


def check(pool: BlockPool, held: list[int]) -> None:
    refs: dict[int, int] = {}
    for block_id in held:
        refs[block_id] = refs.get(block_id, 0) + 1
    pool.check_integrity(refs)


def test_take_pops_lowest_first_and_release_orders_by_digest() -> None:
    pool = pool_with()
    taken = pool.take(4)
    blocks = taken.blocks
    assert taken.block_ids == [0, 1, 2, 3] and not taken.evicted_ids
    assert pool.free_block_ids() == [4, 5] and pool.num_free == 2
    assert store(pool, blocks[0], b"d0", b"t0") and store(pool, blocks[1], b"d1", b"t1")
    assert not store(pool, blocks[2], b"d0", b"t0")  # a duplicate stays out of the map
    check(pool, [0, 1, 2, 3])
    pool.release(reversed(blocks))
    assert pool.free_block_ids() == [2, 3, 4, 5, 1, 0]
    check(pool, [])


def test_touch_removes_from_the_middle_without_eviction() -> None:
    pool = pool_with()
    blocks = pool.take(3).blocks
    store(pool, blocks[1], b"d1", b"t1")
    pool.release(reversed(blocks))
    assert pool.free_block_ids() == [0, 2, 3, 4, 5, 1]
    pool.touch([pool.blocks[3], pool.blocks[1]])
    assert pool.free_block_ids() == [0, 2, 4, 5]
    assert index_of(pool).digest_map[b"d1"] is pool.blocks[1]
    check(pool, [3, 1])
    pool.touch([pool.blocks[1]])  # already held: only the count moves
    check(pool, [3, 1, 1])


def test_lazy_eviction_on_pop_returns_the_evicted_and_bumps_epoch() -> None:
    pool = pool_with(num_blocks=2)
    blocks = pool.take(2).blocks
    store(pool, blocks[0], b"d0", b"t0")
    pool.release(reversed(blocks))
    assert pool.free_block_ids() == [1, 0]
    epoch = pool.epoch
    first = pool.take(1)
    assert first.block_ids == [1] and not first.evicted_ids and pool.epoch == epoch
    second = pool.take(1)
    assert second.block_ids == [0]
    assert (second.evicted_ids, second.evicted_digests) == ([0], [b"d0"])
    assert pool.epoch == epoch + 1
    assert b"d0" in index_of(pool).digest_map  # the map is the index's: the cache forgets it
    index_of(pool).forget(second.evicted_digests)
    assert pool.blocks[0].digest is None and index_of(pool).num_cached == 0
    check(pool, [0, 1])
    with pytest.raises(RuntimeError, match="free blocks"):
        pool.take(1)


def test_reset_refuses_while_held() -> None:
    pool = pool_with()
    (block,) = pool.take(1).blocks
    store(pool, block, b"d", b"t")
    assert pool.reset() is False and index_of(pool).num_cached == 1
    pool.release([block])
    assert pool.reset() is True
    assert pool.blocks[0].digest is None  # the index is its cache's to clear
    check(pool, [])


def test_zero_on_reuse_tracks_owner_namespace() -> None:
    pool = pool_with(num_blocks=2, zero_on_reuse=True)
    blocks = pool.take(2, b"ns-a").blocks
    assert pool.take_blocks_to_zero() == [0, 1]
    pool.release(blocks)  # both undigested: each goes to the head
    assert pool.free_block_ids() == [1, 0]
    assert pool.take(1, b"ns-a").block_ids == [1]
    assert pool.take(1, b"ns-b").block_ids == [0]
    pool.cancel_zero(1)  # not queued: nothing happens
    assert pool.take_blocks_to_zero() == [0]


def test_integrity_catches_broken_links_and_stale_map() -> None:
    pool = pool_with()
    pool.blocks[2].prev = pool.blocks[4]
    with pytest.raises(AssertionError, match="links consistent"):
        check(pool, [])
    pool = pool_with()
    (block,) = pool.take(1).blocks
    store(pool, block, b"d", b"t")
    block.digest = None
    with pytest.raises(AssertionError, match="keeps its tokens exactly while it has a digest"):
        check(pool, [0])


def test_constructor_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0)
