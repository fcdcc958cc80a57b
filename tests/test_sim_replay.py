"""Replay through the real caches: ideal at unlimited capacity, LRU against a reference model,
timed scheduler equivalences, held blocks, cluster mode and routers."""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import pytest

from prefixcache.cache import Sequence
from prefixcache.sim.config import RunSpec, build_cache
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.mooncake import read_mooncake
from prefixcache.sim.report import ideal_hit_ratio
from prefixcache.sim.sequential import replay_sequential
from prefixcache.sim.synthetic import generate
from prefixcache.sim.timed import ReplicaConfig, TimedReplica, replay_timed
from prefixcache.sim.tokens import TokenSource
from prefixcache.sim.trace import Trace, TraceRequest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def conversation() -> Trace:
    return read_mooncake(FIXTURES / "mooncake_conversation_300.jsonl")


def reference_lru(trace: Trace, capacity: int) -> float:
    """The bench-style replay: one request at a time, hits touched, new blocks from the LRU end,
    the request's complete blocks released deepest first (so shallow prefixes are evicted last)."""
    bs, cached = trace.block_size, OrderedDict[int, None]()
    hit = total = 0
    for r in trace.requests:
        num_full, cap = r.input_length // bs, (r.input_length - 1) // bs
        total += r.input_length
        if math.ceil(r.input_length / bs) > capacity:
            continue  # can never fit: computed without the cache, nothing changes
        n = 0
        while n < cap and r.hash_ids[n] in cached:
            n += 1
        hit += n * bs
        for h in r.hash_ids[:n]:
            cached.pop(h)
        while len(cached) + math.ceil(r.input_length / bs) > capacity:
            cached.popitem(last=False)
        for h in reversed(r.hash_ids[:num_full]):
            cached[h] = None
    return hit / total


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_unlimited_capacity_reaches_the_ideal(conversation: Trace, kind: str) -> None:
    (result,) = replay_sequential(conversation, [RunSpec(kind, "lru", None)])
    assert result.hit_ratio == pytest.approx(ideal_hit_ratio(conversation), abs=1e-12)
    assert result.num_evictions == 0 and result.num_rejected == 0


def test_agentic_unlimited_reaches_the_ideal() -> None:
    from prefixcache.sim.agentic import read_agentic

    trace = read_agentic(FIXTURES)
    (result,) = replay_sequential(trace, [RunSpec("hash", "lru", None)])
    assert result.hit_ratio == pytest.approx(ideal_hit_ratio(trace), abs=1e-12)
    assert result.hit_ratio > 0.5


@pytest.mark.parametrize("capacity", [150, 600])
def test_sequential_lru_equals_the_reference_replay(conversation: Trace, capacity: int) -> None:
    results = replay_sequential(
        conversation, [RunSpec("hash", "lru", capacity), RunSpec("radix", "lru", capacity)]
    )
    expected = reference_lru(conversation, capacity)
    assert expected < ideal_hit_ratio(conversation)  # the capacity really bites
    for result in results:
        assert result.hit_ratio == pytest.approx(expected, abs=1e-12)
        assert result.num_evictions > 0


def test_timed_at_concurrency_one_equals_sequential(conversation: Trace) -> None:
    trace = conversation.head(120)
    spec = RunSpec("hash", "lru", 400)
    (sequential,) = replay_sequential(trace, [spec])
    config = ReplicaConfig(max_num_seqs=1, store_decode=False)
    timed = replay_timed(trace, spec, config=config)
    assert timed.hit_ratio == pytest.approx(sequential.hit_ratio, abs=1e-12)
    assert timed.ttft_p50_s >= sequential.ttft_p50_s  # queueing only adds


def _request(rid: str, t: float, n_in: int, n_out: int, ids: list[int]) -> TraceRequest:
    return TraceRequest(rid, t, n_in, n_out, ids)


