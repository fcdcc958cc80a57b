"""Schema-driven fuzzing: schemathesis generates requests from the server's own OpenAPI
description (``/openapi.json``) for every route and checks every answer against it.

What a user would notice, checked per generated request: no 5xx; every status the route answers is
one it documents, in the documented content type and shape (the OpenAI error body, Anthropic's on
``/v1/messages``); a body that breaks the schema is refused with a 4xx; a missing or wrong key is
refused. Afterwards the server is healthy and the KV pool is back to idle, its integrity intact.
A bounded number of examples per route keeps this inside the suite's time
(``PREFIXCACHE_FUZZ_EXAMPLES`` raises it for a longer run; docs/robustness.md).
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from server_harness import RunningServer, start_server, wait_idle

MODEL = "tiny"
ADMIN_KEY = "sk-fuzz-admin-0123456789"
TENANTS = f"""
[tenants.ops]
api_keys = ["{ADMIN_KEY}"]
admin = true
[tenants.alice]
api_keys = ["sk-fuzz-alice-0123456789"]
"""
EXAMPLES = int(os.environ.get("PREFIXCACHE_FUZZ_EXAMPLES", "12"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance, negative_data_rejection,
          ignored_auth]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> RunningServer:
    tenants = tmp_path_factory.mktemp("fuzz") / "tenants.toml"
    tenants.write_text(TENANTS)
    running = start_server(["--model", MODEL, "--tenants", str(tenants), "--num-kv-blocks", "96",
                            "--default-max-tokens", "4", "--max-request-bytes", "65536"])
    yield running
    running.stop()


def _bounded(case: schemathesis.Case) -> None:
    """Generated max_tokens may ask for the whole context on every example: keep it short."""
    if isinstance(case.body, dict):
        for field in ("max_tokens", "max_output_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(field), int) and case.body[field] > 8:
                case.body[field] = 8


def test_every_route_answers_as_it_documents(server: RunningServer) -> None:
    api = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
        "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/v1/models",
        "/v1/models/{model_id}", "/v1/cache/warm", "/v1/cache/pins", "/v1/cache/pins/{pin_id}"}
    failed: list[str] = []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def fuzz(case: schemathesis.Case) -> None:
            _bounded(case)
            case.call_and_validate(headers=headers, checks=CHECKS, timeout=60)

        try:
            fuzz()
        except Exception as exc:  # every route is fuzzed; all failures reported together
            failed.append(f"{operation.method.upper()} {operation.path}: {exc}")
    assert not failed, "\n\n".join(failed)


def test_linked_calls_answer_as_documented(server: RunningServer) -> None:
    """Sequences that follow the description's links (warm a prefix, list the pins, delete one):
    each answer checked as above, a deleted pin gone."""
    api = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}

    class Linked(api.as_state_machine()):  # type: ignore[misc]
        def before_call(self, case: schemathesis.Case) -> None:
            _bounded(case)

        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, object]:
            return {"headers": headers, "timeout": 60}

        def validate_response(self, response, case, additional_checks=None, **kwargs) -> None:
            case.validate_response(response, checks=CHECKS)

    Linked.run(settings=settings(max_examples=EXAMPLES, stateful_step_count=4, deadline=None,
                                 database=None, suppress_health_check=list(HealthCheck)))


def test_the_server_is_healthy_and_idle_after_the_fuzzing(server: RunningServer) -> None:
    # runs after the fuzzing (pytest keeps the file's order); alone, it checks a fresh server
    assert httpx.get(server.base_url + "/health", timeout=10).json() == {"status": "ok"}
    reply = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                       json={"model": MODEL, "prompt": "still serving", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    wait_idle(server)
    reset = httpx.post(server.base_url + "/reset_prefix_cache", timeout=30,
                       headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert reset.status_code == 200  # pins made by fuzzed warm-ups released with the cache
    engine = server.engine
    engine.cache.check_integrity()
    snapshot = engine.snapshot()
    assert snapshot.num_running == snapshot.num_waiting == 0
    assert snapshot.num_pinned_blocks == 0
    # no block held by a request that is gone
    assert snapshot.kv_cache_usage == 0.0 and snapshot.num_free_blocks == snapshot.num_blocks
