"""llama.cpp server prompt-cache reports, replayed against prefixcache's OpenAI-compatible server.

llama-server keeps one KV cache per slot, a RAM prompt cache of whole-prompt snapshots that it
moves in and out of slots (``--cache-ram``, ``--cache-idle-slots``, ``cache_prompt``), context
checkpoints, and a slot save/restore API. prefixcache has none of these parts: one paged KV pool
is shared by every request, a prefix is found block by block in one index over that pool (hash
or radix), and a disk tier under the pool outlives the process. Each test below acts out a
reporter's steps through the same surface they used (the HTTP API, with llama.cpp's own request
fields where they sent them, which our server ignores), on the built-in tiny model, and asserts
what the reporter watched: the answer, ``cached_tokens``, memory.

Greedy answers are compared with a cache-off server's, token by token, up to the first step
whose top-2 logprob margin is under `SAFE_MARGIN`: batch composition moves float32 logits by
~1e-4, so only a step with a safe margin is a sound claim (tests/test_engine_regressions.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server_harness import SAFE_MARGIN, RunningServer, start_server, wait_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MIN_COMPARED = 4  # a reference with a near-tie before this step needs other prompts
BLOCK = 16
# -np 2 and a pool small enough that finished conversations are evicted and their blocks reused
SERVER_ARGS = ["--model", "tiny", "--block-size", str(BLOCK), "--num-kv-blocks", "32",
               "--max-num-seqs", "2"]  # fmt: skip
KINDS = ["hash", "radix"]
LLAMA_FIELDS = {"cache_prompt": True}  # llama.cpp's request field; ignored here (warned)


@dataclass
class Answer:
    tokens: list[str]
    margins: list[float]  # top-1 minus top-2 logprob at each generated token
    prompt_tokens: int
    cached_tokens: int
    details: dict[str, Any]  # usage.prompt_tokens_details


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def chat(server: RunningServer, messages: list[dict[str, str]], **extra: Any) -> Answer:
    out = client(server).chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0.0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True, **LLAMA_FIELDS, **extra},
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    margins = [e.top_logprobs[0].logprob - e.top_logprobs[1].logprob for e in content]
    details = out.usage.prompt_tokens_details
    return Answer([e.token for e in content], margins, out.usage.prompt_tokens,
                  details.cached_tokens, details.model_dump())  # fmt: skip


def complete(server: RunningServer, prompt: str, **extra: Any) -> Answer:
    out = client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=2,
        extra_body={"ignore_eos": True, **LLAMA_FIELDS, **extra},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    margins = []
    for top in lp.top_logprobs:
        first, second = sorted(top.values(), reverse=True)[:2]
        margins.append(first - second)
    details = out.usage.prompt_tokens_details
    return Answer(list(lp.tokens), margins, out.usage.prompt_tokens, details.cached_tokens,
                  details.model_dump())  # fmt: skip


def assert_same_answer(got: Answer, ref: Answer, what: str) -> None:
    """Greedy tokens equal to the cache-off reference up to its first near-tie."""
    safe = next((k for k, m in enumerate(ref.margins) if m < SAFE_MARGIN), len(ref.margins))
    assert safe >= MIN_COMPARED, (
        f"{what}: the reference has a near-tie at step {safe} (margin {ref.margins[safe]:.2g}); "
        "pick other prompts (not an engine fault)"
    )
    assert got.prompt_tokens == ref.prompt_tokens
    assert got.tokens[:safe] == ref.tokens[:safe], f"{what}: the answer differs from cache-off"


def tokenize(server: RunningServer, messages: list[dict[str, str]]) -> list[int]:
    body = {"model": "tiny", "messages": messages}
    return httpx.post(server.base_url + "/tokenize", json=body, timeout=30).json()["tokens"]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def full_blocks(prompt_tokens: int) -> int:
    """Tokens a repeat of a fully cached prompt reads from the cache (one is always computed)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def reference() -> Iterator[RunningServer]:
    """The same server with the prefix cache off: every answer computed from scratch."""
    running = start_server([*SERVER_ARGS, "--prefix-cache", "off"])
    yield running
    running.stop()


@pytest.fixture(scope="module", params=KINDS)
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    running = start_server([*SERVER_ARGS, "--prefix-cache", request.param])
    yield running
    running.stop()


# -- llama.cpp#27148 ----------------------------------------------------------------------------

TOPICS = ["maps", "tides", "bees", "clocks", "ferns", "kilns", "lutes", "moths"]


def conversation(i: int, turns: int) -> list[dict[str, str]]:
    """Conversation ``i``: its own system prompt (they differ from the first character, so two
    conversations share only the template's first 10 tokens, less than a block)."""
    topic = TOPICS[i]
    msgs = [
        {
            "role": "system",
            "content": f"{topic.upper()} desk {i}: you answer questions on {topic}.",
        },
        {"role": "user", "content": f"Where are the {topic} kept, and who looks after them?"},
    ]
    if turns == 2:
        msgs += [
            {"role": "assistant", "content": f"The {topic} are in room {i + 3}, with the keeper."},
            {"role": "user", "content": f"And how old are the oldest {topic}?"},
        ]
    return msgs


