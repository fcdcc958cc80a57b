"""`prefixcache serve --replicas 2 --enable-lora` on Ray Serve: an adapter an admin loads at run
time through the ingress is served by every replica, and the cache-aware router sends its
requests where its blocks are (the ingress names them in the adapter's namespace, as for an
adapter given at start: the same files under a run-time name find the start-time name's blocks,
not the base's replica) and keeps each of its prefixes on one replica, until it is unloaded from
every replica. The command starts a Ray instance of its own (no $RAY_ADDRESS), as
test_cluster_ray_tiers.py's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lora_helpers import peft_adapter
from prefixcache.model import load_model
from test_cluster_ray import BLOCK, EXAMPLE, KEY, PREFIXES, _port, _replicas, _stop, _wait

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow

ADMIN = {"Authorization": "Bearer sk-ops-admin-example-key"}


def _ask(base: str, model: str, prompt: str) -> httpx.Response:
    return httpx.post(
        base + "/v1/completions",
        timeout=60,
        headers=KEY,
        json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0},
    )


def _cached(base: str, model: str, prompt: str) -> int:
    response = _ask(base, model, prompt)
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_an_adapter_loaded_at_run_time_is_on_every_replica_and_routed_by_its_prefixes(
    tmp_path: Path,
) -> None:
    adapter = tmp_path / "sql"
    peft_adapter(load_model("tiny").path, adapter, seed=3, r=8, lora_alpha=16,
                 target_modules=["q_proj", "v_proj"])  # fmt: skip
    port = _port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "prefixcache", "serve", "--model", "tiny", "--replicas", "2",
           "--router", "cache-aware", "--port", str(port), "--cpus-per-replica", "1",
           "--threads-per-replica", "1", "--num-kv-blocks", "256", "--tenants", str(EXAMPLE),
           "--metrics-key", "cluster-metrics-key", "--enable-lora", "--lora-modules",
           f"sql={adapter}", "--allow-runtime-lora-updating"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _replicas(base) == 2, 180, proc, log)
        # the adapter given at start computes a prompt on one replica; the base's same prompt
        # goes to the other (nothing of its namespace anywhere: the one holding fewer blocks)
        prompt = f"{PREFIXES[2]} Which table?"
        assert _cached(base, "sql", prompt) == 0
        time.sleep(1.0)  # the replica's KV events reach the router's index
        assert _cached(base, "tiny", prompt) == 0
        time.sleep(1.0)
        # the same files loaded at run time under another name: the same identity, so the
        # ingress names its blocks as the replica holding sql's (not the base's) does
        body = {"lora_name": "sql2", "lora_path": str(adapter)}
        loaded = httpx.post(base + "/v1/load_lora_adapter", headers=ADMIN, json=body, timeout=60)
        assert loaded.status_code == 200 and "added successfully" in loaded.text, loaded.text
        again = httpx.post(base + "/v1/load_lora_adapter", headers=ADMIN, json=body, timeout=60)
        assert again.status_code == 400 and "already been loaded" in again.text
        assert _cached(base, "sql2", prompt) >= len(prompt) // BLOCK // 2 * BLOCK
        cached = {}
        for i, prefix in enumerate(PREFIXES[:2]):
            for j in range(3):  # a replica without the adapter would answer 404
                cached[i, j] = _cached(base, "sql2", f"{prefix} Question {j}?")
                time.sleep(0.3)
        for i, prefix in enumerate(PREFIXES[:2]):
            assert cached[i, 0] == 0
            for j in range(1, 3):  # a request sent to the other replica would hit nothing
                assert cached[i, j] >= len(prefix) // BLOCK // 2 * BLOCK, (i, j, cached)
        gone = httpx.post(base + "/v1/unload_lora_adapter", headers=ADMIN, timeout=60,
                          json={"lora_name": "sql2"})  # fmt: skip
        assert gone.status_code == 200, gone.text
        for j in range(4):  # on neither replica now; sql, given at start, stays
            response = _ask(base, "sql2", f"{PREFIXES[0]} Question {j}?")
            assert response.status_code == 404, response.text
            assert response.json()["error"]["code"] == "model_not_found"
            assert _ask(base, "sql", f"{PREFIXES[0]} Question {j}?").status_code == 200
    finally:
        if proc.poll() is None:
            _stop(proc)
