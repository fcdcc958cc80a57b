"""LMCache reports, replayed against prefixcache's lower KV tiers (disk and Valkey).

LMCache keeps KV chunks outside the serving engine: an L1 in host RAM and L2 adapters (a local
disk, a filesystem, Redis/Valkey), reached through a connector that copies KV between vLLM's
pages and its own buffers. prefixcache's equivalent is one paged KV pool in RAM with a disk
directory and a Valkey server under it (``docs/tiers.md``): prompt blocks are written behind each
step, one self-checking record per block (identity, chained digest, parent, token check, CRC),
and a request whose prompt runs past the RAM hit waits while a loader reads the longest intact
run of its next blocks, nearest tier first, then adopts them into fresh pool blocks. Each test
acts out a reporter's steps through the surface they used (the HTTP server and the OpenAI SDK for
server reports, the offline `LLM` or `LLMEngine` for engine reports, the tier itself for a
connector report) on the built-in tiny model, with a real temporary directory and a real
valkey-server, and asserts what the reporter watched: the answer, the hit counters, the files.

Greedy answers are compared with a cache-off reference only for prompts whose every generated
step has a top-2 logprob margin above `SAFE_MARGIN` (batch composition moves float32 logits by
~1e-4: tests/test_engine_regressions.py), so a mismatch is a cache fault, not a near-tie.

LMCache #4546 and #2840 are not here: neither thread is in the stored corpora this was written
from, so there is no report to replay.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from prefixcache import LLM
from prefixcache.cache import Sequence
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.tiers import DiskTier
from prefixcache.tiers import record as rec
from server_harness import SAFE_MARGIN, RunningServer, start_server, wait_idle
from tier_helpers import IDENTITY, ValkeyProcess, flush, key, payload, record_files, shared_url

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 16
MAX_TOKENS = 6


# ---- references ------------------------------------------------------------------------------


def _params(max_tokens: int = MAX_TOKENS, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs
    )


class Reference:
    """Cache-off greedy answers of one dtype, and prompts whose answers cannot flip."""

    def __init__(self, dtype: str = "float32", margin: float = SAFE_MARGIN) -> None:
        self.llm = LLM(
            "tiny", block_size=BS, enable_prefix_caching=False, num_kv_blocks=64, dtype=dtype
        )
        self.margin = margin

    def answer(self, prompt: list[int]) -> tuple[list[int], str, float]:
        """Tokens, text and the smallest top-2 margin of ``prompt``'s greedy answer."""
        out = self.llm.generate([prompt], _params(logprobs=2))[0]
        tops = [sorted(e["top"].values(), reverse=True) for e in out.outputs[0].logprobs or []]
        assert len(tops) == MAX_TOKENS
        return out.token_ids, out.text, min(t[0] - t[1] for t in tops)

    def tie_free(self, make: Any, label: str, *, sensitive: bool = True) -> list[int]:
        """The first ``make(rng)`` prompt (seeded by ``label``) whose answer has a safe margin
        and, if ``sensitive``, changes when block 4's tokens do: the random-weight model's
        answer to some prompts hardly depends on the earlier blocks, and a test that checks
        KV read back from a tier by its answer needs one that does."""
        for attempt in range(50):
            rng = random.Random(f"{label}#{attempt}")
            prompt = make(rng)
            tokens, _, margin = self.answer(prompt)
            if margin <= self.margin:
                continue
            other = prompt[: 4 * BS] + _tokens(rng, BS) + prompt[5 * BS :]
            if not sensitive or self.answer(other)[0] != tokens:
                return prompt
        raise AssertionError(f"no tie-free prompt for {label!r} in 50 tries")


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def _kv(engine: LLMEngine, prompt: list[int], num_blocks: int) -> torch.Tensor:
    """The K and V the pool holds for ``prompt``'s first ``num_blocks`` blocks, as raw bytes."""
    ids = engine.cache.match(Sequence("probe", prompt[: num_blocks * BS] + [0])).block_ids
    assert len(ids) == num_blocks
    return engine.kv_cache.read_blocks(ids).view(torch.uint8)


