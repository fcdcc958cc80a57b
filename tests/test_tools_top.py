"""``prefixcache top``: one plain frame, a live view in a real terminal (tmux, as over SSH), and
one-line errors for a server that is down or refuses the key."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from server_harness import RunningServer, start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SYSTEM = "The terminal view's shared system prompt, several blocks long. " * 4


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server(["--model", "tiny"])
    for i in range(3):  # the last two compared with an id never issued: diagnosed not_found
        options = {"prompt_cache_options": {"comparison_response_id": "chatcmpl-x"}} if i else {}
        reply = httpx.post(running.base_url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 2, **options, "messages": [
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Q{i}"}]})
        assert reply.status_code == 200
    yield running
    running.stop()


def _top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefixcache", "top", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "160"})


def test_once_prints_the_dashboards_numbers(server) -> None:
    out = _top("--url", server.base_url, "--once")
    assert out.returncode == 0, out.stderr
    data = httpx.get(server.base_url + "/dashboard/data").json()
    assert f"{data['counters']['prefix_cache_hits']:,}" in out.stdout
    assert "hit ratio" in out.stdout and "tenant:default" in out.stdout
    assert data["tree"][0]["digest"] in out.stdout and "full-hit" in out.stdout
    assert "misses by reason" in out.stdout and "not_found 2" in out.stdout
    assert "terminal view" not in out.stdout  # digests, never text


def test_errors_are_one_line_and_exit_2(server) -> None:
    down = _top("--url", "http://127.0.0.1:9", "--once")
    assert down.returncode == 2 and "cannot reach" in down.stderr
    assert "Traceback" not in down.stderr
    assert _top("--url", server.base_url, "--interval", "0").returncode == 2


def test_a_tenanted_server_refuses_top_without_an_admin_key(tmp_path) -> None:
    from pathlib import Path

    secret = tmp_path / "secret"
    secret.write_text("a-top-secret-of-enough-bytes-here")
    tenants = Path(__file__).resolve().parents[1] / "examples" / "tenants.toml"
    running = start_server(["--model", "tiny", "--tenants", str(tenants), "--secret-file",
                            str(secret), "--metrics-key", "top-metrics-key"])
    try:
        refused = _top("--url", running.base_url, "--once", "--api-key", "sk-acme-example-key-1")
        assert refused.returncode == 2 and "refused the key" in refused.stderr
        assert _top("--url", running.base_url, "--once", "--api-key",
                    "top-metrics-key").returncode == 0
    finally:
        running.stop()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux for a real terminal")
def test_the_live_view_refreshes_in_a_terminal(server) -> None:
    session = f"top-{uuid.uuid4().hex[:8]}"
    command = f"{sys.executable} -m prefixcache top --url {server.base_url} --interval 0.3"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "60",
                    command], check=True)
    try:
        def screen() -> str:
            return subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                                  capture_output=True, text=True).stdout

        deadline = time.monotonic() + 30
        while "hit ratio" not in screen():
            assert time.monotonic() < deadline, screen()
            time.sleep(0.2)
        first = screen()
        httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "something new " * 40, "max_tokens": 2})
        while screen() == first:  # the step, the counters and the clock move
            assert time.monotonic() < deadline, first
            time.sleep(0.2)
        assert "prefill saved" in screen() and "tok/s" in screen()
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
