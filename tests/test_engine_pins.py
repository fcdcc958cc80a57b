"""Pinned prefixes (`cache/pins.py`): a pinned prompt survives another tenant's eviction flood,
expires exactly at its TTL on a controlled clock, refreshes on a hit, stays inside its domain's
budget, and a reset says what it did with the pins."""

from __future__ import annotations

import random
from typing import Any

import pytest

from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(engine: LLMEngine, rid: str, prompt: list[int], domain: str,
        pins: list[tuple[int, float]] | None = None) -> int:
    engine.add_request(rid, prompt_token_ids=prompt, cache_salt=domain, domain=domain,
                       sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
                       pins=pins or [])
    cached = -1
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                cached = out.num_cached_tokens
    return cached


def flood(engine: LLMEngine, rng: random.Random, domain: str, n: int = 12) -> None:
    for _ in range(n):
        run(engine, f"flood-{rng.random()}", [rng.randrange(3, 250) for _ in range(161)],
            domain)


@pytest.fixture
def engine() -> Any:
    engine = LLMEngine("tiny", block_size=BS, num_kv_blocks=40, check_integrity=True,
                       max_pinned_blocks=12)
    engine.pins.clock = Clock()
    return engine


def test_a_pinned_prefix_survives_a_flood_and_expires_at_its_ttl(engine: LLMEngine) -> None:
    rng = random.Random(3)
    pinned = [rng.randrange(3, 250) for _ in range(161)]
    unpinned = [rng.randrange(3, 250) for _ in range(161)]
    run(engine, "p", pinned, "tenant:a", pins=[(160, 300.0)])
    run(engine, "u", unpinned, "tenant:a")
    assert [p.num_blocks for p in engine.pins.of_domain("tenant:a")] == [10]
    flood(engine, rng, "tenant:b")  # another tenant's churn (fair shares guard a's cache too)
    flood(engine, rng, "tenant:a")  # and a's own, which may evict a's unpinned blocks
    assert run(engine, "p2", pinned, "tenant:a") == 160  # still every pinned block
    assert run(engine, "u2", unpinned, "tenant:a") == 0  # evicted by the flood
    engine.pins.clock.now += 299.0  # type: ignore[attr-defined]
    engine.step()
    assert engine.pins.of_domain("tenant:a")  # the hit at p2 refreshed it: 300 s from then
    engine.pins.clock.now += 2.0  # type: ignore[attr-defined]
    engine.step()
    assert not engine.pins.pins and engine.pins.num_expired == 1
    flood(engine, rng, "tenant:a")
    assert run(engine, "p3", pinned, "tenant:a") == 0  # evictable again after the TTL


def test_the_pin_budget_releases_the_domains_oldest_pin_never_anothers(engine) -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 250) for _ in range(97)] for _ in range(3)]  # 6 blocks each
    run(engine, "b0", prompts[0], "tenant:b", pins=[(96, 60.0)])
    run(engine, "a0", prompts[1], "tenant:a", pins=[(96, 60.0)])
    run(engine, "a1", prompts[2], "tenant:a", pins=[(96, 60.0)])
    assert engine.pins.blocks_pinned("tenant:a") == 12 and engine.pins.blocks_pinned(
        "tenant:b") == 6
    run(engine, "a2", [t ^ 1 for t in prompts[1]], "tenant:a", pins=[(96, 60.0)])
    assert engine.pins.blocks_pinned("tenant:a") == 12  # a0's pin went, b0's stayed
    assert engine.pins.blocks_pinned("tenant:b") == 6 and engine.pins.num_evicted_for_budget == 1


def test_a_reset_releases_the_pins_and_says_so(engine: LLMEngine) -> None:
    run(engine, "p", list(range(3, 164)), "tenant:a", pins=[(160, 300.0)])
    assert engine.reset_prefix_cache() and engine.num_pins_released_by_reset == 1
    assert not engine.pins.pins and engine.cache.num_cached_blocks == 0


def test_a_domains_own_budget_replaces_the_default() -> None:
    engine = LLMEngine("tiny", block_size=BS, num_kv_blocks=40, max_pinned_blocks=12,
                       pin_budgets={"tenant:small": 3, "tenant:none": 0})
    prompt = list(range(3, 164))  # 10 blocks
    run(engine, "a", prompt, "tenant:small", pins=[(160, 60.0)])
    run(engine, "b", prompt, "tenant:none", pins=[(160, 60.0)])
    run(engine, "c", prompt, "tenant:other", pins=[(160, 60.0)])
    assert engine.pins.blocks_pinned("tenant:small") == 3
    assert engine.pins.blocks_pinned("tenant:none") == 0
    assert engine.pins.blocks_pinned("tenant:other") == 10


def test_the_tenants_file_sets_each_tenants_pin_budget(tmp_path) -> None:
    from prefixcache.server.tenancy import TenancyError, load_tenants

    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a]\napi_keys = ['long-enough-key']\nmax_pinned_blocks = 7\n")
    (tenant,) = set(load_tenants(path).values())
    assert tenant.max_pinned_blocks == 7
    path.write_text("[tenants.a]\napi_keys = ['long-enough-key']\nmax_pinned_blocks = -1\n")
    with pytest.raises(TenancyError, match="max_pinned_blocks"):
        load_tenants(path)


