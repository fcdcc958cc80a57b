"""The contract both prefix caches keep, run against each (``hash`` and ``radix``).

Every scenario here goes through the public API only (`make_prefix_cache`), with
`check_integrity()` after every call. Hash-only internals (free-queue order) are pinned in
test_hash_cache.py; radix internals (splits, locks, eviction order) in test_radix_cache.py.
Block size 16 and a pool of 10 blocks unless stated.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cache_helpers import Checked
from prefixcache.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheHit,
    PrefixCache,
    Sequence,
    make_prefix_cache,
)
from prefixcache.sched.fairness import QuietDomains

BS = 16
KINDS = ["hash", "radix"]
# the first 300 requests of the shared Mooncake conversation trace, committed with the tests
TRACE = Path(__file__).parent / "fixtures" / "mooncake_conversation_300.jsonl"




@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def new_cache(kind: str, num_blocks: int = 10, **kwargs: Any) -> Any:
    return Checked(make_prefix_cache(kind, num_blocks=num_blocks, block_size=BS, **kwargs))


def run_prompt(cache: Any, seq: Sequence) -> list[int]:
    """match + allocate + commit the whole prompt; returns the block table."""
    hit = cache.match(seq)
    table = cache.allocate(seq, seq.num_tokens - hit.num_tokens, hit)
    assert table is not None
    cache.commit(seq, seq.num_tokens)
    return list(table)


def removed_ids(cache: Any) -> list[int]:
    return [b for e in cache.take_events() if isinstance(e, BlockRemoved) for b in e.block_ids]


def snapshot(cache: Any, live: list[Sequence]) -> tuple[object, ...]:
    """What a caller can observe; drains the events (take them before the first snapshot)."""
    stats = cache.stats.as_dict()
    for name in ("num_requests", "num_queried_tokens", "num_hit_tokens", "num_hit_requests"):
        del stats[name]
    del stats["lookup_time_ns"], stats["first_miss_blocks"], stats["hit_rate"]
    tables = [cache.block_table(s) for s in live]
    computed = [s.num_computed_tokens for s in live]
    return tables, computed, cache.num_free_blocks, stats, cache.take_events()


# -- the scenarios of the hash cache that are about the contract -------------------------------


def test_miss_then_shared_prefix_then_eviction(kind: str) -> None:
    cache = new_cache(kind)
    a = Sequence("a", range(55))
    assert cache.match(a).num_tokens == 0
    assert run_prompt(cache, a) == [0, 1, 2, 3]
    digests = a.block_digests
    assert cache.take_events() == [
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
    assert cache.num_free_blocks == 5
    cache.commit(b, 58)
    assert cache.take_events() == []  # its only new block is partial
    cache.free(a)
    cache.free(b)
    assert cache.num_free_blocks == 10
    long_miss = Sequence("c", range(5000, 5160))
    assert sorted(run_prompt(cache, long_miss)) == list(range(10))
    removed = [e for e in cache.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(digests[:3])
    assert sorted(b for e in removed for b in e.block_ids) == [0, 1, 2]
    assert cache.stats.num_evictions == 3
    assert cache.match(Sequence("d", range(55))).num_tokens == 0


def test_own_hits_are_never_evicted_and_failed_allocation_changes_nothing(kind: str) -> None:
    cache = new_cache(kind)
    a = Sequence("a", range(49))
    run_prompt(cache, a)
    cache.free(Sequence("a", []))  # a different object with the same id: no-op
    assert cache.block_table(a) == [0, 1, 2, 3]
    cache.free(a)
    b = Sequence("b", range(161))
    hit = cache.match(b)
    assert hit.block_ids == [0, 1, 2]
    cache.take_events()
    before = snapshot(cache, [])
    assert cache.allocate(b, 161 - 48, hit) is None  # needs 11 blocks
    assert snapshot(cache, []) == before and b.num_computed_tokens == 0
    c = Sequence("c", range(160))
    hit = cache.match(c)
    table = cache.allocate(c, 160 - 48, hit)
    assert table[:3] == [0, 1, 2] and sorted(table) == list(range(10))
    assert cache.stats.num_evictions == 0


def test_failed_decode_allocation_changes_nothing(kind: str) -> None:
    cache = new_cache(kind, num_blocks=3)
    a = Sequence("a", range(48))
    run_prompt(cache, a)
    a.append(1)
    cache.take_events()
    before = snapshot(cache, [a])
    assert cache.allocate(a, 1) is None
    assert snapshot(cache, [a]) == before


def test_salt_acts_through_the_root(kind: str) -> None:
    cache = new_cache(kind)
    run_prompt(cache, Sequence("a", range(40), salt="org_1"))
    same = Sequence("b", range(40), salt="org_1")
    other = Sequence("c", range(40), salt="org_2")
    unsalted = Sequence("d", range(40))
    assert cache.match(same).num_tokens == 32
    assert cache.match(other).num_tokens == 0
    assert cache.match(unsalted).num_tokens == 0
    assert not set(same.block_digests) & set(other.block_digests)
    assert not set(same.block_digests) & set(unsalted.block_digests)


def test_block_aligned_prompt_recomputes_its_last_block(kind: str) -> None:
    cache = new_cache(kind)
    run_prompt(cache, Sequence("a", range(48)))
    b = Sequence("b", range(48))
    hit = cache.match(b)
    assert (hit.num_tokens, hit.num_matched_blocks, hit.first_miss_block) == (32, 3, 2)
    assert cache.allocate(b, 16, hit) == [0, 1, 3]
    cache.commit(b, 48)
    assert cache.stats.num_duplicate_blocks == 1
    assert cache.stats.first_miss_blocks == {0: 1, 2: 1}
    assert cache.match(Sequence("c", range(49))).block_ids == [0, 1, 2]


def test_decode_fills_partial_block_then_commits_one_digest(kind: str) -> None:
    cache = new_cache(kind)
    a = Sequence("a", range(20))
    assert run_prompt(cache, a) == [0, 1]
    cache.take_events()
    num_free = cache.num_free_blocks
    for token in range(100, 112):
        a.append(token)
        assert cache.allocate(a, 1) == [0, 1]
        assert cache.num_free_blocks == num_free
        cache.commit(a, a.num_tokens)
    stored = cache.take_events()
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    assert stored[0].block_ids == [1]
    assert stored[0].parent_block_hash == a.block_digests[0]
    assert stored[0].token_ids == [*range(16, 20), *range(100, 112)]
    a.append(7)
    assert cache.allocate(a, 1) == [0, 1, 2]
    b = Sequence("b", [*range(20), *range(100, 112), 5])
    assert cache.match(b).num_tokens == 32


def test_chunked_prefill_commits_block_by_block(kind: str) -> None:
    cache = new_cache(kind)
    a = Sequence("a", range(70))
    assert cache.allocate(a, 24, cache.match(a)) == [0, 1]
    cache.commit(a, 24)
    assert cache.match(Sequence("p", range(40))).num_tokens == 16
    assert cache.allocate(a, 46) == [0, 1, 2, 3, 4]
    cache.commit(a, 70)
    assert cache.match(Sequence("q", range(80))).num_tokens == 64
    assert [len(e.block_hashes) for e in cache.take_events()] == [1, 3]


def test_reset_refuses_while_held_then_clears(kind: str) -> None:
    cache = new_cache(kind)
    a = Sequence("a", range(40))
    run_prompt(cache, a)
    cache.take_events()
    before = snapshot(cache, [a])
    assert cache.reset() is False
    assert snapshot(cache, [a]) == before
    cache.free(a)
    assert cache.reset() is True
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.stats.num_resets == 1
    assert cache.num_cached_blocks == 0 and cache.num_free_blocks == 10
    assert cache.match(Sequence("b", range(40))).num_tokens == 0


def test_hit_from_before_a_reset_is_stale(kind: str) -> None:
    cache = new_cache(kind)
    a = Sequence("a", range(40))
    run_prompt(cache, a)
    cache.free(a)
    b = Sequence("b", range(40))
    hit = cache.match(b)
    assert hit.num_tokens == 32
    assert cache.reset() is True
    with pytest.raises(ValueError, match="stale"):
        cache.allocate(b, 8, hit)


def test_duplicates_are_tolerated_and_counted(kind: str) -> None:
    cache = new_cache(kind)
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
    assert cache.num_free_blocks == 10
    assert cache.match(Sequence("c", range(40))).block_ids == [0, 1]


def test_fork_then_append_copies_on_write(kind: str) -> None:
    cache = new_cache(kind)
    a = Sequence("a", range(20))
    run_prompt(cache, a)
    child = cache.fork(a, "a.1")
    assert cache.block_table(child) == [0, 1]
    assert child.num_computed_tokens == 20 and cache.num_free_blocks == 8
    a.append(500)
    assert cache.allocate(a, 1) == [0, 2]
    assert cache.take_block_copies() == [(1, 2)]
    child.append(600)
    assert cache.allocate(child, 1) == [0, 1]
    assert cache.take_block_copies() == []
    cache.commit(a, 21)
    cache.commit(child, 21)
    cache.free(a)
    cache.free(child)
    assert cache.num_free_blocks == 10


def test_fork_before_commit_reallocates_the_pending_write(kind: str) -> None:
    cache = new_cache(kind)
    a = Sequence("a", range(40))
    assert cache.allocate(a, 40, cache.match(a)) == [0, 1, 2]
    cache.commit(a, 24)
    child = cache.fork(a, "a.1")
    with pytest.raises(ValueError, match="allocated"):
        cache.commit(a, 40)  # the pending write must be allocated again (copy-on-write)
    assert cache.allocate(a, 16) == [0, 3, 4]
    assert cache.take_block_copies() == [(1, 3)]
    cache.commit(a, 40)
    assert cache.allocate(child, 16) == [0, 1, 2]
    cache.commit(child, 40)
    assert cache.match(Sequence("q", range(41))).num_tokens == 32
    cache.free(a)
    cache.free(child)
    assert cache.num_free_blocks == 10


def test_stale_hit_is_rejected_without_changes(kind: str) -> None:
    cache = new_cache(kind, num_blocks=4)
    a = Sequence("a", range(40))
    run_prompt(cache, a)
    cache.free(a)
    b = Sequence("b", range(40))
    hit = cache.match(b)
    assert hit.block_ids == [0, 1]
    c = Sequence("c", range(900, 964))
    run_prompt(cache, c)  # evicts both
    cache.free(c)
    cache.take_events()
    before = snapshot(cache, [])
    with pytest.raises(ValueError, match="stale"):
        cache.allocate(b, 8, hit)
    assert snapshot(cache, []) == before
    forged = CacheHit(num_tokens=32, block_ids=[0, 1])
    with pytest.raises(ValueError):
        cache.allocate(b, 8, forged)
    assert cache.block_table(b) == []


def test_disabled_caching_and_isolation_none(kind: str) -> None:
    cache = new_cache(kind, enable_prefix_caching=False)
    run_prompt(cache, Sequence("a", range(40)))
    hit = cache.match(Sequence("b", range(40)))
    assert hit.num_tokens == 0 and cache.stats.num_requests == 1  # match alone counts nothing
    assert cache.num_cached_blocks == 0
    shared = new_cache(kind)
    run_prompt(shared, Sequence("a", range(40), use_cache=False))
    assert shared.num_cached_blocks == 0
    run_prompt(shared, Sequence("b", range(40)))
    assert shared.match(Sequence("c", range(40), use_cache=False)).num_tokens == 0


def test_match_is_pure_and_admission_counts_the_lookup_once(kind: str) -> None:
    cache = new_cache(kind)
    run_prompt(cache, Sequence("a", range(40)))
    before = (dict(cache.stats.as_dict()), cache.num_free_blocks)
    b = Sequence("b", range(40))
    for _ in range(3):
        assert cache.match(b).num_tokens == 32
    assert (dict(cache.stats.as_dict()), cache.num_free_blocks) == before
    hit = cache.match(b)
    assert cache.allocate(b, 8, hit) is not None
    stats = cache.stats
    assert stats.num_requests == 2 and stats.num_hit_requests == 1
    assert stats.num_hit_tokens == 32 and stats.first_miss_blocks == {0: 1, 2: 1}
    assert cache.allocate(b, 1) is not None  # a later allocation is not a lookup
    assert stats.num_requests == 2


def test_bad_input_is_a_clear_error(kind: str) -> None:
    cache = new_cache(kind)
    a = Sequence("a", range(20))
    with pytest.raises(ValueError, match="num_new_tokens"):
        cache.allocate(a, -1)
    with pytest.raises(ValueError, match="holds no blocks"):
        cache.commit(a, 16)
    with pytest.raises(ValueError, match="holds no blocks"):
        cache.fork(a, "x")
    cache.allocate(a, 20)
    with pytest.raises(ValueError, match="allocated"):
        cache.commit(a, 21)
    with pytest.raises(ValueError, match="already live"):
        cache.allocate(Sequence("a", range(3)), 3)
    with pytest.raises(ValueError, match="hash_algo"):
        make_prefix_cache(kind, num_blocks=4, block_size=16, hash_algo="md5")
    cache.free(Sequence("nobody", []))
    cache.free(a)
    cache.free(a)
    assert cache.num_free_blocks == 10


def test_zero_on_reuse_marks_blocks_changing_namespace(kind: str) -> None:
    cache = new_cache(kind, num_blocks=4, zero_on_reuse=True)
    a = Sequence("a", range(40), salt="t1")
    run_prompt(cache, a)
    assert cache.take_blocks_to_zero() == [0, 1, 2]  # unknown past
    cache.free(a)
    b = Sequence("b", range(100, 140), salt="t1")
    run_prompt(cache, b)
    assert cache.take_blocks_to_zero() == [3]  # the others stayed in namespace t1
    cache.free(b)
    c = Sequence("c", range(200, 264), salt="t2")
    table = run_prompt(cache, c)
    assert sorted(cache.take_blocks_to_zero()) == sorted(table)


def test_event_buffer_is_bounded(kind: str) -> None:
    cache = new_cache(kind, num_blocks=16, max_events=2)
    for i in range(4):
        seq = Sequence(f"s{i}", range(i * 100, i * 100 + 20))
        run_prompt(cache, seq)
        cache.free(seq)
    assert len(cache.take_events()) == 2


# -- isolation, locking and scale ---------------------------------------------------------------


def test_eviction_never_touches_a_block_in_use(kind: str) -> None:
    cache = new_cache(kind, num_blocks=8)
    held = Sequence("held", range(49))  # 3 cached blocks + 1 partial, all in use
    run_prompt(cache, held)
    old = Sequence("old", range(300, 348))
    run_prompt(cache, old)
    cache.free(old)
    cache.take_events()
    x = Sequence("x", range(1000, 1080))  # 5 blocks; only 1 free + 3 cached unused ones exist
    assert cache.allocate(x, 80, cache.match(x)) is None
    y = Sequence("y", range(1000, 1064))
    assert sorted(run_prompt(cache, y)) == [4, 5, 6, 7]
    assert sorted(removed_ids(cache)) == [4, 5, 6]
    assert cache.match(Sequence("q", range(49))).block_ids == [0, 1, 2]


@pytest.mark.parametrize(
    "other",
    [
        {"salt": "t2"},
        {"adapter": "lora-a"},
        {"salt": None},
    ],
)
def test_namespace_isolation(kind: str, other: dict[str, Any]) -> None:
    cache = new_cache(kind, num_blocks=12)
    run_prompt(cache, Sequence("a", range(64), salt="t1"))
    outsider = Sequence("o", range(65), **other)
    hit = cache.match(outsider)
    assert hit.num_tokens == 0
    run_prompt(cache, outsider)
    assert cache.num_cached_blocks == 8  # nothing shared across namespaces
    assert cache.match(Sequence("p", range(65), salt="t1")).num_tokens == 64
    assert cache.match(Sequence("q", range(65), **other)).num_tokens == 64


def test_model_identity_isolates_caches(kind: str) -> None:
    a = new_cache(kind, model_id="model-a")
    b = new_cache(kind, model_id="model-b")
    s, t = Sequence("s", range(40)), Sequence("t", range(40))
    run_prompt(a, s)
    run_prompt(b, t)
    assert not set(s.block_digests) & set(t.block_digests)


@pytest.fixture
def no_gc() -> Iterator[None]:
    """10,000 live 4,096-token sequences are millions of objects: keep the collector out."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_ten_thousand_sequences_share_one_prefix(kind: str, no_gc: None) -> None:
    ideal = 4096 // BS + 10_000  # the shared prefix once, plus each sequence's partial tail
    cache = make_prefix_cache(kind, num_blocks=ideal + 100, block_size=BS)
    template = Sequence("t", range(4096))
    template.digests(cache.hasher, cache.model_id)
    live = []
    for i in range(10_000):
        seq = template.fork(f"s{i}")  # the Sequence copy: same tokens, digests already known
        for k in range(8):
            seq.append(100_000 + 8 * i + k)
        seq.num_prompt_tokens = seq.num_tokens
        hit = cache.match(seq)
        assert cache.allocate(seq, seq.num_tokens - hit.num_tokens, hit) is not None
        cache.commit(seq, seq.num_tokens)
        live.append(seq)
    cache.check_integrity()
    used = cache.num_blocks - cache.num_free_blocks
    assert used <= 1.1 * ideal
    assert cache.stats.num_hit_tokens == 9_999 * 4096


