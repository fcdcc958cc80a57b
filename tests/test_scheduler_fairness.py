"""Fair sharing across isolation domains: one tenant's huge request cannot starve another's,
hard per-domain caps refuse what could never fit, and outputs stay those of the cache off.

Runs the real engine on the tiny model with small KV pools, so that one domain's request
exhausts the pool and the other domain has to be let in by the fairness rules.
"""

from __future__ import annotations

import pytest

from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.request import Request
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.sched.fairness import DomainLimits, blocks_needed, fair_order

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(**kw: object) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    return LLMEngine("tiny", check_integrity=True, **kw)  # type: ignore[arg-type]


def _run_until(engine: LLMEngine, done, max_steps: int = 2000) -> int:  # noqa: ANN001
    for step in range(max_steps):
        if done():
            return step
        engine.step()
    raise AssertionError("did not finish")


def _hog_and_small(domains: tuple[str, str]) -> tuple[LLMEngine, Request, Request, int]:
    """Domain 0 sends n=8 long generations that overfill a 64-block pool; once it runs,
    domain 1 sends one short request. Returns the steps domain 1's request took."""
    engine = _engine(max_num_seqs=16)
    hog = engine.add_request("hog", list(range(40, 72)), SamplingParams(
        n=8, max_tokens=300, **GREEDY), domain=domains[0])
    _run_until(engine, lambda: engine.cache.num_free_blocks < 4, max_steps=400)
    assert not hog.all_finished  # the hog now holds nearly the whole pool
    small = engine.add_request("small", list(range(100, 116)), SamplingParams(
        max_tokens=4, **GREEDY), domain=domains[1])
    steps = _run_until(engine, lambda: small.is_finished)
    return engine, hog, small, steps


def test_a_second_tenant_finishes_while_the_first_tenants_n8_request_runs():
    engine, hog, small, steps = _hog_and_small(("tenant:a", "tenant:b"))
    assert small.finish_reason == "length" and len(small.output_token_ids) == 4
    assert not hog.all_finished  # the hog is still running when the small one is done
    assert steps <= 8  # admitted at once: the hog, over its half of the pool, gave way
    assert engine.scheduler.num_fairness_preemptions > 0
    _run_until(engine, lambda: hog.all_finished, max_steps=20000)
    assert all(len(c.output_token_ids) == 300 for c in hog.choices)
    assert engine.cache.num_free_blocks == engine.cache.num_blocks


def test_without_domains_the_same_load_makes_the_small_request_wait():
    """The contrast: one domain for both (single-tenant scheduling, unchanged) keeps FCFS
    order, so the short request waits until the n=8 request happens to preempt its own."""
    engine, hog, small, steps = _hog_and_small(("", ""))
    assert steps >= 16
    assert engine.scheduler.num_fairness_preemptions == 0


def test_fair_order_interleaves_domains_least_served_first():
    engine = _engine()
    params = SamplingParams(max_tokens=1)
    reqs = [engine.add_request(f"a{i}", [1, 2, 3], params, domain="a") for i in range(3)]
    reqs += [engine.add_request(f"b{i}", [1, 2, 4], params, domain="b") for i in range(2)]
    order = fair_order(reqs, {})
    assert [r.request_id for r in order] == ["a0", "b0", "a1", "b1", "a2"]

    order = fair_order(reqs, {"a": 5})  # a holds more: b goes first
    assert [r.request_id for r in order] == ["b0", "a0", "b1", "a1", "a2"]
    assert fair_order(reqs[:3], {}) == reqs[:3]  # one domain: policy order untouched


def test_a_flood_of_one_domain_does_not_delay_another_domains_admission():
    engine = _engine(max_num_seqs=2, num_kv_blocks=128)
    params = SamplingParams(max_tokens=20, **GREEDY)
    flood = [engine.add_request(f"f{i}", [5, 6, 7, i], params, domain="flood")
             for i in range(10)]
    engine.step()
    other = engine.add_request("other", [9, 9, 9], params, domain="calm")
    _run_until(engine, lambda: other.is_finished)
    finished_first = sum(r.is_finished for r in flood)
    assert finished_first <= 2  # only what was already running when it arrived


def test_hard_caps_refuse_what_could_never_fit():
    limits = {"tenant:small": DomainLimits(max_seqs=4, max_blocks=20)}
    engine = _engine(domain_limits=limits)
    with pytest.raises(ValueError, match=r"^n \(8\) exceeds this caller's limit of 4"):
        engine.add_request("x", [1, 2, 3], SamplingParams(n=8), domain="tenant:small")
    with pytest.raises(ValueError, match="over this caller's limit of 20"):
        engine.add_request("y", list(range(64)), SamplingParams(n=2, max_tokens=200),
                           domain="tenant:small")
    assert blocks_needed(64, 200, 2, 16) == 4 + 2 * (13 + 1)
    engine.add_request("z", [1, 2, 3], SamplingParams(n=4, max_tokens=4), domain="tenant:small")
    engine.add_request("w", [1, 2, 3], SamplingParams(n=8, max_tokens=4), domain="tenant:big")
    assert not engine.scheduler.has_unfinished() or engine.step() is not None
    with pytest.raises(ValueError):
        DomainLimits(max_seqs=0)


def test_domain_caps_bound_running_sequences():
    engine = _engine(max_num_seqs=16, default_domain_limits=DomainLimits(max_seqs=3))
    params = SamplingParams(max_tokens=8, **GREEDY)
    reqs = [engine.add_request(f"r{i}", [3, 1, i], params, domain="d") for i in range(6)]
    peak = 0
    while not all(r.is_finished for r in reqs):
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 3


def test_fair_scheduling_keeps_outputs_equal_to_the_cache_off():
    def run(enable: bool) -> dict[str, list[list[int]]]:
        engine = _engine(num_kv_blocks=40, max_num_seqs=8, enable_prefix_caching=enable)
        shared = list(range(10, 58))
        reqs = []
        for i in range(6):
            domain = "tenant:a" if i % 3 else "tenant:b"
            params = SamplingParams(n=2 if i % 2 else 1, max_tokens=40, **GREEDY)
            reqs.append(engine.add_request(f"r{i}", shared + [i], params, domain=domain))
        _run_until(engine, lambda: all(r.all_finished for r in reqs), max_steps=20000)
        return {r.request_id: [c.output_token_ids for c in r.choices] for r in reqs}

    assert run(True) == run(False)
