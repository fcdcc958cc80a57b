"""Sampler, SamplingParams validation and stop rules (no model needed)."""

from __future__ import annotations

import pytest
import torch

from prefixcache.cache import Sequence
from prefixcache.engine.request import Request
from prefixcache.engine.sampler import Sampler, derive_seed, make_generator
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.stop import check_stop, emittable_text
from prefixcache.model.byte_tokenizer import write_byte_tokenizer
from prefixcache.model.detokenizer import IncrementalDetokenizer
from prefixcache.model.tokenizer import Tokenizer
from prefixcache.sched.request import RequestStatus


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=make_generator(seed)) * 2


def test_greedy_is_exact_argmax():
    logits = _logits()
    params = [SamplingParams(temperature=0.0)] * 4
    out = Sampler().sample(logits, params, [None] * 4)
    assert [t.token_id for t in out] == logits.argmax(dim=-1).tolist()


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    logits = _logits()
    p = SamplingParams(temperature=1.0)
    alone = Sampler().sample(logits[2:3], [p], [make_generator(11)])
    batch = Sampler().sample(logits, [p] * 4, [make_generator(s) for s in (1, 2, 11, 3)])
    assert alone[0].token_id == batch[2].token_id


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    probs = torch.softmax(logits[0], dim=-1)
    gen = make_generator(5)
    sampler, p = Sampler(), SamplingParams(temperature=1.0)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sampler.sample(logits, [p], [gen])[0].token_id] += 1
    assert torch.allclose(counts / 4000, probs, atol=0.03)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0, -2.0]])
    gen = make_generator(1)
    sampler = Sampler()
    seen_k = {
        sampler.sample(logits, [SamplingParams(top_k=2)], [gen])[0].token_id for _ in range(200)
    }
    assert seen_k == {0, 1}
    seen_p = {
        sampler.sample(logits, [SamplingParams(top_p=0.1)], [gen])[0].token_id for _ in range(50)
    }
    assert seen_p == {0}


def test_logprobs_are_reported_when_asked():
    logits = _logits(rows=1)
    (tok,) = Sampler().sample(logits, [SamplingParams(temperature=0.0, logprobs=3)], [None])
    expected = torch.log_softmax(logits[0], dim=-1)
    assert tok.logprob == pytest.approx(float(expected.max()))
    assert len(tok.top_logprobs) == 3 and tok.token_id in tok.top_logprobs


def test_choice_seeds():
    assert derive_seed(42, 0) == 42
    assert len({derive_seed(42, i) for i in range(8)}) == 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n must"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "non-empty"),
        ({"stop": [1]}, "stop must"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_stop():
    p = SamplingParams(stop="END", stop_token_ids=[3, 4])
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4) and p.max_stop_len == 3


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytes")
    write_byte_tokenizer(path)
    return Tokenizer.from_dir(path)


def _feed(tokenizer, text: str, params: SamplingParams, extra_ids=()):
    """Feed ``text`` byte by byte through check_stop; returns (status, streamed text)."""
    request = Request("r", Sequence("r", [1]), params, None)
    request.detokenizer = IncrementalDetokenizer(tokenizer)
    streamed, status = "", None
    for token_id in [*tokenizer.encode(text, add_special_tokens=False), *extra_ids]:
        request.append_output(token_id)
        status = check_stop(request, token_id, tokenizer.eos_token_ids)
        if status is not None:
            request.status = status
        streamed += emittable_text(request)
        if status is not None:
            break
    return status, streamed, request


def test_stop_string_is_cut_and_never_streamed(tokenizer):
    status, streamed, request = _feed(tokenizer, "hello END world", SamplingParams(stop=["END"]))
    assert status is RequestStatus.FINISHED_STOPPED
    assert streamed == request.text == "hello "


def test_max_tokens_and_stop_token_ids(tokenizer):
    status, streamed, _ = _feed(tokenizer, "abcdefgh", SamplingParams(max_tokens=3))
    assert (status, streamed) == (RequestStatus.FINISHED_LENGTH, "abc")
    stop_id = tokenizer.encode("d", add_special_tokens=False)[0]
    status, streamed, request = _feed(
        tokenizer, "abcdefgh", SamplingParams(max_tokens=10, stop_token_ids=[stop_id])
    )
    assert (status, streamed) == (RequestStatus.FINISHED_STOPPED, "abc")
    assert request.output_token_ids[-1] == stop_id  # the stop token stays in token_ids


def test_eos_stops_unless_ignored(tokenizer):
    eos = tokenizer.eos_token_ids[0]
    status, streamed, _ = _feed(tokenizer, "ab", SamplingParams(max_tokens=10), [eos, 70])
    assert (status, streamed) == (RequestStatus.FINISHED_STOPPED, "ab")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    status, _, request = _feed(tokenizer, "ab", params, [eos, 70])
    assert status is RequestStatus.FINISHED_LENGTH and request.output_token_ids[2] == eos