def test_blocks_held_by_running_requests_are_unavailable() -> None:
    # two 8-block requests with no shared prefix in a 12-block cache: the second must wait
    trace = Trace(
        "held",
        16,
        [
            _request("a", 0.0, 120, 8, list(range(7))),
            _request("b", 0.0, 120, 8, list(range(100, 107))),
        ],
    )
    cost = CostModel(
        prefill_tokens_per_s=1000.0, decode_step_s=0.01, decode_per_seq_s=0.0, overhead_s=0.0
    )
    spec = RunSpec("hash", "lru", 12)
    cache = build_cache(spec, 12, 16, with_events=False)
    replica = TimedReplica(cache, cost, ReplicaConfig(), TokenSource(trace))
    for r in trace.requests:
        replica.add(r, Sequence(r.request_id, TokenSource(trace).prompt(r)))
    replica.run_until(math.inf)
    first, second = replica.tally.ttft_s
    assert first == pytest.approx(0.12)  # 120 tokens at 1000 tok/s
    assert second >= first + 7 * 0.01  # started only after a finished its 7 decode steps
    assert cache.usage == 0.0
    cache.check_integrity()


def test_timed_replay_with_decode_preempts_and_stays_consistent() -> None:
    trace = generate("multi-turn", "num_conversations=6,turns=3,rate=50,think_time_s=0.2")
    spec = RunSpec("radix", "lru", 120)
    result = replay_timed(trace, spec, config=ReplicaConfig(max_num_batched_tokens=512))
    assert result.num_requests == len(trace)
    assert result.num_preemptions > 0 and result.peak_usage == pytest.approx(1.0)
    assert 0.0 < result.hit_ratio <= ideal_hit_ratio(trace)


@pytest.mark.parametrize("router", ["round-robin", "cache-aware", "prefix-affinity"])
def test_cluster_with_one_replica_equals_single_mode(conversation: Trace, router: str) -> None:
    trace = conversation.head(150)
    single, cluster = replay_sequential(
        trace, [RunSpec("hash", "lru", 300), RunSpec("hash", "lru", 300, 1, router)]
    )
    assert cluster.hit_ratio == single.hit_ratio
    assert cluster.num_evictions == single.num_evictions
    timed_single = replay_timed(trace.head(50), RunSpec("hash", "lru", 300))
    timed_cluster = replay_timed(trace.head(50), RunSpec("hash", "lru", 300, 1, router))
    assert timed_cluster.hit_ratio == timed_single.hit_ratio
    assert timed_cluster.ttft_p99_s == timed_single.ttft_p99_s


@pytest.mark.parametrize("mode", ["sequential", "timed"])
def test_affinity_and_cache_aware_beat_round_robin_on_shared_prefixes(mode: str) -> None:
    trace = generate(
        "generated-shared-prefix",
        "num_groups=8,prompts_per_group=12,system_prompt_len=512,question_len=32,output_len=8",
    )
    capacity = 4 * 80  # each replica holds two or three groups' prompts, not all eight
    specs = [
        RunSpec("hash", "lru", capacity, 4, r)
        for r in ("round-robin", "prefix-affinity", "cache-aware")
    ]
    if mode == "sequential":
        rr, affinity, aware = replay_sequential(trace, specs)
    else:
        rr, affinity, aware = (replay_timed(trace, s) for s in specs)
    assert affinity.hit_ratio > rr.hit_ratio + 0.1
    assert aware.hit_ratio > rr.hit_ratio + 0.1
    assert sum(aware.replica_requests) == len(trace)
    assert min(aware.replica_requests) > 0  # the guard and tie-breaks keep every replica busy


def _burst(n: int, prefix_blocks: int = 4, bs: int = 16) -> Trace:
    """``n`` requests arriving together, sharing ``prefix_blocks`` blocks, each with its own."""
    shared = list(range(prefix_blocks))
    return Trace(
        "burst",
        bs,
        [
            _request(f"r{i}", 0.0, (prefix_blocks + 1) * bs + 3, 4, [*shared, 100 + i])
            for i in range(n)
        ],
    )


def _replica(trace: Trace, config: ReplicaConfig, num_blocks: int = 200) -> TimedReplica:
    spec = RunSpec("radix", "lru", num_blocks)
    cache = build_cache(spec, num_blocks, trace.block_size, with_events=False)
    source = TokenSource(trace)
    replica = TimedReplica(cache, CostModel(), config, source)
    for r in trace.requests:
        replica.add(r, Sequence(r.request_id, source.prompt(r)))
    replica.run_until(math.inf)
    cache.check_integrity()
    assert cache.usage == 0.0 and replica.tally.num_requests == len(trace)
    return replica