def test_llamacpp_27148_a_new_conversation_never_continues_an_unrelated_finished_one(
    server: RunningServer, reference: RunningServer
) -> None:
    """https://github.com/ggml-org/llama.cpp/issues/27148 — with ``--cache-ram`` and
    ``--cache-idle-slots`` (both on by default), two slots under concurrent load, a fresh slot
    serving a new request was given the KV of an unrelated, finished conversation and the model
    continued that conversation, while ``cached_tokens`` read 0.

    Cannot arise here: there are no slots whose state is swapped in as a whole. A request's
    cached prefix is found block by block in one index, each block's key chains every token
    before it (docs/block-key.md) and a hit compares the block's tokens, so a block only ever
    serves the exact prefix that computed it; a reused block is re-keyed, never read as the old
    prefix. Replayed: four conversations run and finish one after another, then, with two
    sequences at once, four new unrelated ones and the second turns of all eight, on a 32-block
    pool that evicts and reuses blocks throughout. Every answer equals the cache-off server's,
    ``cached_tokens`` never exceeds what the conversation's own other turn shares with it (two
    conversations share less than a block), and no block leaks.
    """
    first_turns = [conversation(i, 1) for i in range(8)]
    second_turns = [conversation(i, 2) for i in range(8)]
    expected = [chat(reference, m) for m in first_turns + second_turns]
    for msgs in first_turns[:4]:  # finished conversations, left in the cache
        chat(server, msgs)
    jobs = list(range(4, 16))  # four new conversations and every second turn, interleaved
    random.Random(27148).shuffle(jobs)
    everything = first_turns + second_turns
    with ThreadPoolExecutor(4) as pool:
        answers = dict(
            zip(jobs, pool.map(lambda j: chat(server, everything[j]), jobs), strict=True)
        )
    ids = [tokenize(server, m) for m in everything]
    assert max(common_prefix(ids[i], ids[k]) for i in range(8) for k in range(8) if i != k) < BLOCK
    for j, got in answers.items():
        assert_same_answer(got, expected[j], f"job {j}")
        # a hit can only be the conversation's own other turn: cross-conversation prefixes are
        # shorter than a block
        own = common_prefix(ids[j % 8], ids[j % 8 + 8]) // BLOCK * BLOCK
        assert got.cached_tokens % BLOCK == 0 and got.cached_tokens <= own, f"job {j}"
    wait_idle(server)
    stats = server.engine.stats()
    assert stats["evictions"] > 0  # the pool did reuse finished conversations' blocks
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    server.engine.cache.check_integrity()


# -- llama.cpp#28139 ----------------------------------------------------------------------------

DOC_A = "Shelf list A. " + " ".join(f"item {n} is a blue jar of {n * 7} seeds;" for n in range(4))
DOC_B = "Ledger B. " + " ".join(f"row {n} holds {n * 3} red coins and a key;" for n in range(4))


def test_llamacpp_28139_a_request_pinned_to_an_empty_slot_still_reads_the_cache(
    server: RunningServer, reference: RunningServer
) -> None:
    """https://github.com/ggml-org/llama.cpp/issues/28139 — with two slots and ``--cache-ram``,
    prompt A on slot 0, then prompt B on slot 0 (A moves to the RAM cache), then A pinned to the
    never-used slot 1 (``id_slot: 1``): ``cache_n`` 0, the whole prompt recomputed. An empty
    slot's keep-fraction was 0/0 = NaN, so the cache lookup was skipped; unpinned, or pinned to
    slot 0, A was a hit.

    Cannot arise here: there are no slots to pin to and no per-slot decision about whether to
    look; every request is matched against the one shared index, whatever ran before or runs
    beside it. The reporter's requests are sent as they were (``id_slot``, ``cache_prompt``,
    ignored by this server), on a server that runs two sequences at once: A repeated after B
    reads all its full blocks from the cache in each of the reporter's three variants, and its
    answer equals the cache-off one.
    """
    first = complete(server, DOC_A, id_slot=0)
    expected = complete(reference, DOC_A)
    assert_same_answer(first, expected, "A, cold")
    complete(server, DOC_B, id_slot=0)
    for variant in ({}, {"id_slot": 1}, {"id_slot": 0}):  # not pinned, the empty slot, slot 0
        again = complete(server, DOC_A, **variant)
        assert again.cached_tokens == full_blocks(again.prompt_tokens), variant
        assert_same_answer(again, expected, f"A again, {variant or 'not pinned'}")


