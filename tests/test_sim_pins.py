"""Cache breakpoints in the simulator: traces carry tenants and pins, both replay modes honour
them on trace time (a pinned prefix survives what evicts it unpinned, then expires), the report
splits hits by tenant, and the routers take an affinity key (``prompt_cache_key``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.sim.config import RunSpec
from prefixcache.sim.errors import TraceFormatError
from prefixcache.sim.mooncake import read_mooncake
from prefixcache.sim.record import TraceRecorder, read_record, tenant_label
from prefixcache.sim.router import CacheAware, PrefixAffinity
from prefixcache.sim.sequential import replay_sequential
from prefixcache.sim.synthetic import generate
from prefixcache.sim.timed import replay_timed


def _pinned_prompt(**params: object) -> object:
    text = ",".join(f"{k}={v}" for k, v in params.items())
    return generate("pinned-prompt", text)


def test_a_pinned_system_prompt_keeps_hitting_where_unpinned_it_is_evicted() -> None:
    trace = _pinned_prompt(num_questions=12)
    on, off = replay_sequential(trace, [RunSpec("hash", "lru", 700),
                                        RunSpec("hash", "lru", 700, pins=False)])
    system_share = 2048 / (2048 + 64)
    # every question after the first reads the whole system prompt from the cache
    assert on.tenant_hit_ratios["app"] > 0.9 * system_share * (11 / 12) * _question_share(trace)
    assert off.tenant_hit_ratios["app"] < 0.01  # its own one-off prompts evicted it each time
    assert on.tenant_hit_ratios["flood"] == off.tenant_hit_ratios["flood"]  # nobody else pays
    assert on.num_pins == 1 and off.num_pins == 0  # one pin, refreshed by each question
    assert on.capacity_label == "700" and off.capacity_label == "700-nopin"


def _question_share(trace: object) -> float:
    """The share of the app tenant's prompt tokens that its questions carry."""
    app = [r for r in trace.requests if r.tenant == "app"]  # type: ignore[attr-defined]
    questions = [r for r in app if r.pins]
    return sum(r.input_length for r in questions) / sum(r.input_length for r in app)


@pytest.mark.parametrize("mode", ["sequential", "timed"])
def test_a_pin_is_released_exactly_at_its_ttl_on_trace_time(mode: str) -> None:
    """Questions 400 s apart with a 300 s pin: the pin is gone 100 s before each next
    question, and the tenant's own traffic evicts the prompt meanwhile; with a 500 s pin every
    later question hits."""
    def hit_tokens(ttl_s: float) -> float:
        trace = _pinned_prompt(num_questions=6, interval_s=400.0, ttl_s=ttl_s, own_rate=1.0,
                               flood_rate=0.0)
        spec = RunSpec("hash", "lru", 700)
        result = (replay_sequential(trace, [spec])[0] if mode == "sequential"
                  else replay_timed(trace, spec))
        app_tokens = sum(r.input_length for r in trace.requests if r.tenant == "app")
        return result.tenant_hit_ratios["app"] * app_tokens

    assert hit_tokens(300.0) < 2048  # not one system prompt read from the cache
    assert hit_tokens(500.0) == pytest.approx(5 * 2048, rel=1e-3)  # each later question's


def test_timed_mode_honours_pins_too() -> None:
    trace = _pinned_prompt(num_questions=8)
    on = replay_timed(trace, RunSpec("hash", "lru", 700))
    off = replay_timed(trace, RunSpec("hash", "lru", 700, pins=False))
    assert on.tenant_hit_ratios["app"] > off.tenant_hit_ratios["app"] + 0.05


def test_pins_count_against_the_tenants_own_budget() -> None:
    """A budget smaller than the system prompt pins only its first blocks."""
    trace = _pinned_prompt(num_questions=12)
    full, small, none = replay_sequential(trace, [
        RunSpec("hash", "lru", 700), RunSpec("hash", "lru", 700, max_pinned_blocks=64),
        RunSpec("hash", "lru", 700, max_pinned_blocks=0)])
    assert full.tenant_hit_ratios["app"] > small.tenant_hit_ratios["app"] > 0.0
    assert none.tenant_hit_ratios["app"] < 0.01


