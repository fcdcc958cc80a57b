"""Pinned prompt caching under a flood: time to first token of a request behind a long system
prompt, pinned (a ``cache_control`` breakpoint: `cache/pins.py`) vs not, after a flood of other
conversations has gone through a small KV pool.

SmolLM2-135M (float32), a 1,024-token system prompt + a 32-token question, one output token; a
pool of 160 blocks (2,560 tokens); the flood: 8 prompts of 1,024 fresh tokens from the same
tenant (its own churn: fair shares already keep other tenants from evicting its blocks). Per
repeat, back to back: unpinned (the system prompt cached by a first request, then the flood, then
the measured request) and pinned (the same with a 5-minute pin). Median of ``--repeats``.

    .venv/bin/python benchmarks/bench_prompt_caching.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tiers import cpu_name  # noqa: E402

SYSTEM, QUESTION, FLOOD, NUM_FLOOD, NUM_BLOCKS = 1024, 32, 1024, 8, 160


def ttft(engine: object, rid: str, prompt: list[int], pins: list[tuple[int, float]]) -> float:
    from prefixcache.engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, prompt_token_ids=prompt, sampling_params=params,  # type: ignore[attr-defined]
                       domain="tenant:a", pins=pins)
    while engine.has_unfinished():  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    from prefixcache.engine import LLMEngine

    engine = LLMEngine("smollm2", block_size=16, num_kv_blocks=NUM_BLOCKS,
                       max_pinned_blocks=NUM_BLOCKS // 2)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, vocab - 16) for _ in range(n)]

    ttft(engine, "warm", fresh(64), [])
    times: dict[str, list[float]] = {"unpinned": [], "pinned": []}
    hits: dict[str, list[int]] = {"unpinned": [], "pinned": []}
    for r in range(args.repeats):
        for case in ("unpinned", "pinned"):
            assert engine.reset_prefix_cache()
            system = fresh(SYSTEM)
            pins = [(SYSTEM, 300.0)] if case == "pinned" else []
            ttft(engine, f"{case}-first-{r}", system + fresh(QUESTION), pins)
            for i in range(NUM_FLOOD):
                ttft(engine, f"{case}-flood-{r}-{i}", fresh(FLOOD), [])
            before = engine.cache.stats.num_hit_tokens
            times[case].append(ttft(engine, f"{case}-{r}", system + fresh(QUESTION), []))
            hits[case].append(engine.cache.stats.num_hit_tokens - before)
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; SmolLM2 float32, "
          f"{SYSTEM}-token system prompt, {NUM_FLOOD} x {FLOOD}-token flood, "
          f"{NUM_BLOCKS}-block pool, median of {args.repeats}")
    for case in times:
        print(f"{case:<10} TTFT {medians[case]:.3f} s  cached tokens {hits[case]}")
    print(f"pinned / unpinned: {medians['pinned'] / medians['unpinned']:.3f}")
    print(json.dumps({"bench": "prompt_caching", "cpu": cpu_name(), "median_s": medians,
                      "times_s": times, "cached_tokens": hits}))


if __name__ == "__main__":
    main()
