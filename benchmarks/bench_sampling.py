"""What each sampling control costs a decode step: 64 sequences, control off vs on, side by side.

Question: on the real model's vocabulary (SmolLM2-135M, 49,152 tokens), how much does each
control add to one decode step of 64 running sequences — top-5 logprobs, the three penalties,
min_p, a 10-token logit_bias — and what do prompt logprobs (echo + logprobs) add per prompt
token to a prefill? Target (issue: real clients): each control adds at most 5% to the step.

Each repeat runs every case back to back, in a rotated order: 64 requests with 128-token prompts
(the same prompts every time, so after the first case the prefill is a cache hit), prefilled
untimed, then ``--steps`` decode steps timed one by one (median step). The prompt-logprobs case
times whole 64 x 128-token prefills with and without ``prompt_logprobs=5`` (prompts never seen
before, so neither reads the cache). Medians over repeats; prints a table and one JSON line.

    .venv/bin/python benchmarks/bench_sampling.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

import torch

from prefixcache.engine import LLMEngine, SamplingParams

GREEDY = {"temperature": 0.0, "ignore_eos": True}
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (baseline params, params with the control)
    "logprobs top-5": (GREEDY, {**GREEDY, "logprobs": 5}),
    "penalties (presence, frequency, repetition)": (
        GREEDY, {**GREEDY, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                 "repetition_penalty": 1.2}),
    "min_p 0.1 (temperature 1)": ({"temperature": 1.0, "ignore_eos": True, "seed": 1},
                                  {"temperature": 1.0, "ignore_eos": True, "seed": 1,
                                   "min_p": 0.1}),
    "logit_bias (10 tokens)": (GREEDY, {**GREEDY, "logit_bias": {i: 1.5 for i in range(100, 110)}}),
}


def prompts(vocab: int, num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(num)]


def decode_step_time(
    engine: LLMEngine, batch: list[list[int]], fields: dict[str, Any] | SamplingParams, steps: int
) -> float:
    """Median seconds of one decode step of ``len(batch)`` sequences under ``fields`` (or
    ready parameters, which must allow ``steps + 2`` tokens)."""
    params = (fields if isinstance(fields, SamplingParams)
              else SamplingParams(max_tokens=steps + 2, **fields))
    for i, p in enumerate(batch):
        engine.add_request(f"d{i}", prompt_token_ids=p, sampling_params=params)
    def prefilling() -> bool:
        view = engine.inspect()
        return bool(view.waiting) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in view.running)

    while prefilling():
        engine.step()
    engine.step()  # every sequence has its first token: the next steps are pure decodes
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for i in range(len(batch)):  # the rest is not measured
        engine.abort(f"d{i}")
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def prefill_time(engine: LLMEngine, batch: list[list[int]], fields: dict[str, Any]) -> float:
    params = SamplingParams(max_tokens=1, **fields)
    start = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"p{i}", prompt_token_ids=p, sampling_params=params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    engine = LLMEngine(args.model, max_num_seqs=args.seqs, max_num_batched_tokens=2048,
                       kv_cache_memory_bytes=1 << 30)
    vocab = engine.model_config.vocab_size
    batch = prompts(vocab, args.seqs, args.prompt_len, seed=0)
    decode_step_time(engine, batch, GREEDY, 2)  # warm-up: caches the prompts, builds kernels
    names = list(CASES)
    samples: dict[str, dict[str, list[float]]] = {n: {"off": [], "on": []} for n in names}
    prefill: dict[str, list[float]] = {"off": [], "on": []}
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[: repeat % len(names)]
        for name in order:
            off, on = CASES[name]
            pair = [("off", off), ("on", on)] if repeat % 2 == 0 else [("on", on), ("off", off)]
            for which, fields in pair:
                samples[name][which].append(decode_step_time(engine, batch, fields, args.steps))
        for k, which in enumerate(("off", "on") if repeat % 2 == 0 else ("on", "off")):
            fresh = prompts(vocab, args.prefill_seqs, args.prompt_len, seed=1000 + 2 * repeat + k)
            fields = GREEDY if which == "off" else {**GREEDY, "prompt_logprobs": 5}
            prefill[which].append(prefill_time(engine, fresh, fields))
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    rows = {}
    for name in names:
        off = statistics.median(samples[name]["off"])
        on = statistics.median(samples[name]["on"])
        rows[name] = {"off_ms": 1e3 * off, "on_ms": 1e3 * on, "added": on / off - 1}
    num_tokens = args.prefill_seqs * args.prompt_len
    off, on = statistics.median(prefill["off"]), statistics.median(prefill["on"])
    rows["echo prompt logprobs top-5 (prefill)"] = {
        "off_ms": 1e3 * off, "on_ms": 1e3 * on, "added": on / off - 1,
        "added_us_per_token": 1e6 * (on - off) / num_tokens}
    return {"model": args.model, "threads": args.threads, "seqs": args.seqs,
            "prompt_len": args.prompt_len, "repeats": args.repeats, "steps": args.steps,
            "vocab": vocab, "cases": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--prefill-seqs", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    result = run(args)
    print(f"\n{args.model}, {args.seqs} sequences, {args.threads} threads, median of "
          f"{args.repeats} repeats x {args.steps} decode steps")
    print(f"{'control':46} {'off ms':>9} {'on ms':>9} {'added':>8}")
    for name, row in result["cases"].items():
        print(f"{name:46} {row['off_ms']:9.1f} {row['on_ms']:9.1f} {100 * row['added']:7.1f}%")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