# ---- Valkey and the server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def valkey_url() -> Iterator[str]:
    """The CI's shared valkey-server, else one of our own (as tests/test_tiers.py does)."""
    url = shared_url()
    if url is not None:
        flush(url)
        yield url
        return
    server = ValkeyProcess().start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, valkey_url: str) -> Iterator[RunningServer]:
    """``serve`` with a disk and a Valkey tier under a pool of 48 blocks (3.5 of the 4385
    sessions): long prompts are evicted from RAM and read back from the tiers."""
    kv = tmp_path_factory.mktemp("kv")
    running = start_server(
        [
            "--model",
            "tiny",
            "--block-size",
            str(BS),
            "--num-kv-blocks",
            "48",
            "--kv-disk",
            str(kv),
            "--kv-valkey",
            valkey_url,
        ]
    )
    yield running
    running.stop()


def _complete(server: RunningServer, prompt: list[int]) -> tuple[str, dict[str, int]]:
    client = openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120
    )
    out = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return out.choices[0].text, dict(out.usage.prompt_tokens_details.model_dump())


def _reset(server: RunningServer) -> None:
    """vLLM's ``POST /reset_prefix_cache`` (engine-local RAM only; the tiers keep their blocks)."""
    assert server.engine.flush_tiers(30)  # the reporter waited for the stores to settle
    wait_idle(server)
    assert httpx.post(server.base_url + "/reset_prefix_cache", timeout=30).status_code == 200


# ---- LMCache #5151 ---------------------------------------------------------------------------


def test_lmcache_5151_a_full_hit_at_an_exact_block_multiple_answers_like_the_cold_run(
    server: RunningServer, reference: Reference
) -> None:
    """https://github.com/LMCache/LMCache/issues/5151 — a prompt stored, the engine's own prefix
    cache reset (``POST /reset_prefix_cache``) and the prompt re-sent: the lookup reported a full
    external hit, the answer was fast and unrelated to the cold one. The broken lengths were exact
    multiples of the chunk size (a full hit leaves no token to compute), and the external-hit
    counter was off by one (closed; fixed by PR #5249, which backs off one chunk).

    Here a hit never covers the last prompt token: the loader asks the tiers for blocks up to
    ``(n - 1) // block_size`` only, so at ``n = 10 * 16`` the last block is computed (the logits
    need it) and the usage says 144 cached, all external; one token more and all 160 come from
    the tier. The answer is the cold one each time."""
    prompt = reference.tie_free(lambda rng: _tokens(rng, 10 * BS), "5151")
    longer = prompt + [prompt[3]]
    assert reference.answer(longer)[2] > SAFE_MARGIN
    cold, cold_longer = reference.answer(prompt)[1], reference.answer(longer)[1]

    text, usage = _complete(server, prompt)  # cold: computed and stored
    assert text == cold and usage["cached_tokens"] == 0
    wait_idle(server)
    computed = _kv(server.engine, prompt, 10)
    text, usage = _complete(server, prompt)  # a RAM hit: the same bound
    assert text == cold and usage["cached_tokens"] == usage["local_cached_tokens"] == 9 * BS
    _reset(server)
    text, usage = _complete(server, prompt)  # the reporter's flow: served from the tiers
    assert text == cold
    assert usage["cached_tokens"] == usage["external_cached_tokens"] == 9 * BS
    assert usage["local_cached_tokens"] == 0
    wait_idle(server)
    assert torch.equal(_kv(server.engine, prompt, 9), computed[:9])  # what the tiers gave back
    _reset(server)
    text, usage = _complete(server, longer)  # every block of the stored prompt is a hit
    assert text == cold_longer
    assert usage["cached_tokens"] == usage["external_cached_tokens"] == 10 * BS
    wait_idle(server)
    assert torch.equal(_kv(server.engine, prompt, 10), computed)


# ---- LMCache #4385 ---------------------------------------------------------------------------


