"""SGLang serving reports (github.com/sgl-project/sglang) replayed against prefixcache.

This file covers four reports that users saw through the server, or that a router sees through
its KV events:
- #27504: output garbled on an L3 (lower-tier) hit.
- #35129: long agentic sessions get zero cached tokens on every turn.
- #39108: a router forgets a prefix whose device copy was demoted to a lower tier.
- #28801: ``cached_tokens`` is null instead of 0 on a miss.

Server scenarios run on a real server through the official ``openai`` SDK. The router scenario
feeds real engines' KV events, in their wire encoding, to the cache-aware rule that the Ray
cluster routes with. SGLang's cache is a radix tree, so every scenario runs on our radix cache
and on the hash cache.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from prefixcache.cache import Sequence
from prefixcache.engine import LLMEngine, SamplingParams
from prefixcache.server.kv_events import decode_batch, encode_batch
from prefixcache.sim.router import make_router
from server_harness import SAFE_MARGIN, RunningServer, start_server
from tier_helpers import ValkeyProcess, shared_url

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 16  # the servers' and engines' block size (serve's default)
CACHES = ["hash", "radix"]
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]  # fmt: skip


@pytest.fixture(scope="module", params=CACHES)
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """A server with a pool large enough for a long session (400 blocks, 6,400 tokens).
    Prefill is chunked at 512 tokens, so each turn of a long session is computed in chunks."""
    argv = "--model tiny --num-kv-blocks 400 --max-num-batched-tokens 512 --prefix-cache"
    running = start_server([*argv.split(), request.param])
    yield running
    running.stop()


@pytest.fixture(scope="module", params=CACHES)
def tiered(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """A small RAM pool (128 blocks) over a disk tier: our nearest equivalent of HiCache with an
    L3 backend. A prompt that is evicted from RAM is read back from the disk."""
    disk = tmp_path_factory.mktemp(f"disk-{request.param}")
    argv = "--model tiny --num-kv-blocks 128 --prefix-cache"
    running = start_server([*argv.split(), request.param, "--kv-disk", str(disk)])
    yield running
    running.stop()


def gpt(running: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused", max_retries=0)


def full_hit(num_prompt_tokens: int) -> int:
    """The cached tokens of a prompt sent a second time: all of its complete blocks except the
    block that holds its last token, which is always computed."""
    return (num_prompt_tokens - 1) // BS * BS


def cached_of(usage: Any) -> Any:
    """``usage.prompt_tokens_details.cached_tokens`` as the SDK parsed it. The value is None
    when the server sent null or left the field out."""
    details = usage.prompt_tokens_details
    return None if details is None else details.cached_tokens


def agentic_messages(label: str, files: int, file_lines: int = 12) -> list[dict[str, Any]]:
    """A coding agent's conversation. It has a system prompt, a task, and ``files`` rounds of an
    assistant ``read_file`` call followed by the tool's answer (a file's text)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"[{label}] You are a coding agent. Read before you edit."},
        {"role": "user", "content": "The tests in tests/test_parse.py fail; find out why."},
    ]
    for i in range(files):
        call = f"call_{label}_{i}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call, "type": "function",
             "function": {"name": "read_file",
                          "arguments": json.dumps({"path": f"src/mod{i}.py"})}}]})  # fmt: skip
        body = "".join(f"def f{i}_{n}(x):\n    return x * {n} + {i}\n" for n in range(file_lines))
        messages.append({"role": "tool", "tool_call_id": call, "content": body})
    return messages


# ---- sglang#27504: garbled output when HiCache's L3 (Mooncake) copy is loaded ------------------


def _same_answer(cold: Any, warm: Any) -> int:
    """Check that two greedy answers agree, step by step: the chosen token's logprob within
    2e-3, and the same token wherever the cold run's top-2 margin is safe (a near-tie can flip
    on float noise alone). Stops at the first unsafe step and returns the number of steps
    compared."""
    compared = 0
    for c, w in zip(cold.logprobs.content, warm.logprobs.content, strict=True):
        assert abs(c.logprob - w.logprob) < 2e-3, (compared, c, w)
        top = sorted((t.logprob for t in c.top_logprobs), reverse=True)
        if top[0] - top[1] <= SAFE_MARGIN:
            break
        assert c.token == w.token, (compared, c, w)
        compared += 1
    return compared