def test_mooncake_lines_carry_tenants_and_pins(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [{"timestamp": 0, "input_length": 64, "output_length": 1, "hash_ids": [1, 2, 3, 4],
              "tenant": "a", "pins": [{"tokens": 48, "ttl": "1h"}, {"tokens": 32}]},
             {"timestamp": 5, "input_length": 64, "output_length": 1, "hash_ids": [1, 2, 3, 5]}]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    trace = read_mooncake(path, block_size=16)
    assert trace.requests[0].tenant == "a"
    assert trace.requests[0].pins == [(48, 3600.0), (32, 300.0)]
    assert trace.requests[1].tenant == "" and trace.requests[1].pins == []


@pytest.mark.parametrize("pins", [
    [{"tokens": 0}], [{"tokens": 16, "ttl": "2h"}], [{"tokens": 16, "ttl": 90000}], "x",
    [{"tokens": 16}] * 5, [[16]], [{"tokens": True}],
])
def test_a_bad_pin_names_the_line(tmp_path: Path, pins: object) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 64, "output_length": 1,
                                "hash_ids": [1], "pins": pins}) + "\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:1"):
        read_mooncake(path, block_size=16)


def test_a_recorded_trace_keeps_pins_and_a_one_way_tenant_label(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    with TraceRecorder(path, 16) as recorder:
        recorder.record(48, 2, [b"\1" * 32, b"\2" * 32], pins=[(32, 300.0)],
                        tenant=tenant_label("tenant:acme"), arrival_s=0.0)
        recorder.record(48, 2, [b"\3" * 32], arrival_s=1.0)
    text = path.read_text()
    assert "acme" not in text
    trace = read_record(path)
    assert trace.requests[0].pins == [(32, 300.0)]
    assert trace.requests[0].tenant == tenant_label("tenant:acme") != ""
    assert trace.requests[1].tenant == "" and trace.requests[1].pins == []


def test_simulate_compares_pins_on_and_off_and_splits_hits_by_tenant() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "prefixcache", "simulate", "synthetic:pinned-prompt:num_questions=8",
         "--capacity", "700", "--prefix-cache", "hash", "--pins", "on,off", "--no-progress"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "700-nopin" in out.stdout and "hit ratio by tenant:" in out.stdout
    rows = out.stdout.split("hit ratio by tenant:")[1].splitlines()[2:]
    app = {row.split()[1]: float(row.split()[3]) for row in rows if row.strip()}
    assert app["700"] > 0.1 and app["700-nopin"] < 0.01
    bad = subprocess.run([sys.executable, "-m", "prefixcache", "simulate",
                          "synthetic:pinned-prompt", "--pins", "maybe"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--pins" in bad.stderr and "Traceback" not in bad.stderr


def _chain(name: str, n: int = 4) -> list[bytes]:
    return [f"{name}-{i}".encode().ljust(32, b"\0") for i in range(n)]


def _everywhere(prefix: list[bytes]) -> CacheAware:
    """A cache-aware router whose four replicas all hold ``prefix`` (a common system prompt)."""
    from prefixcache.cache import BlockStored

    router = CacheAware(4)
    for replica in range(4):
        router.observe(replica, [BlockStored(prefix, b"\0" * 32, [], 16)])
    return router


@pytest.mark.parametrize("rule", ["prefix-affinity", "cache-aware"])
def test_an_affinity_key_gathers_its_requests_and_spreads_one_prefix(rule: str) -> None:
    prefix = _chain("system")
    router = PrefixAffinity(4) if rule == "prefix-affinity" else _everywhere(prefix)
    keys = [f"key-{i}".encode() for i in range(32)]
    chosen = {key: router.choose(prefix, [0] * 4, key) for key in keys}  # type: ignore[attr-defined]
    # one key, one prefix: one replica, whatever the rest of the prompt says
    for key in keys[:4]:
        again = router.choose(prefix + _chain(f"tail-{key!r}", 2), [0] * 4, key)  # type: ignore[attr-defined]
        assert again == chosen[key]
    assert len(set(chosen.values())) > 1  # different keys spread one shared prefix


def test_without_a_key_prefix_affinity_routes_as_before() -> None:
    router = PrefixAffinity(4)
    prefix = _chain("system")
    assert router.choose(prefix, [0] * 4) == router.choose(prefix + _chain("x", 3), [0] * 4)
    assert router.choose(prefix, [0] * 4, None) == router.choose(prefix, [0] * 4)


def test_cache_aware_still_follows_the_cache_and_the_load_guard_before_a_key() -> None:
    from prefixcache.cache import BlockStored

    router = CacheAware(2)
    prefix = _chain("doc")
    router.observe(1, [BlockStored(prefix, b"\0" * 32, [], 16)])
    assert all(router.choose(prefix, [0, 0], f"k{i}".encode()) == 1 for i in range(8))
    assert router.choose(prefix, [0, 40], b"k0") == 0  # out of balance: the least loaded
