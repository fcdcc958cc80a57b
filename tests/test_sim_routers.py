"""The routers that score tiers differently, side by side on cases a user would notice: the
tier-blind version of the cache-aware router, and Ray Serve LLM's prefix-aware rules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.cache import BlockRemoved, BlockStored
from prefixcache.sim.replica_costs import ReplicaCosts
from prefixcache.sim.router import ROUTERS, CacheAware, CacheAwareTierBlind, RayPrefixAware

FIXTURES = Path(__file__).parent / "fixtures"


def _chain(name: str, n: int = 10) -> list[bytes]:
    return [f"{name}-{i}".encode().ljust(32, b"\0") for i in range(n)]


def _events(digests: list[bytes], medium: str | None) -> list[BlockStored | BlockRemoved]:
    """A prompt computed into the pool, written to ``medium``, then evicted from the pool."""
    return [
        BlockStored(digests, b"\0" * 32, [], 16),
        BlockStored(digests, b"\0" * 32, [], 16, medium=medium),
        BlockRemoved(digests),
    ]


@pytest.mark.parametrize("medium", ["DISK", "VALKEY"])
def test_a_prefix_offloaded_from_ram_draws_its_request_only_when_tiers_count(medium: str) -> None:
    """A long document replica 0 computed left its RAM for its disk (or Valkey); replica 1 holds
    the shared system prompt (the first two blocks) in RAM. Loading a block costs a tenth of
    computing it. The tier-aware router sends the follow-up where 9 of 10 blocks' prefill is
    saved; the tier-blind one scores the offloaded prefix as though it weren't cached and sends
    it where 8 of 10 blocks are computed again. In Valkey every replica loads it: replica 1,
    which also holds the first two in RAM, is the better one."""
    doc = _chain("doc")
    costs = ReplicaCosts(1e-2, {medium: 1e-3})
    routers: list[CacheAware] = [CacheAware(2), CacheAwareTierBlind(2)]
    for router in routers:
        router.observe(0, _events(doc, medium))
        router.observe(1, [BlockStored(doc[:2], b"\0" * 32, [], 16)])
        router.set_costs(0, costs)
        router.set_costs(1, costs)
    aware, blind = routers
    assert aware.credit(0, doc) == pytest.approx(9.0)
    assert blind.credit(0, doc) == 0.0 and blind.credit(1, doc) == 2.0
    assert blind.choose(doc, [1, 1]) == 1
    if medium == "DISK":  # replica 0's own
        assert aware.credit(1, doc) == 2.0
        assert aware.choose(doc, [1, 1]) == 0
    else:  # shared: replica 1 loads the other 8 and holds the first 2 in RAM
        assert aware.credit(1, doc) == pytest.approx(2.0 + 8 * 0.9)
        assert aware.choose(doc, [1, 1]) == 1
    assert blind.held_blocks(0) == {"POOL": 0}  # the tiers' events never reach its index


def test_tier_blind_keeps_the_pool_rules() -> None:
    doc = _chain("doc")
    blind = CacheAwareTierBlind(2)
    blind.observe(1, [BlockStored(doc, b"\0" * 32, [], 16)])
    assert blind.choose(doc, [3, 1]) == 1
    assert blind.choose(doc, [40, 1]) == 1
    assert blind.choose(doc, [1, 40]) == 0  # the load guard still comes first


def test_ray_prefix_aware_follows_what_it_routed_and_never_hears_an_eviction() -> None:
    """Ray's tree holds every prompt it routed, inserted at routing time, whatever the replica
    then evicted: a request sharing at least 10% of its blocks goes to the replica it matches
    longest, however much busier (the imbalance threshold is infinite by default)."""
    router = RayPrefixAware(2)
    doc = _chain("doc")
    assert router.choose(doc, [0, 0]) == 0  # nothing matches: the smallest tree, then load
    assert router.choose(_chain("other"), [0, 0]) == 1  # replica 0's tree is larger now
    follow = doc[:3] + _chain("question", 7)  # 30% of it matches replica 0
    assert router.choose(follow, [9, 0]) == 0
    router.observe(0, [BlockRemoved(doc)])  # an eviction is not an input of its rules
    assert router.choose(doc, [9, 0]) == 0
    short = doc[:1] + _chain("fresh", 19)  # 5% matches: below the threshold
    assert router.choose(short, [0, 0]) == 1  # the replica with the fewest blocks
    assert not router.wants_events


def test_ray_prefix_aware_balances_past_its_imbalance_threshold() -> None:
    router = RayPrefixAware(2, imbalanced_threshold=4)
    doc = _chain("doc")
    router.choose(doc, [0, 0])
    assert router.choose(doc, [4, 0]) == 0  # a difference of 4 is not over the threshold
    assert router.choose(doc, [6, 0]) == 1  # power of two choices over two: the less loaded
    assert RayPrefixAware(2).choose([], [3, 1]) == 1  # no block: power of two choices


def _simulate(*flags: str) -> subprocess.CompletedProcess[str]:
    trace = str(FIXTURES / "mooncake_conversation_300.jsonl")
    command = [sys.executable, "-m", "prefixcache", "simulate", trace, "--replicas", "2"]
    return subprocess.run([*command, *flags, "--no-progress"], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_simulate_accepts_the_new_router_names() -> None:
    names = ["cache-aware-tier-blind", "ray-prefix-aware"]
    assert set(names) <= set(ROUTERS)
    out = _simulate("--router", ",".join(names), "--capacity", "300", "--prefix-cache", "hash",
                    "--kv-disk-gib", "64")  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if " 2 " in line]
    assert [name for name in names if any(name in row for row in rows)] == names
    bad = _simulate("--router", "ray-prefix")
    assert bad.returncode == 2 and "ray-prefix-aware" in bad.stderr
    assert "Traceback" not in bad.stderr
