"""`prefixcache serve --replicas 2 --tenants ...` on Ray Serve, as a user runs it: a subprocess
that joins the Ray instance in $RAY_ADDRESS (CI starts one) or starts its own. Checks that the
cache-aware router keeps each prefix on one replica (so ``cached_tokens`` covers the prefix from
its second request on: the ingress names blocks as the replicas' caches do, tenant namespace
included), that tenants stay apart, that /metrics and /cluster/routing need the metrics key and
show every replica, that streaming works through Serve's proxy with the openai client, and that a
replica killed mid-load costs no request and comes back."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow

BLOCK = 16
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tenants.toml"
KEY = {"Authorization": "Bearer sk-acme-example-key-1"}
OTHER = {"Authorization": "Bearer sk-globex-example-key"}
METRICS = {"Authorization": "Bearer cluster-metrics-key"}
PREFIXES = [f"System prompt {i}: answer briefly and precisely, citing the manual. " * 4
            for i in range(3)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster(str):
    """The base URL, with the process and its recorded trace."""

    proc: subprocess.Popen
    trace: Path


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    port = _port()
    work = tmp_path_factory.mktemp("cluster")
    log = work / "serve.log"
    cmd = [sys.executable, "-m", "prefixcache", "serve", "--model", "tiny", "--replicas", "2",
           "--router", "cache-aware", "--port", str(port), "--cpus-per-replica", "1",
           "--threads-per-replica", "1", "--num-kv-blocks", "256", "--tenants", str(EXAMPLE),
           "--metrics-key", "cluster-metrics-key", "--record-trace", str(work / "trace.jsonl")]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = Cluster(f"http://127.0.0.1:{port}")
    base.proc, base.trace = proc, work / "trace.jsonl"
    try:
        _wait(lambda: _replicas(base) == 2, 180, proc, log)
        yield base
    finally:
        if proc.poll() is None:
            _stop(proc)


def _replicas(base: str) -> int:
    try:
        if httpx.get(base + "/health", timeout=5).status_code != 200:
            return 0
        routing = httpx.get(base + "/cluster/routing", timeout=5, headers=METRICS).json()
    except httpx.HTTPError:
        return 0
    return sum(1 for r in (routing.get("replicas") or {}).values() if r["slot"] is not None)


def _wait(check, timeout_s: float, proc=None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out" + (f":\n{log.read_text()[-4000:]}" if log else ""))
        time.sleep(0.5)


def _complete(base: str, prompt: str, headers: dict = KEY) -> dict:
    response = httpx.post(base + "/v1/completions", timeout=60, headers=headers, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_cache_aware_routing_keeps_each_prefix_on_one_replica(cluster) -> None:
    cached = {}
    for i, prefix in enumerate(PREFIXES):
        for j in range(4):
            cached[i, j] = _complete(cluster, f"{prefix} Question {j}?")["prompt_tokens_details"][
                "cached_tokens"]
            time.sleep(0.3)  # the replica's KV events reach the router's index
    prefix_blocks = [len(p) // BLOCK // 2 for p in PREFIXES]  # well under the prefix's blocks
    for i in range(len(PREFIXES)):
        assert cached[i, 0] == 0
        for j in range(1, 4):  # a miss on the other replica would be 0
            assert cached[i, j] >= prefix_blocks[i] * BLOCK, (i, j, cached)
    # another tenant, same text: another namespace, so nothing cached for it (the ingress and
    # every replica derive the same salts from the launcher's one secret)
    assert _complete(cluster, f"{PREFIXES[0]} Question 1?", OTHER)["prompt_tokens_details"][
        "cached_tokens"] == 0
    routing = httpx.get(cluster + "/cluster/routing", headers=METRICS).json()
    assert routing["policy"] == "cache-aware"
    assert all(n > 0 for n in routing["routed_per_slot"])  # the prefixes were spread
    for info in routing["replicas"].values():  # what each replica measured reaches the router
        costs = info["routing_stats"]["kv_costs"]
        assert costs["prefill_s_per_block"] > 0 and costs["load_s_per_block"] == {}
        assert info["mirror_blocks_by_medium"] == {"POOL": info["mirror_blocks"]}
    assert httpx.get(cluster + "/cluster/routing", headers=KEY).status_code == 403
    assert httpx.get(cluster + "/metrics", headers=KEY).status_code == 403
    text = httpx.get(cluster + "/metrics", headers=METRICS).text
    for name in routing["replicas"]:
        assert f'replica="{name}"' in text
    assert 'prefixcache:prefix_cache_hits_total{replica="all"}' in text
    # the router's belief beside each replica's own count of cached blocks
    for name in routing["replicas"]:
        assert f'prefixcache:router_mirror_blocks{{replica="{name}"}}' in text
        assert f'prefixcache:kv_cached_blocks{{replica="{name}"}}' in text
    # and on the dashboard, through the ingress: every replica's belief and truth
    assert httpx.get(cluster + "/dashboard/data", headers=KEY).status_code == 401
    data = httpx.get(cluster + "/dashboard/data", headers=METRICS, timeout=60).json()
    rows = {r["replica"]: r for r in data["cluster"]["replicas"]}
    assert set(rows) == set(routing["replicas"])
    assert all(isinstance(r["router_believes"], int) and r["replica_holds"] > 0
               for r in rows.values())
    assert sum(r["replica_holds"] for r in rows.values()) >= sum(
        r["router_believes"] for r in rows.values()) > 0
    for r in rows.values():  # per medium: only the pool, with its drift
        pool = r["by_medium"]["POOL"]
        assert list(r["by_medium"]) == ["POOL"]
        assert (pool["believes"], pool["holds"]) == (r["router_believes"], r["replica_holds"])
        assert pool["drift"] == pool["believes"] - pool["holds"]


def test_streaming_through_serve_with_the_openai_client(cluster) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=cluster + "/v1", api_key="sk-acme-example-key-1")
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PREFIXES[0]}], max_tokens=5,
        stream=True, stream_options={"include_usage": True}, temperature=0))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content is not None) >= 1
    bad = httpx.post(cluster + "/v1/chat/completions", headers=KEY,
                     json={"model": "tiny", "messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    assert httpx.post(cluster + "/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": "hi"}]}).status_code == 401  # the replica authenticates


def test_a_prompt_cache_key_keeps_its_requests_on_one_replica(cluster) -> None:
    """Distinct prompts that share nothing but a key land on one replica (cache-aware routes a
    prompt nobody holds by its key); Anthropic's /v1/messages with x-api-key routes too."""
    def routed() -> list[int]:
        return httpx.get(cluster + "/cluster/routing", headers=METRICS).json()["routed_per_slot"]

    before = routed()
    for i in range(6):
        response = httpx.post(cluster + "/v1/chat/completions", headers=KEY, timeout=60, json={
            "model": "tiny", "max_tokens": 1, "prompt_cache_key": "conversation-7",
            "messages": [{"role": "user", "content": f"A question of its own, number {i}."}]})
        assert response.status_code == 200, response.text
    grew = [a - b for a, b in zip(routed(), before, strict=True)]
    assert sorted(grew) == [0, 6], grew
    keyed = httpx.get(cluster + "/cluster/routing", headers=METRICS).json()["routed_with_key"]
    assert keyed >= 6
    anthropic = {"x-api-key": KEY["Authorization"].removeprefix("Bearer "),
                 "anthropic-version": "2023-06-01"}
    message = httpx.post(cluster + "/v1/messages", timeout=60, headers=anthropic, json={
        "model": "tiny", "max_tokens": 2, "system": PREFIXES[1],
        "messages": [{"role": "user", "content": "Hello?"}]})
    assert message.status_code == 200, message.text
    assert message.json()["type"] == "message"