# -- both implementations, same hits ------------------------------------------------------------


def drive(cache: PrefixCache, prompts: list[list[int]], salts: list[str | None]) -> list[int]:
    hits = []
    for i, (tokens, salt) in enumerate(zip(prompts, salts, strict=True)):
        seq = Sequence(f"r{i}", tokens, salt)
        hit = cache.match(seq)
        hits.append(hit.num_tokens)
        assert cache.allocate(seq, seq.num_tokens - hit.num_tokens, hit) is not None
        cache.commit(seq, seq.num_tokens)
        if i % 3:
            cache.free(seq)
    cache.check_integrity()
    return hits


def branching_prompts() -> tuple[list[list[int]], list[str | None]]:
    """Few-shot sets x questions, and a small tree of thought, with two tenants."""
    prompts: list[list[int]] = []
    for s in range(3):
        shots = list(range(10_000 * s, 10_000 * s + 100))
        prompts += [shots + list(range(50_000 + 40 * q, 50_000 + 40 * q + 37)) for q in range(6)]
    frontier = [list(range(90_000, 90_040))]
    for depth in range(3):
        frontier = [p + [depth * 10 + b] * 33 for p in frontier for b in range(3)]
        prompts += frontier
    salts: list[str | None] = [None if i % 4 else "t1" for i in range(len(prompts))]
    return prompts, salts


