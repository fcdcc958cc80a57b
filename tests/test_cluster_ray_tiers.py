"""`prefixcache serve --replicas 2 --kv-valkey URL` on Ray Serve: a prefix one replica computed is
loaded, not recomputed, by the other. The command starts a Ray instance of its own (no
$RAY_ADDRESS): Serve's HTTP proxy in CI's shared instance already listens on the port of
test_cluster_ray.py's cluster, and a second Serve application there would not get its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cluster_ray import BLOCK, PREFIXES, _complete, _port, _replicas, _stop, _wait

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow


def test_replicas_on_one_valkey_load_each_others_prefixes(tmp_path: Path) -> None:
    """``--kv-valkey``: a prefix one replica computed is loaded, not recomputed, by the other
    (round-robin sends the repeat to the other replica)."""
    from tier_helpers import ValkeyProcess, flush, keys, shared_url

    url, server = shared_url(), None
    if url is None:
        server = ValkeyProcess().start()
        url = server.url
    else:
        flush(url)
    port = _port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "prefixcache", "serve", "--model", "tiny", "--replicas", "2",
           "--router", "round-robin", "--port", str(port), "--cpus-per-replica", "1",
           "--threads-per-replica", "1", "--num-kv-blocks", "256", "--kv-valkey", url,
           "--metrics-key", "cluster-metrics-key"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _replicas(base) == 2, 180, proc, log)
        prompt = f"{PREFIXES[1]} Which page?"
        first = _complete(base, prompt, {})["prompt_tokens_details"]
        assert first["cached_tokens"] == 0 and first["external_cached_tokens"] == 0
        _wait(lambda: len(keys(url)) > 4, 30)  # the write-behind reached Valkey
        time.sleep(1.0)
        second = _complete(base, prompt, {})["prompt_tokens_details"]
        assert second["external_cached_tokens"] >= 4 * BLOCK, (first, second)
        assert second["local_cached_tokens"] == second["cached_tokens"] - second[
            "external_cached_tokens"]
    finally:
        if proc.poll() is None:
            _stop(proc)
        if server is not None:
            server.stop()
