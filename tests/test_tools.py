"""Tool calling in chat: the Hermes ``<tool_call>`` parser on its own and streamed, then a real
server (tiny, random weights) through the openai SDK, langchain-openai and litellm: ``required``
and named calls are forced by the grammar (arguments always validate), ``auto`` parses what the
model wrote, a two-turn conversation renders the call and its result and hits the cache."""

from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest

from prefixcache.server.tools import ToolCallStream, parse_tool_calls, render_messages
from server_harness import RunningServer, start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "a city's weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


# ---- the parser ---------------------------------------------------------------------------------


def test_parse_tool_calls() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])


def test_stream_parser_holds_back_a_possible_call() -> None:
    text = 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    for size in (1, 3, 7, len(text)):
        stream = ToolCallStream()
        content, calls = "", []
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            c, new = stream.feed(piece, final=i == len(pieces) - 1)
            assert "<" not in c  # never a fragment of the tag
            content += c
            calls += new
        assert content.strip() == "Sure."
        assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "add")]
    plain = ToolCallStream()
    assert plain.feed("a < b and <tool", final=False)[0] == "a < b and "
    assert plain.feed("", final=True)[0] == "<tool"


def test_templates_without_tools_get_a_tools_section() -> None:
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    rendered, extra = render_messages(messages, TOOLS, "{{ messages }}")
    assert extra == {} and rendered[0]["role"] == "system"
    assert '"name": "get_weather"' in rendered[0]["content"]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in (
        rendered[2]["content"])
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    native, extra = render_messages(messages, TOOLS, "{% for t in tools %}{% endfor %}")
    assert extra == {"tools": TOOLS}
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}


# ---- a real server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> RunningServer:
    running = start_server(["--model", MODEL, "--num-kv-blocks", "512", "--max-num-seqs", "8"])
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _check(call) -> None:  # noqa: ANN001
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


QUESTIONS = ["What is the weather in Oslo?", "Add 2 and 40.", "Tell me something."]


def test_required_and_named_calls_always_validate(client: openai.OpenAI) -> None:
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                             tool_choice="required", max_tokens=300,
                                             temperature=1.0, seed=7, n=2)
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
            for call in choice.message.tool_calls:
                _check(call)
        named = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=300, temperature=0.0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        [call] = named.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        _check(call)


def test_streamed_tool_calls(client: openai.OpenAI) -> None:
    calls, reasons = [], []
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "add"}], tools=TOOLS,
            tool_choice="required", parallel_tool_calls=False, max_tokens=300,
            temperature=0.0, stream=True):
        if chunk.choices:
            calls += chunk.choices[0].delta.tool_calls or []
            reasons.append(chunk.choices[0].finish_reason)
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    _check(calls[0])
    assert reasons[-1] == "tool_calls"


def test_auto_parses_what_the_model_wrote(client: openai.OpenAI) -> None:
    written = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "1+2?"}], tools=TOOLS,
        tool_choice="auto", max_tokens=100, temperature=0.0,
        extra_body={"structured_outputs": {"choice": [written]}})  # make the model write one
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
        max_tokens=5, temperature=0.0, extra_body={"structured_outputs": {"choice": ["hello"]}})
    assert plain.choices[0].message.content == "hello" and not plain.choices[0].message.tool_calls


def test_two_turn_conversation_renders_the_result_and_hits(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are a weather bot. " * 8},
                {"role": "user", "content": "Weather in Lima?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=300, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C, cloudy"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                            max_tokens=8, temperature=0.0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10  # call and result in
    # the system prompt, the tools section and the question are one cached prefix
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": [], "tool_choice": "required"}, "needs tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "same name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "already constrains"),
])
def test_bad_tool_requests_are_400(client: openai.OpenAI, fields, fragment) -> None:
    body = {"tools": TOOLS, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=5, **body)
    error = info.value.body
    assert fragment in error["message"] or fragment == error["param"], error
    assert error["param"] is not None


def test_langchain_bind_tools(server: RunningServer) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class AddArgs(BaseModel):  # bounded: a random-weight model would write digits forever
        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=99)

    @tool(args_schema=AddArgs)
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    chat = ChatOpenAI(base_url=server.base_url + "/v1", api_key="unused", model=MODEL,
                      temperature=0.0, max_tokens=300, max_retries=0)
    reply = chat.bind_tools([add], tool_choice="any").invoke("What is 2 + 40?")
    [call] = reply.tool_calls[:1]
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in call["args"].values())


def test_litellm_tools(server: RunningServer) -> None:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm

    out = litellm.completion(model=f"openai/{MODEL}", api_base=server.base_url + "/v1",
                             api_key="unused", messages=[{"role": "user", "content": "2+2?"}],
                             tools=TOOLS, tool_choice="required", max_tokens=300,
                             temperature=0.0)
    calls = out.choices[0].message.tool_calls
    assert calls and calls[0].function.name in SCHEMAS
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])