def _routing(base: str) -> dict:
    return httpx.get(base + "/cluster/routing", headers=METRICS, timeout=10).json()


def test_a_replica_killed_mid_stream_ends_that_stream_with_an_error(cluster) -> None:
    """Two streams on the two replicas; the first one's replica is killed after its first
    chunk. Its client reads an error event (the openai SDK raises it) instead of a stream that
    merely stops; the other stream completes; new requests are answered by the live replica at
    once; the router forgets the dead replica and its blocks; a new replica joins."""
    import openai

    client = openai.OpenAI(base_url=cluster + "/v1", api_key=KEY["Authorization"][7:],
                           max_retries=0, timeout=120)

    def stream(tag: str):
        return client.completions.create(
            model="tiny", prompt=f"{tag}: a prompt sharing no block. " * 8, max_tokens=1500,
            temperature=0, stream=True, extra_body={"ignore_eos": True})

    def busy() -> list[dict]:
        return [r for r in _routing(cluster)["replicas"].values() if r["in_flight"]]

    first = stream("First")  # no block in common: the second goes to the idle replica
    next(iter(first))
    pids = {r["routing_stats"].get("pid") for r in _routing(cluster)["replicas"].values()}
    # a request of the test before may still be finishing on the other replica: the router's
    # rule (the least loaded) places the second stream only once it has
    _wait(lambda: len(busy()) == 1, 30)
    victim = busy()[0]
    second = stream("Second")
    next(iter(second))
    os.kill(int(victim["routing_stats"]["pid"]), signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(openai.APIError, match="the replica serving this stream failed"):
        for _ in first:
            pass
    assert _complete(cluster, PREFIXES[2] + " Still there?")["completion_tokens"] == 2
    assert time.monotonic() - killed_at < 10  # answered elsewhere within seconds
    assert sum(1 for _ in second) > 0  # ran to its end, no error
    dead = victim["routing_stats"]["pid"]
    _wait(lambda: all(r["slot"] is None or r["routing_stats"].get("pid") != dead
                      for r in _routing(cluster)["replicas"].values()), 10)
    _wait(lambda: _replicas(cluster) == 2, 120)
    newcomers = [r for r in _routing(cluster)["replicas"].values()
                 if r["routing_stats"].get("pid") not in pids]
    assert len(newcomers) == 1 and newcomers[0]["mirror_blocks"] == 0  # nothing believed yet


def test_a_replica_killed_mid_load_costs_no_request_and_is_restarted(cluster) -> None:
    pids = subprocess.run(["pgrep", "-f", "ServeReplica:prefixcache:EngineReplica"],
                          capture_output=True, text=True).stdout.split()
    assert len(pids) == 2, pids
    before = set(httpx.get(cluster + "/cluster/routing", headers=METRICS).json()["replicas"])
    results: list[int] = []

    def ask(j: int) -> None:
        response = httpx.post(cluster + "/v1/completions", timeout=120, headers=KEY, json={
            "model": "tiny", "prompt": f"{PREFIXES[j % 3]} Under load {j}?", "max_tokens": 600,
            "ignore_eos": True})
        results.append(response.json()["usage"]["completion_tokens"]
                       if response.status_code == 200 else response.status_code)

    threads = [threading.Thread(target=ask, args=(j,)) for j in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # every request is queued or running on a replica
    os.kill(int(pids[0]), signal.SIGKILL)
    for thread in threads:
        thread.join(180)
    assert results == [600] * 8  # none lost: those on the dead replica were sent again
    routing = httpx.get(cluster + "/cluster/routing", headers=METRICS).json()
    assert routing["retries"] >= 1
    _wait(lambda: _replicas(cluster) == 2, 120)
    after = set(httpx.get(cluster + "/cluster/routing", headers=METRICS).json()["replicas"])
    assert len(after - before) == 1  # a new replica took the dead one's slot
    assert _complete(cluster, PREFIXES[1] + " Back to two?")["completion_tokens"] == 2


def test_the_recorded_trace_merges_every_replica_at_exit(cluster) -> None:
    """Run last: stops the cluster. Each replica (the killed one and its successor too) wrote
    its part; the launcher merged them into one trace the simulator reads."""
    from prefixcache.sim.record import read_record

    _stop(cluster.proc)
    assert cluster.proc.returncode == 0
    trace = read_record(cluster.trace)
    assert len(trace.requests) >= 12 + 1 + 8  # every request that finished on a live replica
    assert not list(cluster.trace.parent.glob("trace.jsonl.*.part"))
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)
    out = subprocess.run([sys.executable, "-m", "prefixcache", "simulate", str(cluster.trace),
                          "--replicas", "2", "--router", "cache-aware", "--no-plots",
                          "--no-progress", "--out", str(cluster.trace.parent / "sim")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