def test_timed_in_batch_dedup_turns_a_burst_into_hits() -> None:
    trace = _burst(8)
    with_dedup = _replica(trace, ReplicaConfig())
    without = _replica(trace, ReplicaConfig(dedup=False))
    assert without.tally.num_hit_tokens == 0  # all eight computed the shared prefix at once
    assert with_dedup.tally.num_hit_tokens == 7 * 4 * 16  # the first computed it, seven hit
    assert with_dedup.scheduler.num_deferred > 0


def test_timed_n_choices_fork_and_hold_their_own_blocks() -> None:
    trace = _burst(3)
    one = _replica(trace, ReplicaConfig())
    three = _replica(trace, ReplicaConfig(n=3))
    assert three.tally.num_requests == one.tally.num_requests == 3  # a request counts once
    assert three.tally.peak_usage > one.tally.peak_usage  # each choice decodes in its own blocks
    assert three.scheduler.num_block_copies > 0  # the last prompt block was copied on write


def test_timed_lpm_admits_the_longest_cached_prefix_first() -> None:
    # a warm prefix, then at one instant a cold request before a warm one; one slot at a time
    bs = 16
    warm, cold = list(range(6)), list(range(50, 56))
    trace = Trace(
        "lpm",
        bs,
        [
            _request("w0", 0.0, 6 * bs + 1, 1, warm),
            _request("c1", 1.0, 6 * bs + 1, 1, cold),
            _request("w2", 1.0, 6 * bs + 1, 1, warm),
        ],
    )
    fcfs = _replica(trace, ReplicaConfig(max_num_seqs=1))
    lpm = _replica(trace, ReplicaConfig(max_num_seqs=1, schedule_policy="lpm"))
    assert fcfs.tally.num_hit_tokens == lpm.tally.num_hit_tokens == 6 * bs
    # under lpm the warm request goes first: its time to first token is the shorter one
    assert lpm.tally.ttft_s[1] < fcfs.tally.ttft_s[2]


@pytest.mark.parametrize("mode", ["sequential", "timed"])
def test_prefix_affinity_replays_a_recorded_trace_with_its_own_digests(mode, tmp_path) -> None:
    """The hash ring reads digest bytes: a recorded trace's digests (what the serving router
    saw), not the replay's own, decide the slot, so the replay routes as the real run did."""
    import hashlib

    from prefixcache.sim.record import TraceRecorder, read_record
    from prefixcache.sim.router import PrefixAffinity

    with TraceRecorder(tmp_path / "t.jsonl", 16) as recorder:
        for i in range(24):
            digests = [hashlib.sha256(f"prefix {i % 8} block {b}".encode()).digest()
                       for b in range(3)]
            recorder.record(48, 2, digests, arrival_s=i * 0.1)
    trace = read_record(tmp_path / "t.jsonl")
    ring = PrefixAffinity(2)
    expected = [0, 0]
    for request in trace.requests:
        expected[ring.choose(request.recorded_digests, [0, 0])] += 1
    spec = RunSpec("hash", "lru", 200, 2, "prefix-affinity")
    result = replay_sequential(trace, [spec])[0] if mode == "sequential" else replay_timed(
        trace, spec)
    assert result.replica_requests == expected


def test_cache_aware_follows_requests_it_routed_before_their_events_arrive() -> None:
    """A burst sharing a new prefix stays on one replica although no event has named it yet;
    new prefixes go to the least loaded replica; events settle what was expected."""
    from prefixcache.cache import AllBlocksCleared, BlockRemoved, BlockStored
    from prefixcache.sim.router import CacheAware

    def chain(name: str, n: int = 4) -> list[bytes]:
        return [f"{name}-{i}".encode().ljust(32, b"\0") for i in range(n)]

    router = CacheAware(2, max_expected=6)
    a, b = chain("a"), chain("b")
    first = router.choose(a, [0, 0])
    assert [router.choose(a + chain(f"q{j}", 1), [1, 0]) for j in range(3)] == [first] * 3
    other = router.choose(b, [3, 0])  # no match: the less loaded replica gets the new prefix
    assert other != first
    router.observe(first, [BlockStored(a, b"\0" * 32, [], 16)])
    assert not set(a) & set(router.expected[first]) and set(a) <= router.mirrors[first]
    router.observe(first, [BlockRemoved(a[2:])])
    assert router.choose(a, [0, 0]) == first  # half the prefix is still cached there
    router.observe(other, [AllBlocksCleared()])
    assert not router.expected[other] and not router.mirrors[other]
    for j in range(10):  # a replica expects at most max_expected digests, the newest
        router.choose(chain(f"c{j}", 2), [0, 5])
    assert all(len(e) <= 6 for e in router.expected)
    router.forget(first)
    assert not router.mirrors[first] and not router.expected[first]


