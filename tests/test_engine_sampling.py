"""Sampling controls and log probabilities in the engine.

The batched logits processors are checked against a plain per-row reference of vLLM's rules
(hypothesis); prompt and sample logprobs against transformers' own log-softmax on the same
weights; the controls end to end through `LLM` (best_of, min_tokens, stop strings, neutral
values bit-identical to none, prompt logprobs identical with the cache off, cold and warm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import LLM, SamplingParams
from prefixcache.engine.logits_processors import apply_logits_processors
from prefixcache.model.byte_tokenizer import write_byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 12
EOS = (3,)


@dataclass
class _State:
    params: SamplingParams
    prompt: list[int]
    output_token_ids: list[int] = field(default_factory=list)

    def unique_prompt_ids(self) -> torch.Tensor:
        return torch.unique(torch.tensor(self.prompt, dtype=torch.long))


def _reference(row: list[float], s: _State) -> list[float]:
    """vLLM's rules, one token at a time, in the documented order."""
    p = s.params
    out = list(row)
    for token, bias in (p.logit_bias or {}).items():
        out[token] += bias
    if len(s.output_token_ids) < p.min_tokens:
        for token in {*(() if p.ignore_eos else EOS), *p.stop_token_ids}:
            out[token] = -math.inf
    seen = set(s.prompt) | set(s.output_token_ids)
    for token in seen:
        r = p.repetition_penalty
        out[token] = out[token] / r if out[token] > 0 else out[token] * r
    for token in set(s.output_token_ids):
        count = s.output_token_ids.count(token)
        out[token] -= count * p.frequency_penalty + p.presence_penalty
    return out


_params = st.builds(
    lambda bias, min_tokens, rep, freq, pres, stops: SamplingParams(
        max_tokens=8, logit_bias=bias or None, min_tokens=min_tokens, repetition_penalty=rep,
        frequency_penalty=freq, presence_penalty=pres, stop_token_ids=stops),
    st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3),
    st.integers(0, 4),
    st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    st.sampled_from([0.0, -1.0, 0.7, 2.0]),
    st.sampled_from([0.0, 1.5, -0.4]),
    st.lists(st.integers(0, VOCAB - 1), max_size=2),
)
_state = st.builds(_State, _params, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
                   st.lists(st.integers(0, VOCAB - 1), max_size=6))


@settings(max_examples=200, deadline=None)
@given(st.lists(_state, min_size=1, max_size=5), st.randoms())
def test_batched_processors_equal_the_per_row_reference(states: list[_State], rnd) -> None:
    logits = torch.tensor([[rnd.uniform(-5, 5) for _ in range(VOCAB)] for _ in states])
    expected = [_reference(row, s) for row, s in zip(logits.tolist(), states, strict=True)]
    got = apply_logits_processors(logits.clone(), states, EOS).tolist()
    for got_row, want_row in zip(got, expected, strict=True):
        for g, w in zip(got_row, want_row, strict=True):
            assert (g == w == -math.inf) or g == pytest.approx(w, rel=1e-5, abs=1e-4)


def test_neutral_rows_are_untouched_bit_for_bit() -> None:
    logits = torch.randn(3, VOCAB)
    states = [_State(SamplingParams(presence_penalty=0.0, repetition_penalty=1.0, min_p=0.0,
                                    logit_bias={}), [1, 2]),
              _State(SamplingParams(presence_penalty=1.0), [1], [4, 4]),
              _State(SamplingParams(), [5])]
    out = apply_logits_processors(logits.clone(), states, EOS)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert not torch.equal(out[1], logits[1])


# ---- end to end on a transformers checkpoint --------------------------------------------------


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=512,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    return path, model


@pytest.fixture(scope="module")
def llm(hf_checkpoint) -> LLM:
    return LLM(str(hf_checkpoint[0]), block_size=16, num_kv_blocks=128, check_integrity=True)


PROMPT = list(range(40, 40 + 70))  # 70 token ids: 4 full blocks and a partial one


def test_prompt_and_sample_logprobs_equal_transformers(hf_checkpoint, llm: LLM) -> None:
    _, model = hf_checkpoint
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    out = llm.generate([PROMPT], params)[0]
    full = PROMPT + out.token_ids
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[pos]
        assert entry["token_id"] == PROMPT[pos]
        assert entry["logprob"] == pytest.approx(reference[pos - 1, PROMPT[pos]].item(), abs=1e-4)
        top_ids = reference[pos - 1].topk(2).indices.tolist()
        assert list(entry["top"]) == top_ids
        row = reference[pos - 1]
        assert entry["rank"] == int((row > row[PROMPT[pos]]).sum()) + 1
    for i, entry in enumerate(out.outputs[0].logprobs):
        row = reference[len(PROMPT) - 1 + i]
        assert entry["token_id"] == out.token_ids[i] == int(row.argmax())
        assert entry["logprob"] == pytest.approx(row.max().item(), abs=1e-4)
        assert list(entry["top"]) == row.topk(3).indices.tolist()


