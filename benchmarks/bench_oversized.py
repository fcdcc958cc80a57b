"""Oversized uploads: does a client sending 20 MB bodies read its 413, and do others notice?

Question (issue 38, point 1): against a real multi-tenant ``prefixcache serve`` with
``--max-request-bytes`` at its default (8 MiB), one tenant posts 20 MB completions bodies (a
declared Content-Length, as every HTTP client sends) one after another, each ``--interval``
seconds apart, while a calm tenant sends one short streamed request at a time over a prefix it
cached first. Does every oversized client read its 413 (not a connection error), how long does
it take, and is the calm tenant's time to first token p99 the same as in the quiet rounds?

Rounds alternate quiet / uploading (``--rounds`` of each, ``--requests`` calm requests per
round), in one run against one server; the figures are the medians over rounds of each round's
p50 and p99. Both clients run in this process (their own threads), on the same cores as the
server, as a local attacker would. Prints a table and a final JSON line.

    .venv/bin/python benchmarks/bench_oversized.py [--model smollm2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from bench_serve import MODEL_ID, ServerProcess
from bench_tiers import cpu_name

TENANTS = """
[tenants.calm]
api_keys = ["sk-calm-oversized-key"]
[tenants.rogue]
api_keys = ["sk-rogue-oversized-key"]
"""
CALM_KEY, ROGUE_KEY = "sk-calm-oversized-key", "sk-rogue-oversized-key"
CALM_PREFIX = "You are the calm tenant's assistant. Answer briefly and politely. " * 6


def calm_ttft(client: httpx.Client, i: int) -> float:
    body = {"model": MODEL_ID, "prompt": f"{CALM_PREFIX} Question {i}: hello?",
            "max_tokens": 4, "temperature": 0, "stream": True}
    start = time.monotonic()
    with client.stream("POST", "/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {CALM_KEY}"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - start
    raise RuntimeError("a calm stream ended without a token")


class Uploader(threading.Thread):
    """Posts a 20 MB body every ``interval`` seconds; records how each one ended."""

    def __init__(self, base_url: str, size: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.base_url, self.interval = base_url, interval
        self.body = json.dumps({"model": MODEL_ID, "prompt": "x" * size}).encode()
        self.outcomes: Counter[str] = Counter()
        self.seconds: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {ROGUE_KEY}", "Content-Type": "application/json"}
        while not self.stop.is_set():
            start = time.monotonic()
            try:  # a fresh connection each time: the server closes it after the 413
                response = httpx.post(self.base_url + "/v1/completions", content=self.body,
                                      headers=headers, timeout=30)
                ok = (response.status_code == 413
                      and response.json()["error"]["code"] == "request_too_large")
                self.outcomes["413" if ok else f"status {response.status_code}"] += 1
            except httpx.HTTPError as exc:
                self.outcomes[type(exc).__name__] += 1
            self.seconds.append(time.monotonic() - start)
            self.stop.wait(self.interval)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(args: argparse.Namespace, base_url: str) -> dict[str, object]:
    rounds: dict[str, list[tuple[float, float]]] = {"quiet": [], "uploading": []}
    outcomes: Counter[str] = Counter()
    upload_seconds: list[float] = []
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for i in range(5):  # warm-up: the prefix cached, the kernels compiled
            calm_ttft(client, -i)
        n = 0
        for _ in range(args.rounds):
            for phase in ("quiet", "uploading"):
                uploader = Uploader(base_url, args.size, args.interval)
                if phase == "uploading":
                    uploader.start()
                    time.sleep(0.5)  # the first upload under way
                ttfts = []
                for _ in range(args.requests):
                    ttfts.append(calm_ttft(client, n))
                    n += 1
                uploader.stop.set()
                if phase == "uploading":
                    uploader.join(60)
                    outcomes.update(uploader.outcomes)
                    upload_seconds += uploader.seconds
                rounds[phase].append((percentile(ttfts, 0.5), percentile(ttfts, 0.99)))
    summary: dict[str, object] = {
        "cpu": cpu_name(), "model": args.model, "upload_bytes": args.size,
        "uploads": sum(outcomes.values()), "outcomes": dict(outcomes),
        "seconds_to_413_p50": percentile(upload_seconds, 0.5),
        "seconds_to_413_max": max(upload_seconds),
    }
    for phase, values in rounds.items():
        summary[f"calm_ttft_p50_{phase}"] = statistics.median(p50 for p50, _ in values)
        summary[f"calm_ttft_p99_{phase}"] = statistics.median(p99 for _, p99 in values)
    summary["calm_p99_ratio"] = (summary["calm_ttft_p99_uploading"]  # type: ignore[operator]
                                 / summary["calm_ttft_p99_quiet"])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=30, help="calm requests per round")
    parser.add_argument("--size", type=int, default=20 * 1024 * 1024, help="upload bytes")
    parser.add_argument("--interval", type=float, default=0.25,
                        help="seconds between one oversized upload's answer and the next")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="oversized-"))
    (work / "tenants.toml").write_text(TENANTS)
    (work / "secret").write_bytes(b"oversized-benchmark-secret-0123")
    server_args = ["--model", args.model, "--tenants", str(work / "tenants.toml"),
                   "--secret-file", str(work / "secret"), "--log-level", "warning"]
    with ServerProcess(server_args, work / "server.log") as server:
        summary = run(args, server.base_url)
    print(f"{summary['cpu']}, {args.model}: {summary['uploads']} uploads of "
          f"{args.size / 1e6:.0f} MB, outcomes {summary['outcomes']}, 413 read in "
          f"{summary['seconds_to_413_p50']:.3f} s (p50), {summary['seconds_to_413_max']:.3f} s "
          f"(max)")
    print(f"{'calm TTFT':<12}{'p50 (s)':>10}{'p99 (s)':>10}")
    for phase in ("quiet", "uploading"):
        print(f"{phase:<12}{summary[f'calm_ttft_p50_{phase}']:>10.4f}"
              f"{summary[f'calm_ttft_p99_{phase}']:>10.4f}")
    print(f"calm p99 uploading / quiet: {summary['calm_p99_ratio']:.2f}x")
    print(json.dumps({"bench": "oversized", **summary}))


if __name__ == "__main__":
    main()