# ---- tier-weighted routing: where a replica holds a prefix, and what loading it costs there ----


def _chain(name: str, n: int = 10) -> list[bytes]:
    return [f"{name}-{i}".encode().ljust(32, b"\0") for i in range(n)]


def _held(router, replica: int, digests: list[bytes], medium: str | None) -> None:
    from prefixcache.cache import BlockStored

    router.observe(replica, [BlockStored(digests, b"\0" * 32, [], 16, medium=medium)])


@pytest.mark.parametrize("holder", [0, 1])
def test_a_replica_holding_the_prefix_on_disk_beats_a_cold_one(holder: int) -> None:
    from prefixcache.sim.replica_costs import ReplicaCosts
    from prefixcache.sim.router import CacheAware

    prompt = _chain("doc")
    busier = [1, 1]
    busier[holder] = 3  # busier, within the load guard: the cold one is less loaded

    def router(disk_load_s: float | None):
        """Two replicas, ``holder`` with the prompt on its disk only; a disk load of a block
        measured at ``disk_load_s`` (None: not measured yet) against 1 ms of prefill."""
        rule = CacheAware(2)
        _held(rule, holder, prompt, "DISK")
        if disk_load_s is not None:
            rule.set_costs(holder, ReplicaCosts(1e-3, {"DISK": disk_load_s}))
        return rule

    assert router(None).credit(holder, prompt) == 5.0  # the tier's default weight
    assert router(None).choose(prompt, busier) == holder
    assert router(2e-4).credit(holder, prompt) == pytest.approx(8.0)  # saves 0.8 of a prefill
    assert router(2e-4).choose(prompt, busier) == holder
    # a disk no faster than the replica's prefill saves nothing: the less loaded one is chosen
    assert router(1.5e-3).credit(holder, prompt) == 0.0
    assert router(1.5e-3).choose(prompt, busier) == 1 - holder
    assert router(2e-4).credit(1 - holder, prompt) == 0.0  # a disk is its replica's own


@pytest.mark.parametrize("ram", [0, 1])
def test_the_kv_pool_beats_a_disk_when_loads_are_equal(ram: int) -> None:
    from prefixcache.sim.replica_costs import ReplicaCosts
    from prefixcache.sim.router import CacheAware

    prompt = _chain("doc")
    router = CacheAware(2)
    _held(router, ram, prompt, None)
    _held(router, 1 - ram, prompt + _chain("tail", 4), "DISK")
    router.set_costs(1 - ram, ReplicaCosts(1e-3, {"DISK": 1e-6}))  # nearly free, still a load
    assert router.credit(ram, prompt) > router.credit(1 - ram, prompt)
    assert router.choose(prompt, [2, 2]) == ram
    # a longer run on disk outweighs a shorter one in the pool
    assert router.choose(prompt + _chain("tail", 4), [2, 2]) == 1 - ram


def test_a_shared_tier_credits_every_replica_with_its_own_weight() -> None:
    from prefixcache.sim.replica_costs import ReplicaCosts
    from prefixcache.sim.router import CacheAware

    prompt = _chain("doc")
    router = CacheAware(3)
    _held(router, 0, prompt, "VALKEY")  # replica 0 wrote it; any replica loads it
    assert [router.credit(i, prompt) for i in range(3)] == [5.0, 5.0, 5.0]
    assert router.choose(prompt, [4, 1, 2]) == _owner(prompt, 3)  # equal credit: its owner
    other = _chain("other")
    _held(router, 1, other, "VALKEY")
    router.set_costs(2, ReplicaCosts(1e-3, {"VALKEY": 1e-4}))  # replica 2 loads it faster
    assert [router.credit(i, other) for i in range(3)] == [5.0, 5.0, pytest.approx(9.0)]
    assert router.choose(other, [4, 1, 2]) == 2
    router.observe(0, [_removed(prompt[5:], "VALKEY")])  # Valkey dropped the tail
    others = [i for i in range(3) if i != _owner(prompt, 3)]  # the owner expects all ten
    assert [router._matched(i, prompt) for i in others] == [5, 5]
    assert router.held_blocks(0) == {"POOL": 0, "VALKEY": 15}


