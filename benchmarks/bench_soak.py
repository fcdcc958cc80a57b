"""Hostile-load soak: does a well-behaved tenant keep its latency while others flood and misbehave?

Question: against a real multi-tenant ``prefixcache serve`` (tiny model, tenants file), with one
tenant flooding (many concurrent long requests, ``n = 8``), one misbehaving (invalid JSON values,
lone surrogates, oversized bodies and prompts, streams it abandons after the first chunk) and
one calm tenant sending one short request at a time over a prefix it cached before the soak, is
the calm tenant's TTFT p99 within 3x of its unloaded p99; is RSS flat after warm-up; are there
zero 5xx; is the KV pool back to idle at the end, and does the calm prefix still hit?

RSS is read three ways: one sample at each end of the loaded phase after its first quarter; the
level (medians of the first and the last tenth of those samples: the trimmer makes RSS a
sawtooth, and one sample lands on a tooth or a trough); and idle, before the flood and after the
drain, each once the server has had time to trim what its last steps freed: what the whole soak
left the process holding.

Phases: warm-up (calm alone, which is also the unloaded baseline), then the soak for
``--seconds`` (bounded, stops by itself), then a drain. RSS of the server process is sampled
every 2 s. Prints a table and a final JSON line.

    .venv/bin/python benchmarks/bench_soak.py --seconds 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench_serve import MODEL_ID, ServerProcess
from prefixcache.model.host_memory import TRIM_INTERVAL_S

TENANTS = """
[tenants.calm]
api_keys = ["sk-calm-soak-key"]
[tenants.flood]
api_keys = ["sk-flood-soak-key"]
[tenants.rogue]
api_keys = ["sk-rogue-soak-key"]
[tenants.ops]
api_keys = ["sk-ops-soak-admin"]
admin = true
"""
KEYS = {"calm": "sk-calm-soak-key", "flood": "sk-flood-soak-key", "rogue": "sk-rogue-soak-key"}
ADMIN = "sk-ops-soak-admin"
CALM_PREFIX = "You are the calm tenant's assistant. Answer briefly and politely. " * 6


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


class Soak:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.statuses: dict[str, Counter[int]] = {t: Counter() for t in KEYS}
        self.calm_ttft: dict[str, list[float]] = {"unloaded": [], "loaded": []}
        self.calm_cached: dict[str, list[int]] = {"unloaded": [], "loaded": []}
        self.errors: Counter[str] = Counter()  # transport errors by exception type
        self.phase = "unloaded"
        self.stop = False

    async def calm_once(self, client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL_ID, "prompt": f"{CALM_PREFIX} Question {i}: hello?",
                "max_tokens": 8, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.monotonic()
        first, cached = None, 0
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers=_headers(KEYS["calm"])) as response:
            self.statuses["calm"][response.status_code] += 1
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk.get("choices"):
                    first = time.monotonic() - start
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        if first is not None:
            self.calm_ttft[self.phase].append(first)
        self.calm_cached[self.phase].append(cached)
        return cached

    async def calm_loop(self, client: httpx.AsyncClient) -> None:
        i = 0
        while not self.stop:
            await self.calm_once(client, i)
            i += 1
            await asyncio.sleep(0.2)

    async def flood_loop(self, client: httpx.AsyncClient, worker: int) -> None:
        rng = random.Random(worker)
        while not self.stop:
            body = {"model": MODEL_ID, "prompt": "flood " * rng.randrange(50, 400),
                    "max_tokens": rng.choice([64, 256, 600]), "n": rng.choice([1, 4, 8]),
                    "temperature": 0.8, "ignore_eos": True}
            try:
                response = await client.post("/v1/completions", json=body,
                                             headers=_headers(KEYS["flood"]), timeout=600)
                self.statuses["flood"][response.status_code] += 1
                if response.status_code == 429:
                    await asyncio.sleep(0.5)
            except httpx.HTTPError as exc:
                self.errors[f"flood {type(exc).__name__}"] += 1

    async def rogue_loop(self, client: httpx.AsyncClient) -> None:
        rng = random.Random(7)
        head = '{"model": "' + MODEL_ID + '", '
        bad_bodies = [
            head + '"prompt": "ab\\ud800cd"}',
            head + '"prompt": "x", "temperature": 1e999}',
            head + '"prompt": "x", "cache_salt": "\\udfff"}',
            head + '"messages": [{"role": "user", "content": "<|eot_id|>hi"}]}',
            "",
            head + '"prompt": "' + "z" * 700_000 + '"}',  # more tokens than the context
            head + '"prompt": "' + "z" * 9_000_000 + '"}',  # over the body limit
        ]
        while not self.stop:
            kind = rng.random()
            try:
                if kind < 0.6:
                    raw = rng.choice(bad_bodies)
                    path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
                    response = await client.post(path, content=raw, timeout=60,
                                                 headers=_headers(KEYS["rogue"]))
                    self.statuses["rogue"][response.status_code] += 1
                else:  # a stream abandoned after its first chunk
                    body = {"model": MODEL_ID, "prompt": "abandon " * 100, "max_tokens": 500,
                            "stream": True, "ignore_eos": True}
                    async with client.stream("POST", "/v1/completions", json=body,
                                             headers=_headers(KEYS["rogue"])) as response:
                        self.statuses["rogue"][response.status_code] += 1
                        async for _ in response.aiter_lines():
                            break
            except httpx.HTTPError as exc:  # the server closes an oversized body's connection
                self.errors[f"rogue {type(exc).__name__}"] += 1
            await asyncio.sleep(0.05)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _sample_rss(pid: int, samples: list[tuple[float, float]], soak: Soak) -> None:
    start = time.monotonic()
    while not soak.stop:
        samples.append((time.monotonic() - start, _rss_mb(pid)))
        await asyncio.sleep(2.0)


def _metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", headers=_headers(ADMIN), timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("prefixcache:") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def run(args: argparse.Namespace, server: ServerProcess) -> dict[str, Any]:
    soak = Soak(server.base_url)
    rss: list[tuple[float, float]] = []
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600, limits=limits) as client:
        before = await soak.calm_once(client, -1)  # caches the calm prefix
        sampler = asyncio.ensure_future(_sample_rss(server.proc.pid, rss, soak))
        warm_end = time.monotonic() + args.warmup
        while time.monotonic() < warm_end:
            await soak.calm_once(client, len(soak.calm_ttft["unloaded"]))
            await asyncio.sleep(0.2)
        await asyncio.sleep(TRIM_INTERVAL_S + 2)  # idle: the server trims what it freed
        idle_before = _rss_mb(server.proc.pid)
        soak.phase = "loaded"
        soak_start = len(rss)
        tasks = [asyncio.ensure_future(soak.calm_loop(client)),
                 asyncio.ensure_future(soak.rogue_loop(client))]
        tasks += [asyncio.ensure_future(soak.flood_loop(client, w)) for w in range(args.flood)]
        await asyncio.sleep(args.seconds)
        soak.stop = True
        await asyncio.wait(tasks[:1], timeout=600)  # the calm loop's last request
        after = await soak.calm_once(client, 10**6)  # the flood's last requests still running
        await asyncio.wait(tasks, timeout=600)
        sampler.cancel()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _metrics(server.base_url).get(
                "prefixcache:num_requests_running", 1) > 0:
            await asyncio.sleep(1)
        await asyncio.sleep(TRIM_INTERVAL_S + 2)
        idle_after = _rss_mb(server.proc.pid)
    end = _metrics(server.base_url)
    warm_rss = [m for _, m in rss[soak_start:]]
    settle = warm_rss[len(warm_rss) // 4:]  # after warm-up under load
    # RSS is a sawtooth (freed memory accumulates between two trims, `FreedMemoryTrimmer`), so
    # one sample at each end measures the teeth as much as any trend: the level of the first
    # and the last tenth of the settled samples, each a median, is the growth to read
    tenth = max(1, len(settle) // 10)
    level = (statistics.median(settle[:tenth]), statistics.median(settle[-tenth:])) if settle \
        else (None, None)
    return {
        "seconds": args.seconds,
        "calm_ttft_ms": {phase: {"p50": _p(v, 0.5), "p99": _p(v, 0.99), "n": len(v)}
                         for phase, v in soak.calm_ttft.items()},
        "calm_hit_fraction": {phase: sum(c > 0 for c in v) / max(1, len(v))
                              for phase, v in soak.calm_cached.items()},
        "statuses": {t: dict(sorted(c.items())) for t, c in soak.statuses.items()},
        "transport_errors": dict(soak.errors),
        "num_5xx": sum(n for c in soak.statuses.values() for s, n in c.items() if s >= 500),
        "rss_mb": {"start": rss[0][1] if rss else None, "after_warmup": settle[0] if settle else
                   None, "end": rss[-1][1] if rss else None,
                   "max": max((m for _, m in rss), default=None),
                   "growth_after_warmup": (settle[-1] / settle[0] - 1) if settle else None,
                   "level_first_last_tenth": level,
                   "level_growth": (level[1] / level[0] - 1) if settle else None,
                   "idle_before_after": (idle_before, idle_after),
                   "idle_growth": idle_after / idle_before - 1,
                   "every_minute": [round(m) for _, m in rss[::30]],  # sampled each 2 s
                   "every_10s": [round(m) for _, m in rss[::5]]},
        "kv_usage_end": end.get("prefixcache:kv_cache_usage_perc"),
        "running_end": end.get("prefixcache:num_requests_running"),
        "calm_prefix_cached_tokens": {"before": before, "after": after},
    }


async def rss_run(args: argparse.Namespace, server: ServerProcess) -> dict[str, Any]:
    """``--rss-requests`` distinct prompts of ``--rss-tokens`` tokens (4 clients, 1 output token
    each): server RSS after the first tenth (warm-up) and at the end."""
    rng = random.Random(1)
    samples: list[float] = []
    count = 0

    async def client_loop(client: httpx.AsyncClient, worker: int) -> None:
        nonlocal count
        while count < args.rss_requests:
            count += 1
            ids = [rng.randrange(32, 127) for _ in range(args.rss_tokens)]
            body = {"model": MODEL_ID, "prompt": ids, "max_tokens": 1}
            response = await client.post("/v1/completions", json=body,
                                         headers=_headers(KEYS["calm"]))
            if response.status_code != 200:
                raise RuntimeError(f"status {response.status_code}: {response.text[:200]}")
            if count % max(1, args.rss_requests // 20) == 0:
                samples.append(_rss_mb(server.proc.pid))

    async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
        await asyncio.gather(*(client_loop(client, w) for w in range(4)))
    warm = samples[len(samples) // 10 :] or samples
    return {"requests": args.rss_requests, "tokens": args.rss_tokens,
            "rss_mb_after_warmup": warm[0], "rss_mb_end": warm[-1],
            "rss_growth_after_warmup": warm[-1] / warm[0] - 1, "rss_mb_samples": samples}


def print_table(s: dict[str, Any]) -> None:
    t = s["calm_ttft_ms"]
    print(f"soak {s['seconds']} s: calm tenant TTFT p50/p99 unloaded "
          f"{t['unloaded']['p50']:.1f}/{t['unloaded']['p99']:.1f} ms (n={t['unloaded']['n']}), "
          f"loaded {t['loaded']['p50']:.1f}/{t['loaded']['p99']:.1f} ms (n={t['loaded']['n']}); "
          f"p99 ratio {t['loaded']['p99'] / t['unloaded']['p99']:.2f}")
    for tenant, statuses in s["statuses"].items():
        print(f"  {tenant:<6} statuses {statuses}")
    print(f"  transport errors {s['transport_errors']}; calm requests hitting its prefix "
          f"{s['calm_hit_fraction']}")
    r = s["rss_mb"]
    print(f"RSS MB start {r['start']:.0f}, after warm-up {r['after_warmup']:.0f}, end "
          f"{r['end']:.0f}, max {r['max']:.0f}; growth after warm-up "
          f"{100 * r['growth_after_warmup']:.1f}% (one sample each end); level (median of the "
          f"first / last tenth after warm-up) {r['level_first_last_tenth'][0]:.0f} -> "
          f"{r['level_first_last_tenth'][1]:.0f} MB, {100 * r['level_growth']:+.1f}%; idle "
          f"before the flood / after the drain {r['idle_before_after'][0]:.0f} -> "
          f"{r['idle_before_after'][1]:.0f} MB, {100 * r['idle_growth']:+.1f}%")
    print(f"5xx: {s['num_5xx']}; KV usage at the end {s['kv_usage_end']}; running "
          f"{s['running_end']}; calm prefix cached tokens before/after "
          f"{s['calm_prefix_cached_tokens']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--warmup", type=float, default=20)
    parser.add_argument("--flood", type=int, default=12, help="concurrent flooding clients")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--rss-requests", type=int, default=0,
                        help="instead of the soak: this many distinct prompts, RSS before/after")
    parser.add_argument("--rss-tokens", type=int, default=2000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    (work / "tenants.toml").write_text(TENANTS)
    (work / "secret").write_bytes(b"soak-benchmark-secret-0123456789")
    server_args = ["--model", args.model, "--tenants", str(work / "tenants.toml"),
                   "--secret-file", str(work / "secret"), "--num-kv-blocks",
                   str(args.num_kv_blocks), "--log-interval", "30", "--log-level", "warning"]
    with ServerProcess(server_args, work / "server.log") as server:
        if args.rss_requests:
            result = asyncio.run(rss_run(args, server))
            print(f"{result['requests']} requests of {result['tokens']} tokens: RSS "
                  f"{result['rss_mb_after_warmup']:.0f} MB after warm-up, "
                  f"{result['rss_mb_end']:.0f} MB at the end "
                  f"({100 * result['rss_growth_after_warmup']:+.1f}%)")
            print(json.dumps({"bench": "soak_rss", **result}))
            return
        summary = asyncio.run(run(args, server))
    print_table(summary)
    print(json.dumps({"bench": "soak", **summary}))


if __name__ == "__main__":
    main()
