"""`POST /v1/messages` (Anthropic's Messages API) through the official `anthropic` SDK against a
real server: create, stream, count_tokens, tools, errors in Anthropic's shape, x-api-key auth,
and greedy answers equal to /v1/chat/completions'."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from server_harness import RunningServer, start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tenants.toml"
SECRET = b"0123456789abcdef0123456789abcdef"
ACME = "sk-acme-example-key-1"
GREEDY = {"temperature": 0.0}  # this SDK has no sampling parameters of its own
SYSTEM = "You are the archive's clerk. Answer in one short sentence, citing the shelf. " * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    secret = tmp_path_factory.mktemp("secret") / "secret"
    secret.write_bytes(SECRET)
    running = start_server(["--model", "tiny", "--tenants", str(EXAMPLE), "--secret-file",
                            str(secret), "--num-kv-blocks", "256"])
    yield running
    running.stop()


def sdk(server: RunningServer, key: str = ACME) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0)


def test_create_answers_as_chat_completions_and_reports_cache_reads(server) -> None:
    client = sdk(server)
    messages = [{"role": "user", "content": "Where is the map room?"}]
    first = client.messages.create(model="tiny", max_tokens=8, system=SYSTEM, messages=messages,
                                   extra_body=GREEDY)
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in first.content if b.type == "text")
    chat = openai.OpenAI(base_url=server.base_url + "/v1", api_key=ACME, max_retries=0)
    same = chat.chat.completions.create(
        model="tiny", max_tokens=8, extra_body=GREEDY,
        messages=[{"role": "system", "content": SYSTEM}, *messages])
    assert text == same.choices[0].message.content
    again = client.messages.create(model="tiny", max_tokens=8, extra_body=GREEDY, system=[
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=messages)
    use = again.usage
    assert use.cache_read_input_tokens > 0 and use.cache_creation_input_tokens == 0
    total = use.input_tokens + use.cache_read_input_tokens + use.cache_creation_input_tokens
    assert total == same.usage.prompt_tokens and use.output_tokens == again.usage.output_tokens


def test_stream_sends_anthropics_event_sequence(server) -> None:
    client = sdk(server)
    with client.messages.stream(model="tiny", max_tokens=12, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Name a shelf."}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    whole = client.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Name a shelf."}])
    assert text == "".join(b.text for b in whole.content) == "".join(
        b.text for b in final.content)
    assert final.usage.output_tokens == whole.usage.output_tokens
    raw = httpx.post(server.base_url + "/v1/messages", headers={"x-api-key": ACME,
                     "anthropic-version": "2023-06-01"}, timeout=60, json={
        "model": "tiny", "max_tokens": 4, "stream": True,
        "messages": [{"role": "user", "content": "Hi"}]})
    kinds = [line.split(": ", 1)[1] for line in raw.text.splitlines()
             if line.startswith("event: ")]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) <= {"content_block_delta"}


def test_count_tokens_and_tools(server) -> None:
    client = sdk(server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=messages)
    answer = client.messages.create(model="tiny", max_tokens=1, system=SYSTEM,
                                    messages=messages)
    assert counted.input_tokens == (answer.usage.input_tokens
                                    + answer.usage.cache_read_input_tokens)
    tools = [{"name": "get_weather", "description": "The weather of a city",
              "input_schema": {"type": "object", "additionalProperties": False,
                               "properties": {"city": {"type": "string", "maxLength": 10}},
                               "required": ["city"]}}]
    forced = client.messages.create(model="tiny", max_tokens=300, extra_body=GREEDY, tools=tools,
                                    tool_choice={"type": "tool", "name": "get_weather"},
                                    messages=messages)
    uses = [b for b in forced.content if b.type == "tool_use"]
    assert forced.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert isinstance(uses[0].input.get("city"), str)
    follow = client.messages.create(model="tiny", max_tokens=4, tools=tools, messages=[
        *messages, {"role": "assistant", "content": [
            {"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "sunny, 21 C"}]}])
    assert follow.type == "message"
    with client.messages.stream(model="tiny", max_tokens=300, extra_body=GREEDY, tools=tools,
                                tool_choice={"type": "any"}, messages=messages) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content][-1] == "tool_use"


def test_errors_take_anthropics_shape_and_keys_work_either_way(server) -> None:
    with pytest.raises(anthropic.AuthenticationError) as denied:
        sdk(server, "sk-not-a-tenant").messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert denied.value.status_code == 401
    assert denied.value.body["type"] == "error"  # type: ignore[index]
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    for body, fragment in (
        ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
        ({"model": "tiny", "max_tokens": 4, "messages": []}, "messages"),
        ({"model": "tiny", "max_tokens": 4, "messages": [
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x",
                                               "content": "?"}]}]}, "tool_result"),
        ({"model": "tiny", "max_tokens": 4, "tool_choice": {"type": "tool", "name": "nope"},
          "tools": [{"name": "a", "input_schema": {"type": "object"}}],
          "messages": [{"role": "user", "content": "Hi"}]}, "tool_choice"),
    ):
        reply = httpx.post(server.base_url + "/v1/messages", json=body, timeout=30,
                           headers={"x-api-key": ACME})
        assert reply.status_code == 400, reply.text
        error = reply.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert fragment in error["error"]["message"], error
    bearer = httpx.post(server.base_url + "/v1/messages/count_tokens", timeout=30,
                        headers={"authorization": f"Bearer {ACME}"},
                        json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    openai_shape = httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                              headers={"x-api-key": ACME}, content=json.dumps({"model": "tiny"}))
    assert openai_shape.status_code == 400 and "error" in openai_shape.json()


def test_tenants_stay_apart_on_messages(server) -> None:
    prompt = [{"role": "user", "content": "A confidential question about shelf nine? " * 4}]
    sdk(server).messages.create(model="tiny", max_tokens=2, messages=prompt)
    other = sdk(server, "sk-globex-example-key").messages.create(model="tiny", max_tokens=2,
                                                                 messages=prompt)
    assert other.usage.cache_read_input_tokens == 0
    mine = sdk(server).messages.create(model="tiny", max_tokens=2, messages=prompt)
    assert mine.usage.cache_read_input_tokens > 0


def test_cache_control_pins_the_prefix_and_reports_creation_then_reads(server) -> None:
    client = sdk(server)
    system = [{"type": "text", "text": "Shelf rules, volume two. " * 12,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    messages = [{"role": "user", "content": "Which volume?"}]
    first = client.messages.create(model="tiny", max_tokens=2, system=system, messages=messages)
    use = first.usage
    assert use.cache_read_input_tokens == 0 and use.cache_creation_input_tokens >= 256
    assert use.cache_creation.ephemeral_1h_input_tokens == use.cache_creation_input_tokens
    prompt = use.input_tokens + use.cache_creation_input_tokens + use.cache_read_input_tokens
    assert prompt == client.messages.count_tokens(model="tiny", system=system,
                                                  messages=messages).input_tokens
    pin = server.engine.pins.of_domain("tenant:acme")[-1]  # an earlier test pinned one too
    assert pin.num_tokens == use.cache_creation_input_tokens and pin.ttl_s == 3600.0
    second = client.messages.create(model="tiny", max_tokens=2, system=system,
                                    messages=[{"role": "user", "content": "And the shelf?"}])
    assert second.usage.cache_read_input_tokens >= use.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0
    for body, fragment in (
        ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "'5m' or '1h'"),
        ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}] * 5},
         "at most 4"),
    ):
        reply = httpx.post(server.base_url + "/v1/messages", timeout=30,
                           headers={"x-api-key": ACME},
                           json={"model": "tiny", "max_tokens": 2, "messages": messages, **body})
        assert reply.status_code == 400 and fragment in reply.json()["error"]["message"]


def test_openai_prompt_cache_retention_24h_pins_the_prompt(server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=ACME, max_retries=0)
    before = {p.pin_id for p in server.engine.pins.of_domain("tenant:acme")}
    out = client.chat.completions.create(
        model="tiny", max_tokens=2, messages=[{"role": "user", "content": "Keep me. " * 30}],
        extra_body={"prompt_cache_retention": "24h", "prompt_cache_key": "clerk-7"})
    new = [p for p in server.engine.pins.of_domain("tenant:acme") if p.pin_id not in before]
    assert len(new) == 1 and new[0].ttl_s == 24 * 3600.0
    assert new[0].num_tokens == (out.usage.prompt_tokens - 1) // 16 * 16
    bad = httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                     headers={"x-api-key": ACME}, json={
                         "model": "tiny", "max_tokens": 2, "prompt_cache_retention": "forever",
                         "messages": [{"role": "user", "content": "Hi"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_retention"


def test_warm_up_pins_and_a_tenant_sees_and_releases_only_its_own(server) -> None:
    headers = {"x-api-key": ACME}
    system = "The warm archive: " + "volumes and shelves. " * 14
    warm = httpx.post(server.base_url + "/v1/cache/warm", timeout=60, headers=headers, json={
        "model": "tiny", "messages": [{"role": "system", "content": system}], "ttl": "1h"})
    assert warm.status_code == 200, warm.text
    out = warm.json()
    assert out["object"] == "cache.warm" and out["pinned_tokens"] >= 256
    assert out["ttl_s"] == 3600.0
    listed = httpx.get(server.base_url + "/v1/cache/pins", headers=headers, timeout=30).json()
    mine = [p for p in listed["data"] if p["num_tokens"] == out["pinned_tokens"]]
    assert mine and 0 < mine[-1]["expires_in_s"] <= 3600.0
    assert set(mine[-1]) == {"id", "num_tokens", "ttl_s", "expires_in_s", "last_block_digest"}
    other = {"x-api-key": "sk-globex-example-key"}
    assert httpx.get(server.base_url + "/v1/cache/pins", headers=other,
                     timeout=30).json()["data"] == []
    pin_id = mine[-1]["id"]
    refused = httpx.delete(f"{server.base_url}/v1/cache/pins/{pin_id}", headers=other, timeout=30)
    assert refused.status_code == 404
    hit = sdk(server).messages.create(
        model="tiny", max_tokens=2, system=system,
        messages=[{"role": "user", "content": "Which shelf?"}])
    assert hit.usage.cache_read_input_tokens >= out["pinned_tokens"] - 16
    done = httpx.delete(f"{server.base_url}/v1/cache/pins/{pin_id}", headers=headers, timeout=30)
    assert done.status_code == 200 and done.json() == {"id": pin_id, "deleted": True}
    ids = httpx.post(server.base_url + "/v1/cache/warm", headers=headers, timeout=60, json={
        "model": "tiny", "prompt": list(range(3, 60)), "ttl": 120}).json()
    assert ids["prompt_tokens"] == 57 and ids["pinned_tokens"] == 48 and ids["ttl_s"] == 120.0
    for body in ({"model": "tiny"}, {"model": "tiny", "prompt": "x", "ttl": "2d"},
                 {"model": "tiny", "prompt": "x", "ttl": 0}):
        assert httpx.post(server.base_url + "/v1/cache/warm", json=body, headers=headers,
                          timeout=30).status_code == 400


def test_serve_warm_preloads_and_pins_each_tenants_prompts(tmp_path: Path) -> None:
    import subprocess
    import sys

    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    warm = tmp_path / "warm.jsonl"
    system = "Standing orders of the archive. " * 12
    warm.write_text("\n".join(json.dumps(line) for line in (
        {"tenant": "acme", "messages": [{"role": "system", "content": system}], "ttl": "1h"},
        {"tenant": "globex", "prompt": list(range(3, 100))},
    )) + "\n")
    running = start_server(["--model", "tiny", "--tenants", str(EXAMPLE), "--secret-file",
                            str(secret), "--warm", str(warm)])
    try:
        pins = running.engine.pins
        assert [p.ttl_s for p in pins.of_domain("tenant:acme")] == [3600.0]
        assert pins.of_domain("group:partners") == []  # no ttl: cached, not pinned
        hit = sdk(running).messages.create(model="tiny", max_tokens=2, system=system, messages=[
            {"role": "user", "content": "What now?"}])
        assert hit.usage.cache_read_input_tokens >= pins.of_domain("tenant:acme")[0].num_tokens
    finally:
        running.stop()
    warm.write_text('{"tenant": "nobody", "prompt": "x"}\n')
    out = subprocess.run([sys.executable, "-m", "prefixcache", "serve", "--model", "tiny",
                          "--tenants", str(EXAMPLE), "--secret-file", str(secret), "--warm",
                          str(warm)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"--warm {warm}:1: no such tenant" in out.stderr


def test_langchain_chat_anthropic_and_litellm_anthropic_talk_to_messages(server) -> None:
    import os

    from langchain_anthropic import ChatAnthropic

    chat = ChatAnthropic(model="tiny", base_url=server.base_url, api_key=ACME, max_tokens=8,
                         temperature=0.0, max_retries=0)
    reply = chat.invoke([("system", SYSTEM), ("human", "Where is the map room?")])
    direct = sdk(server).messages.create(
        model="tiny", max_tokens=8, system=SYSTEM, extra_body=GREEDY,
        messages=[{"role": "user", "content": "Where is the map room?"}])
    assert reply.content == "".join(b.text for b in direct.content)
    assert reply.usage_metadata["input_tokens"] > 0
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no fetch of the price list
    import litellm

    litellm.telemetry = False
    out = litellm.completion(model="anthropic/tiny", api_base=server.base_url, api_key=ACME,
                             max_tokens=8, temperature=0.0,
                             messages=[{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": "Where is the map room?"}])
    assert out.choices[0].message.content == reply.content
    stream = litellm.completion(model="anthropic/tiny", api_base=server.base_url,
                                api_key=ACME, max_tokens=8, temperature=0.0, stream=True,
                                messages=[{"role": "user", "content": "Where is the map room?"}])
    assert "".join(c.choices[0].delta.content or "" for c in stream)


def test_the_anthropic_sdk_against_the_built_in_smollm2() -> None:
    """As against `make serve`: the trained model's real answers, plain and streamed; the
    token counts sum; the second call reads what the first's breakpoint created."""
    running = start_server(["--model", "smollm2"])
    try:
        client = anthropic.Anthropic(base_url=running.base_url, api_key="unused", max_retries=0)
        system = [{"type": "text", "cache_control": {"type": "ephemeral"},
                   "text": "You are a terse geography assistant. Answer in one short sentence."}]
        ask = [{"role": "user", "content": "What is the capital of France?"}]
        first = client.messages.create(model="smollm2", max_tokens=24, system=system,
                                       messages=ask, extra_body=GREEDY)
        assert "Paris" in first.content[0].text and first.stop_reason == "end_turn"
        counted = client.messages.count_tokens(model="smollm2", system=system, messages=ask)
        use = first.usage
        assert (use.input_tokens + use.cache_creation_input_tokens
                + use.cache_read_input_tokens) == counted.input_tokens
        assert use.cache_creation_input_tokens > 0
        with client.messages.stream(model="smollm2", max_tokens=24, system=system,
                                    messages=[{"role": "user", "content":
                                               "What is the capital of Italy?"}],
                                    extra_body=GREEDY) as stream:
            text = "".join(stream.text_stream)
            second = stream.get_final_message()
        assert "Rome" in text
        assert second.usage.cache_read_input_tokens >= use.cache_creation_input_tokens
    finally:
        running.stop()