def test_both_caches_report_the_same_hits_and_stored_blocks() -> None:
    prompts, salts = branching_prompts()
    results = {}
    for kind in KINDS:
        cache = make_prefix_cache(kind, num_blocks=4096, block_size=BS)
        hits = drive(cache, prompts, salts)
        stored = sorted(
            (e.parent_block_hash, tuple(e.block_hashes))
            for e in cache.take_events()
            if isinstance(e, BlockStored)
        )
        digests = sorted({h for _, hs in stored for h in hs})
        results[kind] = (hits, digests, cache.stats.num_hit_tokens)
    assert results["hash"] == results["radix"]
    assert sum(results["hash"][0]) > 0


def test_mooncake_slice_same_hits_with_unlimited_capacity() -> None:
    with TRACE.open() as f:
        requests = [json.loads(line) for _, line in zip(range(300), f, strict=False)]
    num_blocks = sum(len(r["hash_ids"]) for r in requests)
    totals = []
    for kind in KINDS:
        cache = make_prefix_cache(kind, num_blocks=num_blocks, block_size=512)
        fresh = 2**31
        for i, req in enumerate(requests):
            n_full = req["input_length"] // 512
            tokens = [t for h in req["hash_ids"][:n_full] for t in range(h * 512, h * 512 + 512)]
            tokens += range(fresh, fresh + req["input_length"] - n_full * 512)
            fresh += 512
            seq = Sequence(str(i), tokens)
            hit = cache.match(seq)
            assert cache.allocate(seq, seq.num_tokens - hit.num_tokens, hit) is not None
            cache.commit(seq, seq.num_tokens)
            cache.free(seq)
        cache.check_integrity()
        totals.append(cache.stats.num_hit_tokens)
    assert totals[0] == totals[1] > 0


