"""Faults under load on Ray Serve: how many requests fail, how long until it recovers, and what
happens to the hit ratio?

Runs ``prefixcache serve --replicas 2 --router cache-aware`` (one CPU and one torch thread per
replica, a tenants file) and keeps a steady streamed load on it (``--concurrency`` clients, each
request one of the tenants' shared system prompts plus its own question), while faults are
injected one after another, each after ``--steady`` seconds of calm:

- ``replica``: SIGKILL to the engine replica that is serving the most requests (its pid from
  ``/cluster/routing``); Serve starts a new one.
- ``ingress``: SIGKILL to the ingress replica (which also holds the router and its cache view);
  Serve starts a new one.

For each fault: the requests that failed, split into those in flight at the kill and those sent
after it; the recovery time (from the kill to the first request sent after it that succeeds, and
to the cluster serving with every replica again); the token hit ratio (cached / prompt tokens)
over the steady period before the fault and over the same length once recovered. Prints a table
and a final JSON line.

    .venv/bin/python benchmarks/bench_chaos.py            # about 4 minutes on 2 cores

Starts its own local Ray instance ($RAY_ADDRESS is ignored): run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cluster import METRICS_KEY, serve, stop, tenants_file  # noqa: E402
from bench_serve import MODEL_ID  # noqa: E402
from bench_tiers import cpu_name  # noqa: E402

METRICS = {"Authorization": f"Bearer {METRICS_KEY}"}


@dataclass(slots=True)
class Outcome:
    started: float
    ended: float
    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0


def one_request(client: httpx.Client, key: str, prompt: list[int], output_len: int) -> Outcome:
    """A streamed completion; an error event, a short stream or a non-200 is a failure."""
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    started = time.monotonic()
    usage, error = None, ""
    try:
        with client.stream("POST", "/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as response:
            if response.status_code != 200:
                response.read()
                error = f"HTTP {response.status_code}"
            for line in response.iter_lines() if not error else ():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = "error event"
                    usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        error = type(exc).__name__
    if not error and usage is None:
        error = "stream ended without usage"
    if error:
        return Outcome(started, time.monotonic(), False, error)
    assert usage is not None
    return Outcome(started, time.monotonic(), True, "", usage["prompt_tokens"],
                   usage["prompt_tokens_details"]["cached_tokens"])


class Load:
    """``concurrency`` client threads sending requests back to back until stopped."""

    def __init__(self, base: str, args: argparse.Namespace) -> None:
        rng = random.Random(args.seed)
        self.prefixes = [(f"sk-bench-tenant-{t}", [rng.randrange(32, 127)
                                                  for _ in range(args.prefix_len)])
                         for t in range(args.tenants) for _ in range(2)]
        self.base, self.args = base, args
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                        for i in range(args.concurrency)]

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.base, timeout=120) as client:
            while not self.stop.is_set():
                key, prefix = rng.choice(self.prefixes)
                question = [rng.randrange(32, 127) for _ in range(self.args.question_len)]
                self.outcomes.append(one_request(client, key, prefix + question,
                                                 self.args.output_len))

    def between(self, start: float, end: float) -> list[Outcome]:
        return [o for o in self.outcomes if start <= o.started < end]


def routing(base: str) -> dict:
    try:
        return httpx.get(base + "/cluster/routing", headers=METRICS, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}


def live_replicas(base: str) -> int:
    return sum(1 for r in (routing(base).get("replicas") or {}).values() if r["slot"] is not None)


def victim_pid(base: str, fault: str) -> int:
    if fault == "replica":  # the engine replica with the most requests in flight
        replicas = sorted(routing(base)["replicas"].values(), key=lambda r: -r["in_flight"])
        return int(replicas[0]["routing_stats"]["pid"])
    found = subprocess.run(["pgrep", "-f", "ServeReplica:prefixcache:Ingress"],
                           capture_output=True, text=True).stdout.split()
    assert len(found) == 1, found
    return int(found[0])


def hit_ratio(outcomes: list[Outcome]) -> float:
    prompt = sum(o.prompt_tokens for o in outcomes if o.ok)
    return sum(o.cached_tokens for o in outcomes if o.ok) / prompt if prompt else 0.0


def inject(base: str, load: Load, fault: str, args: argparse.Namespace) -> dict[str, object]:
    steady_from = time.monotonic()
    time.sleep(args.steady)
    pid = victim_pid(base, fault)
    killed = time.monotonic()
    subprocess.run(["kill", "-9", str(pid)], check=True)
    while live_replicas(base) < args.replicas or not load.between(killed, time.monotonic()):
        time.sleep(0.2)
        if time.monotonic() - killed > 300:
            raise RuntimeError(f"no recovery from the {fault} fault in 300 s")
    restored = time.monotonic()
    time.sleep(args.steady)
    after = load.between(killed, time.monotonic())
    first_ok = min((o.ended for o in after if o.ok), default=float("nan"))
    in_flight = [o for o in load.outcomes if o.started < killed <= o.ended]
    return {
        "fault": fault, "requests_after": len(after),
        "failed_in_flight": sum(not o.ok for o in in_flight), "in_flight": len(in_flight),
        "failed_after": sum(not o.ok for o in after),
        "errors": sorted({o.error for o in in_flight + after if not o.ok}),
        "seconds_to_first_success": first_ok - killed,
        "seconds_to_all_replicas": restored - killed,
        "hit_ratio_before": hit_ratio(load.between(steady_from, killed)),
        "hit_ratio_after": hit_ratio(load.between(restored, restored + args.steady)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--faults", default="replica,ingress")
    parser.add_argument("--steady", type=float, default=20.0, help="seconds of calm around faults")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=2)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--blocks-per-replica", type=int, default=320)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    tenants = tenants_file(work / "tenants.toml", args.tenants)
    proc, base = serve(args, "cache-aware", work / "trace.jsonl", tenants, work / "serve.log")
    load = Load(base, args)
    try:
        for thread in load.threads:
            thread.start()
        results = [inject(base, load, fault, args) for fault in args.faults.split(",")]
    finally:
        load.stop.set()
        for thread in load.threads:
            thread.join(130)
        stop(proc)
    print(f"{cpu_name()}, {args.model}, {args.replicas} replicas, {args.concurrency} clients")
    print(f"{'fault':<9}{'in flight':>10}{'failed':>8}{'after':>7}{'failed':>8}"
          f"{'1st ok (s)':>12}{'all up (s)':>12}{'hits before':>13}{'after':>7}")
    for r in results:
        print(f"{r['fault']:<9}{r['in_flight']:>10}{r['failed_in_flight']:>8}"
              f"{r['requests_after']:>7}{r['failed_after']:>8}"
              f"{r['seconds_to_first_success']:>12.2f}{r['seconds_to_all_replicas']:>12.2f}"
              f"{r['hit_ratio_before']:>13.3f}{r['hit_ratio_after']:>7.3f}")
    for r in results:
        if r["errors"]:
            print(f"{r['fault']}: {', '.join(r['errors'])}")
    print(json.dumps({"bench": "chaos", "cpu": cpu_name(), "model": args.model,
                      "results": results}))


if __name__ == "__main__":
    main()