def test_lmcache_4385_returning_sessions_get_their_own_kv_back_from_the_disk_tier(
    server: RunningServer, reference: Reference
) -> None:
    """https://github.com/LMCache/LMCache/issues/4385 — with ``local_cpu`` + ``local_disk``, six
    long sessions (each with its own planted fact) returned under a mixed load of short unrelated
    requests after their KV had been paged to disk, and answered with another session's fact
    and fragments of the short requests, silently, in 124 of 138 returns (open; not reproduced
    in LMCache's multi-process mode, so it looks confined to the in-process connector).

    Here the six sessions share every token but one block (the "needle", at 10% depth), the
    sharpest case for a store keyed by a block's own tokens or by position: each block's key is
    its chained digest (the needle changes every digest after it), and a record is used only
    if its digest, parent and token check match the block asked for. The pool holds 48 blocks,
    so the sessions (12 blocks each) are evicted and come back from the disk tier."""
    haystack = _tokens(random.Random("4385 haystack"), 12 * BS + 5)

    def session(i: int) -> list[int]:
        def make(rng: random.Random) -> list[int]:
            return haystack[:BS] + _tokens(rng, BS) + haystack[2 * BS :]  # the needle: block 1

        return reference.tie_free(make, f"4385 session {i}", sensitive=False)

    sessions = [session(i) for i in range(6)]
    cold = [reference.answer(p)[1] for p in sessions]
    assert len(set(cold)) > 1  # the needles change the answer: cross-talk would show
    for prompt, expected in zip(sessions, cold, strict=True):  # the first visits: stored
        assert _complete(server, prompt)[0] == expected
    assert server.engine.flush_tiers(30)  # the sessions return once their KV is on the tiers

    def short(worker: int) -> None:  # "the ticket number is TK-<k>": short unrelated requests
        rng = random.Random(f"4385 short {worker}")
        for _ in range(6):
            _complete(server, _tokens(rng, rng.randrange(20, 60)))

    def returning(i: int) -> list[tuple[str, dict[str, int]]]:
        return [_complete(server, sessions[i]) for _ in range(2)]

    with ThreadPoolExecutor(max_workers=9) as pool:  # the mixed load
        background = [pool.submit(short, w) for w in range(3)]
        returns = [pool.submit(returning, i) for i in range(6)]
        answers = [f.result() for f in returns]
        for f in background:
            f.result()
    for i, got in enumerate(answers):
        assert [text for text, _ in got] == [cold[i]] * 2, f"session {i} got another's KV"
    external = sum(usage["external_cached_tokens"] for got in answers for _, usage in got)
    assert external > 0, server.engine.stats()["tiers"]  # some came back from the tiers

    for i in range(4):  # four long unrelated prompts: every session is out of RAM now
        _complete(server, _tokens(random.Random(f"4385 flood {i}"), 12 * BS + 5))
    for i, prompt in enumerate(sessions):  # the reporter's single-return probe
        text, usage = _complete(server, prompt)
        assert text == cold[i], f"session {i} got another's KV"
        assert usage["cached_tokens"] == 12 * BS and usage["external_cached_tokens"] >= 11 * BS


# ---- LMCache #4463 ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lmcache_4463_kv_read_back_from_a_tier_is_the_pools_own_bytes(
    tmp_path: Path, reference: Reference, dtype: str
) -> None:
    """https://github.com/LMCache/LMCache/issues/4463 — on vLLM 0.26's packed KV layout (K and V
    sharing the last dimension) the in-process connector copied the wrong bytes: a request
    served from LMCache's CPU tier answered differently from the same request computed from
    scratch, with no error (open; fix proposed in PR #4467).

    prefixcache has one KV layout (per layer a K and a V tensor of ``[blocks, block_size,
    kv_heads, head_dim]``), and the tier copies whole blocks in that order (`read_blocks` /
    `write_blocks`), in the pool's dtype, which is part of the tier identity. The reporter's
    offline script, acted out with a restart between the store and the read: every layer's K
    and V of every block comes back bit for bit, and the answer is the cold one."""
    ref = reference if dtype == "float32" else Reference(dtype, margin=0.05)
    prompt = ref.tie_free(lambda rng: _tokens(rng, 10 * BS + 1), f"4463 {dtype}")
    cold = ref.answer(prompt)[0]

    def llm() -> LLM:
        return LLM("tiny", block_size=BS, num_kv_blocks=32, kv_disk=str(tmp_path), dtype=dtype)

    first = llm()
    assert first.generate([prompt], _params())[0].token_ids == cold
    stored = first.engine.kv_cache.read_blocks(
        first.engine.cache.match(Sequence("probe", prompt)).block_ids
    )
    assert first.engine.flush_tiers(30)
    first.engine.close()
    second = llm()  # a fresh pool: nothing in it but what the tier gives back
    out = second.generate([prompt], _params())[0]
    assert out.num_cached_tokens == 10 * BS
    assert second.engine.stats()["tiers"]["engine"]["blocks_loaded_by_tier"] == {"disk": 10}
    restored = second.engine.kv_cache.read_blocks(
        second.engine.cache.match(Sequence("probe", prompt)).block_ids
    )
    assert restored.dtype == stored.dtype == getattr(torch, dtype)
    assert torch.equal(restored.view(torch.uint8), stored.view(torch.uint8))
    assert out.token_ids == cold