@pytest.mark.parametrize("domains", [("calm", "flood"), ("", "")])
def test_a_flooding_domain_evicts_its_own_cached_blocks_first(
    kind: str, domains: tuple[str, str]
) -> None:
    # 16 blocks; a calm tenant caches a 2-block prefix, then a flood of 3-block prompts (its
    # own blocks cached too) churns through the pool: with domains the flood gives up its own
    # cached blocks before the calm prefix; as one domain (one LRU) the prefix goes first
    calm, flood = domains
    cache = new_cache(kind, num_blocks=16)
    prefix = list(range(2 * BS))
    first = Sequence("c0", [*prefix, 1], domain=calm)
    run_prompt(cache, first)
    cache.free(first)
    for i in range(12):
        seq = Sequence(f"f{i}", [1000 + 100 * i + t for t in range(3 * BS)], domain=flood)
        run_prompt(cache, seq)
        cache.free(seq)
    hit = cache.match(Sequence("c1", [*prefix, 2], domain=calm))
    assert hit.num_tokens == (2 * BS if calm != flood else 0)



def test_an_over_share_domain_cannot_evict_a_quiet_domains_cache(kind: str) -> None:
    # 16 blocks, two domains: the flood holds 13 blocks in live sequences (over its share of 8)
    # and the calm tenant's freed 2-block prefix is the only cached free memory left: the
    # flood's next block is refused (the scheduler would preempt the flood), the prefix stays.
    # The scheduler's fair shares are what protects it: handed to the cache as its protection
    cache = new_cache(kind, num_blocks=16)
    cache.cache.protection = QuietDomains(cache.cache)
    prefix = list(range(2 * BS))
    calm = Sequence("c0", [*prefix, 1], salt="calm", domain="calm")
    run_prompt(cache, calm)
    cache.free(calm)
    flood = [Sequence(f"f{i}", [1000 + 100 * i + t for t in range(3 * BS)], salt="flood",
                      domain="flood") for i in range(4)]  # fmt: skip
    for seq in flood:
        run_prompt(cache, seq)  # 12 blocks held; free: the 2 prefix blocks and 2 uncached
    big = Sequence("f9", list(range(5000, 5000 + 3 * BS)), salt="flood", domain="flood")
    assert cache.allocate(big, 3 * BS) is None  # 3 blocks: only 2 are not the calm prefix
    again = Sequence("c1", [*prefix, 2], salt="calm", domain="calm")
    assert cache.match(again).num_tokens == 2 * BS
    one = Sequence("f8", list(range(6000, 6000 + BS)), salt="flood", domain="flood")
    assert cache.allocate(one, BS) is not None  # uncached free blocks are the flood's to take
    for seq in flood:
        cache.free(seq)
    assert cache.allocate(big, 3 * BS) is not None  # its own cached blocks are free again
    assert cache.match(again).num_tokens == 2 * BS


