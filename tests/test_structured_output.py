"""Structured output: JSON Schema, JSON mode, regex, choice and Lark constraints, in the engine and
through the openai SDK, langchain-openai and litellm against a real server. The tiny model has
random weights, the hard case for a constraint: every output must still parse and validate."""

from __future__ import annotations

import json
import re
import uuid

import httpx
import jsonschema
import openai
import pytest

from prefixcache import LLM, SamplingParams
from prefixcache.engine.sampling_params import StructuredOutputs
from server_harness import RunningServer, start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
ARGS = ["--model", MODEL, "--num-kv-blocks", "512", "--max-num-seqs", "16"]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "celsius": {"type": "integer", "minimum": -60, "maximum": 60},
        "sky": {"enum": ["clear", "cloudy", "rain"]},
        "windy": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23},
                  "maxItems": 3},
    },
    "required": ["city", "celsius", "sky", "windy", "hours"],
    "additionalProperties": False,
}
PROMPTS = ["What is the weather in Oslo?", "Report the weather.", "weather for a sailing trip",
           "Tell me about tomorrow", "Is it raining in Lima?"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", num_kv_blocks=256, check_integrity=True)


# ---- engine ---------------------------------------------------------------------------------


def test_json_schema_outputs_validate_greedy_and_sampled(llm: LLM) -> None:
    spec = StructuredOutputs.of(json=WEATHER)
    for params in (SamplingParams(max_tokens=400, temperature=0.0, structured_outputs=spec),
                   SamplingParams(max_tokens=400, temperature=1.0, seed=4, n=3,
                                  structured_outputs=spec)):
        for out in llm.generate(PROMPTS, params):
            for choice in out.outputs:
                assert choice.finish_reason == "stop", choice.text
                jsonschema.validate(json.loads(choice.text), WEATHER)


def test_property_order_follows_the_schema(llm: LLM) -> None:
    out = llm.generate(PROMPTS[:1], SamplingParams(
        max_tokens=400, temperature=0.0, structured_outputs=StructuredOutputs.of(json=WEATHER)))
    assert list(json.loads(out[0].text)) == list(WEATHER["properties"])


def test_regex_choice_and_lark(llm: LLM) -> None:
    cases = [
        (StructuredOutputs.of(regex=r"[A-Z]{2}-[0-9]{3}"),
         lambda t: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", t)),
        (StructuredOutputs.of(choice=["positive", "negative", "neutral"]),
         lambda t: t in ("positive", "negative", "neutral")),
        (StructuredOutputs.of(grammar='start: "SELECT " COL " FROM t"\nCOL: "a" | "b" | "c"'),
         lambda t: t in ("SELECT a FROM t", "SELECT b FROM t", "SELECT c FROM t")),
    ]
    for spec, ok in cases:
        for out in llm.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0.0,
                                                        structured_outputs=spec)):
            assert out.finish_reason == "stop" and ok(out.text), (spec, out.text)


def test_constrained_output_identical_with_the_cache_on_and_off(llm: LLM) -> None:
    off = LLM("tiny", num_kv_blocks=256, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=400, temperature=0.0,
                            structured_outputs=StructuredOutputs.of(json=WEATHER))
    prompts = ["shared system prompt for every agent call. " * 3 + p for p in PROMPTS]
    cold = [o.text for o in llm.generate(prompts, params)]
    warm = llm.generate(prompts, params)  # the shared prefix now hits
    assert [o.text for o in warm] == cold == [o.text for o in off.generate(prompts, params)]
    assert all(o.num_cached_tokens > 0 for o in warm)


