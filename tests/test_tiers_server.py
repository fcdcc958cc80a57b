"""The tiers behind the HTTP server: a `kill -9` and a restart keep the cache, the usage block
splits local and external cached tokens, /metrics exports every tier, an outage answers no 5xx,
and an admin purges one tenant through ``POST /cache/purge``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from server_harness import RunningServer, start_server
from tier_helpers import ValkeyProcess, free_port, record_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tenants.toml"
SECRET = b"0123456789abcdef0123456789abcdef"
PROMPT = [(i * 37) % 250 + 3 for i in range(161)]  # 10 complete blocks of 16 below the last


def complete(base_url: str, key: str = "unused", prompt: list[int] = PROMPT) -> dict[str, int]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=120)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0.0)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return dict(out.usage.prompt_tokens_details.model_dump())


def metric(base_url: str, name: str, key: str | None = None) -> dict[str, float]:
    """Every sample of ``name`` on /metrics: labels text -> value."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            labels, _, value = line[len(name):].rpartition(" ")
            out[labels] = float(value)
    return out


def _serve(port: int, kv_disk: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "prefixcache", "serve", "--model", "tiny", "--host", "127.0.0.1",
         "--port", str(port), "--block-size", "16", "--kv-disk", str(kv_disk)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )


def _wait_healthy(proc: subprocess.Popen[bytes], base_url: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def test_after_kill_9_and_a_restart_the_first_repeat_is_a_hit(tmp_path: Path) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    proc = _serve(port, tmp_path)
    try:
        _wait_healthy(proc, base_url)
        first = complete(base_url)
        assert first["cached_tokens"] == 0 and first["external_cached_tokens"] == 0
        deadline = time.monotonic() + 30
        while len(record_files(tmp_path)) < 10:  # the write-behind is asynchronous
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # no shutdown, no flush
        proc.wait(30)
        proc = _serve(port, tmp_path)
        _wait_healthy(proc, base_url)
        again = complete(base_url)
        assert again["cached_tokens"] == again["external_cached_tokens"] == 160
        assert again["local_cached_tokens"] == 0
        assert metric(base_url, "prefixcache:kv_tier_hits_total") == {'{tier="disk"}': 10.0}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.fixture
def tiered_server(tmp_path: Path) -> Iterator[tuple[RunningServer, ValkeyProcess]]:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    valkey = ValkeyProcess()  # down at start
    running = start_server(["--model", "tiny", "--tenants", str(EXAMPLE), "--secret-file",
                            str(secret), "--block-size", "16", "--kv-disk", str(tmp_path / "kv"),
                            "--kv-valkey", valkey.url])
    yield running, valkey
    running.stop()
    valkey.stop()


def test_an_outage_answers_no_5xx_and_the_tiers_show_on_metrics(
    tiered_server: tuple[RunningServer, ValkeyProcess],
) -> None:
    server, valkey = tiered_server
    admin = "sk-ops-admin-example-key"
    first = complete(server.base_url, "sk-acme-example-key-1")
    assert (first["cached_tokens"], first["local_cached_tokens"],
            first["external_cached_tokens"]) == (0, 0, 0)
    assert metric(server.base_url, "prefixcache:kv_tier_up", admin) == {
        '{tier="disk"}': 1.0, '{tier="valkey"}': 0.0}
    valkey.start()
    time.sleep(1.2)  # past the reconnect backoff
    again = complete(server.base_url, "sk-acme-example-key-1")
    assert again["cached_tokens"] == again["local_cached_tokens"] == 160  # RAM
    complete(server.base_url, "sk-acme-example-key-1", [t ^ 1 for t in PROMPT])
    assert server.engine.flush_tiers(30)
    up = metric(server.base_url, "prefixcache:kv_tier_up", admin)
    assert up['{tier="valkey"}'] == 1.0
    assert metric(server.base_url, "prefixcache:kv_tier_written_blocks_total", admin)[
        '{tier="valkey"}'] >= 10
    valkey.stop()  # lost mid-run: still no 5xx
    complete(server.base_url, "sk-acme-example-key-1", [t ^ 2 for t in PROMPT])


def test_purge_needs_an_admin_and_a_known_tenant(
    tiered_server: tuple[RunningServer, ValkeyProcess],
) -> None:
    server, valkey = tiered_server
    complete(server.base_url, "sk-acme-example-key-1")
    complete(server.base_url, "sk-globex-example-key")
    assert server.engine.flush_tiers(30)
    url = server.base_url + "/cache/purge"

    def post(key: str, tenant: str) -> httpx.Response:
        return httpx.post(url, json={"tenant": tenant},
                          headers={"authorization": f"Bearer {key}"}, timeout=30)

    refused = post("sk-acme-example-key-1", "acme")
    assert refused.status_code == 403 and refused.json()["error"]["message"]
    unknown = post("sk-ops-admin-example-key", "nobody")
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "tenant"
    bad = httpx.post(url, json={"tenant": 3},
                     headers={"authorization": "Bearer sk-ops-admin-example-key"}, timeout=30)
    assert bad.status_code == 400
    down = post("sk-ops-admin-example-key", "acme")  # Valkey is down: said, the disk purged
    assert down.status_code == 503 and "valkey" in down.json()["error"]["message"]
    kv = Path(str(server.engine.engine_config.tiers.settings.get("kv_disk", "")))
    assert len(record_files(kv)) == 10  # globex's (group partners) are kept
    valkey.start()
    done = post("sk-ops-admin-example-key", "acme")
    assert done.status_code == 200
    assert done.json() == {"tenant": "acme", "domain": "tenant:acme",
                           "removed": {"ram": 0, "disk": 0, "valkey": 0}}
    assert complete(server.base_url, "sk-acme-example-key-1")["cached_tokens"] == 0
    assert complete(server.base_url, "sk-globex-example-key")["cached_tokens"] == 160


def test_two_servers_on_one_valkey_share_a_prefix(tmp_path: Path) -> None:
    valkey = ValkeyProcess().start()
    one = two = None
    try:
        argv = ["--model", "tiny", "--block-size", "16", "--kv-valkey", valkey.url]
        one, two = start_server(argv), start_server(argv)  # two replicas, one shared tier
        assert complete(one.base_url)["cached_tokens"] == 0
        assert one.engine.flush_tiers(30)
        hit = complete(two.base_url)
        assert hit["cached_tokens"] == hit["external_cached_tokens"] == 160
    finally:
        for server in (one, two):
            if server is not None:
                server.stop()
        valkey.stop()


def test_the_simulator_predicts_the_engines_hits_with_a_disk_tier(tmp_path: Path) -> None:
    import json
    import random

    path = tmp_path / "traffic.jsonl"
    running = start_server(["--model", "tiny", "--block-size", "16", "--num-kv-blocks", "40",
                            "--kv-disk", str(tmp_path / "kv"), "--record-trace", str(path)])
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 250) for _ in range(192)] for _ in range(4)]  # 12 blocks each
    served = total = 0
    try:
        for i in range(24):  # the four prefixes in turn: RAM holds about three of them
            prompt = prefixes[i % 4] + [rng.randrange(3, 250) for _ in range(20)]
            details = complete(running.base_url, prompt=prompt)
            assert running.engine.flush_tiers(30)
            served += details["cached_tokens"]
            total += len(prompt)
    finally:
        running.stop()
    engine_ratio = served / total

    def simulate(*tiers: str) -> float:
        out = subprocess.run(
            [sys.executable, "-m", "prefixcache", "simulate", str(path), "--format", "record",
             "--capacity", "40", "--prefix-cache", "hash", "--no-progress", "--no-plots",
             "--out", str(tmp_path / "sim"), *tiers],
            capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        rows = json.loads((tmp_path / "sim" / "results.json").read_text())["results"]
        return float(rows[0]["hit_ratio"])

    with_disk = simulate("--kv-disk-gib", "1")
    assert abs(with_disk - engine_ratio) <= 0.05
    assert simulate() < engine_ratio - 0.2  # without the disk, RAM alone would miss


@pytest.mark.parametrize("flags, message", [
    (["--kv-disk", "/proc/version/kv"], "--kv-disk"),
    (["--kv-disk-gib", "0", "--kv-disk", "/tmp"], "--kv-disk-gib must be > 0"),
    (["--kv-valkey", "not-a-url"], "--kv-valkey 'not-a-url': Valkey URL must specify"),
])
def test_a_bad_tier_flag_is_a_clear_error_at_start(flags: list[str], message: str) -> None:
    out = subprocess.run([sys.executable, "-m", "prefixcache", "serve", "--model", "tiny",
                          "--port", str(free_port()), *flags], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
