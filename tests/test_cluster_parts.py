"""The cluster's parts that need no Ray instance, on real servers and sockets: the ingress's block
digests equal the replica cache's own, an HTTP request run through the app in-process streams and
aborts like one over a socket, the KV event feed fills gaps from the replay socket, and the
merged /metrics page and trace parts."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from prefixcache.cache import AllBlocksCleared, BlockRemoved, BlockStored
from prefixcache.cluster.asgi import ForwardedRequest, ResponseHead, run_asgi
from prefixcache.cluster.digests import PromptDigester
from prefixcache.cluster.feed import EventFeed
from prefixcache.cluster.metrics import merge_replica_metrics
from prefixcache.server.cli import add_arguments, tenant_registry
from prefixcache.server.kv_events import KVEventsConfig, ZmqEventPublisher
from prefixcache.server.metrics import EngineSnapshot, ServerMetrics
from prefixcache.sim.record import TraceRecorder, merge_records, read_record
from server_harness import RunningServer, start_server, wait_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tenants.toml"
ACME, GLOBEX = "sk-acme-example-key-1", "sk-globex-example-key"
LONG = "A shared system prompt that runs over several blocks of sixteen tokens, " * 3


@pytest.fixture(scope="module")
def tenanted(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunningServer, list[str]]:
    secret = tmp_path_factory.mktemp("secret") / "secret"
    secret.write_text("a-cluster-secret-of-enough-bytes")
    argv = ["--model", "tiny", "--tenants", str(EXAMPLE), "--secret-file", str(secret)]
    running = start_server(argv)
    yield running, argv
    running.stop()


def _digester(server: RunningServer, argv: list[str]) -> PromptDigester:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engine = server.engine
    return PromptDigester(engine.tokenizer, tenant_registry(parser.parse_args(argv)),
                          engine.cache_identity)


def _cached(server: RunningServer) -> set[bytes]:
    return {b.digest for b in server.engine.cache.pool.blocks if b.digest is not None}


def _post(server: RunningServer, path: str, key: str, body: dict) -> dict:
    response = httpx.post(server.base_url + path, json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "tiny", "prompt": LONG + "one", "max_tokens": 1}),
    ("/v1/completions", {"model": "tiny", "prompt": [LONG + "two", "x"], "max_tokens": 1}),
    ("/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "system", "content": LONG}, {"role": "user", "content": "three"}]}),
    ("/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "cache_salt": "narrow",
                              "messages": [{"role": "user", "content": LONG + "four"}]}),
    ("/v1/responses", {"model": "tiny", "input": LONG + "five", "max_output_tokens": 1}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 1, "system": [
        {"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "six"}]}]}),
])
def test_ingress_digests_are_the_replica_cache_digests(tenanted, path, body) -> None:
    server, argv = tenanted
    digester = _digester(server, argv)
    raw = json.dumps(body).encode()
    digests = digester.digests(path, ACME, raw)
    usage = _post(server, path, ACME, body)["usage"]
    prompt_tokens = usage.get("prompt_tokens", usage.get("input_tokens"))
    if path == "/v1/messages":  # Anthropic's input_tokens leave out what the cache read or wrote
        prompt_tokens += usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    if isinstance(body.get("prompt"), list):
        prompt_tokens = len(server.engine.tokenizer.encode(body["prompt"][0]))
    assert len(digests) == prompt_tokens // server.engine.block_size > 0
    assert set(digests) <= _cached(server)  # the very blocks the replica now caches
    other = digester.digests(path, GLOBEX, raw)  # another tenant: another namespace
    assert other and not set(other) & set(digests)


def test_ingress_gives_no_digests_for_what_the_replica_rejects(tenanted) -> None:
    server, argv = tenanted
    digester = _digester(server, argv)
    good = json.dumps({"model": "tiny", "prompt": LONG}).encode()
    assert digester.digests("/v1/completions", "sk-unknown", good) == []
    assert digester.digests("/v1/completions", None, good) == []
    assert digester.digests("/v1/completions", ACME, b"{not json") == []
    assert digester.digests("/v1/completions", ACME, b'{"prompt": 5}') == []
    assert digester.digests("/v1/models", ACME, good) == []
    # isolation "none": the replica never reads the cache for it, so nothing to route on
    assert digester.digests("/v1/completions", "sk-hospital-example-key", good) == []


def test_prompt_cache_key_is_a_routing_key_scoped_to_the_tenant_never_an_identity(
        tenanted) -> None:
    server, argv = tenanted
    digester = _digester(server, argv)
    body = {"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "system", "content": LONG}, {"role": "user", "content": "seven"}]}
    plain = digester.route("/v1/chat/completions", ACME, json.dumps(body).encode())
    keyed = digester.route("/v1/chat/completions", ACME,
                           json.dumps({**body, "prompt_cache_key": "user-42"}).encode())
    again = digester.route("/v1/chat/completions", ACME,
                           json.dumps({**body, "prompt_cache_key": "user-42"}).encode())
    other = digester.route("/v1/chat/completions", ACME,
                           json.dumps({**body, "prompt_cache_key": "user-43"}).encode())
    globex = digester.route("/v1/chat/completions", GLOBEX,
                            json.dumps({**body, "prompt_cache_key": "user-42"}).encode())
    assert plain.affinity_key is None and keyed.affinity_key == again.affinity_key
    assert keyed.block_digests == plain.block_digests  # the key names no block
    assert other.affinity_key not in (None, keyed.affinity_key)
    assert globex.affinity_key not in (None, keyed.affinity_key)  # scoped by the namespace
    assert b"user-42" not in keyed.affinity_key


def test_x_api_key_authenticates_the_ingress_like_a_bearer_token() -> None:
    from starlette.requests import Request

    from prefixcache.server.app import api_key_of

    def request(headers: list[tuple[bytes, bytes]]) -> Request:
        return Request({"type": "http", "headers": headers})

    assert api_key_of(request([(b"x-api-key", ACME.encode())])) == ACME
    assert api_key_of(request([(b"authorization", f"Bearer {ACME}".encode())])) == ACME
    assert api_key_of(request([])) is None


def _forwarded(body: dict, path: str = "/v1/completions") -> ForwardedRequest:
    return ForwardedRequest("POST", path, b"", [(b"content-type", b"application/json"),
                                                (b"authorization", f"Bearer {ACME}".encode())],
                            json.dumps(body).encode())


def test_run_asgi_answers_and_streams_like_the_http_server(tenanted) -> None:
    server, _ = tenanted

    async def collect(request: ForwardedRequest) -> tuple[ResponseHead, bytes]:
        items = [item async for item in run_asgi(server.app, request)]
        head = items[0]
        assert isinstance(head, ResponseHead)
        return head, b"".join(i for i in items[1:] if isinstance(i, bytes))

    body = {"model": "tiny", "prompt": LONG, "max_tokens": 3, "temperature": 0}
    head, data = asyncio.run(collect(_forwarded(body)))
    direct = _post(server, "/v1/completions", ACME, body)
    assert head.status == 200
    assert json.loads(data)["choices"][0]["text"] == direct["choices"][0]["text"]
    head, data = asyncio.run(collect(_forwarded({**body, "stream": True})))
    assert dict(head.headers)[b"content-type"].startswith(b"text/event-stream")
    events = [line for line in data.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 4
    head, data = asyncio.run(collect(_forwarded({"model": "tiny", "prompt": ""})))
    assert head.status == 400 and json.loads(data)["error"]["param"] == "prompt"


def test_a_caller_that_stops_reading_aborts_the_replica_request(tenanted) -> None:
    server, _ = tenanted
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 400, "stream": True,
            "ignore_eos": True}

    async def read_two() -> int:
        n = 0
        async for _ in run_asgi(server.app, _forwarded(body)):
            n += 1
            if n == 3:
                break  # closes the generator: the app sees http.disconnect
        return n

    assert asyncio.run(read_two()) == 3
    wait_idle(server)  # aborted, not left running its 400 tokens


# ---- the KV event feed ---------------------------------------------------------------------


def _stored(i: int) -> BlockStored:
    return BlockStored([bytes([i]) * 32], b"\0" * 32, [], 16)


def _publisher(topic: str, buffer_steps: int = 100) -> ZmqEventPublisher:
    config = KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                            buffer_steps=buffer_steps, topic=topic)
    return ZmqEventPublisher(config, with_tokens=False)


def _until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_event_feed_replays_what_it_missed_and_keeps_order() -> None:
    seen: dict[str, list] = {"r0": [], "r1": []}
    lost: list[str] = []
    feed = EventFeed(lambda topic, events: seen[topic].extend(events), lost.append)
    first, second = _publisher("r0"), _publisher("r1")
    try:
        for i in range(5):  # published before anyone subscribed: only a replay can bring them
            first.publish([_stored(i)])
        time.sleep(0.2)
        feed.watch("r0", first.endpoint, first.replay_endpoint)
        feed.watch("r1", second.endpoint, second.replay_endpoint)
        time.sleep(0.3)  # the SUB connection settles
        first.publish([_stored(5), BlockRemoved([bytes([0]) * 32])])
        second.publish([AllBlocksCleared()])
        _until(lambda: len(seen["r0"]) == 7 and len(seen["r1"]) == 1)
        assert [e.block_hashes[0][0] for e in seen["r0"][:6]] == [0, 1, 2, 3, 4, 5]
        assert isinstance(seen["r0"][6], BlockRemoved)
        assert isinstance(seen["r1"][0], AllBlocksCleared)
        assert feed.num_replays == 1 and not lost
        feed.forget("r1")
        time.sleep(0.2)
        second.publish([_stored(9)])
        first.publish([_stored(6)])
        _until(lambda: len(seen["r0"]) == 8)
        assert len(seen["r1"]) == 1  # forgotten: no longer read
    finally:
        feed.close()
        first.close()
        second.close()


def test_event_feed_reports_a_gap_the_replay_buffer_no_longer_holds() -> None:
    seen: list = []
    lost: list[str] = []
    feed = EventFeed(lambda topic, events: seen.extend(events), lost.append)
    publisher = _publisher("r0", buffer_steps=2)
    try:
        for i in range(6):  # only the last two stay in the replay buffer
            publisher.publish([_stored(i)])
        time.sleep(0.2)
        feed.watch("r0", publisher.endpoint, publisher.replay_endpoint)
        time.sleep(0.3)
        publisher.publish([_stored(6)])
        _until(lambda: lost == ["r0"])
        _until(lambda: seen and seen[-1].block_hashes[0][0] == 6)
    finally:
        feed.close()
        publisher.close()


def test_event_feed_keeps_each_events_medium() -> None:
    seen: list = []
    feed = EventFeed(lambda topic, events: seen.extend(events), lambda topic: None)
    publisher = _publisher("r0")
    digest = [bytes([7]) * 32]
    try:
        feed.watch("r0", publisher.endpoint, publisher.replay_endpoint)
        time.sleep(0.3)
        publisher.publish([BlockStored(digest, b"\0" * 32, [], 16, medium="DISK"),
                           BlockRemoved(digest), BlockRemoved(digest, medium="DISK")])
        _until(lambda: len(seen) == 3)
        assert [e.medium for e in seen] == ["DISK", None, "DISK"]  # None: the KV pool
    finally:
        feed.close()
        publisher.close()


# ---- what a replica measures for its router ------------------------------------------------


def test_a_replica_reports_its_measured_prefill_and_disk_load_costs(tmp_path) -> None:
    from prefixcache.cluster.costs import replica_costs
    from prefixcache.engine import LLMEngine, SamplingParams
    from prefixcache.sim.replica_costs import ReplicaCosts

    engine = LLMEngine("tiny", num_kv_blocks=24, kv_disk=str(tmp_path))
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def prompt(i: int) -> list[int]:
        return [(i * 131 + j * 37) % 250 + 3 for j in range(161)]  # 10 complete blocks

    try:
        assert replica_costs(engine.snapshot(), engine.tier_stats(), 16) == ReplicaCosts()
        for i in (0, 1, 2, 3, 0):  # the pool turns over; the last request loads from the disk
            engine.add_request(f"r{i}-{engine.num_steps}", prompt_token_ids=prompt(i),
                               sampling_params=params)
            while engine.has_unfinished():
                engine.step()
            assert engine.flush_tiers(30)
        costs = replica_costs(engine.snapshot(), engine.tier_stats(), engine.block_size)
        assert costs.prefill_s_per_block and costs.prefill_s_per_block > 0
        assert set(costs.load_s_per_block) == {"DISK"} and costs.load_s_per_block["DISK"] > 0
        assert costs.backlog_s == 0.0  # idle
        stats = engine.tier_stats()["tiers"]["disk"]  # type: ignore[index]
        assert costs.load_s_per_block["DISK"] == stats["read_seconds"] / stats["hits"]
        assert costs.weight("DISK") == max(0.0, min(1.0, 1 - costs.load_s_per_block["DISK"]
                                                    / costs.prefill_s_per_block))
        for i in (4, 5):  # waiting, not yet computed: the backlog at the measured speed
            engine.add_request(f"q{i}", prompt_token_ids=prompt(i), sampling_params=params)
        snap = engine.snapshot()
        assert snap.queued_prefill_tokens == 2 * 161
        queued = replica_costs(snap, engine.tier_stats(), engine.block_size)
        assert queued.backlog_s == pytest.approx(2 * 161 * snap.prefill_s_per_token)
        assert ReplicaCosts.from_dict(json.loads(json.dumps(queued.as_dict()))) == queued
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.close()


def test_router_belief_beside_each_replica_truth_per_medium() -> None:
    from prefixcache.cluster.metrics import belief_beside_truth

    doc = {"pool": {"cached": 12},
           "tiers": {"disk": {"blocks_held": 40}, "valkey": {"blocks_held": None}}}
    rows = belief_beside_truth({"POOL": 14, "DISK": 40, "VALKEY": 25}, doc)
    assert rows == {"POOL": {"believes": 14, "holds": 12, "drift": 2},
                    "DISK": {"believes": 40, "holds": 40, "drift": 0},
                    "VALKEY": {"believes": 25, "holds": None, "drift": None}}
    assert list(belief_beside_truth(None, doc)) == ["POOL", "DISK", "VALKEY"]
    assert belief_beside_truth({"POOL": 3}, None) == {
        "POOL": {"believes": 3, "holds": None, "drift": None}}


# ---- metrics and traces --------------------------------------------------------------------


def test_merged_metrics_label_each_replica_and_sum_them() -> None:
    pages = {}
    for name, hits in (("a", 30), ("b", 12)):
        metrics = ServerMetrics("tiny", 1024)
        metrics.update(EngineSnapshot(queried_tokens=100, hit_tokens=hits, kv_cache_usage=0.5
                                      if name == "a" else 0.25))
        metrics.observe_first_token("acme", 0.01, hits)
        pages[name] = metrics.render().decode()
    text = merge_replica_metrics(pages).decode()
    assert 'prefixcache:prefix_cache_hits_total{replica="a"} 30.0' in text
    assert 'prefixcache:prefix_cache_hits_total{replica="b"} 12.0' in text
    assert 'prefixcache:prefix_cache_hits_total{replica="all"} 42.0' in text
    assert 'prefixcache:prefix_cache_queries_total{replica="all"} 200.0' in text
    assert 'prefixcache:kv_cache_usage_perc{replica="all"} 0.375' in text
    assert ('prefixcache:time_to_first_token_seconds_count{cache="hit",domain="acme",'
            'replica="all"} 2.0') in text


def test_trace_parts_merge_in_time_order(tmp_path) -> None:
    epoch = time.time() - 10
    a = TraceRecorder(tmp_path / "t.a.part", 16, clock=time.time, start=epoch)
    b = TraceRecorder(tmp_path / "t.b.part", 16, clock=time.time, start=epoch)
    a.record(32, 4, [b"\1" * 32, b"\2" * 32], arrival_s=3.0)
    b.record(16, 2, [b"\1" * 32], arrival_s=1.0)
    a.record(16, 1, [b"\3" * 32], arrival_s=5.0)
    a.close()
    b.close()
    n = merge_records([tmp_path / "t.a.part", tmp_path / "t.b.part"], tmp_path / "t.jsonl")
    trace = read_record(tmp_path / "t.jsonl")
    assert n == 3 and [r.arrival_s for r in trace.requests] == [1.0, 3.0, 5.0]
    assert trace.requests[0].hash_ids == [trace.requests[1].hash_ids[0]]


def test_ray_prefix_aware_is_rays_own_router_reading_block_digests_as_its_text() -> None:
    """``serve --router ray-prefix-aware`` deploys Ray Serve LLM's PrefixCacheAffinityRouter
    (our subclass only hands it the prompt's block digests in hex as its text, never prompt
    text): its character tree then matches whole blocks, so its match rate is matched blocks
    over the prompt's blocks."""
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    from prefixcache.cluster.deployments import replica_options
    from prefixcache.cluster.ray_prefix import RayPrefixAwareRouter

    args = argparse.Namespace(cpus_per_replica=1, threads_per_replica=1, max_num_seqs=4,
                              max_queue_len=4, affinity_blocks=4, router="ray-prefix-aware")
    config = replica_options(args, 2)["request_router_config"]
    assert config["request_router_class"] == "prefixcache.cluster.ray_prefix.RayPrefixAwareRouter"
    args.router = "cache-aware-tier-blind"
    config = replica_options(args, 2)["request_router_config"]
    assert config["request_router_kwargs"]["policy"] == "cache-aware-tier-blind"

    def pending(digests: list[bytes]) -> PendingRequest:
        forwarded = ForwardedRequest("POST", "/v1/completions", b"", [], b"{}", digests)

        async def made() -> PendingRequest:  # it holds a future of the router's event loop
            return PendingRequest([forwarded], {}, RequestMetadata("r", "r"))

        return asyncio.run(made())

    doc = [bytes([i]) * 32 for i in range(10)]
    question = doc[:3] + [bytes([100 + i]) * 32 for i in range(7)]
    router = object.__new__(RayPrefixAwareRouter)  # its text extraction reads no state
    text = router._extract_text_from_request(pending(doc))
    assert text == "".join(d.hex() for d in doc)
    tree = PrefixTree()
    tree.add_tenants(["replica-0", "replica-1"], 0.0)
    tree.insert(text, "replica-0", 0.0)
    matched, tenants = tree.prefix_match(router._extract_text_from_request(pending(question)))
    assert len(matched) / len(text) == 0.3 and tenants == ["replica-0"]
