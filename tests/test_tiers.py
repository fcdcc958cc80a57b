"""The lower KV tiers: the record format, the disk and Valkey tiers, and the engine over them.

Each upstream bug the tiers must make impossible has a test named after it: a lower tier that
ignores the cache salt (LMCache #2878, SGLang #26747, #37160), keys that omit the model revision
or the KV dtype (SGLang #24758, #33268, vLLM #49261), a disk index lost at restart (LMCache
#1175), a missing file that kills the engine (LMCache #1313). Real storage throughout: a
temporary directory and a real valkey-server.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.tiers import BadRecord, BlockKey, DiskTier, TierIdentity
from prefixcache.tiers import record as rec
from tier_helpers import (
    BS,
    IDENTITY,
    ValkeyProcess,
    flush,
    key,
    keys,
    payload,
    record_files,
    shared_url,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [(i * 37) % 250 + 3 for i in range(161)]  # 10 complete blocks to offload, 1 to compute


# ---- the record ------------------------------------------------------------------------------


def test_record_round_trips_and_refuses_every_mismatch() -> None:
    data = rec.encode(IDENTITY.as_json(), key(1), payload(1))
    assert bytes(rec.decode(data, IDENTITY.as_json(), key(1))) == payload(1)
    other = TierIdentity("llama:abc", "bfloat16", 4, 2, 64, BS, "sha256", 2)
    with pytest.raises(BadRecord, match="identity"):
        rec.decode(data, other.as_json(), key(1))
    with pytest.raises(BadRecord, match="another block"):
        rec.decode(data, IDENTITY.as_json(), key(2))
    k = key(1)
    with pytest.raises(BadRecord, match="parent"):
        rec.decode(data, IDENTITY.as_json(), BlockKey(k.digest, b"\x07" * 32, k.token_check,
                                                      k.domain_tag))
    with pytest.raises(BadRecord, match="other tokens"):
        rec.decode(data, IDENTITY.as_json(), BlockKey(k.digest, k.parent, b"\0" * 32,
                                                      k.domain_tag))


@settings(max_examples=200, deadline=None)
@given(position=st.integers(min_value=0), flip=st.integers(min_value=1, max_value=255),
       cut=st.integers(min_value=0))
def test_any_flipped_byte_or_truncation_is_refused(position: int, flip: int, cut: int) -> None:
    small = TierIdentity("m", "float32", 1, 1, 4, 2, "sha256", 4)
    data = bytearray(rec.encode(small.as_json(), key(3), bytes(range(small.payload_bytes))))
    position %= len(data)
    data[position] ^= flip
    with pytest.raises(BadRecord):
        rec.decode(bytes(data), small.as_json(), key(3))
    data[position] ^= flip
    with pytest.raises(BadRecord):
        rec.decode(bytes(data[: cut % len(data)]), small.as_json(), key(3))


# ---- the disk tier ---------------------------------------------------------------------------


def test_disk_index_is_rebuilt_at_restart_lmcache_1175(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, IDENTITY, 1 << 30)
    assert tier.put([(key(i), payload(i)) for i in range(5)]) == 5
    reopened = DiskTier(tmp_path, IDENTITY, 1 << 30)
    assert reopened.num_blocks == 5
    got = reopened.get_run([key(i) for i in range(6)])  # the sixth was never written
    assert [bytes(p) for p in got] == [payload(i) for i in range(5)]
    assert reopened.stats.hits == 5 and reopened.stats.misses == 1


def test_a_bad_file_is_quarantined_at_start_and_at_read_never_served(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, IDENTITY, 1 << 30)
    tier.put([(key(i), payload(i)) for i in range(3)])
    truncated, flipped = tier.path_of(key(0).digest), tier.path_of(key(1).digest)
    truncated.write_bytes(truncated.read_bytes()[:-10])
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF  # the header still parses: only the checksum can tell
    flipped.write_bytes(bytes(data))
    reopened = DiskTier(tmp_path, IDENTITY, 1 << 30)
    assert reopened.stats.quarantined == 1 and reopened.num_blocks == 2  # the truncated file
    assert reopened.get_run([key(1), key(2)]) == []
    assert reopened.stats.quarantined == 2
    assert [bytes(p) for p in reopened.get_run([key(2)])] == [payload(2)]
    assert len(list((tmp_path / "quarantine").iterdir())) == 2
    assert not truncated.exists() and not flipped.exists()


def test_capacity_keeps_the_most_recently_used_files(tmp_path: Path) -> None:
    size = len(rec.encode(IDENTITY.as_json(), key(0), payload(0)))
    tier = DiskTier(tmp_path, IDENTITY, 3 * size)
    tier.put([(key(i), payload(i)) for i in range(3)])
    assert len(tier.get_run([key(0)])) == 1  # block 0 is now the most recent
    tier.put([(key(3), payload(3))])
    assert tier.contains([key(i).digest for i in range(4)]) == [True, False, True, True]
    assert len(record_files(tmp_path)) == 3 and tier.stats.evicted == 1


def test_another_process_never_sees_a_half_written_block(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        from tier_helpers import IDENTITY, key, payload
        from prefixcache.tiers import DiskTier
        tier = DiskTier(sys.argv[1], IDENTITY, 1 << 34)
        for i in range(200):
            tier.put([(key(i), payload(i))])
    """)
    writer = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)],
                              cwd=Path(__file__).resolve().parents[1])
    reader = DiskTier(tmp_path, IDENTITY, 1 << 34)
    seen = 0
    while writer.poll() is None or seen < 200:
        for i in range(200):
            got = reader.get_run([key(i)])
            if got:
                assert bytes(got[0]) == payload(i)
        seen = reader.num_blocks
        if writer.poll() is not None and writer.returncode != 0:
            break
    assert writer.wait(60) == 0
    assert reader.stats.quarantined == 0 and reader.stats.read_errors == 0
    assert not list(tmp_path.glob("v1/*/*/.tmp-*"))


