"""Structured logs: cache decisions carry digests, counts and block ids, and nothing the server
logs during a multi-tenant run contains a prompt's text or its token ids."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import httpx
import pytest

from prefixcache.tools.cachelog import (
    DECISION_LOGGER,
    LOG_ENV,
    CacheDecisionLog,
    JsonFormatter,
    attach,
    configure,
)
from server_harness import start_server, wait_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SECRET = "the launch code is swordfish-7781 and the vault opens at dawn; "
PROMPT = SECRET * 3
KEYS = {"alice": "key-alice-0001", "bob": "key-bob-000002"}


@pytest.fixture()
def tenants(tmp_path: Path) -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(
        "".join(f'[tenants.{name}]\napi_keys = ["{key}"]\n' for name, key in KEYS.items())
    )
    return str(path)


def _completion(url: str, key: str, prompt: str, stream: bool = False) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    if stream:
        body["stream"] = True
    response = httpx.post(
        f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )
    assert response.status_code == 200, response.text
    return {} if stream else response.json()


def test_server_logs_hold_no_prompt_text(
    tenants: str, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = logging.getLogger()
    old_level, root_handlers = root.level, list(root.handlers)
    monkeypatch.setenv(LOG_ENV, "json")  # the operator's switch: JSON logs + decision log
    running = start_server(["--tenants", tenants, "--num-kv-blocks", "64", "--log-level", "debug"])
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter())
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)  # everything any logger emits, at every level
    try:
        # attached by PREFIXCACHE_LOG=json, once, beside the dashboard's own observer
        (log,) = [o for o in running.engine.cache.observers if isinstance(o, CacheDecisionLog)]
        assert attach(running.engine) is log
        url = running.base_url
        first = _completion(url, KEYS["alice"], PROMPT)
        second = _completion(url, KEYS["alice"], PROMPT)
        cross = _completion(url, KEYS["bob"], PROMPT)
        _completion(url, KEYS["bob"], PROMPT + " tail", stream=True)
        bad = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": PROMPT, "max_tokens": -1},
            headers={"Authorization": f"Bearer {KEYS['alice']}"},
            timeout=60,
        )
        assert bad.status_code == 400
        wait_idle(running)
    finally:
        running.stop()
        root.handlers[:] = root_handlers
        root.setLevel(old_level)
        logging.getLogger(DECISION_LOGGER).setLevel(logging.NOTSET)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cross["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    captured = capfd.readouterr()
    everything = buffer.getvalue() + captured.out + captured.err
    records = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert any(line.startswith('{"ts"') for line in captured.err.splitlines())  # JSON on stderr
    decisions = [r for r in records if r["logger"] == DECISION_LOGGER]
    hits = [r for r in decisions if r.get("hit") is True]
    commits = [r for r in decisions if r.get("event") == "commit"]
    assert hits and commits, "the decision log recorded no hit or no commit"
    for record in hits + commits:
        assert len(record["namespace"]) == 12 and len(record["parent"]) == 12
        assert isinstance(record["block_id"], int) and record["num_tokens"] == 16
        assert isinstance(record["block_index"], int) and record["ref_cnt"] is not None
    # alice's and bob's lookups live in different namespaces
    assert len({r["namespace"] for r in decisions if r.get("event") == "lookup"}) >= 2
    for needle in ("swordfish", "launch code", "vault opens", SECRET[:20]):
        assert needle not in everything, f"prompt text {needle!r} leaked into the logs"
    ids = ",".join(str(b) for b in b"swordfish")
    assert ids not in everything.replace(" ", "")  # nor its token ids (byte tokenizer)
    for key in KEYS.values():
        assert key not in everything


def test_json_formatter_keeps_fields_and_drops_exception_messages() -> None:
    record = logging.makeLogRecord(
        {"msg": "x %d", "args": (3,), "levelname": "INFO", "name": "t", "block_index": 2}
    )
    try:
        raise ValueError(PROMPT)
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "x 3" and line["block_index"] == 2 and line["exc_type"] == "ValueError"
    assert "swordfish" not in json.dumps(line)


def test_configure_rejects_unknown_formats() -> None:
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    try:
        with pytest.raises(ValueError, match="json"):
            configure("xml")
        handler = configure("json", "warning")
        assert isinstance(handler.formatter, JsonFormatter)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
