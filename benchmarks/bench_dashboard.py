"""What the live dashboard costs the server: serving throughput with no viewer, with the page open
in headless Chromium (polling once a second), and with a plain HTTP poller at the page's rate.

One ``prefixcache serve`` (the same process for every case, so the cache, compilation and memory
are alike), loaded by `bench_serve`'s prefix-repetition client in rounds; the cases alternate
round by round and the median of the repeats is compared. Each round also records the CPU
seconds of the server and of the browser's processes (psutil). Wall-clock throughput can move
between rounds by more than the effect measured, so the server's own cost is also measured
directly: the time the server takes per ``/dashboard/data`` request (sequential, idle server)
and the cache observer's time per admission (in-process), set against a second of serving. On a
small machine the browser also takes CPU from the engine (it renders the page).

    .venv/bin/python benchmarks/bench_dashboard.py --model smollm2 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import PrefixRepetition, ServerProcess, run_load  # noqa: E402
from bench_tiers import cpu_name  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def _cpu_seconds(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                times = p.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def _browser_pids() -> list[int]:
    import psutil

    return [p.pid for p in psutil.process_iter(["name"]) if "chrom" in (p.info["name"] or "")]


def poll_cost(base_url: str, n: int = 200) -> float:
    """Seconds per /dashboard/data answer, sequential on an idle server (HTTP included)."""
    with httpx.Client(base_url=base_url, timeout=10) as client:
        client.get("/dashboard/data").raise_for_status()
        start = time.perf_counter()
        for _ in range(n):
            client.get("/dashboard/data").raise_for_status()
        return (time.perf_counter() - start) / n


def admit_cost(n: int = 2000, prompt_len: int = 544) -> float:
    """Seconds the dashboard's cache observer takes per admission (a 544-token prompt)."""
    from prefixcache.cache import CacheHit, CacheIdentity, Sequence
    from prefixcache.server.dashboard import CacheView

    identity = CacheIdentity("bench", 16, "sha256")
    view = CacheView(identity, lambda d: d)
    seqs = [Sequence(f"s{i}", [i % 4] * 512 + list(range(i, i + prompt_len - 512)))
            for i in range(n)]
    for seq in seqs:
        identity.block_digests(seq)  # the cache has computed them before it admits
    start = time.perf_counter()
    for seq in seqs:
        view.on_admit(seq, CacheHit(), [])
        view.on_free(seq, 0)
    return (time.perf_counter() - start) / n


class Poller:
    """GET /dashboard/data once a second on a thread (the page's own rate)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.polls = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=10) as client:
            while not self.stop.wait(1.0):
                client.get("/dashboard/data").raise_for_status()
                self.polls += 1

    def __enter__(self) -> Poller:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


class Browser:
    """The dashboard open in headless Chromium for as long as the block runs."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def __enter__(self) -> Browser:
        from playwright.sync_api import sync_playwright

        self._p = sync_playwright().start()
        self._browser = self._p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        self.page = self._browser.new_page(viewport={"width": 1400, "height": 1200})
        self.page.goto(self.base_url + "/dashboard")
        self.page.wait_for_function("window.dashboard && window.dashboard.polls >= 1")
        return self

    @property
    def polls(self) -> int:
        return int(self.page.evaluate("window.dashboard.polls"))

    def __exit__(self, *exc: object) -> None:
        self._browser.close()
        self._p.stop()


def one_round(base_url: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """One load round, on a thread of its own (Playwright's sync API holds this one's loop)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(asyncio.run(run_load(
        base_url, prompts, args.output_len, math.inf, args.max_concurrency, "round"))))
    thread.start()
    thread.join()
    results, duration = out[0]
    ok = [r for r in results if r.ok]
    assert len(ok) == len(results), [r.error for r in results if not r.ok][:3]
    tokens = sum(r.num_output for r in ok)
    return {"seconds": duration, "req_per_s": len(ok) / duration, "tok_per_s": tokens / duration}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench_dashboard_results.json")
    args = p.parse_args(argv)
    prompts = PrefixRepetition(args.prefix_len, args.suffix_len, args.num_prefixes,
                               args.output_len, args.num_requests).prompts()
    cases = {"closed": None, "poller": Poller, "browser": Browser}
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    log = Path(args.out).with_suffix(".server.log")
    with ServerProcess(["--model", args.model, "--log-interval", "60"], log) as server:
        for _ in range(2):  # warm-up: compile, cache the prefixes, settle the allocator
            one_round(server.base_url, prompts, args)
        per_poll = poll_cost(server.base_url)
        for repeat in range(args.repeats):
            for name, viewer in cases.items():
                server_cpu = _cpu_seconds([server.proc.pid])
                if viewer is None:
                    result = one_round(server.base_url, prompts, args)
                else:
                    with viewer(server.base_url) as open_view:
                        browser_cpu = _cpu_seconds(_browser_pids())
                        result = one_round(server.base_url, prompts, args)
                        result["polls"] = open_view.polls
                        result["browser_cpu_s"] = _cpu_seconds(_browser_pids()) - browser_cpu
                result["server_cpu_s"] = _cpu_seconds([server.proc.pid]) - server_cpu
                runs[name].append(result)
                print(f"round {repeat + 1} {name:8s} {result['tok_per_s']:8.1f} tok/s "
                      f"{result['seconds']:6.2f} s server {result['server_cpu_s']:6.1f} cpu-s "
                      f"browser {result.get('browser_cpu_s', 0.0):5.1f} cpu-s", flush=True)
    per_admit = admit_cost()
    medians = {name: statistics.median(r["tok_per_s"] for r in rs) for name, rs in runs.items()}
    closed = runs["closed"]
    req_per_s = statistics.median(r["req_per_s"] for r in closed)
    cpu_per_s = statistics.median(r["server_cpu_s"] / r["seconds"] for r in closed)
    # the server's own share: one poll a second plus the observer at the served request rate,
    # over the CPU seconds the server spends per second of serving
    direct = (per_poll + per_admit * req_per_s) / cpu_per_s
    browser_cpu = statistics.median(r["browser_cpu_s"] / r["seconds"] for r in runs["browser"])
    summary = {
        "cpu": cpu_name(), "model": args.model, "repeats": args.repeats,
        "median_tok_per_s": medians,
        "cost_browser": 1 - medians["browser"] / medians["closed"],
        "cost_poller": 1 - medians["poller"] / medians["closed"],
        "seconds_per_poll": per_poll, "seconds_per_admission": per_admit,
        "server_cpu_s_per_s": cpu_per_s, "server_cost_direct": direct,
        "browser_cpu_s_per_s": browser_cpu,
        "runs": runs, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"{summary['cpu']}: closed {medians['closed']:.1f}, poller {medians['poller']:.1f} "
          f"({summary['cost_poller']:+.1%}), browser {medians['browser']:.1f} tok/s "
          f"({summary['cost_browser']:+.1%} cost); server's own share {direct:.3%} "
          f"({per_poll * 1e3:.2f} ms per poll, {per_admit * 1e6:.0f} us per admission); "
          f"the browser used {browser_cpu:.2f} CPU-s per s")
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