def test_a_full_disk_stops_writes_counts_them_and_reads_go_on(tmp_path: Path) -> None:
    # RLIMIT_FSIZE makes every write past 1 MiB fail with EFBIG: a real disk-full error
    script = textwrap.dedent("""
        import json, resource, signal, sys
        sys.path.insert(0, "tests")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        from tier_helpers import IDENTITY, key, payload
        from prefixcache.tiers import DiskTier
        tier = DiskTier(sys.argv[1], IDENTITY, 1 << 34)
        tier.put([(key(0), payload(0))])
        resource.setrlimit(resource.RLIMIT_FSIZE, (IDENTITY.payload_bytes // 2,) * 2)
        written = tier.put([(key(i), payload(i)) for i in range(1, 5)])
        again = tier.put([(key(9), payload(9))])  # inside the backoff: dropped, not tried
        got = tier.get_run([key(0)])
        print(json.dumps({"written": written, "again": again, "read": len(got),
                          **tier.stats.as_dict()}))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout.splitlines()[-1])
    assert stats["written"] == 0 and stats["again"] == 0 and stats["read"] == 1
    assert stats["write_errors"] == 1 and stats["dropped"] == 4 and stats["up"] is False
    assert out.stderr.count("writes stopped") == 1  # one warning per outage
    assert not list(tmp_path.glob("v1/*/*/.tmp-*"))


# ---- the engine over the tiers ---------------------------------------------------------------


def generate(engine: LLMEngine, prompt: list[int], rid: str, salt: str | None = None,
             domain: str = "", max_tokens: int = 6) -> dict[str, Any]:
    engine.add_request(rid, prompt_token_ids=prompt, cache_salt=salt, domain=domain,
                       sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                      ignore_eos=True))
    tokens: list[int] = []
    last = None
    deadline = time.monotonic() + 120
    while engine.has_unfinished():
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                last = out
    assert last is not None and last.finished
    return {"tokens": tokens, "cached": last.num_cached_tokens,
            "external": last.num_external_cached_tokens, "reason": last.finish_reason}


def engine_on(tmp_path: Path | None = None, valkey: str | None = None,
              **settings: Any) -> LLMEngine:
    settings.setdefault("model", "tiny")
    settings.setdefault("block_size", BS)
    return LLMEngine(kv_disk=str(tmp_path) if tmp_path else None, kv_valkey=valkey,
                     check_integrity=True, **settings)


def written(engine: LLMEngine) -> None:
    assert engine.flush_tiers(30)


@pytest.fixture(scope="module")
def cold() -> list[int]:
    """The prompt's greedy tokens with no cache at all."""
    engine = LLMEngine("tiny", block_size=BS, enable_prefix_caching=False)
    return generate(engine, PROMPT, "cold")["tokens"]


def test_a_restarted_engine_hits_the_disk_and_answers_the_same(tmp_path: Path,
                                                               cold: list[int]) -> None:
    first = engine_on(tmp_path)
    out = generate(first, PROMPT, "a")
    assert out["tokens"] == cold and out["cached"] == 0 and out["external"] == 0
    written(first)
    first.close()
    assert len(record_files(tmp_path)) == 10  # the prompt's complete blocks (one is computed)
    second = engine_on(tmp_path)
    again = generate(second, PROMPT, "b")
    assert again["tokens"] == cold
    assert again["cached"] == again["external"] == 10 * BS
    stats = second.stats()["tiers"]
    assert stats["engine"]["blocks_loaded_by_tier"] == {"disk": 10}
    assert stats["tiers"]["disk"]["hits"] == 10
    # a third request is a plain RAM hit: nothing external any more
    third = generate(second, PROMPT, "c")
    assert third["tokens"] == cold and third["cached"] == 10 * BS and third["external"] == 0


def test_an_engine_dropped_without_close_lets_go_of_its_kv_memory(tmp_path: Path) -> None:
    """A tiered engine a program drops without `close` (as a script or a test does) gives its
    KV tensors back: its tier threads end instead of holding them for the rest of the process
    (each such engine used to keep its whole pool, 512 MiB for `tiny`)."""
    before = set(threading.enumerate())
    engine = engine_on(tmp_path)
    generate(engine, PROMPT, "a")
    written(engine)
    threads = [t for t in threading.enumerate()
               if t.name.startswith("kv-tier-") and t not in before]
    assert len(threads) == 2  # its writer and its loader
    kv = weakref.ref(engine.runner.kv_cache)
    del engine
    gc.collect()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive(), "the tier threads outlived their engine"
    gc.collect()
    assert kv() is None


def test_radix_cache_adopts_tier_blocks_too(tmp_path: Path, cold: list[int]) -> None:
    first = engine_on(tmp_path)
    generate(first, PROMPT, "a")
    written(first)
    radix = engine_on(tmp_path, prefix_cache="radix")
    out = generate(radix, PROMPT, "b")
    assert out["tokens"] == cold and out["external"] == 10 * BS


def test_records_hold_kv_and_digests_never_token_ids(tmp_path: Path) -> None:
    prompt = [1000 + i for i in range(161)]  # ids whose u32be bytes cannot occur by chance
    engine = engine_on(tmp_path, model="tiny")
    generate(engine, [t % 256 for t in prompt], "a")  # the tiny vocabulary is 256 ids
    written(engine)
    block = [t % 256 for t in prompt][:BS]
    needle = b"".join(t.to_bytes(4, "big") for t in block)
    files = record_files(tmp_path)
    assert files and all(needle not in f.read_bytes() for f in files)


def test_a_missing_file_is_a_miss_and_the_engine_goes_on_lmcache_1313(tmp_path: Path,
                                                                      cold: list[int]) -> None:
    first = engine_on(tmp_path)
    generate(first, PROMPT, "a")
    written(first)
    second = engine_on(tmp_path)  # its index names all ten files
    files = record_files(tmp_path)
    digests = [bytes.fromhex(f.stem) for f in files]
    # remove block 4 of the chain: blocks 0-3 are still a hit, the rest is computed
    chain = first.cache_identity.block_digests(_seq(first))[:10]
    assert set(chain) == set(digests)
    os.unlink(second.tiers.offload.store.tiers[0].path_of(chain[4]))  # type: ignore[union-attr]
    out = generate(second, PROMPT, "b")
    assert out["tokens"] == cold and out["external"] == 4 * BS
    assert second.stats()["tiers"]["tiers"]["disk"]["misses"] == 1


def _seq(engine: LLMEngine) -> Any:
    from prefixcache.cache import Sequence

    return Sequence("probe", PROMPT)


def test_a_corrupted_file_is_quarantined_and_computed_instead(tmp_path: Path,
                                                              cold: list[int]) -> None:
    first = engine_on(tmp_path)
    generate(first, PROMPT, "a")
    written(first)
    chain = first.cache_identity.block_digests(_seq(first))[:10]
    path = first.tiers.offload.store.tiers[0].path_of(chain[2])  # type: ignore[union-attr]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55  # a flipped bit in the KV payload
    path.write_bytes(bytes(data))
    second = engine_on(tmp_path)
    out = generate(second, PROMPT, "b")
    assert out["tokens"] == cold and out["external"] == 2 * BS
    assert second.stats()["tiers"]["tiers"]["disk"]["quarantined"] == 1
    assert len(list((tmp_path / "quarantine").iterdir())) == 1
    written(second)  # the recomputed blocks are written again, intact
    assert path.read_bytes() != bytes(data)


def test_a_tenants_blocks_never_hit_another_tenant_through_the_disk_lmcache_2878_sglang_26747(
    tmp_path: Path,
) -> None:
    first = engine_on(tmp_path)
    generate(first, PROMPT, "a", salt="salt-of-acme", domain="tenant:acme")
    written(first)
    second = engine_on(tmp_path)
    other = generate(second, PROMPT, "b", salt="salt-of-globex", domain="tenant:globex")
    unsalted = generate(second, PROMPT, "c")
    assert other["external"] == 0 and unsalted["external"] == 0
    third = engine_on(tmp_path)
    same = generate(third, PROMPT, "d", salt="salt-of-acme", domain="tenant:acme")
    assert same["external"] == 10 * BS


@pytest.mark.parametrize("change", [
    {"dtype": "bfloat16"}, {"block_size": 32}, {"hash_algo": "blake2b"}, {"model": "revision"},
])
def test_another_model_revision_dtype_or_layout_finds_no_block_sglang_24758_33268_vllm_49261(
    tmp_path: Path, change: dict[str, Any], tiny_revision: str
) -> None:
    first = engine_on(tmp_path / "kv")
    generate(first, PROMPT, "a")
    written(first)
    if change.get("model") == "revision":
        change = {"model": tiny_revision}
    second = engine_on(tmp_path / "kv", **change)
    out = generate(second, PROMPT, "b")
    assert out["external"] == 0 and out["cached"] == 0
    assert second.stats()["tiers"]["tiers"]["disk"]["hits"] == 0


@pytest.fixture(scope="module")
def tiny_revision(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny checkpoint with one weight nudged: another revision of the same architecture."""
    from safetensors.torch import load_file, save_file

    from prefixcache.model.builtin import ensure_builtin

    target = tmp_path_factory.mktemp("revision") / "tiny-r2"
    shutil.copytree(ensure_builtin("tiny"), target)
    weights = load_file(target / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3
    save_file(weights, target / "model.safetensors")
    return str(target)


def test_a_record_planted_under_another_identity_is_quarantined(tmp_path: Path) -> None:
    first = engine_on(tmp_path)
    generate(first, PROMPT, "a")
    written(first)
    bf16 = engine_on(tmp_path, dtype="bfloat16")
    src = first.tiers.offload.store.tiers[0]  # type: ignore[union-attr]
    dst = bf16.tiers.offload.store.tiers[0]  # type: ignore[union-attr]
    chain = first.cache_identity.block_digests(_seq(first))
    # the same digests (the model id differs, so they would not even be asked for): plant
    # block 0's file where the bf16 engine looks for its own block 0
    own = bf16.cache_identity.block_digests(_seq(bf16))[0]
    dst.path_of(own).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src.path_of(chain[0]), dst.path_of(own))
    out = generate(bf16, PROMPT, "b")
    assert out["external"] == 0
    assert bf16.stats()["tiers"]["tiers"]["disk"]["quarantined"] == 1


def test_a_full_write_queue_drops_and_counts(tmp_path: Path, cold: list[int]) -> None:
    engine = engine_on(tmp_path, kv_offload_max_pending_blocks=4)
    out = generate(engine, PROMPT, "a")  # one prefill chunk completes 10 blocks: over 4
    assert out["tokens"] == cold
    stats = engine.stats()["tiers"]["engine"]
    assert stats["blocks_dropped"] == 10 and stats["blocks_queued"] == 0


@pytest.mark.parametrize("ttl_s,at_rest", [(3600.0, 10), (300.0, 0)])
def test_an_hour_long_pin_writes_its_prefix_through_to_the_disk(
        tmp_path: Path, cold: list[int], ttl_s: float, at_rest: int) -> None:
    """The write-behind drops every block here (a queue of 4); a pin of an hour still puts
    the pinned prefix at rest, so a restarted engine reads it; a 5-minute pin does not."""
    engine = engine_on(tmp_path, kv_offload_max_pending_blocks=4)
    engine.add_request("p", prompt_token_ids=PROMPT, pins=[(10 * BS, ttl_s)],
                       sampling_params=SamplingParams(max_tokens=6, temperature=0.0,
                                                      ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    written(engine)
    stats = engine.stats()["tiers"]["engine"]
    assert stats["blocks_dropped"] == 10 and stats["blocks_written_through"] == at_rest
    assert len(record_files(tmp_path)) == at_rest
    engine.close()
    again = generate(engine_on(tmp_path), PROMPT, "q")
    assert again["tokens"] == cold and again["external"] == at_rest * BS


def test_an_abort_while_loading_ends_the_request(tmp_path: Path) -> None:
    first = engine_on(tmp_path)
    generate(first, PROMPT, "a")
    written(first)
    second = engine_on(tmp_path)
    second.add_request("b", prompt_token_ids=PROMPT, sampling_params=SamplingParams(max_tokens=4))
    assert second.abort("b")
    outs = []
    while second.has_unfinished():
        outs += second.step()
    assert [o.finish_reason for o in outs if o.request_id == "b"] == ["abort"]
    second.cache.check_integrity()


def test_purge_removes_one_tenant_from_the_disk(tmp_path: Path) -> None:
    engine = engine_on(tmp_path)
    generate(engine, PROMPT, "a", salt="s-acme", domain="tenant:acme")
    generate(engine, PROMPT, "b", salt="s-globex", domain="tenant:globex")
    written(engine)
    assert len(record_files(tmp_path)) == 20
    out = subprocess.run([sys.executable, "-m", "prefixcache", "cache", "purge", "--tenant",
                          "acme", "--kv-disk", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"domain": "tenant:acme", "removed": {"disk": 10}}
    fresh = engine_on(tmp_path)
    assert generate(fresh, PROMPT, "c", salt="s-acme", domain="tenant:acme")["external"] == 0
    assert generate(fresh, PROMPT, "d", salt="s-globex",
                    domain="tenant:globex")["external"] == 10 * BS


# ---- Valkey ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def valkey_server() -> Iterator[str]:
    url = shared_url()
    if url is not None:
        yield url
        return
    server = ValkeyProcess().start()
    yield server.url
    server.stop()


@pytest.fixture
def valkey(valkey_server: str) -> str:
    flush(valkey_server)
    return valkey_server


def test_valkey_shares_a_prefix_between_engines(valkey: str, cold: list[int]) -> None:
    one, two = engine_on(valkey=valkey), engine_on(valkey=valkey)  # two replicas' engines
    assert generate(one, PROMPT, "a")["tokens"] == cold
    written(one)
    assert len(keys(valkey, "prefixcache:v1:*:*")) == 11  # 10 records and the domain's set
    out = generate(two, PROMPT, "b")
    assert out["tokens"] == cold and out["external"] == 10 * BS
    assert two.stats()["tiers"]["engine"]["blocks_loaded_by_tier"] == {"valkey": 10}


def test_a_valkey_hit_is_copied_to_the_disk(valkey: str, tmp_path: Path) -> None:
    one = engine_on(valkey=valkey)
    generate(one, PROMPT, "a")
    written(one)
    two = engine_on(tmp_path, valkey=valkey)
    assert generate(two, PROMPT, "b")["external"] == 10 * BS
    assert len(record_files(tmp_path)) == 10


def test_valkey_keys_salt_and_identity_lmcache_2878_sglang_37160_vllm_49261(valkey: str) -> None:
    one = engine_on(valkey=valkey)
    generate(one, PROMPT, "a", salt="salt-a", domain="tenant:a")
    written(one)
    two = engine_on(valkey=valkey)
    assert generate(two, PROMPT, "b", salt="salt-b", domain="tenant:b")["external"] == 0
    assert generate(two, PROMPT, "c")["external"] == 0
    three = engine_on(valkey=valkey, dtype="bfloat16")
    assert generate(three, PROMPT, "d", salt="salt-a", domain="tenant:a")["external"] == 0
    four = engine_on(valkey=valkey)
    assert generate(four, PROMPT, "e", salt="salt-a", domain="tenant:a")["external"] == 10 * BS


def test_a_corrupted_valkey_value_is_a_miss_and_deleted(valkey: str, cold: list[int]) -> None:
    from prefixcache.tiers.valkey import connect

    one = engine_on(valkey=valkey)
    generate(one, PROMPT, "a")
    written(one)
    tier = one.tiers.offload.store.tiers[0]  # type: ignore[union-attr]
    chain = one.cache_identity.block_digests(_seq(one))
    client = connect(valkey)
    value = bytearray(client.get(tier.key_of(chain[3])))  # type: ignore[attr-defined]
    value[-5] ^= 1
    client.set(tier.key_of(chain[3]), bytes(value))  # type: ignore[attr-defined]
    two = engine_on(valkey=valkey)
    out = generate(two, PROMPT, "b")
    assert out["tokens"] == cold and out["external"] == 3 * BS
    assert two.stats()["tiers"]["tiers"]["valkey"]["quarantined"] == 1
    written(two)  # deleted, then written again, intact, from the recomputed block
    assert client.get(tier.key_of(chain[3])) != bytes(value)  # type: ignore[attr-defined]


def test_purge_removes_one_tenant_from_valkey_and_disk(valkey: str, tmp_path: Path) -> None:
    engine = engine_on(tmp_path, valkey=valkey)
    generate(engine, PROMPT, "a", salt="s-acme", domain="tenant:acme")
    generate(engine, PROMPT, "b", salt="s-globex", domain="tenant:globex")
    written(engine)
    out = subprocess.run([sys.executable, "-m", "prefixcache", "cache", "purge", "--tenant",
                          "acme", "--kv-disk", str(tmp_path), "--kv-valkey", valkey],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["removed"] == {"disk": 10, "valkey": 10}
    fresh = engine_on(valkey=valkey)
    assert generate(fresh, PROMPT, "c", salt="s-acme", domain="tenant:acme")["external"] == 0
    assert generate(fresh, PROMPT, "d", salt="s-globex",
                    domain="tenant:globex")["external"] == 10 * BS


def test_purged_and_damaged_tier_records_are_announced_removed_and_leave_the_router(
    valkey: str, tmp_path: Path
) -> None:
    """A tenant's purge removes its blocks from the disk and Valkey, and a disk record that
    fails its checks when read is dropped: each is a `BlockRemoved` in that tier's medium, so a
    cache-aware router stops crediting them (a removal it never hears of would keep drawing the
    tenant's requests to a replica that must compute them)."""
    from prefixcache.cache import BlockRemoved, Sequence
    from prefixcache.sim.router import CacheAware

    engine = engine_on(tmp_path, valkey=valkey, kv_events=True)
    generate(engine, PROMPT, "a", salt="s-acme", domain="tenant:acme")
    generate(engine, PROMPT, "b", salt="s-globex", domain="tenant:globex")
    written(engine)
    acme = engine.cache_identity.block_digests(
        Sequence("p", PROMPT, "s-acme", domain="tenant:acme"))[:10]
    globex = engine.cache_identity.block_digests(
        Sequence("p", PROMPT, "s-globex", domain="tenant:globex"))[:10]
    router = CacheAware(2)
    router.observe(0, engine.take_kv_events())
    assert router.held_blocks(0) == {"POOL": 20, "DISK": 20, "VALKEY": 20}
    assert engine.purge_domain("tenant:acme") == {"disk": 10, "valkey": 10}
    removed = [e for e in engine.take_kv_events() if isinstance(e, BlockRemoved)]
    assert {e.medium: sorted(e.block_hashes) for e in removed} == {
        "DISK": sorted(acme), "VALKEY": sorted(acme)}
    router.observe(0, removed)
    router.observe(0, [BlockRemoved(acme)])  # and the RAM's copy (drop_domain, its own events)
    assert router.credit(0, acme) == 0.0 and router.credit(1, acme) == 0.0
    assert router.credit(0, globex) == 10.0

    path = engine.tiers.offload.store.tiers[0].path_of(globex[2])  # type: ignore[union-attr]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))
    other = engine_on(tmp_path, kv_events=True)  # a replica on the disk alone
    generate(other, PROMPT, "c", salt="s-globex", domain="tenant:globex")
    removed = [e for e in other.take_kv_events() if isinstance(e, BlockRemoved)]
    assert [(e.medium, e.block_hashes) for e in removed] == [("DISK", [globex[2]])]


def test_valkey_down_at_start_then_lost_and_back_mid_run(
    tmp_path: Path, cold: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    server = ValkeyProcess()  # not started: nothing listens on its port
    engine = engine_on(tmp_path, valkey=server.url)
    tier = engine.tiers.offload.store.tiers[1]  # type: ignore[union-attr]
    assert tier.stats.up is False
    assert generate(engine, PROMPT, "a")["tokens"] == cold  # served from RAM, written to disk
    written(engine)
    assert tier.stats.dropped + tier.stats.write_errors > 0
    server.start()
    try:
        time.sleep(1.2)  # past the backoff
        prompt2 = [t ^ 1 for t in PROMPT]
        generate(engine, prompt2, "b")
        written(engine)
        assert tier.stats.up is True and tier.stats.blocks_written == 10
        server.stop()  # lost mid-run
        prompt3 = [t ^ 2 for t in PROMPT]
        out = generate(engine, prompt3, "c")
        assert out["reason"] == "length"
        written(engine)
        assert tier.stats.up is False
        assert generate(engine, PROMPT, "d")["tokens"] == cold  # RAM still serves
    finally:
        server.stop()
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 2  # once at start, once when lost: not once per request
    assert all(server.url.split("//")[1] not in r.getMessage() or "***" not in r.getMessage()
               for r in warnings)


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_dropping_a_domain_evicts_only_its_free_ram_blocks_and_zeroes_them(kind: str) -> None:
    engine = LLMEngine("tiny", block_size=BS, prefix_cache=kind, check_integrity=True)
    generate(engine, PROMPT, "a", salt="s-acme", domain="tenant:acme")
    generate(engine, PROMPT, "b", salt="s-globex", domain="tenant:globex")
    acme = _cached_ids(engine, "s-acme", "tenant:acme")
    assert engine.drop_domain("tenant:acme") == 10
    assert all(not engine.kv_cache.k_caches[0][b].any() for b in acme[:10])
    assert generate(engine, PROMPT, "c", salt="s-acme", domain="tenant:acme")["cached"] == 0
    assert generate(engine, PROMPT, "d", salt="s-globex",
                    domain="tenant:globex")["cached"] == 10 * BS
    assert engine.stats()["cache"]["num_evictions"] >= 10


def _cached_ids(engine: LLMEngine, salt: str, domain: str) -> list[int]:
    """The ids of the blocks PROMPT's cached prefix occupies in one namespace."""
    from prefixcache.cache import Sequence

    return engine.cache.match(Sequence("probe", PROMPT, salt, domain=domain)).block_ids


def test_explain_names_the_tier_each_block_would_come_from(tmp_path: Path) -> None:
    engine = engine_on(tmp_path)
    generate(engine, PROMPT, "a")
    written(engine)
    a = json.dumps(PROMPT[: 4 * BS + 3])  # A shares B's first 4 blocks: those stay in RAM
    out = subprocess.run([sys.executable, "-m", "prefixcache", "explain", a, json.dumps(PROMPT),
                          "--kv-disk", str(tmp_path), "--dtype", "float32"],  # the engine's
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "disk tier: holds 10 of B's 10 reusable blocks" in out.stdout
    assert "blocks 0-3: from A's RAM cache" in out.stdout
    assert "blocks 4-9: loaded from the disk tier" in out.stdout
    other = subprocess.run([sys.executable, "-m", "prefixcache", "explain", "--json", a,
                            json.dumps(PROMPT), "--kv-disk", str(tmp_path), "--dtype",
                            "bfloat16"], capture_output=True, text=True, timeout=120)
    assert json.loads(other.stdout)["tiers"] == {"disk": [False] * 10}  # another identity


def test_blocks_in_valkey_are_announced_and_count_for_every_replica(valkey: str) -> None:
    from prefixcache.cache import BlockStored
    from prefixcache.server.kv_events import decode_batch, encode_batch
    from prefixcache.sim.router import CacheAware, affinity_point

    engine = engine_on(valkey=valkey, kv_events=True)
    generate(engine, PROMPT, "a")
    written(engine)
    events = engine.take_kv_events()
    shared = [e for e in events if isinstance(e, BlockStored) and e.medium == "VALKEY"]
    chain = engine.cache_identity.block_digests(_seq(engine))[:10]
    assert [d for e in shared for d in e.block_hashes] == chain
    assert shared[0].parent_block_hash == engine.cache_identity.root(_seq(engine))
    assert any(isinstance(e, BlockStored) and e.medium is None for e in events)  # the RAM's
    _, wire = decode_batch(encode_batch(events, 0.0, with_tokens=False))
    assert [e.medium for e in wire if isinstance(e, BlockStored)] == [
        e.medium for e in events if isinstance(e, BlockStored)]
    router = CacheAware(3)
    router.observe(0, shared)  # replica 0 wrote them to Valkey: any replica can load them
    assert [router._matched(i, chain) for i in range(3)] == [10, 10, 10]
    owner = router._ring.owner(affinity_point(chain, router.k, None))
    assert router.choose(chain, [4, 1, 2]) == owner  # equal for all: the one its prefix hashes to


def test_other_requests_keep_stepping_while_one_waits_for_its_blocks(tmp_path: Path) -> None:
    import threading

    from prefixcache.sched.request import RequestStatus

    first = engine_on(tmp_path)
    generate(first, PROMPT, "a")
    written(first)
    engine = engine_on(tmp_path)
    tier = engine.tiers.offload.store.tiers[0]  # type: ignore[union-attr]
    release = threading.Event()
    real_get_run = tier.get_run

    def slow_get_run(keys: list[BlockKey]) -> list[memoryview]:  # a slow disk, for this test
        release.wait(60)
        return real_get_run(keys)

    tier.get_run = slow_get_run  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("busy", prompt_token_ids=[5, 6, 7], sampling_params=params)
    loading = engine.add_request("loading", prompt_token_ids=PROMPT, sampling_params=params)
    produced = 0
    for _ in range(10):
        produced += sum(len(o.new_token_ids) for o in engine.step() if o.request_id == "busy")
    assert produced == 10 and loading.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    release.set()
    while engine.has_unfinished():
        engine.step()
    assert loading.num_external_cached_tokens == 10 * BS


def test_zero_on_reuse_and_tier_blocks_give_the_same_answer(tmp_path: Path,
                                                            cold: list[int]) -> None:
    first = engine_on(tmp_path, zero_on_reuse=True)
    generate(first, PROMPT, "a", salt="s1")
    written(first)
    engine = engine_on(tmp_path, zero_on_reuse=True, num_kv_blocks=24)
    generate(engine, [t ^ 3 for t in PROMPT], "b", salt="s2")  # the pool's blocks change hands
    out = generate(engine, PROMPT, "c", salt="s1")
    assert out["external"] == 10 * BS and out["tokens"] == cold


def test_valkey_records_expire_with_a_ttl(valkey: str) -> None:
    from prefixcache.tiers.valkey import connect

    engine = engine_on(valkey=valkey, kv_valkey_ttl=120)
    generate(engine, PROMPT, "a")
    written(engine)
    client = connect(valkey)
    ttls = [client.ttl(k) for k in keys(valkey)]
    assert len(ttls) == 11 and all(0 < t <= 120 for t in ttls)  # records and the domain's set


_EXIT_WITH_ENGINES_ALIVE = """
import sys, tempfile
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.sampling_params import SamplingParams
engines = []
for i in range(6):
    engine = LLMEngine(model="tiny", block_size=16, kv_disk=tempfile.mkdtemp(dir=sys.argv[1]))
    engine.add_request(f"r{i}", prompt_token_ids=[(7 * j) % 250 + 5 for j in range(400)],
                       sampling_params=SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    engine.cycle = engine  # alive until the interpreter exits, its writes still queued
    engines.append(engine)
"""


def test_a_process_exits_cleanly_with_tiered_engines_still_alive(tmp_path: Path) -> None:
    """Engines alive at exit leave their tier threads asleep: waking them from the exit handlers
    ran tensor work while torch's thread pool was torn down, and the process aborted ("terminate
    called without an active exception"; half the runs, and the whole test suite once)."""
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", _EXIT_WITH_ENGINES_ALIVE, str(tmp_path)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-500:]
