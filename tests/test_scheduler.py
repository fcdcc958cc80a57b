"""Scheduler on the real prefix caches, driven with synthetic sampled tokens (no model: these
tests check who is scheduled with which blocks, not what the model computes)."""

from __future__ import annotations

import pytest

from prefixcache.cache import Sequence, make_prefix_cache
from prefixcache.engine.request import Request
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.sched import Scheduler, SchedulerOutput
from prefixcache.sched.request import RequestStatus

SAMPLED_TOKEN = 7


def _request(rid: str, token_ids: list[int], max_tokens: int = 4, n: int = 1) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)
    return Request(rid, Sequence(rid, token_ids), params, None, arrival_index=int(rid[1:]))


def _scheduler(kind="hash", num_blocks=64, block_size=4, **kwargs) -> Scheduler:
    cache = make_prefix_cache(kind, num_blocks=num_blocks, block_size=block_size)
    return Scheduler(cache, **kwargs)


def _step(sched: Scheduler) -> SchedulerOutput:
    """One step: schedule, 'compute', sample SAMPLED_TOKEN, finish at max_tokens."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(out.chunks) <= sched.max_num_seqs
    for request, _row in sched.update_from_step(out):
        request.append_output(SAMPLED_TOKEN)
        if len(request.output_token_ids) >= request.params.max_tokens:
            sched.finish(request, RequestStatus.FINISHED_LENGTH)
    sched.cache.check_integrity()
    return out


def _drain(sched: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(_step(sched))
        assert len(outs) < max_steps
    assert sched.cache.num_free_blocks == sched.cache.num_blocks
    return outs


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_chunked_prefill_then_decode(kind):
    sched = _scheduler(kind, max_num_batched_tokens=16)
    sched.add(_request("r0", list(range(100, 150)), max_tokens=3))
    outs = _drain(sched)
    assert [[c.num_new_tokens for c in o.chunks] for o in outs] == [[16], [16], [16], [2], [1], [1]]
    assert [o.chunks[0].samples for o in outs] == [False, False, False, True, True, True]


def test_running_first_then_waiting_within_budget():
    sched = _scheduler(max_num_batched_tokens=10, max_num_seqs=2)
    sched.add(_request("r0", list(range(100, 108))))
    _step(sched)
    sched.add(_request("r1", list(range(200, 230))))
    sched.add(_request("r2", list(range(300, 310))))
    out = _step(sched)
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("r0", 1), ("r1", 9)]
    assert sched.waiting[0].request_id == "r2"  # max_num_seqs = 2


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_preempts_most_recent_and_resumes_with_a_hit(kind):
    # 3 requests of 8 prompt tokens + 8 outputs need 4 blocks each; the pool has 10
    sched = _scheduler(kind, num_blocks=10, block_size=4)
    for i in range(3):
        sched.add(_request(f"r{i}", [10 * i + t for t in range(1, 9)], max_tokens=8))
    _step(sched)
    assert [r.request_id for r in sched.running] == ["r0", "r1", "r2"]
    preempted = []
    while not preempted:
        preempted = _step(sched).preempted
    assert [r.request_id for r in preempted] == ["r2"]
    victim = preempted[0]
    assert victim.status is RequestStatus.PREEMPTED and sched.waiting[0] is victim
    generated = list(victim.output_token_ids)
    assert victim.seq.token_ids[8:] == generated  # resumes with its generated tokens
    while victim.status is not RequestStatus.RUNNING:
        out = _step(sched)
    (chunk,) = [c for c in out.chunks if c.request is victim]
    assert chunk.num_computed_tokens > 0  # its committed blocks were still cached
    assert chunk.num_computed_tokens + chunk.num_new_tokens == 8 + len(generated)
    _drain(sched)
    assert sched.num_preemptions >= 1


def test_in_batch_dedup_defers_the_duplicate_one_step():
    prefix = list(range(50, 82))  # 8 blocks of 4
    sched = _scheduler(max_num_batched_tokens=256)
    sched.add(_request("r0", prefix + [1, 2]))
    sched.add(_request("r1", prefix + [3, 4]))
    first = _step(sched)
    assert [c.request.request_id for c in first.chunks] == ["r0"] and first.num_deferred == 1
    second = _step(sched)
    (chunk,) = [c for c in second.chunks if c.request.request_id == "r1"]
    assert chunk.num_computed_tokens == 32
    _drain(sched)

    plain = _scheduler(max_num_batched_tokens=256, dedup=False)
    plain.add(_request("r0", prefix + [1, 2]))
    plain.add(_request("r1", prefix + [3, 4]))
    out = _step(plain)
    assert [c.num_computed_tokens for c in out.chunks] == [0, 0]
    assert plain.cache.stats.num_duplicate_blocks == 8


def test_dedup_never_idles_a_step():
    prefix = list(range(50, 82))
    sched = _scheduler(max_num_batched_tokens=256)
    sched.add(_request("r0", prefix + [1]))
    sched.add(_request("r1", prefix + [2]))
    while sched.has_unfinished():
        assert not _step(sched).is_empty


def test_n_gt_1_forks_after_prefill_and_copies_the_shared_block():
    sched = _scheduler(num_blocks=32, block_size=4)
    sched.add(_request("r0", list(range(1, 11)), max_tokens=3, n=3))  # 10 tokens: partial block
    out = sched.schedule()
    targets = sched.update_from_step(out)
    assert [(r.index, row) for r, row in targets] == [(0, 0), (1, 0), (2, 0)]
    for request, _ in targets:
        request.append_output(SAMPLED_TOKEN + request.index)
    sched.cache.check_integrity()
    out = _step(sched)
    assert len(out.chunks) == 3 and len(out.block_copies) >= 2  # partial block copied on write
    tables = [c.block_table for c in out.chunks]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # full prompt blocks stay shared
    assert len({t[2] for t in tables}) == 3
    _drain(sched)


def test_lpm_prefers_the_longest_cached_prefix():
    hot = list(range(100, 140))
    sched = _scheduler(schedule_policy="lpm", max_num_seqs=1)
    sched.add(_request("r0", hot + [1], max_tokens=1))
    _drain(sched)
    sched.add(_request("r1", list(range(200, 241)), max_tokens=1))
    sched.add(_request("r2", hot + [2], max_tokens=1))
    out = _step(sched)
    assert [c.request.request_id for c in out.chunks] == ["r2"]
    assert sched.cache.stats.num_requests == 2  # lpm's ordering lookups are not counted


def _cold_wait(lpm_max_wait_steps: int) -> int:
    """Steps a cold request waits while a request sharing a 20-block prefix arrives each step."""
    hot = list(range(100, 180))
    sched = _scheduler(
        num_blocks=256, schedule_policy="lpm", max_num_seqs=1, lpm_max_wait_steps=lpm_max_wait_steps
    )
    sched.add(_request("r0", hot + [0], max_tokens=1))
    _drain(sched)
    cold = _request("r1", list(range(300, 340)), max_tokens=1)
    sched.add(cold)
    for steps_waited in range(60):
        sched.add(_request(f"r{steps_waited + 2}", hot + [steps_waited + 2], max_tokens=1))
        _step(sched)
        if cold.status is not RequestStatus.WAITING:
            return steps_waited
    raise AssertionError("the cold request starved")


def test_lpm_starvation_bound():
    """Documented bound: promoted after lpm_max_wait_steps steps, then served before later
    arrivals; here one request is served per step, so the cold one waits at most the bound."""
    assert _cold_wait(lpm_max_wait_steps=5) <= 5
    assert _cold_wait(lpm_max_wait_steps=1000) > 10  # aging alone lets 20 hot blocks cut in


def test_finish_of_a_waiting_request_frees_nothing_and_dequeues():
    sched = _scheduler()
    request = _request("r0", list(range(10)))
    sched.add(request)
    sched.finish(request, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished() and request.finish_reason == "abort"
    sched.cache.check_integrity()


def test_rejects_bad_configuration():
    cache = make_prefix_cache("hash", num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="policy"):
        Scheduler(cache, schedule_policy="sjf")
    with pytest.raises(TypeError, match="policy"):
        Scheduler(cache, policy="lpm")  # one name: schedule_policy (the eviction policy is not it)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(cache, max_num_seqs=0)