def test_a_grammar_with_no_way_on_stops_its_choice_only(llm: LLM) -> None:
    """``ignore_eos`` cannot push a finished grammar on; others in the step are unaffected."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                            structured_outputs=StructuredOutputs.of(choice=["ok"]))
    free = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    constrained, other = llm.generate(["a", "b"], [params, free])
    assert constrained.text == "ok" and constrained.finish_reason == "stop"
    assert other.finish_reason == "length" and len(other.token_ids) == 20


@pytest.mark.parametrize(("spec", "fragment"), [
    (StructuredOutputs.of(json={"type": "strnig"}), "strnig"),
    (StructuredOutputs.of(json={"not": {"type": "string"}}), "Unimplemented keys"),  # unsupported
    (StructuredOutputs.of(json={"$ref": "http://example.com/s.json"}), "Default retriever"),
    (StructuredOutputs.of(regex="(unclosed"), "unclosed group"),
    (StructuredOutputs.of(grammar="start: ( "), "invalid grammar"),
])
def test_bad_constraints_raise_naming_the_library_error(llm: LLM, spec, fragment) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        llm.generate(["x"], SamplingParams(max_tokens=3, structured_outputs=spec))
    assert llm.generate(["still fine"], SamplingParams(max_tokens=2))[0].token_ids


def test_structured_outputs_spec_validation() -> None:
    for bad in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"choice": [""]},
                {"regex": ""}):
        with pytest.raises(ValueError):
            StructuredOutputs.of(**bad)


# ---- server: openai SDK, langchain, litellm ---------------------------------------------------


@pytest.fixture(scope="module")
def server() -> RunningServer:
    running = start_server(ARGS)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _ask(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"[{uuid.uuid4().hex[:8]}] {prompt}"}]


def test_sdk_json_schema_and_json_object(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER,
                                                  "strict": True}}
    for prompt in PROMPTS:
        out = client.chat.completions.create(model=MODEL, messages=_ask(prompt), max_tokens=400,
                                             temperature=0.0, n=2, response_format=fmt)
        for choice in out.choices:
            jsonschema.validate(json.loads(choice.message.content), WEATHER)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=_ask(PROMPTS[0]), max_tokens=400, temperature=0.0, stream=True,
        response_format=fmt) if c.choices)
    jsonschema.validate(json.loads(streamed), WEATHER)
    completion = client.completions.create(model=MODEL, prompt="weather:", max_tokens=400,
                                           temperature=0.0, extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(completion.choices[0].text), WEATHER)
    obj = client.chat.completions.create(model=MODEL, messages=_ask("hello there"),
                                         max_tokens=200, temperature=0.0,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":  # JSON mode bounds nothing: it may run to length
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    text = client.chat.completions.create(model=MODEL, messages=_ask("hi"), max_tokens=3,
                                          response_format={"type": "text"})
    assert text.usage.completion_tokens <= 3


def test_sdk_vllm_structured_outputs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="sentiment:", max_tokens=10, n=3,
                                    temperature=1.0, seed=2,
                                    extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert {c.text for c in out.choices} <= {"up", "down"}
    out = client.chat.completions.create(
        model=MODEL, messages=_ask("code?"), max_tokens=12, temperature=0.0,
        extra_body={"structured_outputs": {"regex": r"[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{4}", out.choices[0].message.content)


@pytest.mark.parametrize(("fields", "param", "fragment"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "strnig"}}}},
     "response_format", "strnig"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "unclosed group"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "dependentSchemas": {"a": {}}}}}},
     "response_format", "Unimplemented keys"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice must be"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
])
def test_bad_constraints_are_400_and_the_cache_survives(
    server: RunningServer, client: openai.OpenAI, fields, param, fragment
) -> None:
    prompt = f"[{uuid.uuid4().hex}] " + "cached before the bad request " * 4
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    response = httpx.post(server.base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.fixture(scope="module")
def smollm2_server() -> RunningServer:
    """The trained model: JSON mode bounds nothing, so a random model may never close its
    object; a trained one answers in JSON when asked to."""
    running = start_server(["--model", "smollm2", "--max-num-seqs", "4"])
    yield running
    running.stop()


def test_langchain_with_structured_output(server: RunningServer, smollm2_server) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=12)
        celsius: int = Field(ge=-60, le=60)
        windy: bool

    class Capital(BaseModel):
        country: str
        capital: str

    chat = ChatOpenAI(base_url=server.base_url + "/v1", api_key="unused", model=MODEL,
                      temperature=0.0, max_tokens=400, max_retries=0)
    weather = chat.with_structured_output(Weather, method="json_schema").invoke("Oslo weather?")
    assert isinstance(weather, Weather)
    smol = ChatOpenAI(base_url=smollm2_server.base_url + "/v1", api_key="unused",
                      model="smollm2", temperature=0.0, max_tokens=60, max_retries=0)
    answer = smol.with_structured_output(Capital, method="json_mode").invoke(
        'Answer in JSON with the keys "country" and "capital": what is the capital of France?')
    assert isinstance(answer, Capital) and "Paris" in answer.capital


def test_litellm_response_format(server: RunningServer) -> None:
    import os

    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm

    out = litellm.completion(
        model=f"openai/{MODEL}", api_base=server.base_url + "/v1", api_key="unused",
        messages=_ask("weather?"), max_tokens=400, temperature=0.0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "weather", "schema": WEATHER}})
    jsonschema.validate(json.loads(out.choices[0].message.content), WEATHER)


class _Dead:
    """A matcher whose grammar allows nothing (as a grammar the vocabulary cannot spell)."""

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        import ctypes

        ctypes.memset(pointer, 0, size)

    def deep_copy(self) -> _Dead:
        return self


def test_a_grammar_that_allows_no_token_ends_its_choice(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    dead = engine.add_request("dead", "a prompt", params)
    dead.matcher = _Dead()
    alive = engine.add_request("alive", "another prompt", params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    last = [o for o in outputs if o.request_id == "dead"][-1]
    assert last.finished and last.finish_reason == "stop" and last.error is None
    assert "no further token" in last.stop_reason and last.num_output_tokens == 0
    assert len(alive.output_token_ids) == 8
    engine.cache.check_integrity()


def test_responses_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=12)
        celsius: int = Field(ge=-60, le=60)

    out = client.responses.parse(model=MODEL, input="Oslo weather?", text_format=Weather,
                                 max_output_tokens=300, temperature=0.0)
    assert isinstance(out.output_parsed, Weather)
    assert out.text.format.type == "json_schema"
    bad = httpx.post(str(client.base_url) + "responses", json={
        "model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                                          "schema": {"type": "strnig"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format"