def _owner(digests: list[bytes], replicas: int = 2) -> int:
    """The replica a prompt's first blocks hash to (cache-aware's choice on a tie)."""
    from prefixcache.sim.router import CacheAware, affinity_point

    router = CacheAware(replicas)
    return router._ring.owner(affinity_point(digests, router.k, None))  # type: ignore[arg-type]


def _removed(digests: list[bytes], medium: str | None):
    from prefixcache.cache import BlockRemoved

    return BlockRemoved(digests, medium=medium)


def test_a_pool_eviction_keeps_the_tier_entry_and_a_tier_eviction_keeps_the_pool() -> None:
    from prefixcache.cache import AllBlocksCleared
    from prefixcache.sim.router import CacheAware

    prompt = _chain("doc")
    router = CacheAware(2)
    _held(router, 1, prompt, None)
    _held(router, 1, prompt, "DISK")
    router.observe(1, [_removed(prompt, None)])  # evicted from the pool, still on disk
    assert router.held_blocks(1) == {"POOL": 0, "DISK": 10}
    assert router.credit(1, prompt) == 5.0
    _held(router, 1, prompt[:4], None)  # the first four are loaded back into the pool
    router.observe(1, [_removed(prompt, "DISK")])  # then the disk evicts all ten
    assert router.held_blocks(1) == {"POOL": 4, "DISK": 0}
    assert router.credit(1, prompt) == 4.0
    _held(router, 1, prompt, "DISK")
    router.observe(1, [AllBlocksCleared()])  # a reset clears the pool, not the tiers
    assert router.held_blocks(1) == {"POOL": 0, "DISK": 10}
    assert router.choose(prompt, [0, 0]) == 1
    router.forget(1)  # a replaced replica: nothing is known of it
    assert router.held_blocks(1) == {"POOL": 0}
    assert router.credit(1, prompt) == 0.0


def test_the_backlog_ahead_of_a_request_outweighs_its_cached_prefix() -> None:
    from prefixcache.sim.replica_costs import ReplicaCosts
    from prefixcache.sim.router import CacheAware

    prompt = _chain("doc")
    router = CacheAware(2)
    _held(router, 0, prompt, None)
    router.set_costs(0, ReplicaCosts(1e-3, backlog_s=5e-3))  # 5 blocks of prefill queued there
    router.set_costs(1, ReplicaCosts(1e-3))
    assert router.choose(prompt, [1, 1]) == 0  # 5 ms of queue beats 10 ms of prefill
    router.set_costs(0, ReplicaCosts(1e-3, backlog_s=20e-3))
    assert router.choose(prompt, [1, 1]) == 1  # 20 ms of queue does not


def test_replica_costs_round_trip_and_a_bad_report_is_ignored() -> None:
    import json

    from prefixcache.sim.replica_costs import DEFAULT_TIER_WEIGHT, ReplicaCosts

    costs = ReplicaCosts(2e-3, {"DISK": 5e-4, "VALKEY": 3e-3}, 0.25)
    again = ReplicaCosts.from_dict(json.loads(json.dumps(costs.as_dict())))
    assert again == costs
    assert [again.weight(m) for m in (None, "DISK", "VALKEY", "S3")] == [
        1.0, 0.75, 0.0, DEFAULT_TIER_WEIGHT]
    bad = ReplicaCosts.from_dict({"prefill_s_per_block": "fast", "backlog_s": -1.0,
                                  "load_s_per_block": {"DISK": float("nan"), "VALKEY": 1e-4}})
    assert bad == ReplicaCosts(None, {"VALKEY": 1e-4}, 0.0)
    assert bad.weight("VALKEY") == DEFAULT_TIER_WEIGHT  # no prefill speed to weigh it against
