"""`prefixcache serve --record-trace FILE`: real traffic becomes a simulator trace with counts and
block digests only, and `prefixcache simulate` replays it to the same reuse the server saw."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai

from prefixcache.sim.record import read_record
from server_harness import start_server, wait_idle

SYSTEM = "You are the records clerk of a very large archive. " * 3


def test_recorded_trace_holds_counts_and_digests_and_replays(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    running = start_server(["--model", "tiny", "--num-kv-blocks", "128",
                            "--record-trace", str(path)])
    try:
        client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused")
        usages = []
        for question in ("Where is the map room?", "Who keeps the keys?", "Where is the map room?"):
            reply = client.completions.create(model="tiny", prompt=SYSTEM + question,
                                              max_tokens=4, temperature=0)
            usages.append(reply.usage)
        wait_idle(running)
    finally:
        running.stop()
    text = path.read_text()
    assert "records clerk" not in text and "map room" not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert lines[0]["format"] == "prefixcache-trace" and lines[0]["block_size"] == 16
    assert [r["input_length"] for r in lines[1:]] == [u.prompt_tokens for u in usages]
    assert [r["output_length"] for r in lines[1:]] == [u.completion_tokens for u in usages]
    served_cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert [r["cached_tokens"] for r in lines[1:]] == served_cached
    assert served_cached[1] > 0 and served_cached[2] > served_cached[1]
    first, second, third = (r["block_digests"] for r in lines[1:])
    shared = served_cached[1] // 16
    assert first[:shared] == second[:shared] and first[shared] != second[shared]
    assert third == first  # the same prompt gives the same chained digests

    trace = read_record(path)
    assert [r.input_length for r in trace.requests] == [u.prompt_tokens for u in usages]
    out = subprocess.run(
        [sys.executable, "-m", "prefixcache", "simulate", str(path), "--format", "record",
         "--capacity", "inf", "--prefix-cache", "hash", "--out", str(tmp_path / "sim")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "sim" / "results.json").read_text())
    row = result["rows"][0] if "rows" in result else result["results"][0]
    total_input = sum(u.prompt_tokens for u in usages)
    assert abs(row["hit_ratio"] - sum(served_cached) / total_input) < 1e-9
