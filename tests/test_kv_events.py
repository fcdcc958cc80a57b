"""KV events on the wire: a real server publishing over ZMQ, decoded here with msgspec structs
written independently from vLLM 0.32's definitions (batch as an array; events as maps tagged by
``type``; vLLM's field order), checked against the cache's own state through stores, evictions
and a reset, and the replay socket serving a subscriber that missed batches; with a disk tier,
every event's medium, checked against the pool and the disk."""

from __future__ import annotations

import socket
import time
import uuid

import httpx
import msgspec
import pytest
import zmq

from prefixcache.cache import Sequence
from prefixcache.errors import CliError
from prefixcache.server.kv_events import KVEventsConfig
from server_harness import RunningServer, start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOPIC = b"kv"
NUM_BLOCKS = 24


class Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None = None


class Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(Batch)


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"


@pytest.fixture(scope="module")
def server(endpoints: tuple[str, str]) -> RunningServer:
    pub, replay = endpoints
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
              f'"endpoint": "{pub}", "replay_endpoint": "{replay}", "topic": "kv"}}')
    running = start_server(["--model", "tiny", "--num-kv-blocks", str(NUM_BLOCKS),
                            "--max-num-seqs", "2", "--kv-events-config", config])
    yield running
    running.stop()


def _complete(server: RunningServer, prompt: str) -> dict:
    response = httpx.post(server.base_url + "/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200
    return response.json()


def _receive(sub: zmq.Socket, until: float = 3.0) -> list[tuple[int, Batch]]:
    out = []
    deadline = time.monotonic() + until
    while time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC and len(seq) == 8
            out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
            deadline = time.monotonic() + 0.5  # more may follow shortly
    return out


def _replay(endpoint: str, start: int) -> list[tuple[int, Batch]]:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while dealer.poll(5000):
            _, topic, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            assert topic == TOPIC
            out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        raise AssertionError("no end-of-replay marker")
    finally:
        dealer.close(0)


def _cached_digests(server: RunningServer) -> set[bytes]:
    return {b.digest for b in server.engine.cache.pool.blocks if b.digest is not None}


def _apply(state: set[bytes], batches: list[tuple[int, Batch]]) -> None:
    for _, batch in batches:
        for event in batch.events:
            if isinstance(event, Stored):
                state.update(event.block_hashes)
            elif isinstance(event, Removed):
                state.difference_update(event.block_hashes)
            else:
                state.clear()


def test_events_follow_the_cache_through_store_evict_and_reset(
    server: RunningServer, endpoints: tuple[str, str]
) -> None:
    pub, replay = endpoints
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(pub)
    time.sleep(0.3)  # ZMQ's slow joiner: what a late subscriber misses, replay serves
    cache = server.engine.cache
    prompt = f"[{uuid.uuid4().hex}] " + "the events say which blocks are cached. " * 3
    _complete(server, prompt)
    seen = _receive(sub)
    stored = [e for _, b in seen for e in b.events if isinstance(e, Stored)]
    assert stored, "no BlockStored after a request"
    seq = Sequence("x", server.engine.tokenizer.encode(prompt))
    digests = seq.digests(cache.hasher, cache.model_id)
    num_full = (len(seq.token_ids)) // 16
    assert stored[0].block_hashes == digests[:num_full]
    assert stored[0].parent_block_hash == seq.root_digest(cache.hasher, cache.model_id)
    assert stored[0].block_size == 16 and stored[0].medium == "GPU"  # vLLM's name for the pool
    assert stored[0].token_ids == seq.token_ids[: 16 * num_full]  # no tenants: ids included

    # fill the pool with other prompts: the first prompt's blocks are evicted
    for i in range(6):
        _complete(server, f"[{uuid.uuid4().hex} {i}] " + "filler that evicts older blocks. " * 3)
    seen += _receive(sub)
    assert any(isinstance(e, Removed) for _, b in seen for e in b.events)
    state: set[bytes] = set()
    _apply(state, seen)
    assert state == _cached_digests(server)

    assert httpx.post(server.base_url + "/reset_prefix_cache").status_code == 200
    seen += _receive(sub)
    assert isinstance(seen[-1][1].events[-1], Cleared)
    _apply(state, seen[-1:])
    assert state == _cached_digests(server) == set()
    seqs = [s for s, _ in seen]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    # a subscriber that missed everything replays from 0 and rebuilds the same state
    replayed = _replay(replay, 0)
    assert [s for s, _ in replayed][-len(seqs):] == seqs
    assert replayed[0][0] == 0
    rebuilt: set[bytes] = set()
    _apply(rebuilt, replayed)
    assert rebuilt == _cached_digests(server)
    gap = _replay(replay, seqs[-2])
    assert [s for s, _ in gap] == seqs[-2:]
    sub.close(0)


def test_bad_kv_events_config_is_a_cli_error() -> None:
    for text, fragment in (("{", "not JSON"), ('{"publisher": "kafka"}', "publisher"),
                           ('{"colour": 1}', "unknown field"), ("[]", "JSON object"),
                           ('{"buffer_steps": 0}', "buffer_steps")):
        with pytest.raises(CliError, match=fragment):
            KVEventsConfig.from_json(text)


def test_token_ids_left_out_with_tenants(tmp_path) -> None:
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "tenants.toml"
    pub = f"tcp://127.0.0.1:{_port()}"
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
              f'"endpoint": "{pub}", "topic": "kv"}}')
    running = start_server(["--model", "tiny", "--num-kv-blocks", "64", "--tenants",
                            str(example), "--kv-events-config", config])
    try:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(pub)
        time.sleep(0.3)
        httpx.post(running.base_url + "/v1/completions",
                   headers={"authorization": "Bearer sk-acme-example-key-1"},
                   json={"model": "tiny", "prompt": "tenant data " * 8, "max_tokens": 1})
        stored = [e for _, b in _receive(sub) for e in b.events if isinstance(e, Stored)]
        assert stored and all(e.token_ids == [] for e in stored)
        sub.close(0)
    finally:
        running.stop()