# ---- LMCache #4991 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_4991(reference: Reference) -> list[int]:
    return reference.tie_free(lambda rng: _tokens(rng, 10 * BS + 1), "4991")


def _engine(**tiers: Any) -> LLMEngine:
    return LLMEngine("tiny", block_size=BS, num_kv_blocks=32, check_integrity=True, **tiers)


def _generate(engine: LLMEngine, prompt: list[int], rid: str) -> tuple[list[int], int]:
    """Greedy tokens and external cached tokens of one request."""
    engine.add_request(rid, prompt_token_ids=prompt, sampling_params=_params())
    tokens, external = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            external = out.num_external_cached_tokens
    assert external is not None
    return tokens, external


def test_lmcache_4991_a_failed_disk_store_is_never_visible_to_lookups(
    tmp_path: Path, reference: Reference, prompt_4991: list[int]
) -> None:
    """https://github.com/LMCache/LMCache/issues/4991 — with the ``fs_native`` L2 adapter a store
    task failed part-way ("Store task N to adapter 0 failed for keys"), only a warning was
    logged, the keys of the failed batch stayed visible to lookups (EXISTS true for a file the
    store never finished), and every later hit on them served corrupted KV: gibberish at
    temperature 0 (open; the thread traced it to failed batches whose written files stay
    findable and to concurrent stores sharing one staging file).

    Here the disk refuses one block of a batch (a file stands where its directory goes, the
    EISDIR-style refusal the thread's CPU reproduction used): the blocks before it are whole
    files, the refused one and the rest of the batch are no file at all, no temporary file is
    left, the in-memory index and a restarted one agree, and the next engine loads the run
    before the gap and computes the rest: the cold answer."""
    cold = reference.answer(prompt_4991)[0]
    engine = _engine(kv_disk=str(tmp_path))
    tier = engine.tiers.offload.store.tiers[0]  # type: ignore[union-attr]
    chain = engine.cache_identity.block_digests(Sequence("probe", prompt_4991))[:10]
    prefixes = [d.hex()[:2] for d in chain]
    refused = next(i for i in range(3, 8) if prefixes.count(prefixes[i]) == 1)
    blocker = tier.path_of(chain[refused]).parent
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_bytes(b"not a directory")

    assert _generate(engine, prompt_4991, "a") == (cold, 0)
    computed = _kv(engine, prompt_4991, 10)
    assert engine.flush_tiers(30)
    stats = engine.stats()["tiers"]["tiers"]["disk"]
    assert stats["write_errors"] == 1 and stats["blocks_written"] == refused
    visible = [True] * refused + [False] * (10 - refused)
    assert tier.contains(chain) == visible
    assert DiskTier(tmp_path, tier.identity, 1 << 30).contains(chain) == visible  # a restart
    assert len(record_files(tmp_path)) == refused
    assert not list(tmp_path.glob("v1/*/*/.tmp-*"))
    engine.close()

    blocker.unlink()  # the disk is fine again
    second = _engine(kv_disk=str(tmp_path))
    assert _generate(second, prompt_4991, "b") == (cold, refused * BS)
    assert torch.equal(_kv(second, prompt_4991, refused), computed[:refused])
    assert second.flush_tiers(30)  # the computed blocks are stored now, whole
    assert len(record_files(tmp_path)) == 10
    assert second.stats()["tiers"]["tiers"]["disk"]["quarantined"] == 0


