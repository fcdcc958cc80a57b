"""Radix-tree cache specifics: node splits, lock accounting, eviction order and policies.

Scenarios shared with the hash cache live in test_cache_conformance.py. Block size 16 here;
`check_integrity()` runs after every operation through the helpers below.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from prefixcache.cache import BlockRemoved, BlockStored, Sequence, make_prefix_cache
from prefixcache.cache.radix_cache import RadixPrefixCache
from test_cache_properties import BS as PROPERTY_BS
from test_cache_properties import CacheMachine

BS = 16


def radix(num_blocks: int = 10, **kwargs: object) -> RadixPrefixCache:
    cache = make_prefix_cache("radix", num_blocks=num_blocks, block_size=BS, **kwargs)
    assert isinstance(cache, RadixPrefixCache)
    return cache


def tokens(num: int, base: int = 0) -> list[int]:
    return list(range(base, base + num))


def admit(cache: RadixPrefixCache, seq: Sequence) -> list[int]:
    """match + allocate the whole prompt + commit it, checking integrity after each step."""
    hit = cache.match(seq)
    table = cache.allocate(seq, seq.num_tokens - hit.num_tokens, hit)
    assert table is not None
    cache.check_integrity()
    cache.commit(seq, seq.num_tokens)
    cache.check_integrity()
    return table


def release(cache: RadixPrefixCache, *seqs: Sequence) -> None:
    for seq in seqs:
        cache.free(seq)
        cache.check_integrity()


def evicted_ids(cache: RadixPrefixCache) -> list[int]:
    return [b for e in cache.take_events() if isinstance(e, BlockRemoved) for b in e.block_ids]


def test_insert_split_keeps_total_size() -> None:
    cache = radix(20)
    a = Sequence("a", tokens(8 * BS))
    admit(cache, a)
    assert (cache.num_nodes, cache.num_cached_blocks) == (1, 8)
    b = Sequence("b", tokens(3 * BS) + tokens(2 * BS, 1000))
    admit(cache, b)
    # a's run split at block 3: [0:3] shared, [3:8] a's, [3:5] b's
    assert (cache.num_nodes, cache.num_cached_blocks) == (3, 10)
    assert cache.match(Sequence("q", tokens(8 * BS) + [7])).num_tokens == 8 * BS
    assert cache.match(Sequence("r", b.token_ids + [7])).num_tokens == 5 * BS
    release(cache, a, b)
    assert cache.num_evictable_blocks == 10


def test_allocate_splits_a_partial_hit_and_locks_only_the_hit() -> None:
    cache = radix(20)
    a = Sequence("a", tokens(8 * BS))
    admit(cache, a)
    release(cache, a)
    assert cache.num_evictable_blocks == 8
    c = Sequence("c", tokens(3 * BS) + [5000])
    hit = cache.match(c)
    assert hit.num_tokens == 3 * BS and cache.num_nodes == 1  # match changes nothing
    assert cache.allocate(c, 1, hit) == [0, 1, 2, 8]
    cache.check_integrity()
    assert cache.num_nodes == 2 and cache.num_cached_blocks == 8
    assert cache.num_evictable_blocks == 5 and cache.num_protected_blocks == 4


def test_lock_and_unlock_move_exactly_the_path_blocks() -> None:
    cache = radix(20)
    a = Sequence("a", tokens(4 * BS))
    b = Sequence("b", tokens(2 * BS) + tokens(3 * BS, 500))
    admit(cache, a)
    admit(cache, b)
    release(cache, a, b)
    free_before = cache.num_free_blocks
    assert cache.num_evictable_blocks == 7 and cache.num_protected_blocks == 0
    c = Sequence("c", tokens(4 * BS) + [9])  # locks the shared node [0:2] and a's [2:4]
    hit = cache.match(c)
    assert cache.allocate(c, 1, hit) is not None
    cache.check_integrity()
    assert cache.num_evictable_blocks == 7 - 4
    assert cache.num_protected_blocks == 4 + 1  # the locked path plus c's new block
    assert cache.num_free_blocks == free_before - 5
    d = Sequence("d", b.token_ids + [9])  # shares [0:2] (already locked) and locks b's [2:5]
    hit = cache.match(d)
    assert cache.allocate(d, 1, hit) is not None
    cache.check_integrity()
    assert cache.num_evictable_blocks == 0 and cache.num_protected_blocks == 4 + 1 + 3 + 1
    release(cache, c)
    assert cache.num_evictable_blocks == 2  # a's [2:4]; the shared node stays locked by d
    release(cache, d)
    assert cache.num_evictable_blocks == 7 and cache.num_free_blocks == free_before


def test_lru_evicts_leaf_tails_first_then_parents_exact_order() -> None:
    cache = radix(10)
    a = Sequence("a", tokens(4 * BS))  # blocks 0..3
    admit(cache, a)
    b = Sequence("b", tokens(2 * BS) + tokens(2 * BS, 700))  # hits 0,1; own 4,5
    assert admit(cache, b) == [0, 1, 4, 5]
    release(cache, b)  # freed first: b's leaf is the least recent
    release(cache, a)
    cache.take_events()
    x = Sequence("x", tokens(9 * BS + 1, 5000))  # 10 blocks: 4 free + 6 evicted
    assert admit(cache, x) == [6, 7, 8, 9, 5, 4, 3, 2, 1, 0]
    assert evicted_ids(cache) == [5, 4, 3, 2, 1, 0]
    assert cache.stats.num_evictions == 6


@pytest.mark.parametrize(("policy", "expected"), [("lru", [1, 0]), ("lfu", [3, 2])])
def test_lfu_keeps_the_most_hit_run_lru_the_most_recent(policy: str, expected: list[int]) -> None:
    cache = radix(10, eviction_policy=policy)
    hot = Sequence("hot", tokens(2 * BS))
    assert admit(cache, hot) == [0, 1]
    release(cache, hot)
    for i in range(3):
        s = Sequence(f"h{i}", tokens(2 * BS) + [1])
        admit(cache, s)
        release(cache, s)
    cold = Sequence("cold", tokens(2 * BS, 900))
    assert admit(cache, cold) == [2, 3]  # most recent, but never hit
    release(cache, cold)
    cache.take_events()
    x = Sequence("x", tokens(7 * BS + 1, 5000))  # 8 blocks: 6 free + 2 evicted
    admit(cache, x)
    assert evicted_ids(cache) == expected


def test_eviction_never_touches_a_locked_path() -> None:
    cache = radix(6)
    a = Sequence("a", tokens(3 * BS) + [1])  # 3 cached blocks + 1 partial, all locked
    admit(cache, a)
    cache.check_integrity()
    x = Sequence("x", tokens(3 * BS, 4000))
    assert cache.allocate(x, x.num_tokens, cache.match(x)) is None
    cache.check_integrity()
    y = Sequence("y", tokens(2 * BS, 4000))
    assert admit(cache, y) == [4, 5]
    assert evicted_ids(cache) == []
    assert cache.match(Sequence("q", tokens(3 * BS) + [2])).num_tokens == 3 * BS


def test_partial_eviction_keeps_the_head_of_a_run_hittable() -> None:
    cache = radix(6)
    a = Sequence("a", tokens(6 * BS))
    admit(cache, a)
    release(cache, a)
    x = Sequence("x", tokens(2 * BS, 4000))
    admit(cache, x)
    assert evicted_ids(cache) == [5, 4]
    assert cache.match(Sequence("q", tokens(6 * BS) + [1])).num_tokens == 4 * BS


def test_stale_hit_after_eviction_is_rejected_and_changes_nothing() -> None:
    cache = radix(4)
    a = Sequence("a", tokens(3 * BS))
    admit(cache, a)
    release(cache, a)
    b = Sequence("b", tokens(3 * BS) + [1])
    hit = cache.match(b)
    assert hit.num_tokens == 3 * BS
    x = Sequence("x", tokens(4 * BS, 800))
    admit(cache, x)  # evicts a's blocks
    free_before = cache.num_free_blocks
    with pytest.raises(ValueError, match="stale"):
        cache.allocate(b, 1, hit)
    cache.check_integrity()
    assert cache.block_table(b) == [] and cache.num_free_blocks == free_before


def test_hit_survives_a_split_between_match_and_allocate() -> None:
    cache = radix(20)
    a = Sequence("a", tokens(6 * BS))
    admit(cache, a)
    b = Sequence("b", tokens(6 * BS) + [1])
    hit = cache.match(b)
    c = Sequence("c", tokens(2 * BS) + tokens(2 * BS, 900))
    assert admit(cache, c) == [0, 1, 6, 7]  # splits a's run at block 2 after b's match
    assert cache.num_nodes == 3
    assert cache.allocate(b, 1, hit) == [0, 1, 2, 3, 4, 5, 8]
    cache.check_integrity()


def test_hit_of_another_namespace_is_rejected() -> None:
    cache = radix(10)
    a = Sequence("a", tokens(2 * BS), salt="t1")
    admit(cache, a)
    hit = cache.match(Sequence("p", tokens(2 * BS) + [1], salt="t1"))
    other = Sequence("o", tokens(2 * BS) + [1], salt="t2")
    with pytest.raises(ValueError, match="not produced"):
        cache.allocate(other, 1, hit)
    cache.check_integrity()


def test_namespaces_are_separate_subtrees() -> None:
    cache = radix(20)
    for salt in (None, "t1", "t2"):
        admit(cache, Sequence(f"s{salt}", tokens(2 * BS), salt=salt))
    assert cache.num_nodes == 3 and cache.num_cached_blocks == 6
    lora = Sequence("l", tokens(2 * BS) + [1], adapter="lora-x")
    assert cache.match(lora).num_tokens == 0
    assert cache.match(Sequence("q", tokens(2 * BS) + [1], salt="t2")).num_tokens == 2 * BS


def test_duplicates_are_released_at_commit_and_the_table_adopts_the_tree() -> None:
    cache = radix(10)
    a = Sequence("a", tokens(2 * BS) + [1])
    b = Sequence("b", tokens(2 * BS) + [2])
    ta = cache.allocate(a, a.num_tokens, cache.match(a))
    tb = cache.allocate(b, b.num_tokens, cache.match(b))  # both miss: computed twice
    assert ta == [0, 1, 2] and tb == [3, 4, 5]
    cache.commit(a, a.num_tokens)
    cache.commit(b, b.num_tokens)
    cache.check_integrity()
    assert cache.stats.num_duplicate_blocks == 2 and cache.stats.num_committed_blocks == 2
    assert cache.block_table(b) == [0, 1, 5] and cache.num_cached_blocks == 2
    assert cache.num_protected_blocks == 4 and cache.num_free_blocks == 6
    b.append(7)
    assert cache.allocate(b, 1) == [0, 1, 5] and cache.take_block_copies() == []
    cache.check_integrity()
    release(cache, a, b)
    assert cache.num_free_blocks == 10


def test_stored_events_chain_from_the_namespace_root() -> None:
    cache = radix(20, model_id="m")
    a = Sequence("a", tokens(3 * BS))
    b = Sequence("b", tokens(1 * BS) + tokens(2 * BS, 300))
    admit(cache, a)
    admit(cache, b)
    stored = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [3, 2]
    assert stored[0].parent_block_hash == a.root_digest(cache.hasher, "m")
    assert stored[0].block_hashes == a.digests(cache.hasher, "m")
    assert stored[1].parent_block_hash == a.block_digests[0]
    assert stored[1].block_hashes == b.block_digests[1:]
    assert stored[1].block_ids == [3, 4]
    release(cache, a, b)
    x = Sequence("x", tokens(20 * BS, 9000))
    admit(cache, x)
    removed = [e for e in cache.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(
        a.block_digests + b.block_digests[1:]
    )


def test_heap_stays_bounded_under_churn() -> None:
    cache = radix(8)
    for i in range(3000):
        s = Sequence(f"s{i}", tokens(2 * BS) + [i % 50])
        admit(cache, s)
        cache.free(s)
    cache.check_integrity()
    assert sum(map(len, cache.index.heaps.heaps.values())) <= 4 * cache.num_nodes + 1024


@pytest.mark.parametrize("bad", [{"eviction_policy": "fifo"}, {"num_blocks": 0}])
def test_bad_arguments_are_clear_errors(bad: dict[str, object]) -> None:
    kwargs: dict[str, object] = {"num_blocks": 4, "block_size": BS, **bad}
    with pytest.raises(ValueError):
        RadixPrefixCache(**kwargs)  # type: ignore[arg-type]


def test_integrity_check_names_broken_invariants() -> None:
    cache = radix(10)
    a = Sequence("a", tokens(3 * BS) + [1])
    admit(cache, a)
    root = cache.index.root
    node = root.children[a.root_digest(cache.hasher, "")].children[a.block_digests[0]]
    node.lock_ref += 1
    with pytest.raises(AssertionError, match="lock_ref"):
        cache.check_integrity()
    node.lock_ref -= 1
    cache.index.num_parked += 1
    with pytest.raises(AssertionError, match="parked"):
        cache.check_integrity()
    cache.index.num_parked -= 1
    block = cache.pool.blocks[node.block_ids[0]]
    block.digest, block.token_bytes = node.digests[0], node.tokens[0]
    with pytest.raises(AssertionError, match="its node keeps the digest"):
        cache.check_integrity()
    block.digest = block.token_bytes = None
    block.ref_cnt += 1
    with pytest.raises(AssertionError, match="ref count equals live table references"):
        cache.check_integrity()
    block.ref_cnt -= 1
    cache.check_integrity()


class RadixLfuMachine(CacheMachine):
    """The shared state machine against the radix cache with the LFU policy."""

    kind = "radix"

    @initialize(num_blocks=st.integers(4, 12))
    def build(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.cache = make_prefix_cache(
            "radix", num_blocks=num_blocks, block_size=PROPERTY_BS, eviction_policy="lfu"
        )


TestRadixLfuProperties = RadixLfuMachine.TestCase
TestRadixLfuProperties.settings = settings(
    max_examples=50,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