def test_a_stuck_or_vanished_subscriber_never_holds_the_publisher_up() -> None:
    """One subscriber connects and never reads (its pipe fills to the high-water mark long
    before the end), a replay client asks for the whole buffer and disappears before reading a
    byte; a subscriber that keeps up still receives every batch, in order, to the last one:
    publishing never waits for a consumer, and the engine never drops a batch for it."""
    from prefixcache.cache.events import BlockStored
    from prefixcache.server.kv_events import ZmqEventPublisher

    pub_at, replay_at = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=pub_at,
                            replay_endpoint=replay_at, topic="kv", hwm=256)
    publisher = ZmqEventPublisher(config, with_tokens=True)
    context = zmq.Context.instance()
    stuck, healthy = context.socket(zmq.SUB), context.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    for sub in (stuck, healthy):
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(pub_at)
    event = BlockStored([b"\x01" * 32], b"\x00" * 32, list(range(16)), 16)
    received: list[int] = []
    try:
        time.sleep(0.3)  # both subscriptions reach the publisher
        for burst in range(30):  # 3,000 batches: far past the stuck pipe's 256
            for _ in range(100):
                publisher.publish([event])
            if burst == 15:  # a replay client that vanishes at once
                gone = context.socket(zmq.DEALER)
                gone.connect(replay_at)
                gone.send_multipart([b"", (0).to_bytes(8, "big")])
                gone.close(0)
            last = 100 * burst + 99
            deadline = time.monotonic() + 30
            while (not received or received[-1] < last) and time.monotonic() < deadline:
                if healthy.poll(100):
                    received.append(int.from_bytes(healthy.recv_multipart()[1], "big"))
        assert received == list(range(3000)) and publisher.num_dropped == 0
    finally:
        stuck.close(0)
        healthy.close(0)
        publisher.close()


# ---- the medium of every event: the KV pool, and each lower tier by its name -----------------


def _prompt(i: int) -> list[int]:
    return [(i * 131 + j * 37) % 250 + 3 for j in range(161)]  # 10 complete blocks


def _by_medium(state: dict[str | None, set[bytes]], batch: Batch) -> None:
    for event in batch.events:
        if isinstance(event, Stored):
            state.setdefault(event.medium, set()).update(event.block_hashes)
        elif isinstance(event, Removed):
            state.setdefault(event.medium, set()).difference_update(event.block_hashes)
        else:
            state.get("GPU", set()).clear()  # a reset clears the pool, not the tiers


def test_every_store_and_removal_names_its_medium_and_a_pool_eviction_keeps_the_disk_entry(
    tmp_path,
) -> None:
    from prefixcache.engine import LLMEngine, SamplingParams
    from prefixcache.server.kv_events import encode_batch
    from prefixcache.sim.router import CacheAware

    engine = LLMEngine("tiny", num_kv_blocks=NUM_BLOCKS, kv_disk=str(tmp_path), kv_events=True)
    disk = engine.tiers.offload.store.tiers[0]  # type: ignore[union-attr]
    router = CacheAware(2)
    state: dict[str | None, set[bytes]] = {}
    batches: list[Batch] = []
    seen: list[bytes] = []

    def run(i: int) -> list[bytes]:
        engine.add_request(f"r{i}", prompt_token_ids=_prompt(i),
                           sampling_params=SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        assert engine.flush_tiers(30)
        events = engine.take_kv_events()
        router.observe(0, events)  # as the cluster's router: in-process, then over the wire
        batches.append(DECODER.decode(encode_batch(events, 0.0, with_tokens=False)))
        _by_medium(state, batches[-1])
        seen.extend(engine.cache_identity.block_digests(Sequence(f"r{i}", _prompt(i)))[:10])
        return seen[-10:]

    def truth() -> dict[str | None, set[bytes]]:
        pool = {b.digest for b in engine.cache.pool.blocks if b.digest is not None}
        held = disk.contains(seen)
        return {"GPU": pool, "DISK": {d for d, h in zip(seen, held, strict=True) if h}}

    try:
        first = run(0)
        stored = [e for e in batches[0].events if isinstance(e, Stored)]
        assert {e.medium for e in stored} == {"GPU", "DISK"}  # vLLM's pool medium; the tier's
        on_disk = [e for e in stored if e.medium == "DISK"]
        assert [d for e in on_disk for d in e.block_hashes] == first
        assert on_disk[0].parent_block_hash == engine.cache_identity.root(Sequence("x", [1]))
        for i in (1, 2, 3):  # the pool (24 blocks) turns over; the disk keeps everything
            run(i)
        removed = [e for b in batches for e in b.events if isinstance(e, Removed)]
        assert removed and {e.medium for e in removed} == {"GPU"}
        assert set(first) <= state["DISK"] and not set(first) & state["GPU"]
        assert state == truth()
        assert router.held_blocks(0) == {"POOL": len(state["GPU"]), "DISK": 40}
        assert router.credit(0, first) == 5.0  # on disk, at the default weight until measured
        size = disk.num_bytes // disk.num_blocks
        disk.capacity_bytes = 25 * size  # the disk now evicts its oldest blocks: the first's
        run(4)
        dropped = [e for e in batches[-1].events if isinstance(e, Removed) and e.medium == "DISK"]
        assert set(first) <= {d for e in dropped for d in e.block_hashes}
        assert state == truth() and len(state["DISK"]) == 25
        assert router.credit(0, first) == 0.0 and router.held_blocks(0)["DISK"] == 25
    finally:
        engine.close()
