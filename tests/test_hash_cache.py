"""Scenario tests of the hash-chain prefix cache: exact block ids, free-queue and eviction order.

Block size 16 and a pool of 10 blocks unless stated; `check_integrity()` runs after every call.
Scenarios that hold for both caches word for word live in test_cache_conformance.py (run for
`hash` too); this file keeps what is specific to the hash cache: exact queue and eviction order.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

from cache_helpers import Checked
from prefixcache.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheHit,
    Sequence,
    make_prefix_cache,
)
from prefixcache.cache.hash_cache import HashPrefixCache

BS = 16
# the first 300 requests of the shared Mooncake conversation trace, committed with the tests
TRACE = Path(__file__).parent / "fixtures" / "mooncake_conversation_300.jsonl"




def new_cache(num_blocks: int = 10, **kwargs: Any) -> Any:
    cache = make_prefix_cache("hash", num_blocks=num_blocks, block_size=BS, **kwargs)
    assert isinstance(cache, HashPrefixCache)
    return Checked(cache)


def run_prompt(cache: Any, seq: Sequence) -> list[int]:
    """match + allocate + commit the whole prompt; returns the block table."""
    hit = cache.match(seq)
    table = cache.allocate(seq, seq.num_tokens - hit.num_tokens, hit)
    assert table is not None
    cache.commit(seq, seq.num_tokens)
    return list(table)


def refs(cache: Any, ids: list[int]) -> list[int]:
    return [cache.pool.blocks[i].ref_cnt for i in ids]


def test_miss_then_shared_prefix_then_free_order() -> None:
    cache = new_cache()
    a = Sequence("a", range(55))
    assert cache.match(a).num_tokens == 0
    assert run_prompt(cache, a) == [0, 1, 2, 3]
    digests = a.block_digests
    assert [cache.pool.blocks[i].digest for i in range(4)] == [*digests[:3], None]
    events = cache.take_events()
    assert events == [
        BlockStored(
            block_hashes=digests[:3],
            parent_block_hash=a.root_digest(cache.hasher, ""),
            token_ids=list(range(48)),
            block_size=BS,
            block_ids=[0, 1, 2],
        )
    ]
    b = Sequence("b", [*range(48), *range(1000, 1010)])
    hit = cache.match(b)
    assert (hit.num_tokens, hit.block_ids) == (48, [0, 1, 2])
    assert cache.allocate(b, 10, hit) == [0, 1, 2, 4]
    assert refs(cache, [0, 1, 2, 3, 4]) == [2, 2, 2, 1, 1]
    assert cache.free_block_ids() == [5, 6, 7, 8, 9]
    cache.commit(b, 58)
    assert cache.take_events() == []  # its only new block is partial
    cache.free(a)
    assert cache.free_block_ids() == [3, 5, 6, 7, 8, 9]
    cache.free(b)
    # reverse-order release: undigested at the head, deepest digested block evicted first
    assert cache.free_block_ids() == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]
    long_miss = Sequence("c", range(5000, 5160))
    assert run_prompt(cache, long_miss) == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]
    removed = [e for e in cache.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(block_hashes=digests[2::-1], block_ids=[2, 1, 0])]
    assert cache.stats.num_evictions == 3
    assert cache.match(Sequence("d", range(55))).num_tokens == 0


def test_own_hits_are_never_evicted_and_failed_allocation_changes_nothing() -> None:
    cache = new_cache()
    run_prompt(cache, Sequence("a", range(49)))
    cache.free(Sequence("a", []))  # a different object with the same id: no-op
    cache.free(cache.tables.tables["a"].seq)
    assert cache.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    b = Sequence("b", range(161))
    hit = cache.match(b)
    assert hit.block_ids == [0, 1, 2]
    before = snapshot(cache)
    assert cache.allocate(b, 161 - 48, hit) is None  # needs 11 blocks
    assert snapshot(cache) == before
    c = Sequence("c", range(160))
    hit = cache.match(c)
    assert cache.allocate(c, 160 - 48, hit) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert cache.stats.num_evictions == 0


def snapshot(cache: Any) -> tuple[object, ...]:
    pool = cache.pool
    return (
        cache.free_block_ids(),
        [(b.ref_cnt, b.digest) for b in pool.blocks],
        dict(cache.index.digest_map),
        {k: list(t.block_ids) for k, t in cache.tables.tables.items()},
        pool.epoch,
    )


def test_block_aligned_prompt_recomputes_its_last_block() -> None:
    cache = new_cache()
    run_prompt(cache, Sequence("a", range(48)))
    b = Sequence("b", range(48))
    hit = cache.match(b)
    assert (hit.num_tokens, hit.num_matched_blocks, hit.first_miss_block) == (32, 3, 2)
    assert cache.allocate(b, 16, hit) == [0, 1, 3]
    cache.commit(b, 48)
    assert cache.stats.num_duplicate_blocks == 1
    assert cache.pool.blocks[3].digest is None
    assert cache.stats.first_miss_blocks == {0: 1, 2: 1}


def test_reset_refuses_while_held_then_clears() -> None:
    cache = new_cache()
    a = Sequence("a", range(40))
    run_prompt(cache, a)
    cache.take_events()
    before = snapshot(cache)
    assert cache.reset() is False
    assert snapshot(cache) == before and cache.take_events() == []
    cache.free(a)
    assert cache.reset() is True
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.stats.num_resets == 1
    assert cache.num_cached_blocks == 0
    assert cache.match(Sequence("b", range(40))).num_tokens == 0


def test_duplicates_are_tolerated_and_counted() -> None:
    cache = new_cache()
    a, b = Sequence("a", range(40)), Sequence("b", range(40))
    assert cache.allocate(a, 40, cache.match(a)) == [0, 1, 2]
    assert cache.allocate(b, 40, cache.match(b)) == [3, 4, 5]
    cache.commit(a, 40)
    cache.commit(b, 40)
    assert cache.stats.num_duplicate_blocks == 2
    assert cache.stats.num_committed_blocks == 2
    assert [e.block_ids for e in cache.take_events() if isinstance(e, BlockStored)] == [[0, 1]]
    cache.free(a)
    cache.free(b)
    assert cache.free_block_ids() == [3, 4, 5, 2, 6, 7, 8, 9, 1, 0]
    assert cache.match(Sequence("c", range(40))).block_ids == [0, 1]


def test_fork_then_append_copies_on_write() -> None:
    cache = new_cache()
    a = Sequence("a", range(20))
    run_prompt(cache, a)
    child = cache.fork(a, "a.1")
    assert cache.block_table(child) == [0, 1]
    assert refs(cache, [0, 1]) == [2, 2]
    a.append(500)
    assert cache.allocate(a, 1) == [0, 2]
    assert cache.take_block_copies() == [(1, 2)]
    assert refs(cache, [0, 1, 2]) == [2, 1, 1]
    child.append(600)
    assert cache.allocate(child, 1) == [0, 1]
    assert cache.take_block_copies() == []
    cache.commit(a, 21)
    cache.commit(child, 21)
    cache.free(a)
    cache.free(child)
    assert sorted(cache.free_block_ids()) == list(range(10))


def test_shared_block_write_is_caught_by_integrity_check() -> None:
    cache = make_prefix_cache("hash", num_blocks=4, block_size=BS)
    assert isinstance(cache, HashPrefixCache)
    a = Sequence("a", range(20))
    run_prompt(cache, a)
    child = cache.fork(a, "a.1")
    cache.tables.tables[child.seq_id].num_alloc_tokens = 21  # pretend a write into shared block 1
    with pytest.raises(AssertionError, match="shared block is never a write target"):
        cache.check_integrity()


def test_integrity_check_names_broken_invariants() -> None:
    cache = make_prefix_cache("hash", num_blocks=4, block_size=BS)
    assert isinstance(cache, HashPrefixCache)
    a = Sequence("a", range(40))
    run_prompt(cache, a)
    cache.pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref count equals live table references"):
        cache.check_integrity()
    cache.pool.blocks[0].ref_cnt -= 1
    cache.pool.blocks[2].digest = a.block_digests[1]
    with pytest.raises(AssertionError, match="digest"):
        cache.check_integrity()


def test_stale_hit_is_rejected_without_changes() -> None:
    cache = new_cache(num_blocks=4)
    run_prompt(cache, Sequence("a", range(40)))
    cache.free(cache.tables.tables["a"].seq)
    b = Sequence("b", range(40))
    hit = cache.match(b)
    assert hit.block_ids == [0, 1]
    c = Sequence("c", range(900, 964))
    run_prompt(cache, c)  # evicts both
    cache.free(c)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="stale"):
        cache.allocate(b, 8, hit)
    assert snapshot(cache) == before
    forged = CacheHit(num_tokens=32, block_ids=[0, 1])
    with pytest.raises(ValueError, match="stale"):
        cache.allocate(b, 8, forged)


def test_disabled_caching_and_isolation_none() -> None:
    cache = new_cache(enable_prefix_caching=False)
    assert not cache.enable_prefix_caching
    run_prompt(cache, Sequence("a", range(40)))
    hit = cache.match(Sequence("b", range(40)))
    assert hit.num_tokens == 0 and cache.stats.num_requests == 1  # match alone counts nothing
    assert cache.num_cached_blocks == 0
    shared = new_cache()
    run_prompt(shared, Sequence("a", range(40), use_cache=False))
    assert shared.num_cached_blocks == 0
    run_prompt(shared, Sequence("b", range(40)))
    assert shared.match(Sequence("c", range(40), use_cache=False)).num_tokens == 0


def test_bad_input_is_a_clear_error() -> None:
    cache = new_cache()
    a = Sequence("a", range(20))
    with pytest.raises(ValueError, match="num_new_tokens"):
        cache.allocate(a, -1)
    with pytest.raises(ValueError, match="holds no blocks"):
        cache.commit(a, 16)
    cache.allocate(a, 20)
    with pytest.raises(ValueError, match="allocated"):
        cache.commit(a, 21)
    with pytest.raises(ValueError, match="already live"):
        cache.allocate(Sequence("a", range(3)), 3)
    with pytest.raises(ValueError, match="hash_algo"):
        HashPrefixCache(4, 16, "md5")
    cache.free(Sequence("nobody", []))
    cache.free(a)
    cache.free(a)


def test_zero_on_reuse_marks_blocks_changing_namespace() -> None:
    cache = new_cache(num_blocks=4, zero_on_reuse=True)
    a = Sequence("a", range(40), salt="t1")
    run_prompt(cache, a)
    assert cache.take_blocks_to_zero() == [0, 1, 2]  # unknown past
    cache.free(a)
    b = Sequence("b", range(100, 140), salt="t1")
    run_prompt(cache, b)
    assert cache.take_blocks_to_zero() == [3]  # 2, 1, 0 stayed in namespace t1
    cache.free(b)
    c = Sequence("c", range(200, 264), salt="t2")
    table = run_prompt(cache, c)
    assert sorted(cache.take_blocks_to_zero()) == sorted(table)


def test_event_buffer_is_bounded() -> None:
    cache = new_cache(num_blocks=16, max_events=2)
    for i in range(4):
        seq = Sequence(f"s{i}", range(i * 100, i * 100 + 20))
        run_prompt(cache, seq)
        cache.free(seq)
    assert len(cache.take_events()) == 2
    assert cache.events.num_dropped == 2


# -- Mooncake conversation trace: a slice against an independent LRU reference -----------------

MOONCAKE_BS = 512


def mooncake_tokens(hash_ids: list[int], input_length: int, fresh: int) -> list[int]:
    """Block j of hash id h holds tokens h*512 .. h*512+511; a partial tail gets fresh ids."""
    num_full = input_length // MOONCAKE_BS
    tokens: list[int] = []
    for h in hash_ids[:num_full]:
        tokens.extend(range(h * MOONCAKE_BS, (h + 1) * MOONCAKE_BS))
    tail = input_length - num_full * MOONCAKE_BS
    tokens.extend(range(fresh, fresh + tail))
    return tokens


def reference_hit_tokens(requests: list[dict[str, Any]], num_blocks: int) -> int:
    """The contract replayed with an OrderedDict of hash ids (LRU order) and a count of
    undigested free blocks: touch hits, take undigested blocks before evicting the oldest id,
    commit full blocks (a duplicate stays undigested), release in reverse table order."""
    lru: OrderedDict[int, None] = OrderedDict()
    num_blank = num_blocks
    hit_tokens = 0
    for req in requests:
        ids, length = req["hash_ids"], req["input_length"]
        num_full, cap = length // MOONCAKE_BS, (length - 1) // MOONCAKE_BS
        num_hit = 0
        while num_hit < cap and ids[num_hit] in lru:
            num_hit += 1
        hit_tokens += num_hit * MOONCAKE_BS
        for h in ids[:num_hit]:
            del lru[h]
        num_new = -(-length // MOONCAKE_BS) - num_hit
        for _ in range(max(0, num_new - num_blank)):
            lru.popitem(last=False)
        num_blank = max(0, num_blank - num_new)
        digested = [i < num_hit or h not in lru for i, h in enumerate(ids[:num_full])]
        released = list(zip(ids[:num_full], digested, strict=True))
        num_blank += -(-length // MOONCAKE_BS) - sum(digested)
        for h, has_digest in reversed(released):
            if has_digest:
                lru[h] = None
    return hit_tokens


def replay(requests: list[dict[str, Any]], num_blocks: int) -> HashPrefixCache:
    cache = HashPrefixCache(num_blocks, MOONCAKE_BS, enable_kv_events=False)
    fresh = 2**31
    for i, req in enumerate(requests):
        seq = Sequence(str(i), mooncake_tokens(req["hash_ids"], req["input_length"], fresh))
        fresh += MOONCAKE_BS
        hit = cache.match(seq)
        table = cache.allocate(seq, seq.num_tokens - hit.num_tokens, hit)
        assert table is not None
        cache.commit(seq, seq.num_tokens)
        cache.free(seq)
    return cache


@pytest.mark.parametrize("capacity", ["unlimited", 4_000, 1_000])
def test_mooncake_slice_matches_reference(capacity: int | str) -> None:
    with TRACE.open() as f:
        requests = [json.loads(line) for line in f]
    total = sum(len(r["hash_ids"]) for r in requests)
    num_blocks = total if capacity == "unlimited" else int(capacity)
    cache = replay(requests, num_blocks)
    cache.check_integrity()
    expected = reference_hit_tokens(requests, num_blocks)
    assert cache.stats.num_hit_tokens == expected
    assert (cache.stats.num_evictions > 0) == (capacity != "unlimited")
    assert cache.stats.num_queried_tokens == sum(r["input_length"] for r in requests)
    assert expected > 0

