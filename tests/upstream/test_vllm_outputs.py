"""Upstream scoreboard: vLLM reports about what prefix caching does to a request's answer and to
its usage, replayed against prefixcache through the surface each reporter used.

- vllm#40896 and vllm#54490: the same deterministic request answers differently once its prefix
  is cached (first request vs the later ones; cache on vs off). Here the cache-hit path reads the
  same K/V with kernels whose reductions do not depend on where the cached part ends, so tokens
  *and* log-probabilities are the same bits cold, warm, after a reset and with the cache off.
- vllm#44096: a connector looked up a salted prefix but freed it under another salt, so read
  locks leaked and the blocks stayed unevictable until a TTL. Here `free` releases the blocks the
  sequence's own table holds; nothing is looked up again by key.
- vllm#56772: offloaded KV rows whose size depended on the deployment shape (TP), so a second
  deployment of the same model found none of them. Here a disk tier written by one engine shape
  is read whole by another.
- vllm#45079: `/v1/messages` usage lacked `cache_read_input_tokens` and
  `cache_creation_input_tokens`, plain and in the stream's `message_start` / `message_delta`.

The tiny model (random weights, byte tokenizer) throughout; one model load and one server.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from prefixcache import LLM, SamplingParams
from prefixcache.cache import Sequence, make_prefix_cache
from prefixcache.engine import LLMEngine
from prefixcache.model.loader import load_model
from server_harness import RunningServer, start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 16  # the server's and the engines' block size (the default)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_model("tiny")


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server(["--model", "tiny", "--num-kv-blocks", "256"])
    yield running
    running.stop()


@pytest.fixture(scope="module")
def cache_off(tiny: Any) -> LLM:
    """The reference: the same model with no prefix cache at all."""
    return LLM(tiny, enable_prefix_caching=False, num_kv_blocks=64)


def _ids(length: int, base: int) -> list[int]:
    """``length`` byte-token ids, a different run per ``base`` (never a special token)."""
    return [(base + 7 * i) % 250 + 3 for i in range(length)]


def _answer(out: Any) -> list[tuple[int, float]]:
    return [(d["token_id"], d["logprob"]) for d in out.outputs[0].logprobs]


def _split(answer: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    return [t for t, _ in answer], [lp for _, lp in answer]


def _same(llm: LLM, got: tuple[Any, list[float]], want: tuple[Any, list[float]]) -> bool:
    """``(tokens or text, logprobs)`` pairs: the same bits where this CPU's kernels are batch
    invariant (the compiled ones, the default: docs/model.md); where they are off (no C
    compiler) DESIGN.md still promises the same tokens, and logprobs move by float noise only."""
    assert len(got[1]) == len(want[1]) > 0
    if llm.engine.kernels["batch_invariant"]:
        return got == want
    return got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-3)


# ---- vllm#40896 ------------------------------------------------------------------------------


def test_vllm_40896_first_request_equals_later_identical_requests_at_temperature_0(
    server: RunningServer, cache_off: LLM
) -> None:
    """https://github.com/vllm-project/vllm/issues/40896 (open): Qwen3-8B behind
    `/v1/completions` at ``temperature=0``: the first request on a fresh server returned A, every
    later identical request B != A; `--no-enable-prefix-caching` or a restart brought A back.
    Maintainers: determinism with prefix caching is not fully supported; with
    ``VLLM_BATCH_INVARIANT=1`` cold and warm agree (docs PR #52701, closed), a near-tie flips
    otherwise.

    Cannot arise here: the warm request computes only the tokens past its hit, over cached K/V,
    with kernels that reduce every row in an order fixed by the model's shapes, not by the query
    length or where the cached part ends (docs/model.md "Batch invariance"). So the first, the
    later and the after-reset answers are the same bits as the cache-off engine's, token ids and
    log-probabilities alike, for a block-aligned prompt, one a token past a block, and a chain of
    prompts each built on the cached one before it. (Where the compiled kernels are off, e.g. no
    C compiler, the engine reports ``batch_invariant: false`` and only the tokens are held equal,
    log-probabilities within 1e-3: `_same`.)
    """
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    chain = _ids(120, 11)
    prompts = {
        "block-aligned": _ids(64, 1),
        "block+1": _ids(65, 5),
        "chained-1": chain[:40],
        "chained-2": chain[:80],
        "chained-3": chain,
    }
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)

    def ask(prompt: list[int]) -> tuple[str, list[float], int]:
        out = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        choice = out.choices[0]
        assert choice.logprobs is not None and out.usage is not None
        details = out.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens is not None
        return choice.text, list(choice.logprobs.token_logprobs or []), details.cached_tokens

    # a chained prompt's first run reads its parent's whole prompt blocks (the parent's decoded
    # tokens are not this prompt's, so its partly decoded block is no hit)
    first_hits = {
        "block-aligned": 0,
        "block+1": 0,
        "chained-1": 0,
        "chained-2": 40 // BS * BS,
        "chained-3": 80 // BS * BS,
    }
    for name, prompt in prompts.items():
        (ref,) = cache_off.generate([prompt], greedy)
        expected = (ref.text, [lp for _, lp in _answer(ref)])
        for i in range(5):
            text, logprobs, cached = ask(prompt)
            assert _same(cache_off, (text, logprobs), expected), f"{name}: run {i + 1} differs"
            # later runs are served from the cache: the hit is capped at n - 1, whole blocks
            assert cached == (first_hits[name] if i == 0 else (len(prompt) - 1) // BS * BS), name
    assert httpx.post(server.base_url + "/reset_prefix_cache", timeout=30).status_code == 200
    for name, prompt in prompts.items():  # the "restart": cold again, still the same bits
        (ref,) = cache_off.generate([prompt], greedy)
        text, logprobs, cached = ask(prompt)
        assert cached == first_hits[name], f"{name}: the reset left blocks behind"
        assert _same(cache_off, (text, logprobs), (ref.text, [lp for _, lp in _answer(ref)]))


# ---- vllm#54490 ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_vllm_54490_enabling_prefix_caching_leaves_repeated_deterministic_output_unchanged(
    tiny: Any, cache_off: LLM, kind: str
) -> None:
    """https://github.com/vllm-project/vllm/issues/54490 (open, labels bug + kv-cache-manager):
    "enabling prefix caching changes deterministic repeated output". The stored copy of the
    thread holds its title, labels and environment (torch 2.9.1, flashinfer 0.5.3) but not its
    reproduction; its sibling #54487 (same reporter) says the same of the prefix-cache hash
    setting. This replays the title's scenario on the offline `LLM` API: one long deterministic
    prompt sent three times, greedy and with a fixed sampling seed, cache on (each repeat a hit)
    against cache off.

    Cannot arise here: a hit reads K/V that the same kernels wrote, and the rows computed past
    it reduce in the same order as a full prefill (batch invariance); a seeded request draws from
    a stream fixed by its own seed, not by how many tokens the step computed. So every repeat,
    greedy or seeded, equals the cache-off answer bit for bit (`_same`: tokens, and
    log-probabilities within 1e-3, where the compiled kernels are off).
    """
    prompt = "This is a deterministic long-context prefix. " * 6  # 270 bytes: 16 blocks + 14
    settings = {
        "greedy": SamplingParams(
            max_tokens=16, temperature=0.0, seed=0, logprobs=1, ignore_eos=True
        ),
        "seeded": SamplingParams(
            max_tokens=16, temperature=1.0, seed=0, logprobs=1, ignore_eos=True
        ),
    }
    cached = LLM(tiny, prefix_cache=kind, num_kv_blocks=64, check_integrity=True)
    for name, params in settings.items():
        off = [_split(_answer(cache_off.generate(prompt, params)[0])) for _ in range(3)]
        assert off[0] == off[1] == off[2], f"{name}: the cache-off control is not deterministic"
        for i in range(3):
            (out,) = cached.generate(prompt, params)
            assert _same(cached, _split(_answer(out)), off[0]), f"{name}: repeat {i + 1} differs"
            if i > 0 or name == "seeded":  # the greedy run's blocks serve every later repeat
                assert out.num_cached_tokens == (len(out.prompt_token_ids) - 1) // BS * BS > 0


# ---- vllm#44096 ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_vllm_44096_salted_lookups_release_every_block_on_free(kind: str) -> None:
    """https://github.com/vllm-project/vllm/issues/44096 (open, stale; fix PR #44097 open in
    vLLM, the same fix merged in LMCache as #3771): the LMCache multi-process connector looked a
    request's prefix up with its ``cache_salt`` (read-locking the matched chunks on the server)
    but called ``free_lookup_locks`` without it, so the server built another key, found no lock
    to release, and in multi-tenant deployments the chunks stayed locked, unevictable, until
    their TTL.

    We have no external connector; the same property on our allocator is that a salted
    request's hit takes references (hash: ref counts; radix: ``lock_ref`` on the tenant's
    namespace path) and `free` gives back exactly those. It cannot leak here: `free` releases the
    block ids and the tree node the sequence's own table holds, never re-deriving a key from the
    salt. Several tenants share the same tokens under different salts, each hitting its own
    blocks; after every free nothing is referenced and a request that needs the whole pool
    evicts every tenant's cached block.
    """
    num_blocks = 48
    cache = make_prefix_cache(kind, num_blocks=num_blocks, block_size=BS)
    prompt = _ids(5 * BS + 3, 2)
    salts = [None, "tenant-a", "tenant-b", b"tenant-c"]

    def admit(seq: Sequence) -> int:
        hit = cache.match(seq)
        assert cache.allocate(seq, len(seq.token_ids) - hit.num_tokens, hit) is not None
        cache.check_integrity()
        cache.commit(seq, len(seq.token_ids))
        cache.check_integrity()
        return hit.num_tokens

    for salt in salts:
        first = Sequence(f"{salt}-1", prompt, salt)
        assert admit(first) == 0  # another tenant's equal tokens are no hit
        second = Sequence(f"{salt}-2", prompt, salt)
        assert admit(second) == 5 * BS  # its own blocks, referenced by the hit
        cache.free(second)
        cache.free(first)
        cache.check_integrity()
        assert cache.num_free_blocks == num_blocks, f"salt {salt!r}: a block stayed referenced"
    assert cache.num_cached_blocks == 4 * 5
    whole = Sequence("whole-pool", _ids(num_blocks * BS, 99))
    assert admit(whole) == 0  # only possible if every tenant's cached block could be evicted
    assert cache.num_cached_blocks == num_blocks and cache.num_free_blocks == 0
    cache.free(whole)
    cache.check_integrity()
    assert cache.num_free_blocks == num_blocks
    for salt in salts:  # every salted prefix is gone: none was held back
        assert cache.match(Sequence("probe", prompt, salt)).num_tokens == 0


# ---- vllm#56772 ------------------------------------------------------------------------------


def _run(engine: LLMEngine, prompt: list[int], rid: str) -> tuple[list[int], int, int]:
    engine.add_request(
        rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )
    tokens: list[int] = []
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            last = out
    assert last is not None and last.finished
    return tokens, last.num_cached_tokens, last.num_external_cached_tokens


def test_vllm_56772_offloaded_blocks_are_read_by_another_engine_shape(
    tiny: Any, tmp_path: Path
) -> None:
    """https://github.com/vllm-project/vllm/issues/56772 (closed, fixed by #56799, merged
    2026-09): with ``canonical_layout`` offload of GLM-5.2's MLA+DSA KV, the secondary tiers still
    used the TP-dependent primary row, so a TP1 writer and a TP2 reader disagreed on the row
    length: the P2P handshake was refused (``block_len mismatch``) and the filesystem tier gave 0
    external hits of 24,147 tokens.

    We have no tensor parallelism; the nearest case is the same model deployed in another engine
    shape over one disk tier. A record's identity and bytes are the model's KV layout only
    (docs/tiers.md: block size, heads, head dim, layers, dtype, hash), never the pool's size, the
    index kind, the token budget or the batch size, so each shape reads the other's blocks whole,
    in both directions, and answers as with no cache. A layout change (block size) is refused,
    as it must be.
    """
    prompt_a, prompt_b = _ids(10 * BS + 5, 3), _ids(10 * BS + 5, 8)
    kv = tmp_path / "kv"
    shapes = [
        {
            "prefix_cache": "hash",
            "num_kv_blocks": 48,
            "max_num_batched_tokens": 512,
            "max_num_seqs": 8,
        },
        {
            "prefix_cache": "radix",
            "num_kv_blocks": 96,
            "max_num_batched_tokens": 32,
            "max_num_seqs": 3,
        },
    ]
    cold = {}
    reference = LLMEngine(tiny, enable_prefix_caching=False, num_kv_blocks=32)
    for name, prompt in (("a", prompt_a), ("b", prompt_b)):
        cold[name] = _run(reference, prompt, f"cold-{name}")[0]
    writers = [LLMEngine(tiny, kv_disk=str(kv), check_integrity=True, **s) for s in shapes]
    try:
        for writer, (name, prompt) in zip(writers, (("a", prompt_a), ("b", prompt_b)), strict=True):
            assert _run(writer, prompt, f"write-{name}") == (cold[name], 0, 0)
            assert writer.flush_tiers(30)
    finally:
        for writer in writers:
            writer.close()
    records = sorted(kv.rglob("*.kv"))
    assert len(records) == 20 and len({p.stat().st_size for p in records}) == 1
    assert len({p.parent.parent for p in records}) == 1  # one identity directory for both shapes
    readers = [LLMEngine(tiny, kv_disk=str(kv), check_integrity=True, **s) for s in shapes]
    try:
        # each shape reads the blocks the *other* shape wrote
        for reader, (name, prompt) in zip(readers, (("b", prompt_b), ("a", prompt_a)), strict=True):
            assert _run(reader, prompt, f"read-{name}") == (cold[name], 10 * BS, 10 * BS)
    finally:
        for reader in readers:
            reader.close()
    other_layout = LLMEngine(tiny, kv_disk=str(kv), block_size=32, num_kv_blocks=32)
    try:
        assert _run(other_layout, prompt_a, "layout")[1:] == (0, 0)
    finally:
        other_layout.close()


# ---- vllm#45079 ------------------------------------------------------------------------------


CACHE_FIELDS = ("cache_read_input_tokens", "cache_creation_input_tokens")


def test_vllm_45079_messages_usage_carries_cache_fields_plain_and_streamed(
    server: RunningServer,
) -> None:
    """https://github.com/vllm-project/vllm/issues/45079 (open, stale; PR #45083 closed in
    favour of #40912, merged): with ``--enable-prefix-caching --enable-prompt-tokens-details``,
    `/v1/messages` never returned ``cache_read_input_tokens`` or
    ``cache_creation_input_tokens``: neither the message's usage nor the stream's
    ``message_start`` / ``message_delta`` mapped them, and ``input_tokens`` counted the cached
    tokens too.

    Cannot arise here: one function builds Anthropic's usage for the body and for both stream
    events (`MessagesRendering._usage`), always with both fields, and ``message_start`` is sent
    after the prefill so it already knows the hit. Through the official `anthropic` SDK: both
    fields present (set, not defaulted to None) in every usage, 0 read on a cold prompt and the
    whole cached prefix on the repeat, and ``input_tokens + read + creation`` equals the prompt
    as ``count_tokens`` counts it.
    """
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    question = [{"role": "user", "content": "How many lamps were lit last night?"}]

    def check(usage: Any, total: int, read: int) -> None:
        for field in CACHE_FIELDS:
            assert field in usage.model_fields_set and getattr(usage, field) is not None, field
        assert usage.cache_read_input_tokens == read
        assert (
            usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
            == total
        )

    # plain: a cold prompt, then the same prompt again
    system = "You keep the ledger of the lighthouse; answer with one figure. " * 4
    total = client.messages.count_tokens(
        model="tiny", system=system, messages=question
    ).input_tokens
    for read in (0, (total - 1) // BS * BS):  # a hit is capped at n - 1, whole blocks
        message = client.messages.create(
            model="tiny",
            max_tokens=4,
            system=system,
            messages=question,
            extra_body={"temperature": 0.0},
        )
        check(message.usage, total, read)
    # streamed: another cold prompt, then again; both events carry the usage
    system = "Quartermaster's log: count the crates on the quay and say the number. " * 4
    total = client.messages.count_tokens(
        model="tiny", system=system, messages=question
    ).input_tokens
    for read in (0, (total - 1) // BS * BS):
        starts, deltas = [], []
        for event in client.messages.create(
            model="tiny",
            max_tokens=4,
            system=system,
            messages=question,
            stream=True,
            extra_body={"temperature": 0.0},
        ):
            if event.type == "message_start":
                starts.append(event.message.usage)
            elif event.type == "message_delta":
                deltas.append(event.usage)
        assert len(starts) == len(deltas) == 1
        check(starts[0], total, read)
        check(deltas[0], total, read)
