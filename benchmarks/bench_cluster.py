"""Routers side by side on Ray Serve, and the simulator's prediction of each from the same traffic.

Runs ``prefixcache serve --replicas 2`` (Ray Serve, one CPU and one torch thread per replica)
once per router (``round-robin``, ``prefix-affinity``, ``cache-aware``) and once as a single
replica holding the same total cache, sends each the same multi-tenant workload (system prompts of
``--prefix-len`` tokens, ``--prefixes-per-tenant`` per tenant, each request one of them plus its
own question, Poisson arrivals), and measures the cluster's hit ratio (cached over prompt tokens,
from each response's usage), TTFT p50/p90 and throughput. Every run records its traffic with
``--record-trace``; ``prefixcache simulate --replicas 2 --router R`` then replays each router's
recorded trace with the same per-replica cache, and the table sets simulated beside measured.

    .venv/bin/python benchmarks/bench_cluster.py            # about 5 minutes on 2 cores

Prints the table and writes ``--out`` (JSON). Each router's run starts its own local Ray
instance ($RAY_ADDRESS is ignored), so nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import (  # noqa: E402
    MODEL_ID,
    RequestResult,
    _free_port,
    _percentiles,
    send_one,
)

ROUTERS = ("round-robin", "prefix-affinity", "cache-aware")
METRICS_KEY = "bench-cluster-metrics-key"


def workload(args: argparse.Namespace) -> list[tuple[str, list[int]]]:
    """(API key, prompt token ids) per request: a tenant's system prompt plus a fresh question."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(32, 127) for _ in range(n)]

    prompts = [(f"sk-bench-tenant-{t}", tokens(args.prefix_len))
               for t in range(args.tenants) for _ in range(args.prefixes_per_tenant)]
    out = []
    for _ in range(args.num_requests):
        key, prefix = prompts[rng.randrange(len(prompts))]
        out.append((key, prefix + tokens(args.question_len)))
    return out


def tenants_file(path: Path, n: int) -> Path:
    path.write_text("".join(f'[tenants.t{t}]\napi_keys = ["sk-bench-tenant-{t}"]\n\n'
                            for t in range(n)))
    return path