def test_statistics_follow_what_the_pool_and_index_did(kind: str) -> None:
    """The cache's counters (one writer: the cache) agree with what a caller saw happen: the
    free-block low watermark, blocks stored, duplicates computed twice, evictions, resets."""
    cache = new_cache(kind, num_blocks=10)
    prompt = list(range(3 * BS)) + [7]
    a, b = Sequence("a", prompt), Sequence("b", prompt)
    hit_a, hit_b = cache.match(a), cache.match(b)  # both miss: both compute the prompt
    assert cache.allocate(a, a.num_tokens, hit_a) and cache.allocate(b, b.num_tokens, hit_b)
    assert cache.stats.min_free_blocks == 10 - 8
    cache.commit(a, a.num_tokens)
    cache.commit(b, b.num_tokens)
    stats = cache.stats
    assert (stats.num_committed_blocks, stats.num_duplicate_blocks) == (3, 3)
    assert cache.num_cached_blocks == 3
    cache.free(a)
    cache.free(b)
    removed_ids(cache)  # drain
    c = Sequence("c", list(range(100, 100 + 9 * BS)) + [7])  # needs every block: evicts all 3
    assert run_prompt(cache, c)
    assert stats.num_evictions == 3 == len(removed_ids(cache)) and cache.num_cached_blocks == 9
    assert stats.min_free_blocks == 0
    cache.free(c)
    assert cache.reset() and stats.num_resets == 1 and cache.num_cached_blocks == 0