# -- llama.cpp#26676 ----------------------------------------------------------------------------

REPORT = "Field report. " + " ".join(
    f"Day {n}: the north gauge read {n * 11 % 97} and the south one {n * 5 % 89}." for n in range(8)
)


@pytest.mark.parametrize("kind", KINDS)
def test_llamacpp_26676_kv_kept_across_a_restart_is_used_by_the_next_request(
    kind: str, reference: RunningServer, tmp_path: Path
) -> None:
    """https://github.com/ggml-org/llama.cpp/issues/26676 — a slot's KV saved to a file
    (``POST /slots/3?action=save``), the server restarted, ``action=restore`` reported every
    token restored, yet the next completion with the same prefix recomputed it all
    (``cache_n`` 0): the restored state never reached what the prompt matcher reads.

    We have no save/restore endpoint; the nearest is the disk tier (``--kv-disk``,
    docs/tiers.md), which writes every computed prompt block behind the pool and outlives the
    process. Holds: a block read back from disk is adopted into the pool and committed to the
    index before the request is scheduled, so the matcher finds it like any RAM hit. Replayed:
    a ~300-token completion, the server stopped and started again on the same directory, then
    the same prompt: every full block is a hit, counted as ``external_cached_tokens``, and the
    answer equals the cache-off one; the next turn, sharing it, finds those blocks in RAM.
    """
    args = [*SERVER_ARGS, "--prefix-cache", kind, "--kv-disk", str(tmp_path)]
    before = start_server(args)
    try:
        first = complete(before, REPORT)
        assert first.cached_tokens == 0
        assert before.engine.flush_tiers(30)  # the write-behind is asynchronous
    finally:
        before.stop()
    after = start_server(args)
    try:
        restored = complete(after, REPORT)
        blocks = full_blocks(first.prompt_tokens)
        assert restored.cached_tokens == restored.details["external_cached_tokens"] == blocks
        assert restored.details["local_cached_tokens"] == 0
        assert_same_answer(restored, complete(reference, REPORT), "the report after a restart")
        next_turn = complete(after, REPORT + " Day 8: both gauges were replaced.")
        assert next_turn.cached_tokens >= blocks  # the adopted blocks stay in the pool
        assert next_turn.details["external_cached_tokens"] == 0
    finally:
        after.stop()


# -- llama.cpp#21690 ----------------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_llamacpp_21690_cache_memory_stays_bounded_over_long_generations(
    server: RunningServer,
) -> None:
    """https://github.com/ggml-org/llama.cpp/issues/21690 — Gemma 4 in llama-server: every full
    prompt processing of a long conversation kept more host RAM for context checkpoints (and
    the mmproj), gigabytes per generation, until the server went out of memory after four or
    five; ``--ctx-checkpoints 0`` or ``1`` with ``-np 1`` kept it flat.

    Cannot arise here: the cache copies no KV. The pool's K/V tensors are allocated once, at
    start, for ``--num-kv-blocks``; a cached prefix is the very blocks that computed it, shared
    by reference count, and the index holds at most one entry per pool block. There is no
    sliding-window model or vision projector here; the scenario is the reporter's otherwise: a
    conversation that grows turn after turn until its prompt fills the pool, with an unrelated
    long prompt between turns, so each turn's prompt is mostly recomputed. The KV
    tensors are the same, the index never outgrows the pool, no block leaks, and the process'
    resident memory does not climb with the generations.
    """
    evictions = server.engine.stats()["evictions"]
    kv = server.engine.runner.kv_cache
    tensors = [(t.data_ptr(), t.numel()) for t in (*kv.k_caches, *kv.v_caches)]
    num_blocks = server.engine.cache.num_blocks
    history = [{"role": "system", "content": "You keep the long ledger of the western store."}]
    rss = []
    for turn in range(7):
        history.append({"role": "user", "content": f"Turn {turn}: add two grey sacks."})
        got = chat(server, history)
        assert got.prompt_tokens > 100 + 60 * turn  # grows to ~500 tokens: the whole pool
        history.append({"role": "assistant", "content": "Noted and filed."})
        complete(server, f"Unrelated {turn}. " + "a long ledger line; " * 20)  # evicts some
        wait_idle(server)
        cache = server.engine.cache
        assert cache.num_cached_blocks <= num_blocks
        assert cache.num_free_blocks == num_blocks  # everything idle again: nothing held
        rss.append(rss_bytes())
    assert server.engine.stats()["evictions"] > evictions  # the pool was full and recycled
    assert [(t.data_ptr(), t.numel()) for t in (*kv.k_caches, *kv.v_caches)] == tensors
    growth = max(rss[2:]) - rss[1]  # after the first turns have warmed the allocator
    assert growth < 64 << 20, f"resident memory grew by {growth >> 20} MiB over five generations"
    server.engine.cache.check_integrity()
