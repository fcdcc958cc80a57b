"""Declared public prefixes: N tenants that all start with the operator's 2,000-token system
prompt, each in its own salted namespace, hold that prompt N times and compute it N times; with
the prompt declared public (`cache/public.py`) they hold it once and every tenant after the first
reaches the single-tenant hit TTFT.

SmolLM2-135M, block size 16, a declared prefix of 2,000 tokens (125 whole blocks) + a 32-token
question per tenant, one output token, a pool large enough to keep everything (nothing is
evicted). Per repeat, back to back on one engine (reset between cases):

* ``single``: one tenant sends the N questions (from the second on: the single-tenant hit);
* ``salted``: N tenants, one question each, every one in its own namespace (a miss each);
* ``public``: the same N requests with the prefix declared public for all of them.

Reported: the median TTFT of tenants 2..N (the first one computes the prefix in every case),
cached blocks and KV bytes after the N requests, and the prefill tokens computed. Median of
``--repeats``.

    .venv/bin/python benchmarks/bench_public_prefix.py [--model smollm2] [--tenants 8]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tiers import cpu_name  # noqa: E402

PREFIX, QUESTION, BS = 2000, 32, 16
CASES = ("single", "salted", "public")


def ttft(engine: Any, rid: str, prompt: list[int], tenant: str, num_public: int) -> float:
    from prefixcache.engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(
        rid,
        prompt_token_ids=prompt,
        sampling_params=params,
        cache_salt=f"salt-{tenant}",
        domain=f"tenant:{tenant}",
        public_blocks=num_public,
    )
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def run_case(engine: Any, case: str, declared: list[int], questions: list[list[int]],
             repeat: int) -> dict[str, Any]:  # fmt: skip
    """One case on a reset engine: the TTFT of each request after the first, and what the cache
    holds and computed."""
    from prefixcache.cache import PublicPrefixes

    assert engine.reset_prefix_cache()
    prefixes = PublicPrefixes({"system": declared})
    names = ["system"] if case == "public" else []
    tenants = [f"t{0 if case == 'single' else i}" for i in range(len(questions))]
    computed_before = engine.cache.stats.num_queried_tokens - engine.cache.stats.num_hit_tokens
    times = []
    for i, tenant in enumerate(tenants):
        prompt = declared + questions[i]
        num_public = prefixes.num_public_blocks(prompt, names, BS)
        times.append(ttft(engine, f"{case}-{repeat}-{i}", prompt, tenant, num_public))
    stats = engine.cache.stats
    return {"ttft_after_first_s": statistics.median(times[1:]), "first_s": times[0],
            "cached_blocks": engine.cache.num_cached_blocks,
            "computed_tokens": stats.num_queried_tokens - stats.num_hit_tokens
            - computed_before}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    from prefixcache.engine import LLMEngine

    num_blocks = args.tenants * (PREFIX + QUESTION) // BS + 64
    engine = LLMEngine(args.model, block_size=BS, num_kv_blocks=num_blocks)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, vocab - 16) for _ in range(n)]

    ttft(engine, "warm", fresh(256), "warm", 0)  # one-off costs: kernels, allocations
    results: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    for r in range(args.repeats):
        declared = fresh(PREFIX)
        questions = [fresh(QUESTION) for _ in range(args.tenants)]
        for case in CASES:
            results[case].append(run_case(engine, case, declared, questions, r))
    summary = {case: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
               for case, runs in results.items()}  # fmt: skip
    block_bytes = engine.block_bytes
    print(
        f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; {args.model} "
        f"({engine.limits.precision['precision']}), "
        f"{args.tenants} tenants, a {PREFIX}-token declared prefix + {QUESTION}-token "
        f"question each, block size {BS}, median of {args.repeats}"
    )
    print(
        f"{'case':<8} {'TTFT 2..N':>10} {'first':>8} {'cached blocks':>14} {'KV MiB':>8} "
        f"{'computed tokens':>16}"
    )
    for case, row in summary.items():
        print(
            f"{case:<8} {row['ttft_after_first_s'] * 1e3:8.1f}ms {row['first_s']:7.2f}s "
            f"{row['cached_blocks']:>14.0f} {row['cached_blocks'] * block_bytes / 2**20:8.1f} "
            f"{row['computed_tokens']:>16.0f}"
        )
    hit = {case: row["ttft_after_first_s"] for case, row in summary.items()}
    blocks = {case: row["cached_blocks"] for case, row in summary.items()}
    print(
        f"public / single-tenant hit TTFT: {hit['public'] / hit['single']:.3f}; salted / "
        f"public TTFT: {hit['salted'] / hit['public']:.1f}x; blocks held salted / public: "
        f"{blocks['salted'] / blocks['public']:.2f}x"
    )
    print(
        json.dumps(
            {
                "bench": "public_prefix",
                "cpu": cpu_name(),
                "model": args.model,
                "tenants": args.tenants,
                "block_bytes": block_bytes,
                "median": summary,
                "runs": results,
            }
        )
    )


if __name__ == "__main__":
    main()