def test_lmcache_4991_a_valkey_store_refused_part_way_leaves_only_whole_records(
    reference: Reference, prompt_4991: list[int]
) -> None:
    """https://github.com/LMCache/LMCache/issues/4991, on the Valkey tier: a server at its
    ``maxmemory`` with ``noeviction`` refuses the batch's later ``SET``s (OOM). A record is one
    string value, set whole or not at all: the ones stored are a prefix of the chain, the
    engine that wrote them answers from RAM, and another engine loads exactly that prefix and
    computes the rest."""
    from prefixcache.tiers.valkey import connect

    cold = reference.answer(prompt_4991)[0]
    valkey = ValkeyProcess().start()  # its own: the test sets its memory limit
    try:
        client = connect(valkey.url)
        engine = _engine(kv_valkey=valkey.url)
        tier = engine.tiers.offload.store.tiers[0]  # type: ignore[union-attr]
        size = tier.identity.payload_bytes
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory-policy", "noeviction")
        # the pipelined batch sitting in the server's query buffer counts too: about half of
        # the ten records fit
        client.config_set("maxmemory", str(used + 8 * size))
        assert _generate(engine, prompt_4991, "a") == (cold, 0)
        computed = _kv(engine, prompt_4991, 10)
        assert engine.flush_tiers(30)
        chain = engine.cache_identity.block_digests(Sequence("probe", prompt_4991))[:10]
        held = [bool(client.exists(tier.key_of(d))) for d in chain]
        stored = held.count(True)
        assert 0 < stored < 10 and held == [True] * stored + [False] * (10 - stored)
        stats = tier.stats  # the refusals are counted, not raised into the writer thread
        assert stats.blocks_written == stored and stats.dropped == 10 - stored
        assert stats.write_errors >= 1 and stats.up
        engine.close()

        second = _engine(kv_valkey=valkey.url)
        assert _generate(second, prompt_4991, "b") == (cold, stored * BS)
        assert torch.equal(_kv(second, prompt_4991, stored), computed[:stored])
        assert second.stats()["tiers"]["tiers"]["valkey"]["quarantined"] == 0
        second.close()
    finally:
        valkey.stop()


_FAILING_WRITER = """
import resource, signal, sys
sys.path.insert(0, "tests")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from tier_helpers import IDENTITY, key, payload
from prefixcache.tiers import DiskTier
n = int(sys.argv[2])
tiers = [DiskTier(sys.argv[1], IDENTITY, 1 << 34) for _ in range(n)]  # none holds a block yet
size = IDENTITY.payload_bytes // 2  # every write stops half-way with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
print("ready", flush=True)
failed = sum(tiers[i].put([(key(i), payload(i))]) == 0 for i in range(n))
print(failed, flush=True)
"""


def test_lmcache_4991_concurrent_writers_of_one_block_never_publish_a_torn_record(
    tmp_path: Path,
) -> None:
    """https://github.com/LMCache/LMCache/issues/4991, the thread's second failure mode: two
    concurrent stores of one key shared a staging file name, so the store that failed with an
    I/O error truncated the file the successful one renamed into place; EXISTS said yes and
    GET returned a short read.

    Here two processes store the same blocks into one directory at once, neither knowing the
    other wrote them: one succeeds, the other fails every write half-way (a file size limit,
    a real ``EFBIG``). Each write has its own temporary file (process id and a random suffix)
    renamed over the name only when whole, so every published record is the full, intact
    block and no temporary file is left."""
    n = 64
    writer = subprocess.Popen(
        [sys.executable, "-c", _FAILING_WRITER, str(tmp_path), str(n)],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == "ready"
    tier = DiskTier(tmp_path, IDENTITY, 1 << 34)
    written = sum(tier.put([(key(i), payload(i))]) for i in range(n))
    assert writer.wait(60) == 0
    reopened = DiskTier(tmp_path, IDENTITY, 1 << 34)
    assert reopened.stats.quarantined == 0 and reopened.num_blocks == n
    size = len(rec.encode(IDENTITY.as_json(), key(0), payload(0)))
    assert {f.stat().st_size for f in record_files(tmp_path)} == {size}
    got = reopened.get_run([key(i) for i in range(n)])
    assert [bytes(p) for p in got] == [payload(i) for i in range(n)]
    assert not list(tmp_path.glob("v1/*/*/.tmp-*"))
    assert written == n
    assert int(writer.stdout.read().split()[-1]) == n  # every one of its writes failed