def test_sglang_27504_a_prefix_read_back_from_the_lower_tier_answers_as_the_cold_run(
    tiered: RunningServer,
) -> None:
    """https://github.com/sgl-project/sglang/issues/27504. GLM-5.1 ran with HiCache and a
    Mooncake L3 backend in AI-coding sessions with tool calls. Whenever the prefix was loaded
    from L3, the output was garbled: random characters and broken code. The issue is closed,
    fixed by #27550 ("fix(hiradix): wait for extra pool IO"). Load-back did not wait for a
    second KV pool's transfer, so attention read state that had not arrived yet. Mooncake#2236
    is the same family of bug: that store left out the indexer buffer.

    Here we run the same agentic conversation on a 128-block RAM pool over a disk tier. We send
    it cold, evict it from RAM with other sessions, and send it again, so the prefix comes back
    from the disk. The answer must match the cold run. This bug cannot arise here. A tier record
    is one block's complete KV, every layer's K and V in one payload, checked against the
    block's digest. The loader adopts a run of blocks only after the whole read has landed,
    and the request is not computed until then (engine/offload.py, "Load-ahead").
    """
    client = gpt(tiered)
    kind = type(tiered.engine.cache).__name__

    def ask(messages: list[dict[str, Any]]) -> Any:
        return client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=TOOLS,
            max_tokens=12,
            temperature=0.0,
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},
        )

    session = agentic_messages(f"27504-{kind}", files=2, file_lines=2)  # 66 blocks
    cold = ask(session)
    details = cold.usage.prompt_tokens_details
    assert details.cached_tokens == 0
    assert tiered.engine.flush_tiers(30)  # its blocks are on the disk
    for other in range(3):  # other sessions turn the RAM pool over
        ask(agentic_messages(f"27504-{kind}-other-{other}", files=2, file_lines=2))
    assert tiered.engine.flush_tiers(30)
    warm = ask(session)
    details = warm.usage.prompt_tokens_details
    assert details.cached_tokens == full_hit(warm.usage.prompt_tokens)
    # the disk serves almost all of it; the blocks the other sessions share with it (the
    # tool definitions) are still RAM hits
    assert details.model_extra["external_cached_tokens"] >= details.cached_tokens * 3 // 4
    assert _same_answer(cold.choices[0], warm.choices[0]) >= 4


# ---- sglang#35129: long agentic sessions get #cached-token: 0 on every turn ---------------------


def test_sglang_35129_every_turn_of_a_long_agentic_session_hits_the_previous_turns_prefix(
    server: RunningServer,
) -> None:
    """https://github.com/sgl-project/sglang/issues/35129. On DeepSeek-V4-Flash with DSPARK
    and HiCache, Claude Code sessions of about 110K tokens got ``#cached-token: 0`` on every
    turn. More than half of each prompt was a stable prefix, and short requests in the same
    window hit about 98% of the time. The reporter traced it to the sliding-window (SWA)
    component's match validator. A long prefix is almost all SWA tombstones, and the validator
    vetoed a match on them when no SWA host pool was configured. The issue is closed.

    Here we run a coding agent's session through the chat API with tools. Each turn resends
    the whole conversation plus a tool call and a file. The session grows past 4,000
    tokens, and prefill is chunked at 512 tokens. Short requests are interleaved between the
    turns. Each turn must hit at least the complete blocks of the previous turn's prompt. This
    bug cannot arise here. Our model has no sliding-window layers, and a cached block holds
    every layer's K and V. No component of a block is dropped apart from the others, so
    nothing can veto a match that the block digests make.
    """
    client = gpt(server)
    kind = type(server.engine.cache).__name__
    messages = agentic_messages(f"35129-{kind}", files=0)
    short = [{"role": "user", "content": f"[35129-{kind}] What does `git status` do?"}]
    previous = 0
    for turn in range(7):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, max_tokens=8, temperature=0.0
        )
        usage = reply.usage
        cached = cached_of(usage)
        if turn == 0:
            assert cached == 0
        else:
            assert previous // BS * BS <= cached < usage.prompt_tokens, (turn, usage)
        previous = usage.prompt_tokens
        quick = client.chat.completions.create(model="tiny", messages=short, max_tokens=2)
        if turn:
            assert cached_of(quick.usage) == full_hit(quick.usage.prompt_tokens)
        call = f"call_{kind}_{turn}"
        function = {"name": "read_file", "arguments": json.dumps({"path": f"src/m{turn}.py"})}
        messages.append(
            {
                "role": "assistant",
                "content": reply.choices[0].message.content,
                "tool_calls": [{"id": call, "type": "function", "function": function}],
            }
        )
        body = "".join(f"def g{turn}_{n}(x):\n    return x + {n}\n" for n in range(25))
        messages.append({"role": "tool", "tool_call_id": call, "content": body})
    assert previous > 4000  # the last turn's prompt: a long session, chunked at 512 tokens


