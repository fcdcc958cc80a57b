"""vLLM prefix-caching bugs that users reported, replayed against prefixcache.

One test per upstream thread, named after it: prompt logprobs that changed with request order
(#42019), host memory that grew with every request (#44237, a PR for #44175), partial blocks
that pushed cached prefixes out of an LRU (#42656), prefix-cache bookkeeping that grew with the
whole prompt on every prefill chunk (#55749), a failed lower-tier load that wedged a request
(#49176) and ``cached_tokens`` that counted KV the request computed itself (#43370). Each runs the
reporter's scenario through the surface they used (the offline engine, the HTTP server with the
official ``openai`` SDK, or the cache contract) and asserts what they expected to see; where our
design cannot produce the bug, the docstring says which mechanism rules it out.
"""

from __future__ import annotations

import collections
import os
import random
import time
import tracemalloc
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from prefixcache import LLM, SamplingParams
from prefixcache.cache import Sequence, make_prefix_cache
from prefixcache.engine import LLMEngine
from prefixcache.engine.output_processor import MAX_HISTORY
from prefixcache.model.loader import load_model
from prefixcache.server.dashboard.state import MAX_NODES, CacheView
from server_harness import RunningServer, start_server, wait_idle
from tier_helpers import record_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 16


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_model("tiny")


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server(["--model", "tiny", "--block-size", str(BS), "--num-kv-blocks", "64"])
    yield running
    running.stop()