def test_a_reset_says_how_many_pins_it_released(server) -> None:
    pinned = len(server.engine.pins.pins)
    assert pinned >= 1  # the breakpoints above
    reply = httpx.post(server.base_url + "/reset_prefix_cache", timeout=30,
                       headers={"x-api-key": "sk-ops-admin-example-key"})
    assert reply.status_code == 200 and reply.json() == {"reset": True,
                                                         "pins_released": pinned}
    assert not server.engine.pins.pins


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_under_an_eviction_flood_a_pinned_prefix_is_read_whole_until_its_ttl(
        tmp_path: Path) -> None:
    """A Claude Code-style request (tools and a long system prompt, each with a breakpoint)
    pins its prefix; floods from both tenants through the HTTP API then evict an equally long
    unpinned prefix, while the pinned one is still read whole (``cache_read_input_tokens`` =
    what the first call created). Past the TTL (a controlled clock) it goes like any other."""
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    running = start_server(["--model", "tiny", "--tenants", str(EXAMPLE), "--secret-file",
                            str(secret), "--num-kv-blocks", "96"])
    try:
        running.engine.pins.clock = _Clock()
        client = sdk(running)
        tools = [{"name": "read_file", "description": "Read a file of the repository.",
                  "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
                  "cache_control": {"type": "ephemeral"}}]
        system = [{"type": "text", "text": "You are a coding agent in a repository. " * 8,
                   "cache_control": {"type": "ephemeral"}}]
        unpinned = "Reviewing pull requests of a repository is your job here. " * 6

        def ask(question: str) -> anthropic.types.Usage:
            return client.messages.create(model="tiny", max_tokens=1, tools=tools, system=system,
                                          messages=[{"role": "user", "content": question}]).usage

        def plain(question: str) -> int:
            usage = client.messages.create(model="tiny", max_tokens=1, system=unpinned,
                                           messages=[{"role": "user", "content": question}]).usage
            return usage.cache_read_input_tokens

        created = ask("Open the README.").cache_creation_input_tokens
        assert created >= 20 * 16
        assert plain("First review.") == 0 and plain("Second review.") > 0

        def flood(round_: int) -> None:
            for key in (ACME, "sk-globex-example-key"):
                for i in range(6):
                    reply = httpx.post(running.base_url + "/v1/completions", timeout=60,
                                       headers={"x-api-key": key}, json={
                                           "model": "tiny", "max_tokens": 1,
                                           "prompt": f"flood {round_} {i} {key[:6]} " * 20})
                    assert reply.status_code == 200, reply.text

        flood(1)
        again = ask("Open the tests.")
        assert again.cache_read_input_tokens == created and again.cache_creation_input_tokens == 0
        assert plain("Third review.") == 0  # the unpinned prefix was evicted
        running.engine.pins.clock.now += 301.0  # past the TTL the hit at "tests" started
        flood(2)  # its steps expire the pin, then evict the prefix like any other
        assert not running.engine.pins.of_domain("tenant:acme")
        assert ask("Open the docs.").cache_read_input_tokens == 0
    finally:
        running.stop()
