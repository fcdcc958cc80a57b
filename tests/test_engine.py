"""Engine end to end on the built-in tiny model (CPU): cache on == cache off, token for token.

Every engine here runs with ``check_integrity=True``: the cache's invariants are verified after
every step and every abort.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from prefixcache.engine import LLM, LLMEngine, SamplingParams
from prefixcache.model.loader import load_model

NUM_REQUESTS = 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def _workload(tiny, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """64 prompts over 4 shared system prompts, varied suffixes and output lengths."""
    rng = random.Random(seed)
    vocab = tiny.config.vocab_size
    systems = [[rng.randrange(3, 255) for _ in range(n)] for n in (37, 48, 61, 80)]
    prompts, max_tokens = [], []
    for i in range(NUM_REQUESTS):
        suffix = [rng.randrange(3, vocab - 8) for _ in range(rng.randint(1, 30))]
        prompts.append(systems[i % 4] + suffix)
        max_tokens.append(rng.randint(3, 12))
    return prompts, max_tokens


def _run(tiny, prompts, params, **engine_kwargs):
    """All requests at once; returns ({(request, choice): tokens}, {request: cached}, engine)."""
    engine_kwargs.setdefault("num_kv_blocks", 512)
    engine_kwargs.setdefault("check_integrity", True)
    engine = LLMEngine(tiny, **engine_kwargs)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, sampling_params=p)
    tokens: dict[tuple[str, int], list[int]] = defaultdict(list)
    cached: dict[str, int] = {}
    finished: set[tuple[str, int]] = set()
    while engine.has_unfinished():
        for out in engine.step():
            key = (out.request_id, out.index)
            assert key not in finished, "output after the choice finished"
            tokens[key].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
            if out.finished:
                finished.add(key)
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    return dict(tokens), cached, engine


def _greedy(max_tokens):
    return [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]


@pytest.fixture(scope="module")
def reference(tiny):
    prompts, max_tokens = _workload(tiny)
    tokens, cached, _ = _run(tiny, prompts, _greedy(max_tokens), enable_prefix_caching=False)
    assert not any(cached.values())
    assert all(1 <= len(tokens[(f"r{i}", 0)]) <= m for i, m in enumerate(max_tokens))
    return tokens


CONFIGS = {
    "ample": {},
    "small_pool": {"num_kv_blocks": 40, "block_size": 8},
    "chunk7": {"max_num_batched_tokens": 7},
}


@pytest.mark.parametrize("kind", ["hash", "radix"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_cache_on_equals_cache_off(tiny, reference, kind, config):
    prompts, max_tokens = _workload(tiny)
    tokens, cached, engine = _run(
        tiny, prompts, _greedy(max_tokens), prefix_cache=kind, **CONFIGS[config]
    )
    assert tokens == reference
    stats = engine.stats()
    assert stats["hit_tokens"] > 0 and sum(cached.values()) > 0
    if config == "small_pool":
        assert stats["evictions"] > 0
        assert stats["preemptions"] > 0
    if config == "chunk7":
        assert stats["num_steps"] > sum(len(p) for p in prompts[:4]) // 7


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_n3_seeded_cache_on_equals_cache_off(tiny, kind):
    prompts, max_tokens = _workload(tiny, seed=1)
    prompts, max_tokens = prompts[:16], max_tokens[:16]
    params = [
        SamplingParams(max_tokens=m, temperature=1.0, top_p=0.95, seed=100 + i, n=3)
        for i, m in enumerate(max_tokens)
    ]
    off, _, _ = _run(tiny, prompts, params, enable_prefix_caching=False)
    on, _, engine = _run(tiny, prompts, params, prefix_cache=kind, num_kv_blocks=48, block_size=8)
    assert on == off
    assert len(on) == 3 * len(prompts)
    distinct = sum(len({tuple(on[(f"r{i}", c)]) for c in range(3)}) > 1 for i in range(16))
    assert distinct >= 12  # the choices draw from independent seed streams
    assert engine.scheduler.num_block_copies > 0  # the shared partial block was copied on write


def test_seeded_sampling_is_reproducible_and_choice0_matches_n1(tiny):
    prompt = list(range(10, 50))
    one, _, _ = _run(tiny, [prompt], [SamplingParams(max_tokens=12, temperature=1.0, seed=7)])
    three, _, _ = _run(
        tiny, [prompt], [SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3)]
    )
    assert three[("r0", 0)] == one[("r0", 0)]
    again, _, _ = _run(tiny, [prompt], [SamplingParams(max_tokens=12, temperature=1.0, seed=7)])
    assert again == one


def test_evicted_prefix_gives_same_output(tiny):
    llm = LLM(tiny, num_kv_blocks=24, block_size=8, check_integrity=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = list(range(20, 100))
    first = llm.generate([prompt], greedy)[0]
    second = llm.generate([prompt], greedy)[0]
    assert second.num_cached_tokens == 72 and second.token_ids == first.token_ids
    evictions = llm.stats()["evictions"]
    llm.generate([[t + 1 for t in prompt], [t + 2 for t in prompt]], greedy)
    assert llm.stats()["evictions"] > evictions
    third = llm.generate([prompt], greedy)[0]
    assert third.num_cached_tokens < 72
    assert third.token_ids == first.token_ids


def test_fully_cached_block_aligned_prompt_recomputes_one_block(tiny):
    engine = LLMEngine(tiny, num_kv_blocks=64, block_size=16, check_integrity=True)
    prompt = list(range(30, 94))  # 64 tokens = 4 full blocks
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("a", prompt_token_ids=prompt, sampling_params=greedy)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", prompt_token_ids=prompt, sampling_params=greedy)
    engine.step()
    out = engine.last_scheduled
    assert [c.num_new_tokens for c in out.chunks] == [16]
    assert out.chunks[0].num_computed_tokens == 48


def test_abort_mid_prefill_leaves_cache_clean(tiny):
    engine = LLMEngine(
        tiny, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, check_integrity=True
    )
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("long", prompt_token_ids=list(range(3, 120)), sampling_params=greedy)
    engine.add_request("short", prompt_token_ids=list(range(5, 20)), sampling_params=greedy)
    engine.step()
    engine.step()
    (long,) = engine.get_request("long")
    assert 0 < long.num_computed_tokens < long.num_prompt_tokens
    assert engine.abort("long")
    engine.cache.check_integrity()
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    aborted = [o for o in outs if o.request_id == "long"]
    assert [(o.finished, o.finish_reason) for o in aborted] == [(True, "abort")]
    assert any(o.request_id == "short" and o.finish_reason == "length" for o in outs)
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    assert not engine.abort("long")


def test_different_token_ids_for_same_text_miss(tiny):
    """A tokenizer or chat-template change gives other token ids: a miss, never a wrong hit."""
    tok = tiny.tokenizer
    messages = [{"role": "user", "content": "Summarise the policy document for me, please."}]
    ids_a = tok.encode(tok.apply_chat_template(messages, chat_template=_TEMPLATE_A))
    ids_b = tok.encode(tok.apply_chat_template(messages, chat_template=_TEMPLATE_B))
    assert ids_a != ids_b and len(ids_a) > 32
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    llm = LLM(tiny, num_kv_blocks=64, block_size=8, check_integrity=True)
    llm.generate([ids_a], greedy)
    got = llm.generate([ids_b], greedy)[0]
    common = next(i for i, (a, b) in enumerate(zip(ids_a, ids_b, strict=False)) if a != b)
    assert got.num_cached_tokens <= common // 8 * 8
    off = LLM(tiny, num_kv_blocks=64, block_size=8, enable_prefix_caching=False)
    assert got.token_ids == off.generate([ids_b], greedy)[0].token_ids


_TEMPLATE_A = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
_TEMPLATE_B = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


def test_too_long_requests_get_clear_errors_and_disturb_nothing(tiny, reference):
    prompts, max_tokens = _workload(tiny)
    engine = LLMEngine(tiny, num_kv_blocks=64, block_size=16, check_integrity=True)
    greedy = _greedy(max_tokens)
    for i in range(4):
        engine.add_request(f"r{i}", prompt_token_ids=prompts[i], sampling_params=greedy[i])
    tokens: dict[str, list[int]] = defaultdict(list)
    for out in engine.step():
        tokens[out.request_id].extend(out.new_token_ids)
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("ctx", prompt_token_ids=[5] * 8190, sampling_params=greedy[0])
    with pytest.raises(ValueError, match="pool has only 64"):
        engine.add_request("pool", prompt_token_ids=[5] * 1100, sampling_params=greedy[0])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", prompt_token_ids=[], sampling_params=greedy[0])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("vocab", prompt_token_ids=[1, 10**6], sampling_params=greedy[0])
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("r0", prompt_token_ids=[1, 2], sampling_params=greedy[0])
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert set(tokens) == {f"r{i}" for i in range(4)}
    assert all(tokens[f"r{i}"] == reference[(f"r{i}", 0)] for i in range(4))


def test_llm_offline_api_and_stats(tiny):
    llm = LLM(tiny, block_size=16, num_kv_blocks=128, seed=0)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    text = "A shared system prompt that is comfortably longer than two blocks. "
    outs = llm.generate([text + "First?", text + "Second?"], greedy)
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert all(o.finish_reason == "length" and isinstance(o.text, str) for o in outs)
    again = llm.generate(text + "First?", greedy)
    assert again[0].token_ids == outs[0].token_ids and again[0].num_cached_tokens >= 64
    stats = llm.stats()
    assert stats["queries"] == 3 and stats["hit_tokens"] >= 64 + again[0].num_cached_tokens - 64
    assert set(stats["ttft"]) == {o.request_id for o in outs + again}
    assert all(t is not None and t > 0 for t in stats["ttft"].values())
    assert llm.reset_prefix_cache()
    assert llm.generate(text + "First?", greedy)[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(["fine", ""], greedy)
    assert not llm.engine.has_unfinished() or llm.engine.step() is not None


def test_n3_output_shape(tiny):
    llm = LLM(tiny, num_kv_blocks=64, block_size=8, check_integrity=True)
    params = SamplingParams(max_tokens=5, temperature=0.9, seed=3, n=3)
    (out,) = llm.generate([list(range(40, 61))], params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.token_ids == out.outputs[0].token_ids
    assert all(len(c.token_ids) == 5 for c in out.outputs)


def test_streamed_text_equals_final_text_with_a_stop_string(tiny):
    llm = LLM(tiny, num_kv_blocks=64, block_size=8)
    prompt = list(range(60, 90))
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    text = plain[0].text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].isprintable())
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    engine = llm.engine
    engine.add_request("s", prompt_token_ids=prompt, sampling_params=params)
    streamed, last = "", None
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.text
            last = out
    assert last.finished and last.finish_reason == "stop"
    assert streamed == text[: text.index(stop)]


def test_abort_n3_after_fork_frees_every_choice(tiny):
    engine = LLMEngine(tiny, num_kv_blocks=64, block_size=8, check_integrity=True)
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1, n=3, ignore_eos=True)
    engine.add_request("x", prompt_token_ids=list(range(40, 61)), sampling_params=params)
    engine.step()
    engine.step()
    assert len(engine.get_request("x")) == 3
    assert engine.abort("x")
    outs = engine.step()
    assert sorted((o.index, o.finish_reason) for o in outs) == [(i, "abort") for i in range(3)]
    assert outs[-1].request_finished
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
