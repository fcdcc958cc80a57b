"""The simulator's lower tiers: a disk under each replica, one Valkey shared by all of them, read
times in the time to first token, and what the flags refuse."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from prefixcache.sim.config import RunSpec
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.mooncake import read_mooncake
from prefixcache.sim.sequential import replay_sequential
from prefixcache.sim.timed import replay_timed
from prefixcache.sim.trace import Trace, TraceRequest

FIXTURES = Path(__file__).parent / "fixtures"
COST = CostModel(kv_bytes_per_token=1024.0)  # 512 KiB per 512-token block


@pytest.fixture(scope="module")
def conversation() -> Trace:
    return read_mooncake(FIXTURES / "mooncake_conversation_300.jsonl")


def test_a_disk_under_a_small_pool_recovers_the_unbounded_hit_ratio(conversation: Trace) -> None:
    unbounded, small, tiered = replay_sequential(conversation, [
        RunSpec("hash", "lru", None), RunSpec("hash", "lru", 775),  # 10% of the working set
        RunSpec("hash", "lru", 775, tier_gib=(("disk", 64.0),))], COST)
    assert small.hit_ratio < unbounded.hit_ratio - 0.03
    assert abs(tiered.hit_ratio - unbounded.hit_ratio) <= 0.02
    split = tiered.tier_hit_ratios
    assert set(split) == {"ram", "disk"} and split["disk"] > 0
    assert abs(split["ram"] + split["disk"] - tiered.hit_ratio) < 1e-9
    assert unbounded.tier_hit_ratios == {}


def test_a_small_disk_keeps_only_its_capacity(conversation: Trace) -> None:
    big, tiny = replay_sequential(conversation, [
        RunSpec("hash", "lru", 775, tier_gib=(("disk", 64.0),)),
        RunSpec("hash", "lru", 775, tier_gib=(("disk", 800 * 512 * 1024 / (1 << 30)),))], COST)
    assert tiny.tier_hit_ratios.get("disk", 0.0) < big.tier_hit_ratios["disk"]


def test_tier_reads_cost_time_to_first_token() -> None:
    block = 16
    trace = Trace("two", block)
    ids = list(range(8))
    trace.requests = [TraceRequest(f"r{i}", float(i), 8 * block + 1, 1, ids) for i in range(2)]
    slow = replace(COST, tier_reads={"disk": (1e3, 0.5)})
    fast = replace(COST, tier_reads={"disk": (1e12, 0.0)})
    spec = RunSpec("hash", "lru", 9, tier_gib=(("disk", 1.0),))  # the pool holds one prompt
    other = TraceRequest("x", 0.5, 8 * block + 1, 1, list(range(100, 108)))
    trace.requests.insert(1, other)
    (slow_run,) = replay_sequential(trace, [spec], slow)
    (fast_run,) = replay_sequential(trace, [spec], fast)
    assert slow_run.hit_ratio == fast_run.hit_ratio > 0
    assert slow_run.ttft_p99_s > fast_run.ttft_p99_s + 0.5


def test_valkey_is_shared_by_the_replicas_and_a_disk_is_not(conversation: Trace) -> None:
    runs = replay_sequential(conversation, [
        RunSpec("hash", "lru", 600, 2, "round-robin"),
        RunSpec("hash", "lru", 600, 2, "round-robin", tier_gib=(("disk", 64.0),)),
        RunSpec("hash", "lru", 600, 2, "round-robin", tier_gib=(("valkey", 64.0),))], COST)
    alone, disks, valkey = runs
    assert alone.hit_ratio < disks.hit_ratio < valkey.hit_ratio
    assert valkey.tier_hit_ratios["valkey"] > 0


def test_cache_aware_routes_to_a_disk_holder_when_its_loads_beat_prefill(
    conversation: Trace,
) -> None:
    """The replicas announce their disks' stores and evictions to the router, and their read
    time per block beside their prefill time per block: a disk faster than prefill draws a
    conversation's next turn back to the replica holding its history on disk, which the
    tier-blind router, seeing only the pools, does less often."""
    fast = replace(COST, tier_reads={"disk": (1e12, 0.0)})
    aware, blind, spread = replay_sequential(conversation, [
        RunSpec("hash", "lru", 300, 2, router, tier_gib=(("disk", 64.0),))
        for router in ("cache-aware", "cache-aware-tier-blind", "round-robin")], fast)
    assert aware.tier_hit_ratios["disk"] > blind.tier_hit_ratios["disk"] + 0.002
    assert blind.tier_hit_ratios["disk"] > spread.tier_hit_ratios["disk"] + 0.005
    assert aware.tier_hit_ratios["ram"] == blind.tier_hit_ratios["ram"]


def test_the_tiers_refuse_what_they_cannot_model(conversation: Trace) -> None:
    with pytest.raises(ValueError, match="sequential mode only"):
        replay_timed(conversation, RunSpec("hash", "lru", 300, tier_gib=(("disk", 1.0),)), COST)
    with pytest.raises(ValueError, match="--kv-disk-gib must be > 0"):
        RunSpec("hash", "lru", 300, tier_gib=(("disk", 0.0),))
    with pytest.raises(ValueError, match="holds no block"):
        replay_sequential(conversation, [RunSpec("hash", "lru", 300, tier_gib=(("disk", 1e-9),))],
                          COST)
    out = subprocess.run([sys.executable, "-m", "prefixcache", "simulate",
                          str(FIXTURES / "mooncake_conversation_300.jsonl"), "--mode", "timed",
                          "--kv-disk-gib", "4", "--no-progress"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "sequential mode only" in out.stderr
    assert "Traceback" not in out.stderr