# ---- sglang#39108: the router drops a worker's prefix when its device copy is demoted ----------


def _generate(engine: LLMEngine, prompt: list[int], rid: str) -> Any:
    engine.add_request(
        rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                last = out
    assert last is not None and last.finished
    return last


@pytest.fixture(scope="module")
def valkey() -> Iterator[str]:
    url = shared_url()
    if url is not None:
        yield url
        return
    process = ValkeyProcess().start()
    yield process.url
    process.stop()


@pytest.mark.parametrize("tier", ["disk", "valkey"])
@pytest.mark.parametrize("kind", CACHES)
def test_sglang_39108_a_prefix_demoted_from_ram_to_a_lower_tier_still_routes_to_a_holder(
    kind: str, tier: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """https://github.com/sgl-project/sglang/pull/39108 (a PR, merged 2026-09; the series
    #39108-#39111). With a hierarchical cache, an engine publishes a device-tier
    ``BlockRemoved`` when a block is demoted to host memory. The router's cache-aware tree
    applied every ``BlockRemoved`` as a full removal. Every prefix became unroutable after one
    device turnover, about 15 minutes, although the host tier kept it for about 2 hours.
    Repeats went to the least-loaded pod and were prefilled cold.

    Here two replicas are two real engines, each a 24-block RAM pool over a lower tier. The
    tier is either each replica's own disk (per replica, like SGLang's host memory) or one
    shared Valkey. Their KV events pass through the wire encoding that
    ``serve --replicas N --router cache-aware`` reads (`cluster.feed`) into that router's
    rule. A prompt runs on replica 0, is written to the tier, and then leaves RAM as other
    prompts turn the pool over. Both replicas are equally loaded. The repeat must go to a
    replica whose cache or tier holds the prompt, and that replica must serve it as a hit, not
    prefill it cold.
    """
    settings: dict[str, Any] = {"block_size": BS, "num_kv_blocks": 24}
    settings.update(prefix_cache=kind, kv_events=True)
    if tier == "disk":
        replicas = [LLMEngine("tiny", kv_disk=str(tmp_path / f"replica{i}"), **settings)
                    for i in range(2)]  # fmt: skip
    else:
        url = request.getfixturevalue("valkey")
        replicas = [LLMEngine("tiny", kv_valkey=url, **settings) for _ in range(2)]
    for engine in replicas:
        request.addfinalizer(engine.close)
    router = make_router("cache-aware", 2)

    def publish(replica: int) -> None:
        """What the router's event feed does with one step's batch from ``replica``."""
        payload = encode_batch(replicas[replica].take_kv_events(), 0.0, with_tokens=False)
        router.observe(replica, decode_batch(payload)[1])

    def route(prompt: list[int], rid: str) -> tuple[int, Any]:
        digests = replicas[0].cache_identity.block_digests(Sequence(rid, prompt))
        chosen = router.choose(digests[: len(prompt) // BS], [0, 0])
        out = _generate(replicas[chosen], prompt, rid)
        assert replicas[chosen].flush_tiers(30)
        publish(chosen)
        return chosen, out

    rng = random.Random(uuid.uuid4().int)  # prompts no earlier run left in a shared Valkey

    def fresh() -> list[int]:
        return [rng.randrange(1, 250) for _ in range(161)]  # 10 complete blocks

    prompt = fresh()
    first, out = route(prompt, "first")
    assert out.num_cached_tokens == 0
    for n in range(3):  # replica 0's RAM turns over; the prompt is left only in its tier
        _generate(replicas[first], fresh(), f"other{n}")
        assert replicas[first].flush_tiers(30)
        publish(first)
    chosen, again = route(prompt, "again")
    assert again.num_cached_tokens == 160, (
        f"the repeat went to replica {chosen}, which prefilled it cold; replica {first} "
        "holds it in its lower tier"
    )
    assert again.num_external_cached_tokens == 160  # from the tier, as the RAM copy is gone


# ---- sglang#28801: a zero cache hit is reported as null ----------------------------------------


def _complete(client: openai.OpenAI, endpoint: str, mode: str, text: str) -> list[Any]:
    """Send one request and return every usage object in its answer (one per chunk with usage
    when streamed)."""
    common: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "temperature": 0.0}
    if mode == "n=2":
        common["n"] = 2
    if mode.startswith("stream"):
        common["stream"] = True
        common["stream_options"] = {"include_usage": True}
        if mode == "stream+continuous_usage_stats":
            common["stream_options"]["continuous_usage_stats"] = True
    if endpoint == "chat":
        answer = client.chat.completions.create(
            messages=[{"role": "user", "content": text}], **common
        )
    else:
        answer = client.completions.create(prompt=text, **common)
    if not mode.startswith("stream"):
        return [answer.usage]
    chunks = list(answer)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # include_usage's chunk
    if mode == "stream+continuous_usage_stats":
        assert any(c.choices and c.usage is not None for c in chunks[:-1])
    return [c.usage for c in chunks if c.usage is not None]


@pytest.mark.parametrize("mode", ["plain", "n=2", "stream", "stream+continuous_usage_stats"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_sglang_28801_cached_tokens_is_an_integer_zero_on_a_miss_and_the_hit_on_a_hit(
    server: RunningServer, endpoint: str, mode: str
) -> None:
    """https://github.com/sgl-project/sglang/pull/28801 (an open PR, not an issue). With
    ``--enable-cache-report``, a hit of zero came back as ``prompt_tokens_details: null``,
    which looks the same as reporting turned off. Continuous-usage chunks of the legacy
    Completions stream also dropped the cache details. vLLM had the same class of bug (#44961,
    a falsy ``if num_cached_tokens``).

    Here we use the official SDK on chat and completions: plain, ``n=2``, streamed with
    ``include_usage``, and streamed with ``continuous_usage_stats``. A new prompt, then the
    same prompt again. Every usage object must carry ``cached_tokens`` as an integer: 0 on the
    miss and the complete-block hit on the repeat. This bug cannot arise here. The usage block
    always builds ``prompt_tokens_details`` with ``cached_tokens`` from the request's own count
    (server/protocol.py ``usage``), and cache reporting has no off switch. The test guards
    against a later change that leaves out a zero.
    """
    client = gpt(server)
    text = f"{uuid.uuid4().hex} is this prompt cached? " * 3
    for attempt in ("miss", "hit"):
        usages = _complete(client, endpoint, mode, text)
        expected = 0 if attempt == "miss" else full_hit(usages[-1].prompt_tokens)
        for usage in usages:
            cached = cached_of(usage)
            assert type(cached) is int, (attempt, usage)
            assert cached == expected, (attempt, usage)
        if attempt == "hit":
            assert expected > 0