async def load(base: str, requests: list[tuple[str, list[int]]], args: argparse.Namespace
               ) -> tuple[list[RequestResult], float]:
    rng = np.random.default_rng(args.seed)
    async with httpx.AsyncClient(base_url=base, timeout=600,
                                 limits=httpx.Limits(max_connections=256)) as client:
        start = time.perf_counter()
        tasks = []
        for key, prompt in requests:
            tasks.append(asyncio.create_task(send_one(
                client, prompt, args.output_len, {"Authorization": f"Bearer {key}"})))
            await asyncio.sleep(rng.exponential(1.0 / args.rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def serve(args: argparse.Namespace, router: str | None, trace: Path, tenants: Path,
          log: Path, extra: list[str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """``prefixcache serve`` with ``router`` (None: one replica) and ``extra`` flags (tiers)."""
    port = _free_port()
    replicas = 1 if router is None else args.replicas
    blocks = args.blocks_per_replica * args.replicas // replicas
    cmd = [sys.executable, "-m", "prefixcache", "serve", "--model", args.model, "--port",
           str(port), "--served-model-name", MODEL_ID, "--num-kv-blocks", str(blocks),
           "--tenants", str(tenants), "--metrics-key", METRICS_KEY, "--record-trace", str(trace),
           "--log-interval", "60",
           "--max-num-seqs", str(args.max_num_seqs)]
    if router is not None:
        cmd += ["--replicas", str(replicas), "--router", router, "--cpus-per-replica", "1",
                "--threads-per-replica", "1"]
    cmd += extra or []
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PREFIXCACHE_SECRET"] = "bench-cluster-secret-0123456789"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited early; see {log}")
        try:
            ready = httpx.get(base + "/health", timeout=2).status_code == 200
            if ready and router is not None:  # every replica up
                routing = httpx.get(base + "/cluster/routing", timeout=2, headers={
                    "Authorization": f"Bearer {METRICS_KEY}"}).json()
                ready = len(routing.get("replicas") or {}) == replicas
            if ready:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"serve did not become ready; see {log}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def simulate(trace: Path, router: str | None, args: argparse.Namespace, out: Path) -> float:
    total = args.blocks_per_replica * args.replicas
    cmd = [sys.executable, "-m", "prefixcache", "simulate", str(trace), "--format", "record",
           "--capacity", str(total), "--no-plots", "--no-progress", "--out", str(out)]
    if router is not None:
        cmd += ["--replicas", str(args.replicas), "--router", router,
                "--cluster-capacity", str(total)]
    subprocess.run(cmd, check=True, capture_output=True)
    rows = json.loads((out / "results.json").read_text())["results"]
    want = args.replicas if router is not None else 1
    return next(float(r["hit_ratio"]) for r in rows
                if r["replicas"] == want and (router is None or r["router"] == router))


def run_one(args: argparse.Namespace, router: str | None, requests: list[tuple[str, list[int]]],
            work: Path) -> dict[str, Any]:
    name = router or "single"
    trace, log = work / f"{name}.trace.jsonl", work / f"{name}.log"
    proc, base = serve(args, router, trace, tenants_file(work / "tenants.toml", args.tenants),
                       log)
    try:
        results, duration = asyncio.run(load(base, requests, args))
    finally:
        stop(proc)
    ok = [r for r in results if r.ok]
    prompt_tokens = args.prefix_len + args.question_len
    measured = sum(r.num_cached for r in ok) / max(1, prompt_tokens * len(ok))
    simulated = simulate(trace, router, args, work / f"{name}.sim")
    ttft = _percentiles([r.ttft_s for r in ok])
    return {"router": name, "completed": len(ok), "failed": len(results) - len(ok),
            "hit_ratio": measured, "simulated_hit_ratio": simulated,
            "ttft_p50_ms": ttft["p50"], "ttft_p90_ms": ttft["p90"],
            "throughput_rps": len(ok) / duration,
            "output_tok_s": sum(r.num_output for r in ok) / duration,
            "errors": sorted({r.error for r in results if not r.ok})}


def print_table(rows: list[dict[str, Any]], single: float) -> None:
    print(f"\n{'router':<16} {'hit measured':>12} {'simulated':>9} {'vs single':>9} "
          f"{'TTFT p50 ms':>11} {'p90 ms':>8} {'req/s':>6} {'failed':>6}")
    for r in rows:
        print(f"{r['router']:<16} {r['hit_ratio']:>12.3f} {r['simulated_hit_ratio']:>9.3f} "
              f"{r['hit_ratio'] / single if single else math.nan:>9.2f} "
              f"{r['ttft_p50_ms']:>11.1f} {r['ttft_p90_ms']:>8.1f} "
              f"{r['throughput_rps']:>6.2f} {r['failed']:>6}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--blocks-per-replica", type=int, default=320,
                   help="KV blocks (16 tokens) per replica; the single replica gets the total")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--prefixes-per-tenant", type=int, default=2)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--rate", type=float, default=8.0, help="requests/s (Poisson)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--repeats", type=int, default=1, help="runs per router (medians reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_cluster.json")
    return p.parse_args(argv)


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per metric, the median over repeats (and the range, for the table's notes)."""
    row = dict(runs[0])
    for key in ("hit_ratio", "simulated_hit_ratio", "ttft_p50_ms", "ttft_p90_ms",
                "throughput_rps", "output_tok_s"):
        values = sorted(r[key] for r in runs)
        row[key] = float(np.median(values))
        row[key + "_range"] = [values[0], values[-1]]
    row["completed"] = sum(r["completed"] for r in runs)
    row["failed"] = sum(r["failed"] for r in runs)
    row["repeats"] = len(runs)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    requests = workload(args)
    routers = args.routers.split(",")
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in routers}
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        work = Path(tmp)
        single = run_one(args, None, requests, work)
        for repeat in range(args.repeats):  # alternate the order: no router always goes first
            order = routers if repeat % 2 == 0 else routers[::-1]
            for router in order:
                runs[router].append(run_one(args, router, requests, work))
                print(json.dumps(runs[router][-1]), flush=True)
    rows = [single, *(_median_row(runs[r]) for r in routers)]
    print_table(rows, single["hit_ratio"])
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "runs": runs},
                                         indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