def test_another_tenants_burst_runs_beside_a_pin_and_the_pin_survives_preemption(
        engine: LLMEngine) -> None:
    """Tenant a pins 10 of the 40 blocks; tenant b then sends more at once than the other 30
    hold (preemption follows). Every request of b finishes with its full output, and a's
    pinned prefix is still all there afterwards."""
    rng = random.Random(5)
    pinned = [rng.randrange(3, 250) for _ in range(161)]
    run(engine, "p", pinned, "tenant:a", pins=[(160, 300.0)])
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    for i in range(5):  # 5 x (96 prompt + 24 output) tokens: 40 blocks wanted, 30 free
        engine.add_request(f"b{i}", prompt_token_ids=[rng.randrange(3, 250) for _ in range(96)],
                           cache_salt="tenant:b", domain="tenant:b", sampling_params=params)
    done: dict[str, Any] = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == [f"b{i}" for i in range(5)]
    assert all(o.num_output_tokens == 24 and o.finish_reason == "length" and o.error is None
               for o in done.values())
    assert engine.scheduler.num_preemptions > 0  # the burst did not fit beside the pin
    assert run(engine, "p2", pinned, "tenant:a") == 160


def test_a_request_that_cannot_start_beside_the_pins_takes_the_oldest_pin_first(
        engine: LLMEngine) -> None:
    """Tenants a and c pin 10 blocks each of the 40; b's 400-token prompt needs 26 with
    nothing running to free any: the oldest pin (a's) yields, c's stays, b is answered."""
    rng = random.Random(9)
    for domain in ("tenant:a", "tenant:c"):
        run(engine, domain, [rng.randrange(3, 250) for _ in range(161)], domain,
            pins=[(160, 300.0)])
    assert engine.pins.blocks_pinned("tenant:a") == engine.pins.blocks_pinned("tenant:c") == 10
    assert run(engine, "big", [rng.randrange(3, 250) for _ in range(400)], "tenant:b") == 0
    assert engine.pins.num_yielded == 1
    assert not engine.pins.of_domain("tenant:a") and engine.pins.blocks_pinned("tenant:c") == 10


def test_a_request_larger_than_its_share_runs_when_quiet_tenants_fill_the_cache() -> None:
    """No pins: tenants a and c leave 22 cached blocks of 40, which fair shares protect from
    b; b's 400-token prompt needs 26 and nothing is running. It used to wait for ever; the
    idle engine lifts the protection for it (and only then: a's prefix is evicted, not kept)."""
    engine = LLMEngine("tiny", block_size=BS, num_kv_blocks=40, check_integrity=True)
    rng = random.Random(11)
    kept = {}
    for domain in ("tenant:a", "tenant:c"):
        kept[domain] = [rng.randrange(3, 250) for _ in range(161)]
        run(engine, domain, kept[domain], domain)
    assert run(engine, "big", [rng.randrange(3, 250) for _ in range(400)], "tenant:b") == 0
    assert engine.scheduler.protection.active  # lifted for that step only
    hits = [run(engine, f"{d}-again", kept[d], d) for d in kept]
    assert min(hits) < 160  # what b needed came out of the quiet tenants' cache


def test_a_pin_over_a_public_prefix_keeps_the_split(engine: LLMEngine) -> None:
    """a pins declared + its own tail: the pin holds every block, the declared ones in the
    public domain (b, another tenant permitted the prefix, still hits them after a flood) and
    a's tail in a's; b's continuation is b's own."""
    rng = random.Random(5)
    declared = [rng.randrange(3, 250) for _ in range(100)]  # 6 whole blocks + 4 tokens
    mine = declared + [rng.randrange(3, 250) for _ in range(61)]

    def send(rid: str, prompt: list[int], domain: str, pins: list[tuple[int, float]]) -> int:
        engine.add_request(rid, prompt_token_ids=prompt, cache_salt=domain, domain=domain,
                           sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
                           pins=pins, public_blocks=6)
        cached = -1
        while engine.has_unfinished():
            cached = next((o.num_cached_tokens for o in engine.step() if o.finished), cached)
        return cached

    send("p", mine, "tenant:a", [(160, 300.0)])
    (pin,) = engine.pins.of_domain("tenant:a")
    held = [engine.cache.pool.blocks[i].domain for i in engine.cache.block_table(pin.seq)]
    assert held == ["public"] * 6 + ["tenant:a"] * 4
    flood(engine, rng, "tenant:b")
    flood(engine, rng, "tenant:a")
    theirs = declared + [t ^ 1 for t in mine[100:]]
    assert send("b", theirs, "tenant:b", []) == 96  # the public blocks, pinned by a
    assert send("a", mine, "tenant:a", []) == 160  # a's own pinned tail too
