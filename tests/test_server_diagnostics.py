"""Why did it miss? The vendors' prompt-cache diagnostics through the official `anthropic` and
`openai` SDKs against a real server: an unchanged prefix, a changed system prompt, added tools,
a changed message, an evicted prefix, an unknown id and another tenant's id (answered exactly as
an unknown one); OpenAI's prewarm and cache writes in usage."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from prefixcache.cache.fates import BlockFates
from prefixcache.server.diagnostics import Diagnoser, Fingerprint
from server_harness import RunningServer, start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tenants.toml"
SECRET = b"0123456789abcdef0123456789abcdef"
ACME, GLOBEX = "sk-acme-example-key-1", "sk-globex-example-key"
GREEDY = {"temperature": 0.0}
SYSTEM = "You are the archive's clerk. Answer in one short sentence, citing the shelf."
TOOL = {"name": "find_shelf", "description": "Find a shelf by topic.",
        "input_schema": {"type": "object", "properties": {"topic": {"type": "string"}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    secret = tmp_path_factory.mktemp("secret") / "secret"
    secret.write_bytes(SECRET)
    running = start_server(["--model", "tiny", "--tenants", str(EXAMPLE), "--secret-file",
                            str(secret), "--num-kv-blocks", "160", "--block-size", "8"])
    yield running
    running.stop()


def claude(server: RunningServer, key: str = ACME) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0)


def gpt(server: RunningServer, key: str = ACME) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def ask(client: anthropic.Anthropic, previous: str | None, *, system: str = SYSTEM,
        messages: list[dict[str, str]] | None = None, tools: list[dict] | None = None,
        ) -> anthropic.types.Message:  # fmt: skip
    extra = {"tools": tools} if tools else {}
    return client.messages.create(
        model="tiny", max_tokens=4, system=system, extra_body=GREEDY,
        messages=messages or [{"role": "user", "content": "Where is the map room?"}],
        diagnostics={"previous_message_id": previous}, **extra)


def test_messages_name_the_first_change_in_the_vendors_shape(server: RunningServer) -> None:
    client = claude(server)
    first = ask(client, None)
    assert first.diagnostics is None  # the first turn opts in; nothing to compare yet
    same = ask(client, first.id)
    assert same.diagnostics is None and same.usage.cache_read_input_tokens > 0  # no divergence
    changed = ask(client, same.id, system="You are the archive's porter. " + SYSTEM)
    reason = changed.diagnostics.cache_miss_reason
    assert reason.type == "system_changed" and reason.cache_missed_input_tokens > 0
    tooled = ask(client, same.id, tools=[TOOL])
    assert tooled.diagnostics.cache_miss_reason.type == "tools_changed"
    other = ask(client, same.id, messages=[{"role": "user", "content": "Where is the loo?"}])
    assert other.diagnostics.cache_miss_reason.type == "messages_changed"
    longer = ask(client, same.id, messages=[
        {"role": "user", "content": "Where is the map room?"},
        {"role": "assistant", "content": "Shelf 4."},
        {"role": "user", "content": "And the globes?"}])
    assert longer.diagnostics is None  # appended to, not changed: the prefix was served


def test_an_unknown_id_and_another_tenants_id_are_the_same_answer(server: RunningServer) -> None:
    mine = ask(claude(server), None)
    theirs = ask(claude(server, GLOBEX), None)
    for previous in ("msg_" + "0" * 32, theirs.id):
        reply = ask(claude(server), previous)
        assert reply.diagnostics.cache_miss_reason.type == "previous_message_not_found"
    bodies = []
    for previous in ("msg_" + "0" * 32, theirs.id):
        raw = httpx.post(server.base_url + "/v1/messages", timeout=60, headers={
            "x-api-key": ACME, "anthropic-version": "2023-06-01"}, json={
            "model": "tiny", "max_tokens": 4, "system": SYSTEM, **GREEDY,
            "messages": [{"role": "user", "content": "Where is the map room?"}],
            "diagnostics": {"previous_message_id": previous}})
        bodies.append(raw.json()["diagnostics"])
    assert bodies[0] == bodies[1] == {"cache_miss_reason": {"type": "previous_message_not_found"}}
    assert ask(claude(server), mine.id).diagnostics is None  # the owner's own id still works


def flood(client: anthropic.Anthropic, tag: str) -> None:
    for i in range(24):  # other prompts churn the 160-block pool
        client.messages.create(model="tiny", max_tokens=1, extra_body=GREEDY, messages=[
            {"role": "user", "content": f"Flood {tag} {i}: " + "ledger entry " * 8}])


def test_an_evicted_prefix_is_named_with_its_pressure_and_counted(server: RunningServer) -> None:
    client = claude(server)
    long_system = "The catalogue lists every shelf, map and globe by room. " * 3
    first = ask(client, None, system=long_system)
    flood(client, "own")
    again = ask(client, first.id, system=long_system)
    reason = again.diagnostics.cache_miss_reason
    assert reason.type == "evicted" and reason.cache_missed_input_tokens > 0
    assert reason.pressure == "same_tenant" and 0 <= reason.evicted_seconds_ago < 120
    metrics = httpx.get(server.base_url + "/metrics", timeout=30,
                        headers={"Authorization": "Bearer sk-ops-admin-example-key"}).text
    assert 'prefixcache:prefix_cache_miss_reasons_total{domain="tenant:acme",reason="evicted"}' \
        in metrics


def test_block_fates_tell_the_pressure_in_the_callers_terms_only() -> None:
    now = [10.0]
    fates = BlockFates(max_entries=3, clock=lambda: now[0])
    fates.evicted([b"a" * 32], "tenant:acme")
    fates.evicted([b"b" * 32], "tenant:globex")
    fates.evicted([b"c" * 32], None)
    assert fates.of(b"a" * 8, "tenant:acme", since=0.0).pressure == "same_tenant"
    assert fates.of(b"b" * 32, "tenant:acme", since=0.0).pressure == "other_tenants"
    assert fates.of(b"c" * 32, "tenant:acme", since=0.0).pressure == "purge"
    assert fates.of(b"a" * 32, "tenant:acme", since=11.0) is None  # an older story
    now[0] = 20.0
    fates.unpinned([b"d" * 32], expired=False)  # released for a request that could not start
    fates.evicted([b"d" * 32], "tenant:globex")
    fate = fates.of(b"d" * 32, "tenant:acme", since=0.0)
    assert fate.pressure == "pins" and fate.pin_yielded
    fates.tier_failed(b"d" * 32)
    assert fates.of(b"d" * 32, "tenant:acme", since=0.0).tier_failed
    assert fates.of(b"a" * 32, "tenant:acme", since=0.0) is None  # bounded: the oldest went
    fates.reset()
    assert fates.of(b"d" * 32, "tenant:acme", since=0.0).pressure == "reset"


def test_a_pinned_prefix_past_its_ttl_says_ttl_expired(server: RunningServer) -> None:
    class Clock:
        now = 1000.0

        def __call__(self) -> float:
            return self.now

    client = claude(server)
    system = [{"type": "text", "text": "Pinned: the reading room closes at dusk. " * 3,
               "cache_control": {"type": "ephemeral", "ttl": "5m"}}]
    pins = server.engine.pins
    before, pins.clock = pins.clock, Clock()
    try:
        first = ask(client, None, system=system)
        pins.clock.now += 301.0  # past the 5-minute TTL: released at the next step
        flood(client, "ttl")
        reason = ask(client, first.id, system=system).diagnostics.cache_miss_reason
    finally:
        pins.clock = before
    assert reason.type == "ttl_expired" and reason.cache_missed_input_tokens > 0
    assert reason.ttl_expired_seconds_ago >= reason.evicted_seconds_ago >= 0


def test_a_prefix_whose_disk_copy_fails_its_checks_says_tier_verify_failed(
    tmp_path: Path,
) -> None:
    running = start_server(["--model", "tiny", "--num-kv-blocks", "96", "--block-size", "8",
                            "--kv-disk", str(tmp_path / "kv")])
    try:
        client = anthropic.Anthropic(base_url=running.base_url, api_key="none", max_retries=0)
        system = "The disk keeps what the pool lets go, until a record goes bad. " * 3
        first = ask(client, None, system=system)
        assert running.engine.flush_tiers(30)
        flood(client, "tier")
        assert running.engine.flush_tiers(30)
        for record in (tmp_path / "kv").rglob("*.kv"):  # every record on disk goes bad
            data = bytearray(record.read_bytes())
            data[-1] ^= 0xFF
            record.write_bytes(bytes(data))
        reason = ask(client, first.id, system=system).diagnostics.cache_miss_reason
    finally:
        running.stop()
    assert reason.type == "tier_verify_failed" and reason.cache_missed_input_tokens > 0
    assert reason.pressure == "same_tenant"


def test_messages_and_the_warm_up_prewarm_without_output(server: RunningServer) -> None:
    client = claude(server)
    system = [{"type": "text", "text": "Prewarmed: the atlas room opens at nine. " * 3,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    warm = client.messages.create(model="tiny", max_tokens=0, system=system, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "When?"}])
    assert warm.content == [] and warm.stop_reason == "max_tokens"
    assert warm.usage.output_tokens == 0
    assert warm.usage.cache_creation.ephemeral_1h_input_tokens > 0
    with client.messages.stream(model="tiny", max_tokens=0, system=system, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "When?"}]) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert "content_block_start" not in kinds and streamed.content == []
    assert streamed.usage.cache_read_input_tokens >= warm.usage.cache_creation_input_tokens
    hit = client.messages.create(model="tiny", max_tokens=2, system=system, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": "When?"}])
    assert hit.usage.cache_read_input_tokens >= warm.usage.cache_creation_input_tokens
    def warm_up() -> dict:
        return httpx.post(server.base_url + "/v1/cache/warm", timeout=60,
                          headers={"Authorization": f"Bearer {ACME}"},
                          json={"model": "tiny", "prompt": "A warm-up writes blocks. " * 4}).json()

    body = warm_up()
    assert body["cache_write_tokens"] == body["prompt_tokens"] // 8 * 8 > 0
    again = warm_up()
    assert again["cache_write_tokens"] == 0 and again["cached_tokens"] > 0


def test_fingerprints_outlive_a_restart_beside_the_tier_and_name_a_dtype_change(
    tmp_path: Path,
) -> None:
    def serve(dtype: str) -> RunningServer:
        return start_server(["--model", "tiny", "--block-size", "8", "--dtype", dtype,
                             "--kv-disk", str(tmp_path / "kv")])

    def respond(running: RunningServer, earlier: str | None) -> openai.types.responses.Response:
        client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="none", max_retries=0)
        options = {"comparison_response_id": earlier} if earlier else None
        return client.responses.create(model="tiny", instructions=SYSTEM, input="Restarted?",
                                       max_output_tokens=2, prompt_cache_options=options,
                                       **GREEDY)

    running = serve("float32")
    try:
        first = respond(running, None)
    finally:
        running.stop()  # the fingerprints are flushed to DIR/diagnostics at shutdown
    running = serve("float32")
    try:  # a restart on the same weights: the disk tier serves the prefix again
        again = respond(running, first.id)
    finally:
        running.stop()
    assert again.prompt_cache_diagnostics.type == "cache_hit"
    assert again.usage.input_tokens_details.cached_tokens > 0
    running = serve("bfloat16")
    try:
        moved = respond(running, first.id)
    finally:
        running.stop()
    miss = moved.prompt_cache_diagnostics
    assert miss.type == "cache_miss" and miss.reason == "dtype_or_weights_changed"
    assert miss.cache_missed_tokens > 0
    assert "Restarted" not in "".join(p.read_text(errors="replace")
                                      for p in (tmp_path / "kv" / "diagnostics").iterdir())


def test_prompt_cache_options_ttl_pins_the_implicit_breakpoint(server: RunningServer) -> None:
    client = gpt(server, GLOBEX)  # a tenant of its own pins here
    reply = client.responses.create(model="tiny", instructions=SYSTEM, input="Pin me for long",
                                    max_output_tokens=2, **GREEDY,
                                    prompt_cache_options={"ttl": "12h"})
    pins = httpx.get(server.base_url + "/v1/cache/pins", timeout=30,
                     headers={"Authorization": f"Bearer {GLOBEX}"}).json()["data"]
    mine = [p for p in pins if p["ttl_s"] == 43200.0]
    assert mine and mine[0]["num_tokens"] == (reply.usage.input_tokens - 1) // 8 * 8
    explicit = client.responses.create(model="tiny", instructions=SYSTEM, input="No pin",
                                       max_output_tokens=2, **GREEDY,
                                       prompt_cache_options={"mode": "explicit"})
    after = httpx.get(server.base_url + "/v1/cache/pins", timeout=30,
                      headers={"Authorization": f"Bearer {GLOBEX}"}).json()["data"]
    assert explicit.usage.output_tokens > 0 and len(after) == len(pins)
    with pytest.raises(openai.BadRequestError) as both:
        client.responses.create(model="tiny", input="Both", max_output_tokens=2,
                                prompt_cache_retention="24h", prompt_cache_options={"ttl": "30m"})
    assert both.value.body["param"] == "prompt_cache_retention"


def test_a_tenant_without_a_cache_is_told_so(server: RunningServer) -> None:
    client = claude(server, "sk-hospital-example-key")
    first = ask(client, None)
    reason = ask(client, first.id).diagnostics.cache_miss_reason
    assert reason.type == "cache_disabled_for_tenant" and reason.cache_missed_input_tokens > 0


def test_a_prompt_shorter_than_a_block_is_below_block() -> None:
    store = Diagnoser(block_size=16)
    short = Fingerprint.of([("model", "m")], ["hi"], [], 9)
    longer = Fingerprint.of([("model", "m")], ["hi", "there"], [b"b" * 32], 20)
    verdict = store.compare(short, longer, num_cached=0)
    assert verdict.reason == "below_block" and verdict.missed_tokens == 9
    assert store.compare(longer, longer, num_cached=16).reason is None


def test_responses_diagnostics_prewarm_and_cache_writes(server: RunningServer) -> None:
    client = gpt(server)
    warm = client.responses.create(model="tiny", instructions=SYSTEM, input="Where is the map?",
                                   prompt_cache_options={"prewarm": True}, **GREEDY)
    assert warm.status == "completed" and warm.output == [] and warm.usage.output_tokens == 0
    assert warm.usage.input_tokens_details.cache_write_tokens > 0
    hit = client.responses.create(model="tiny", instructions=SYSTEM, input="Where is the map?",
                                  max_output_tokens=4, **GREEDY,
                                  prompt_cache_options={"comparison_response_id": warm.id})
    assert hit.prompt_cache_diagnostics.type == "cache_hit"
    assert hit.usage.input_tokens_details.cached_tokens > 0
    moved = client.responses.create(model="tiny", instructions="Be brief. " + SYSTEM,
                                    input="Where is the map?", max_output_tokens=4, **GREEDY,
                                    prompt_cache_options={"comparison_response_id": warm.id})
    miss = moved.prompt_cache_diagnostics
    assert miss.type == "cache_miss" and miss.reason == "input_changed"
    assert 0 < miss.cache_missed_tokens <= miss.comparison_reusable_tokens
    theirs = gpt(server, GLOBEX).responses.create(model="tiny", input="Hello", **GREEDY,
                                                  max_output_tokens=2)
    lost = client.responses.create(model="tiny", input="Hello", max_output_tokens=2, **GREEDY,
                                   prompt_cache_options={"comparison_response_id": theirs.id})
    assert lost.prompt_cache_diagnostics.type == "comparison_response_not_found"
    plain = client.responses.create(model="tiny", input="Hello", max_output_tokens=2, **GREEDY)
    assert plain.prompt_cache_diagnostics is None  # not asked for
    chat = client.chat.completions.create(model="tiny", max_tokens=2, **GREEDY, messages=[
        {"role": "system", "content": SYSTEM + " Chat."}, {"role": "user", "content": "Hi"}])
    details = chat.usage.prompt_tokens_details
    assert details.cache_write_tokens == chat.usage.prompt_tokens // 8 * 8 - details.cached_tokens


def test_chat_completions_take_the_same_comparison_as_an_extension(server: RunningServer) -> None:
    client = gpt(server)
    messages = [{"role": "system", "content": SYSTEM + " Chat two."},
                {"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model="tiny", max_tokens=2, **GREEDY,
                                           messages=messages)
    again = client.chat.completions.create(
        model="tiny", max_tokens=2, **GREEDY, messages=messages,
        extra_body={"prompt_cache_options": {"comparison_response_id": first.id}})
    assert again.model_extra["prompt_cache_diagnostics"] == {"type": "cache_hit"}
    stream = client.chat.completions.create(
        model="tiny", max_tokens=2, **GREEDY, stream=True,
        stream_options={"include_usage": True}, messages=[messages[0], {
            "role": "user", "content": "Hello"}],
        extra_body={"prompt_cache_options": {"comparison_response_id": first.id}})
    last = list(stream)[-1]
    assert last.model_extra["prompt_cache_diagnostics"]["reason"] == "input_changed"


def test_the_store_is_bounded_and_forgets_after_its_ttl() -> None:
    now = [0.0]
    store = Diagnoser(block_size=4, max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    print_ = Fingerprint.of([("model", "m")], ["hi"], [b"a" * 32], 9)
    for rid in ("r1", "r2", "r3"):
        store.remember("tenant", rid, print_)
    found = store.find("tenant", "r3")
    assert store.find("tenant", "r1") is None and found is not None and found[1] is print_
    assert store.find("other", "r3") is None  # a scope sees its own fingerprints only
    now[0] = 11.0
    assert store.find("tenant", "r3") is None and len(store) == 1