def test_prompt_logprobs_read_no_cache_but_still_cache(llm: LLM) -> None:
    prompt = list(range(120, 120 + 70))
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rated = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    cold = llm.generate([prompt], rated)[0]  # computes and caches the prompt's blocks
    warm = llm.generate([prompt], rated)[0]  # cached now: still computed whole
    hit = llm.generate([prompt], plain)[0]  # a plain request hits what the rated one cached
    assert cold.num_cached_tokens == warm.num_cached_tokens == 0
    assert hit.num_cached_tokens == 64
    assert warm.prompt_logprobs == cold.prompt_logprobs
    assert hit.token_ids == cold.token_ids == warm.token_ids


def test_prompt_logprobs_identical_with_the_cache_off(hf_checkpoint, llm: LLM) -> None:
    off = LLM(str(hf_checkpoint[0]), block_size=16, num_kv_blocks=128,
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, logprobs=1,
                            ignore_eos=True)
    on = llm.generate([PROMPT], params)[0]
    assert off.generate([PROMPT], params)[0].prompt_logprobs == on.prompt_logprobs


def test_neutral_controls_give_the_same_tokens(llm: LLM) -> None:
    base = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    neutral = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                             presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                             min_p=0.0, min_tokens=0, logit_bias={})
    assert llm.generate([PROMPT], neutral)[0].token_ids == llm.generate([PROMPT], base)[0].token_ids


def test_logit_bias_and_penalties_change_greedy_output(llm: LLM) -> None:
    base = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0,
                                                 ignore_eos=True))[0].token_ids
    forced = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                   logit_bias={7: 100.0}))[0].token_ids
    assert forced == [7] * 8
    banned = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                   logit_bias={base[0]: -100.0}))[0].token_ids
    assert banned[0] != base[0]
    fresh = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                  presence_penalty=2.0, frequency_penalty=2.0,
                                                  logit_bias={7: 5.0}))[0].token_ids
    assert fresh.count(7) < 8  # 7 is favoured, but each use costs it 4 logits


def test_min_tokens_holds_back_stop_tokens(llm: LLM) -> None:
    base = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0,
                                                 ignore_eos=True))[0].token_ids
    stop_at = base[1]
    stopped = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=[stop_at]))[0]
    assert stopped.token_ids == base[:2] and stopped.finish_reason == "stop"
    held = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                 stop_token_ids=[stop_at], min_tokens=5))[0]
    assert len(held.token_ids) >= 5 and stop_at not in held.token_ids[:5]


def test_stop_string_kept_with_include_stop_str_in_output(llm: LLM) -> None:
    full = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0,
                                                 ignore_eos=True))[0].text
    stop = full[3:5]
    at = full.find(stop)
    cut = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                stop=[stop]))[0]
    kept = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                 stop=[stop], include_stop_str_in_output=True))[0]
    assert cut.text == full[:at]
    assert kept.text == full[: at + len(stop)]


def test_best_of_returns_the_most_likely_choices(llm: LLM) -> None:
    sampled = SamplingParams(max_tokens=6, temperature=1.5, seed=11, n=4, logprobs=0,
                             ignore_eos=True)
    every = llm.generate([PROMPT], sampled)[0].outputs
    sums = [sum(e["logprob"] for e in c.logprobs) for c in every]
    best = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.5, seed=11, n=2,
                                                 best_of=4, ignore_eos=True))[0].outputs
    order = sorted(range(4), key=lambda i: -sums[i])[:2]
    assert [c.token_ids for c in best] == [every[i].token_ids for i in order]
    assert [c.index for c in best] == [0, 1]
    assert best[0].cumulative_logprob == pytest.approx(sums[order[0]], abs=1e-4)


def test_min_p_keeps_only_likely_tokens(llm: LLM) -> None:
    strict = SamplingParams(max_tokens=6, temperature=1.0, min_p=1.0, seed=5, ignore_eos=True)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = llm.generate([PROMPT], greedy)[0].token_ids
    assert llm.generate([PROMPT], strict)[0].token_ids == want


def test_skip_special_tokens_decides_whether_markers_reach_the_text() -> None:
    tiny = LLM("tiny")
    marker_id = tiny.tokenizer.bos_token_id  # a special token of the byte tokenizer
    forced = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True,
              "logit_bias": {marker_id: 100.0}}
    hidden = tiny.generate(["hi"], SamplingParams(**forced))[0]
    shown = tiny.generate(["hi"], SamplingParams(**forced, skip_special_tokens=False))[0]
    assert hidden.token_ids == shown.token_ids == [marker_id] * 3
    marker = tiny.tokenizer.decode([marker_id], skip_special_tokens=False)
    assert hidden.text == "" and shown.text == marker * 3


def test_min_p_mask_equals_its_probability_definition() -> None:
    from prefixcache.engine.sampler import _min_p

    torch.manual_seed(0)
    for min_p in (0.01, 0.1, 0.5, 0.9):
        scores = torch.randn(5000) * 3
        probs = torch.softmax(scores, dim=-1)
        kept = _min_p(scores, min_p) > float("-inf")
        assert torch.equal(kept, probs >= min_p * probs.max())
