"""The OpenAI API as vLLM serves it, through the official `openai` SDK against a real server:
lenient fields, explicit nulls, batched prompts, logprobs and echo, sampling controls, best_of,
the Responses API, models/{id}, /tokenize and /detokenize, HEAD routes, and bad values (400)
that leave the cache intact."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server_harness import RunningServer, captured_logs, start_server, tie_free_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
ARGS = ["--model", MODEL, "--num-kv-blocks", "512", "--max-num-seqs", "16"]


@pytest.fixture(scope="module")
def logs() -> list[str]:
    with captured_logs("prefixcache") as messages:
        yield messages


@pytest.fixture(scope="module")
def server(logs: list[str]) -> RunningServer:
    running = start_server(ARGS)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def cache_off() -> RunningServer:
    running = start_server([*ARGS, "--prefix-cache", "off"])
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def fresh(length: int = 70) -> str:
    """A prompt no other test sends."""
    return (f"[{uuid.uuid4().hex}] " + "a prefix cache keeps the keys and values. " * 10)[:length]


GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def post(client: openai.OpenAI, path: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(path, body=body, cast_to=httpx.Response)


# ---- lenient fields -------------------------------------------------------------------------


def test_vllm_bench_client_and_sdk_fields_are_accepted(client, logs) -> None:
    prompt = tie_free_prompt("sdk-fields", 4)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **GREEDY)
    secret = "do-not-log-this-value"
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.0,  # vllm bench serve
                    "prompt_cache_key": secret, "service_tier": "auto", "store": True,
                    "metadata": {"k": secret}, "reasoning_effort": "low"})
    assert out.choices[0].text == plain.choices[0].text
    line = next(m for m in logs if "ignoring unknown request field" in m)
    assert "metadata" in line and "service_tier" in line
    assert "prompt_cache_key" not in line  # a known field now (docs/prompt-caching.md)
    assert not any(secret in m or prompt in m for m in logs)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3,
        store=True, metadata={"a": "b"}, parallel_tool_calls=False, service_tier="auto",
        reasoning_effort="low", presence_penalty=0.5, frequency_penalty=0.5)
    assert chat.choices[0].message.role == "assistant"


def test_explicit_null_means_the_default(client) -> None:
    prompt = fresh()
    # each with its own salt: both compute the prompt the same way, so seeded sampling agrees
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, seed=3,
                                      extra_body={"cache_salt": "plain"})
    nulls = post(client, "/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 5, "seed": 3, "temperature": None,
        "cache_salt": "nulls",
        "top_p": None, "n": None, "stop": None, "logprobs": None, "echo": None, "user": None,
        "presence_penalty": None, "logit_bias": None, "stream": None, "best_of": None})
    assert nulls.status_code == 200
    assert nulls.json()["choices"][0]["text"] == plain.choices[0].text


def test_unknown_message_fields_are_accepted(client) -> None:
    messages = [
        {"role": "system", "content": "be brief", "refusal": None},
        {"role": "user", "content": "what is 2+2?", "audio": None},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
    ]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert out.usage.completion_tokens == 3


def test_strict_api_rejects_unknown_fields() -> None:
    strict = start_server([*ARGS, "--strict-api"])
    try:
        c = openai.OpenAI(base_url=strict.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                 extra_body={"bogus_field": 1})
        assert info.value.body["param"] == "bogus_field"
        assert "unknown parameter 'bogus_field'" in info.value.body["message"]
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage
    finally:
        strict.stop()


# ---- batched prompts ------------------------------------------------------------------------


def test_batched_string_prompts_index_choices_and_sum_usage(client) -> None:
    prompts = [tie_free_prompt(f"batch-{i}", 4) for i in range(3)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, **GREEDY)
             for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, one in enumerate(alone):
        assert batch.choices[2 * i].text == batch.choices[2 * i + 1].text == one.choices[0].text
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 6 * 4
    # the second time every prompt hits its own cached prefix
    assert batch.usage.prompt_tokens_details.cached_tokens == 3 * 64


def test_batched_token_id_prompts_and_stream_indices(client, server) -> None:
    tokenizer = server.engine.tokenizer
    prompts = [tokenizer.encode(tie_free_prompt("ids-0", 5)),
               tokenizer.encode(tie_free_prompt("ids-1", 5, length=50))]
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, **GREEDY)
    texts = {0: "", 1: ""}
    usage = None
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert usage.prompt_tokens == sum(len(p) for p in prompts)
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    reusable = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert usage.prompt_tokens_details.cached_tokens == reusable


# ---- logprobs and echo ----------------------------------------------------------------------


def test_completion_logprobs_shape(client) -> None:
    out = client.completions.create(model=MODEL, prompt=fresh(), max_tokens=4, logprobs=3,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and top[token] == logprob
        assert max(top.values()) == logprob  # greedy: the chosen token is the most likely
        assert 3 <= len(top) <= 4


def test_echo_logprobs_identical_with_cache_off_cold_and_warm(client, cache_off) -> None:
    prompt = fresh(90)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "logprobs": 2, "echo": True,
            "temperature": 0.0}
    cold = post(client, "/completions", body).json()
    warm = post(client, "/completions", body).json()
    off = httpx.post(cache_off.base_url + "/v1/completions", json=body).json()
    choice = cold["choices"][0]
    assert choice["text"].startswith(prompt)
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["top_logprobs"][0] is None
    num_prompt = cold["usage"]["prompt_tokens"]
    assert len(choice["logprobs"]["tokens"]) == num_prompt + 1
    assert cold["choices"] == warm["choices"] == off["choices"]
    # prompt logprobs read no cache, but their blocks were cached for others
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY)
    assert plain.usage.prompt_tokens_details.cached_tokens == 80


def test_lm_eval_loglikelihood_shapes(client, server) -> None:
    ids = server.engine.tokenizer.encode(fresh(40))
    scored = post(client, "/completions", {"model": MODEL, "prompt": [ids], "max_tokens": 1,
                                           "logprobs": 1, "echo": True, "temperature": 0})
    assert scored.status_code == 200
    only = post(client, "/completions", {"model": MODEL, "prompt": [ids], "max_tokens": 0,
                                         "logprobs": 1, "echo": True})
    body = only.json()
    choice = body["choices"][0]
    assert body["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    assert (choice["logprobs"]["token_logprobs"]
            == scored.json()["choices"][0]["logprobs"]["token_logprobs"][:-1])


def test_echo_without_logprobs_prepends_the_prompt(client) -> None:
    prompt = tie_free_prompt("echo", 3)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True,
                                       **GREEDY)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, echo=True, stream=True, **GREEDY))
    assert streamed == echoed.choices[0].text


def test_chat_logprobs_and_streamed_deltas(client) -> None:
    messages = [{"role": "user", "content": fresh()}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                         logprobs=True, top_logprobs=2, **GREEDY)
    cold = {"ignore_eos": True, "cache_salt": "streamed"}  # computed the same way again
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == item.logprob  # greedy
        if not item.token.startswith("bytes:"):
            assert item.bytes == list(item.token.encode("utf-8"))
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                logprobs=True, top_logprobs=2, stream=True,
                                                temperature=0.0, extra_body=cold):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_vllm_prompt_logprobs_field(client) -> None:
    out = post(client, "/completions", {"model": MODEL, "prompt": fresh(30), "max_tokens": 1,
                                        "prompt_logprobs": 1}).json()
    table = out["choices"][0]["prompt_logprobs"]
    assert table[0] is None and len(table) == out["usage"]["prompt_tokens"]
    assert all(item["rank"] >= 1 for entry in table[1:] for item in entry.values()
               if item["rank"] is not None)


# ---- sampling controls ----------------------------------------------------------------------


def test_sampling_controls_through_the_api(client, server) -> None:
    prompt = tie_free_prompt("controls", 6)
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=0,
                                     **GREEDY)
    first = base.choices[0].logprobs.tokens[0]
    # the byte tokenizer: a token's id is its byte (named "bytes:\\xNN" when not UTF-8 alone)
    first_id = int(first[8:10], 16) if first.startswith("bytes:") else first.encode()[0]
    decoded = server.engine.tokenizer.decode([first_id], skip_special_tokens=False)
    assert decoded in (first, "\ufffd")
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                       logit_bias={str(first_id): -100}, **GREEDY)
    assert not banned.choices[0].text.startswith(first)
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                       logit_bias={"120": 100}, **GREEDY)
    assert forced.choices[0].text == "xxx"
    stop = base.choices[0].text[2:4]
    keep = {"ignore_eos": True, "include_stop_str_in_output": True}
    kept = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stop=[stop],
                                     temperature=0.0, extra_body=keep)
    assert kept.choices[0].text.endswith(stop)
    penalised = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, presence_penalty=2.0, frequency_penalty=2.0,
        temperature=0.0, extra_body={"ignore_eos": True, "repetition_penalty": 1.5,
                                     "min_p": 0.5, "min_tokens": 2})
    assert penalised.usage.completion_tokens == 6


def test_best_of_returns_n_choices(client) -> None:
    out = client.completions.create(model=MODEL, prompt=fresh(), max_tokens=4, n=2, best_of=4,
                                    temperature=1.0, seed=9, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 4 * 4  # every candidate was generated


# ---- the Responses API ----------------------------------------------------------------------


def test_responses_create_and_cached_tokens(client) -> None:
    text = tie_free_prompt("responses", 4, chat=True, system="answer briefly", length=120)
    first = client.responses.create(model=MODEL, input=text, instructions="answer briefly",
                                    max_output_tokens=4, temperature=0.0)
    again = client.responses.create(model=MODEL, input=[{"role": "user", "content": text}],
                                    instructions="answer briefly", max_output_tokens=4,
                                    temperature=0.0)
    assert first.output_text == again.output_text and first.object == "response"
    assert first.usage.output_tokens == 4 and first.usage.input_tokens > 30
    assert again.usage.input_tokens_details.cached_tokens >= 96


def test_responses_stream_event_sequence(client) -> None:
    kinds = []
    deltas = ""
    done_text = None
    with client.responses.stream(model=MODEL, input=fresh(), max_output_tokens=5,
                                 temperature=0.0) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas += event.delta
            if event.type == "response.output_text.done":
                done_text = event.text
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    assert "response.output_text.delta" in kinds and done_text == deltas
    assert final.output_text == deltas and final.usage.output_tokens == 5


def test_responses_unsupported_parts_are_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert info.value.body["param"] == "tools"


# ---- models, tokenizer endpoints, HEAD --------------------------------------------------------


def test_models_retrieve_and_head(client, server) -> None:
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found"
    for path in ("/v1/models", f"/v1/models/{MODEL}", "/health", "/tokenizer_info"):
        assert httpx.head(server.base_url + path).status_code == 200


def test_tokenize_and_detokenize(server) -> None:
    text = "prefix caching"
    tokens = httpx.post(server.base_url + "/tokenize",
                        json={"prompt": text, "add_special_tokens": False}).json()
    assert tokens["tokens"] == server.engine.tokenizer.encode(text, add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 8192
    back = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}
    chat = httpx.post(server.base_url + "/tokenize",
                      json={"messages": [{"role": "user", "content": text}]}).json()
    assert chat["count"] > tokens["count"]
    bad = httpx.post(server.base_url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    info = httpx.get(server.base_url + "/tokenizer_info").json()
    assert "eos_token" in info


# ---- bad values leave the cache as it was -------------------------------------------------------


BAD = [
    ("/completions", {"prompt": "x", "presence_penalty": 9}, "presence_penalty"),
    ("/completions", {"prompt": "x", "frequency_penalty": "a lot"}, "frequency_penalty"),
    ("/completions", {"prompt": "x", "repetition_penalty": -1}, "repetition_penalty"),
    ("/completions", {"prompt": "x", "min_p": -0.1}, "min_p"),
    ("/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("/completions", {"prompt": "x", "logit_bias": {"1": "high"}}, "logit_bias"),
    ("/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("/completions", {"prompt": "x", "best_of": 0}, "best_of"),
    ("/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/completions", {"prompt": "x", "include_stop_str_in_output": 1},
     "include_stop_str_in_output"),
    ("/completions", {"prompt": "x", "skip_special_tokens": "no"}, "skip_special_tokens"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
     "top_logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                           "top_logprobs": 30}, "top_logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                           "tools": [{"type": "function", "function": {"name": "f"}}],
                           "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ("/responses", {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ("/responses", {"input": []}, "input"),
]


def test_bad_values_name_the_field_and_keep_the_cache(client, server) -> None:
    prompt = fresh(100)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY)
    for path, fields, param in BAD:
        response = httpx.post(server.base_url + "/v1" + path, json={"model": MODEL, **fields})
        assert response.status_code == 400, (path, fields, response.text)
        error = response.json()["error"]
        assert error["param"] == param or param in error["message"], (fields, error)
        assert error["type"] == "invalid_request_error"
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens == 96


# ---- tenancy holds for batched prompts, echo and responses ------------------------------------

EXAMPLE_TENANTS = Path(__file__).resolve().parents[1] / "examples" / "tenants.toml"
ACME, GLOBEX, INITECH = ("sk-acme-example-key-1", "sk-globex-example-key",
                         "sk-initech-example-key")


@pytest.fixture(scope="module")
def tenanted() -> RunningServer:
    running = start_server([*ARGS, "--tenants", str(EXAMPLE_TENANTS)])
    yield running
    running.stop()


def _as(server: RunningServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def test_tenancy_holds_for_batches_echo_and_responses(tenanted) -> None:
    prompts = [fresh(100), fresh(100)]
    globex, initech, acme = _as(tenanted, GLOBEX), _as(tenanted, INITECH), _as(tenanted, ACME)

    def batch_cached(c: openai.OpenAI, **extra: Any) -> int:
        out = c.completions.create(model=MODEL, prompt=prompts, max_tokens=1, **GREEDY, **extra)
        return out.usage.prompt_tokens_details.cached_tokens

    assert batch_cached(globex) == 0
    assert batch_cached(acme) == 0  # another tenant: nothing of globex's
    assert batch_cached(acme, echo=True) == 2 * 96  # its own, now
    assert batch_cached(initech) == 2 * 96  # globex's group partner shares

    text = fresh(120)
    assert globex.responses.create(model=MODEL, input=text, max_output_tokens=1,
                                   temperature=0.0).usage.input_tokens_details.cached_tokens == 0
    other = acme.responses.create(model=MODEL, input=text, max_output_tokens=1, temperature=0.0)
    partner = initech.responses.create(model=MODEL, input=text, max_output_tokens=1,
                                       temperature=0.0)
    assert other.usage.input_tokens_details.cached_tokens == 0
    assert partner.usage.input_tokens_details.cached_tokens > 0


def test_tokenizer_endpoints_need_a_key_with_tenants(tenanted) -> None:
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [65]})):
        assert httpx.post(tenanted.base_url + path, json=body).status_code == 401
        ok = httpx.post(tenanted.base_url + path, json=body,
                        headers={"authorization": f"Bearer {ACME}"})
        assert ok.status_code == 200
    assert httpx.get(tenanted.base_url + "/v1/models/tiny").status_code == 401


def test_chat_prompt_logprobs_sit_beside_the_choices(client) -> None:
    body = post(client, "/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": fresh(20)}], "max_tokens": 1,
        "prompt_logprobs": 0}).json()
    assert body["prompt_logprobs"][0] is None
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert "prompt_logprobs" not in body["choices"][0]


def test_continuous_usage_stats_in_every_chunk(client) -> None:
    usages = [chunk.usage for chunk in client.completions.create(
        model=MODEL, prompt=fresh(), max_tokens=4, stream=True, **GREEDY,
        stream_options={"include_usage": True, "continuous_usage_stats": True}) if chunk.choices]
    assert usages and all(u is not None for u in usages)
    assert [u.completion_tokens for u in usages] == sorted(u.completion_tokens for u in usages)
    assert usages[-1].completion_tokens == 4