@pytest.fixture(scope="module")
def tiered_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A small pool (preemption), chunked prefill of 32 tokens a step, and a disk tier."""
    disk = tmp_path_factory.mktemp("kv-disk")
    running = start_server(
        [
            "--model",
            "tiny",
            "--block-size",
            str(BS),
            "--num-kv-blocks",
            "16",
            "--max-num-batched-tokens",
            "32",
            "--kv-disk",
            str(disk),
        ]
    )
    yield running
    running.stop()


def _client(running: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=running.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


# ---- vllm#42019 ------------------------------------------------------------------------------

SCORED = [  # fixed token ids, as the reporter's; two share a 2-block prefix
    [(7 * i + 11) % 250 + 3 for i in range(40)],
    [(7 * i + 11) % 250 + 3 for i in range(32)] + [(13 * i + 5) % 250 + 3 for i in range(8)],
    [(29 * i + 1) % 250 + 3 for i in range(40)],
    [(3 * i + 100) % 250 + 3 for i in range(37)],
]


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_vllm_42019_prompt_logprobs_do_not_depend_on_request_order(tiny, kind: str) -> None:
    """https://github.com/vllm-project/vllm/issues/42019 (open; fix PR #42245, open).

    Scoring fixed-token prompts with ``prompt_logprobs`` and ``max_tokens=1``, then scoring the
    same prompts in another order, changed per-token logprobs with prefix caching on (exact zeros
    with it off): the PR traces it to an output buffer (``torch.empty``) whose rows for the
    cached prefix kept an earlier request's values. Here it cannot arise: a request asking for
    prompt logprobs reads no cache hit (``Sequence.reads_cache`` is False) and computes every
    prompt position itself; each position's entry is written from that forward pass's own logits
    row (`record_prompt_logprobs`), never from a reused buffer, and the kernels are batch
    invariant, so the values are the same bits in any order, warm or cold, cache on or off.
    """
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    off = LLM(tiny, block_size=BS, enable_prefix_caching=False)
    reference = [o.prompt_logprobs for o in off.generate(SCORED, scoring)]

    on = LLM(tiny, block_size=BS, prefix_cache=kind, check_integrity=True)
    forward = on.generate(SCORED, scoring)
    backward = on.generate(SCORED[::-1], scoring)[::-1]  # every prompt's blocks cached by now
    for outs in (forward, backward):
        assert [o.num_cached_tokens for o in outs] == [0] * len(SCORED)  # no hit read
        for i, out in enumerate(outs):
            assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
            assert out.prompt_logprobs == reference[i], f"prompt {i} scored differently"
    # the scoring requests did cache their blocks: a plain request is a hit, so the cache was live
    plain = on.generate([SCORED[0]], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert plain.num_cached_tokens == 2 * BS


# ---- vllm#44237 (PR for #44175) --------------------------------------------------------------

_OPAQUE = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    types.FrameType,
    torch.Tensor,
    torch.nn.Module,
)
_SIZED = (list, dict, set, frozenset, tuple, collections.deque)


def _container_sizes(root: object) -> dict[str, int]:
    """Every list, dict, set, tuple and deque reachable from ``root`` through attributes, slots
    and items (not through modules, classes, functions, tensors or the model), by its first path
    found: path -> length. The same path names the same container run after run, so growth
    between two censuses is growth of one container."""
    seen: set[int] = set()
    sizes: dict[str, int] = {}
    stack: list[tuple[object, str]] = [(root, "engine")]
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, _SIZED):
            sizes.setdefault(path, len(obj))
        if isinstance(obj, dict):
            # keys that are request ids would make a path per request: items share one path
            stack.extend((v, f"{path}[]") for v in obj.values())
        elif isinstance(obj, _SIZED):
            stack.extend((v, f"{path}[]") for v in obj)
        else:
            for name, value in getattr(obj, "__dict__", {}).items():
                stack.append((value, f"{path}.{name}"))
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        stack.append((getattr(obj, name), f"{path}.{name}"))
    return sizes


def test_vllm_44237_max_tokens_1_requests_leave_no_growing_host_state(
    server: RunningServer,
) -> None:
    """https://github.com/vllm-project/vllm/pull/44237 (closed unmerged; its issue #44175 was
    fixed by #44490).

    A 12-hour ``max_tokens=1`` classification load (short shared template, unique reviews)
    against an OpenAI server with prefix caching grew host RSS linearly, ~90 bytes per request,
    until latency stepped up. #44237 blamed stale block hashes left in the digest map; the
    merged fix found a per-block list (``new_block_ids``) appended on every allocation and
    drained only for Mamba models. Here the same load runs through the server, and a census of
    every container the engine reaches (scheduler, cache, pool, index, observers, output
    processor) is taken three times: none may grow with the request count, except the stores
    that are bounded by design (finished-request timing, the evicted-block fate log, the
    dashboard's block map), which must stay under their bounds; the digest map never holds more
    entries than the pool has blocks, and every cache invariant holds.
    """
    engine = server.engine
    client = _client(server)
    rng = random.Random(44175)
    words = ["good", "bad", "slow", "fast", "great", "awful", "fine", "broken", "cheap", "loud"]

    def classify(n: int) -> None:
        reviews = [
            " ".join(rng.choice(words) for _ in range(rng.randrange(8, 30))) for _ in range(n - 1)
        ]
        for review in [*reviews, "the same last review every round"]:  # the same last step
            out = client.completions.create(
                model="tiny",
                max_tokens=1,
                temperature=0.0,
                prompt=f"Label the review positive or negative.\nReview: {review}\nLabel:",
            )
            assert out.usage is not None and out.usage.completion_tokens == 1
        wait_idle(server)

    per_round = 60
    classify(per_round)  # the pool fills and evicts: a steady state
    censuses = []
    for _ in range(3):
        censuses.append(_container_sizes(engine))
        classify(per_round)
    # the stores that keep something per request on purpose, each under its own bound (by the
    # container's attribute name): finished-request timing, evicted-block fates, dashboard blocks
    bounds = {
        "history": MAX_HISTORY,
        "_gone": engine.cache.allocator.fates.max_entries,
        "_nodes": MAX_NODES,
    }
    a, b, c = censuses
    growing = {
        path: (a[path], b[path], c[path])
        for path in a.keys() & b.keys() & c.keys()
        if b[path] - a[path] >= per_round // 2 and c[path] - b[path] >= per_round // 2
    }
    unbounded = {p: sizes for p, sizes in growing.items() if p.rsplit(".", 1)[-1] not in bounds}
    assert not unbounded, f"containers growing with every request: {unbounded}"
    for path, sizes in growing.items():
        assert max(sizes) <= bounds[path.rsplit(".", 1)[-1]], (path, sizes)
    assert engine.cache.index.num_cached <= engine.cache.num_blocks
    engine.cache.check_integrity()


# ---- vllm#42656 ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_vllm_42656_partial_blocks_never_evict_a_cached_prefix(tiny, kind: str) -> None:
    """https://github.com/vllm-project/vllm/pull/42656 (merged 2026-06-16).

    vLLM's free queue was one LRU for every freed block, so blocks with no hash (a request's
    partial last block, never reusable) queued behind cached prefixes: a wave of short requests
    freed its hashless blocks to the tail, the next wave took the cached prefix from the head,
    and a prompt that should have hit missed (the PR's runs: ``prefix_cache_hits 0`` on
    alternating prompts; a whole H100 cache evicted by concurrent prompts' partial blocks). The
    fix puts hashless blocks at the head. Here the pool has always kept them apart: a freed block
    without a digest goes to the head of the uncached queue, and `BlockPool.take` drains that
    queue before it evicts any cached block. The scenario: a 6-block prefix is cached, then two
    waves of one-block requests use the rest of the pool twice over; the prefix must still hit.
    """
    prefix_prompt = [(17 * i + 5) % 250 + 3 for i in range(6 * BS + 4)]  # 6 full blocks + 4
    waves = [
        [[(31 * j + 101 * w + 7 * k) % 250 + 3 for k in range(10)] for j in range(9)]
        for w in range(2)
    ]  # 9 requests of 10 + 4 tokens: one partial block each
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # 7 blocks for the prefix prompt + 9 for a wave = the whole pool
    llm = LLM(tiny, block_size=BS, num_kv_blocks=16, prefix_cache=kind, check_integrity=True)
    first = llm.generate([prefix_prompt], params)[0]
    for wave in waves:
        assert [o.num_cached_tokens for o in llm.generate(wave, params)] == [0] * len(wave)
    again = llm.generate([prefix_prompt], params)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 6 * BS, "the partial blocks evicted the cached prefix"
    assert again.token_ids == first.token_ids
    assert llm.engine.stats()["evictions"] == 0


# ---- vllm#55749 ------------------------------------------------------------------------------


@pytest.mark.parametrize("observer", ["bare", "server-dashboard"])
@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_vllm_55749_committing_a_prefill_chunk_costs_the_chunk_not_the_prompt(
    kind: str, observer: str
) -> None:
    """https://github.com/vllm-project/vllm/pull/55749 (open, opened 2026-09-07).

    ``BlockPool.cache_full_blocks`` sliced every remaining hash of the request on each prefill
    chunk, although it only registers the chunk's newly full blocks: over a long prompt the
    hashes materialized grow quadratically with its length (reported alongside 1M-token prompts
    that missed the cache, #54094). Our digests are computed once per block as the sequence grows
    (`Sequence.digests`), and `commit` registers blocks ``start .. end`` of the chunk only. The
    test prefills a 2,048-block prompt in 4-block chunks through the cache contract (as the
    scheduler does) and measures what each ``commit`` allocates: the last chunk's commit may not
    allocate more than the first's. ``server-dashboard`` attaches the observer the HTTP server
    attaches to its cache (`CacheView`, the live dashboard), as a served prompt has it.
    """
    num_blocks, chunk = 2048, 4 * BS
    cache = make_prefix_cache(kind, num_blocks=num_blocks + 8, block_size=BS)
    if observer == "server-dashboard":
        cache.add_observer(CacheView(cache.identity, lambda domain: domain))
    seq = Sequence("long", [(i * 7919) % 50_000 for i in range(num_blocks * BS + 1)])
    assert cache.allocate(seq, chunk, cache.match(seq)) is not None
    transient: list[int] = []  # bytes each commit allocated at its peak
    done = chunk
    tracemalloc.start()
    try:
        while done < seq.num_tokens:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            cache.commit(seq, done)
            transient.append(tracemalloc.get_traced_memory()[1] - before)
            step = min(chunk, seq.num_tokens - done)
            assert cache.allocate(seq, step, None) is not None
            done += step
    finally:
        tracemalloc.stop()
    cache.commit(seq, done)
    assert len(transient) == num_blocks * BS // chunk
    head, tail = max(transient[:8]), max(transient[-8:])
    assert tail <= head + 2048, (
        f"a commit near the end of the prompt allocated {tail} bytes, near the start {head}: "
        "registering a chunk touches the whole prompt"
    )
    cache.free(seq)
    cache.check_integrity()


# ---- vllm#49176 ------------------------------------------------------------------------------

TIER_PROMPT = [(i * 37) % 250 + 3 for i in range(161)]  # 10 complete blocks below the last token
TIER_OTHER = TIER_PROMPT[: 7 * BS] + [(i * 11) % 250 + 3 for i in range(40)]  # shares 7 blocks


def _run_together(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, Any]:
    """Add every prompt at once and step until all finish (counting the steps)."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt_token_ids=prompt, sampling_params=params)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    last: dict[str, Any] = {}
    steps = 0
    deadline = time.monotonic() + 60
    while engine.has_unfinished():
        assert time.monotonic() < deadline, f"still unfinished after {steps} steps: a livelock"
        steps += 1
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            last[out.request_id] = out
    return {
        "tokens": tokens,
        "steps": steps,
        "external": {rid: out.num_external_cached_tokens for rid, out in last.items()},
    }


def test_vllm_49176_a_failed_tier_load_is_a_miss_not_a_livelock(tiny, tmp_path: Path) -> None:
    """https://github.com/vllm-project/vllm/issues/49176 (closed; fixed by #49328,
    merged).

    With the KV offloading connector, a secondary-tier block whose file was truncated, deleted
    or unreadable after it was indexed kept its cached "hit" verdict: the scheduler scheduled
    the promotion, the load failed, the next step saw the same hit, forever, and every request
    overlapping that block was wedged with it. Here a request is sent to the loader once
    (`TierTraffic.start_load`); the disk tier checks every record it reads, a record that fails
    is quarantined and ends the run there, and the request is queued with what was loaded, the
    rest computed. The scenario: a 10-block prompt is written to disk, a fresh engine indexes
    it, then block 4's file is truncated and two requests overlapping it arrive together. Both
    must finish in bounded steps with the cold answer, each loaded at most its 4 good blocks,
    the bad file is read once, and once the recomputed block is written back a later engine
    hits all 10 blocks (the failure is not remembered as a permanent miss).
    """
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cold = LLM(tiny, block_size=BS, enable_prefix_caching=False)
    expected = {
        rid: out.token_ids
        for rid, out in zip(
            ("a", "b"), cold.generate([TIER_PROMPT, TIER_OTHER], params), strict=True
        )
    }

    def tiered() -> LLMEngine:
        return LLMEngine(tiny, block_size=BS, kv_disk=str(tmp_path), check_integrity=True)

    first = tiered()
    _run_together(first, {"a": TIER_PROMPT})
    assert first.flush_tiers(30)
    first.close()
    assert len(record_files(tmp_path)) == 10

    second = tiered()  # its index names all ten records; now one goes bad on disk
    chain = second.cache_identity.block_digests(Sequence("probe", TIER_PROMPT))
    path = second.tiers.offload.store.tiers[0].path_of(chain[4])  # type: ignore[union-attr]
    os.truncate(path, os.path.getsize(path) // 2)
    run = _run_together(second, {"a": TIER_PROMPT, "b": TIER_OTHER})
    assert run["tokens"] == expected
    assert run["steps"] < 50
    assert run["external"]["a"] == 4 * BS  # the good run before the bad record
    assert 0 <= run["external"]["b"] <= 4 * BS
    stats = second.stats()["tiers"]
    assert stats["engine"]["loads"] == 2  # one per request: no retry loop
    assert stats["tiers"]["disk"]["quarantined"] == 1
    assert second.flush_tiers(30)  # the recomputed blocks go back to the disk, intact
    second.close()

    third = tiered()
    again = _run_together(third, {"a": TIER_PROMPT})
    assert again["tokens"] == {"a": expected["a"]}
    assert again["external"] == {"a": 10 * BS}
    third.close()


# ---- vllm#43370 ------------------------------------------------------------------------------


def _details(out: Any) -> dict[str, int]:
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    details = out.usage.prompt_tokens_details.model_dump()
    return {
        k: details[k] for k in ("cached_tokens", "local_cached_tokens", "external_cached_tokens")
    }


def test_vllm_43370_cached_tokens_count_only_kv_computed_before_the_request(
    tiered_server: RunningServer,
) -> None:
    """https://github.com/vllm-project/vllm/issues/43370 (closed as stale, no fix merged;
    related PR #46898 open).

    In disaggregated prefill/decode, the decode node counted every KV block it received from
    the prefill node as a cache hit, so a cold, unique prompt reported
    ``prompt_tokens_details.cached_tokens = prompt_tokens - 1``. We have no P/D split; the same
    miscount would come from KV the request produced itself and then read back: its own earlier
    prefill chunks, its own blocks re-hit after a preemption, or blocks moved through a lower
    tier. ``num_cached_tokens`` is the hit at the request's first admission, nothing after. Over
    the HTTP API (chunked prefill of 32 tokens, a 16-block pool, a disk tier): a cold prompt
    reports 0; a repeat reports the block-aligned prefix from RAM, and after a reset the same
    from the disk, split as ``local`` and ``external``; cold requests that are preempted and
    resume on their own blocks report 0.
    """
    client, engine = _client(tiered_server), tiered_server.engine
    prompt = [(i * 53 + 9) % 250 + 3 for i in range(150)]  # 5 chunks; 9 complete blocks below
    cold = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0.0)
    assert cold.usage is not None and cold.usage.prompt_tokens == len(prompt)
    assert _details(cold) == {
        "cached_tokens": 0,
        "local_cached_tokens": 0,
        "external_cached_tokens": 0,
    }

    aligned = (len(prompt) - 1) // BS * BS
    wait_idle(tiered_server)
    assert engine.flush_tiers(30)
    local = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0.0)
    assert _details(local) == {
        "cached_tokens": aligned,
        "local_cached_tokens": aligned,
        "external_cached_tokens": 0,
    }
    assert local.choices[0].text == cold.choices[0].text

    assert httpx.post(tiered_server.base_url + "/reset_prefix_cache", timeout=30).is_success
    external = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0.0)
    assert _details(external) == {
        "cached_tokens": aligned,
        "local_cached_tokens": 0,
        "external_cached_tokens": aligned,
    }
    assert external.choices[0].text == cold.choices[0].text

    # four cold requests that cannot all fit the pool: some are preempted and resume on their
    # own committed blocks, which are not a cache hit of theirs
    preempted_before = engine.stats()["preemptions"]
    prompts = [[(i * 7 + 40 * j + 1) % 250 + 3 for i in range(40)] for j in range(4)]
    out = client.completions.create(
        model="tiny",
        prompt=prompts,
        max_tokens=60,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None and out.usage.prompt_tokens == sum(map(len, prompts))
    assert _details(out) == {
        "cached_tokens": 0,
        "local_cached_tokens": 0,
        "external_cached_tokens": 0,
    }
    assert engine.stats()["preemptions"] > preempted_before, "no preemption: resize the pool"
