"""Batch invariance: a greedy request's tokens and log-probabilities are the same bits whatever
else is in its steps, however its prompt is chunked, and wherever its prefix came from (computed
now, read from the cache, loaded from a tier, recomputed after a preemption), in every dtype and
weight form the engine offers on this CPU. The specification's first debugging step ("reproduce
with the cache disabled") depends on it; vLLM #42019 and #54490 are prompt logprobs that changed
with the cache on.

Each comparison is of (token id, log-probability) pairs, exactly: the tiny model's top-1 gaps are
far above float noise, so a token would rarely flip, but a log-probability differs in its last bit
wherever a row's sums ran in another order. The kernels that make it hold, and what they cost,
are in docs/model.md ("Batch invariance").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefixcache import LLM, SamplingParams
from prefixcache.native import invariance

# (dtype, weight_dtype, kv_cache_dtype): every form a float32 checkpoint runs in (the GGUF file's
# own blocks are checked on the built-in SmolLM2 in tests/test_model_smollm2.py), and the
# quantized KV layouts, whose rows are quantized once, as written (the other layouts, with the
# bfloat16 model too: tests/test_kv_quant.py)
FORMS = [("float32", "auto", "auto"), ("bfloat16", "auto", "auto"),
         ("float32", "bfloat16", "auto"), ("float32", "q8_0", "auto"),
         ("float32", "auto", "int8"), ("float32", "auto", "int4")]  # fmt: skip
BS = 16
SHARED = list(range(40, 40 + 90))  # 5 full blocks and a part of one, shared by every prompt
PROMPTS = [SHARED + [200 + 3 * i + j for j in range(5 + 4 * i)] for i in range(5)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)

Answers = list[list[tuple[int, float]]]


def answers(outs: list[Any]) -> Answers:
    return [[(d["token_id"], d["logprob"]) for d in o.outputs[0].logprobs] for o in outs]


def one_at_a_time(llm: LLM, prompts: list[list[int]] = PROMPTS) -> Answers:
    return [answers(llm.generate([p], GREEDY))[0] for p in prompts]


def together(llm: LLM, prompts: list[list[int]] = PROMPTS) -> Answers:
    return answers(llm.generate(prompts, GREEDY))


def engine(dtype: str, weights: str, kv: str = "auto", **settings: Any) -> LLM:
    settings.setdefault("block_size", BS)
    return LLM(model="tiny", dtype=dtype, weight_dtype=weights, kv_cache_dtype=kv,
               check_integrity=True, **settings)


@pytest.fixture(autouse=True)
def invariant() -> None:
    assert invariance.enabled(), "PREFIXCACHE_BATCH_INVARIANT turns off what is tested here"


IDS = ["+".join(f).removesuffix("+auto") for f in FORMS]  # float32+auto, ..., float32+auto+int8


@pytest.fixture(scope="module", params=FORMS, ids=IDS)
def form(request: pytest.FixtureRequest) -> tuple[str, str, str]:
    return request.param


@pytest.fixture(scope="module")
def reference(form: tuple[str, str, str]) -> Answers:
    """Each prompt alone, the cache off: nothing shared, nothing chunked."""
    return one_at_a_time(engine(*form, enable_prefix_caching=False))


def test_batched_and_cached_answers_equal_one_at_a_time_uncached(form, reference) -> None:
    off = engine(*form, enable_prefix_caching=False)
    assert together(off) == reference  # a batch: other rows in every GEMM
    on = engine(*form)
    assert one_at_a_time(on) == reference  # each after the first hits the shared blocks
    on.reset_prefix_cache()
    assert together(on) == reference  # cold batch: decodes share the first prompt's blocks
    assert together(on) == reference  # warm: every prefill starts after a hit
    assert on.stats()["hit_tokens"] > 0
    radix = engine(*form, prefix_cache="radix")
    assert together(radix) == reference and together(radix) == reference


@pytest.mark.parametrize("budget", [7, 32, 64])
def test_any_prefill_chunking_gives_the_same_bits(form, reference, budget: int) -> None:
    # a step's token budget below a prompt's length splits its prefill into chunks, at places
    # unrelated to key blocks (7) or on them (32, 64), with decodes of other requests beside them
    chunked = engine(*form, max_num_batched_tokens=budget, max_num_seqs=3)
    assert together(chunked) == reference
    assert together(chunked) == reference


def test_preempted_and_recomputed_requests_give_the_same_bits(form, reference) -> None:
    # pools of 8-token blocks (not the reference's size) that two of these requests fill as they
    # decode: one is preempted, and its prompt and generated tokens are recomputed (or, with
    # the cache on, partly hit) when it resumes
    for caching, num_blocks in ((False, 26), (True, 18)):
        small = engine(*form, num_kv_blocks=num_blocks, block_size=8,
                       enable_prefix_caching=caching)
        assert together(small) == reference
        assert small.stats()["preemptions"] > 0


def test_a_prefix_loaded_from_the_disk_tier_gives_the_same_bits(form, reference,
                                                              tmp_path: Path) -> None:
    first = engine(*form, kv_disk=str(tmp_path))
    assert together(first) == reference
    assert first.engine.flush_tiers(30)
    first.engine.close()
    second = engine(*form, kv_disk=str(tmp_path))
    assert together(second) == reference
    assert second.stats()["tiers"]["engine"]["blocks_loaded_by_tier"].get("disk", 0) > 0


def test_a_later_turn_reading_decoded_blocks_equals_its_uncached_answer(form) -> None:
    # the second turn's prompt is the first's prompt and answer: with the cache on it reads
    # blocks whose KV was written by decode steps, with it off it computes them in a prefill
    first_turn = PROMPTS[0]  # 95 tokens: a 40-token answer writes blocks 6 and 7 whole
    on = engine(*form)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    answer = on.generate([first_turn], long)[0].token_ids
    second_turn = first_turn + answer + [7, 8, 9]
    cached = together(on, [second_turn])
    assert on.stats()["hit_tokens"] == 8 * BS
    assert cached == together(engine(*form, enable_prefix_caching=False), [second_turn])


def test_prompt_logprobs_equal_with_the_cache_off_cold_and_warm(form) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2,
                            logprobs=1)
    off = engine(*form, enable_prefix_caching=False).generate(PROMPTS, params)
    on = engine(*form)
    cold = on.generate(PROMPTS, params)
    warm = on.generate(PROMPTS, params)
    for a, b, c in zip(off, cold, warm, strict=True):
        assert a.prompt_logprobs == b.prompt_logprobs == c.prompt_logprobs
        assert answers([a]) == answers([b]) == answers([c])


def test_decode_rows_equal_the_prefill_of_the_same_tokens(form) -> None:
    # the log-probability of each generated token equals that token's prompt log-probability
    # when prompt and answer come back as one prompt: a decode row is a prefill row
    llm = engine(*form, enable_prefix_caching=False)
    (decoded,) = together(llm, [PROMPTS[2]])
    tokens = [t for t, _ in decoded]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (back,) = llm.generate([PROMPTS[2] + tokens], params)
    again = [(e["token_id"], e["logprob"]) for e in back.prompt_logprobs[len(PROMPTS[2]):]]
    assert again == decoded
