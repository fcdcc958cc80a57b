"""Mixed steps: decode tokens sharing a step with a long prefill, against each step run alone.

Question (issue 23, point 2): does a step that computes ``--decodes`` decode tokens, each over its
own ``--context``-token history, together with one fresh ``--prompt``-token prefill cost no more
than the two steps run apart? The engine schedules the mix itself: the decoding requests are
running when the new prompt arrives, and the next step carries both (its token budget is
``prompt + decodes``, so the prompt is one chunk). The prefix cache is off, so every prompt token
is computed. Each repeat times, in alternating order, the decode step alone, the mixed step and
the prefill alone, in one process, per dtype; medians of ``--repeats`` after one warm-up repeat.

    .venv/bin/python benchmarks/bench_mixed.py [--model smollm2] [--dtypes float32,bfloat16]

Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from prefixcache.engine import LLMEngine, SamplingParams
from prefixcache.model.host_memory import retain_freed_memory


def timed_step(engine: LLMEngine) -> tuple[float, set[str]]:
    """One engine step: seconds, and the requests that got a token."""
    start = time.perf_counter()
    outputs = engine.step()
    return time.perf_counter() - start, {o.request_id for o in outputs if o.new_token_ids}


def drain(engine: LLMEngine, request_ids: list[str]) -> None:
    for request_id in request_ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()


class Workload:
    def __init__(self, engine: LLMEngine, args: argparse.Namespace) -> None:
        self.engine = engine
        self.args = args
        self.rng = random.Random(0)
        self.vocab = engine.model_config.vocab_size
        self.params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        self.count = 0

    def add(self, num_tokens: int) -> str:
        self.count += 1
        request_id = f"r{self.count}"
        ids = [self.rng.randrange(3, self.vocab - 16) for _ in range(num_tokens)]
        self.engine.add_request(request_id, prompt_token_ids=ids, sampling_params=self.params)
        return request_id

    def decode_then_mixed(self) -> tuple[float, float]:
        """The decode step alone, then the same decodes with a fresh prompt in one step."""
        engine, args = self.engine, self.args
        running = [self.add(args.context) for _ in range(args.decodes)]
        started: set[str] = set()
        while len(started) < len(running):  # their prefills
            started |= timed_step(engine)[1]
        decode_s, got = timed_step(engine)
        if got != set(running):
            raise RuntimeError("the decode step did not carry every decoding request")
        prompt = self.add(args.prompt)
        mixed_s, got = timed_step(engine)
        if got != {*running, prompt}:
            raise RuntimeError("the mixed step did not carry the decodes and the whole prompt")
        drain(engine, [*running, prompt])
        return decode_s, mixed_s

    def prefill(self) -> float:
        prompt = self.add(self.args.prompt)
        seconds, got = timed_step(self.engine)
        if got != {prompt}:
            raise RuntimeError("the prompt did not fit one step")
        drain(self.engine, [prompt])
        return seconds


def measure(args: argparse.Namespace, dtype: str) -> dict[str, float]:
    per_seq = -(-(max(args.context, args.prompt) + 64) // args.block_size)
    engine = LLMEngine(
        args.model,
        dtype=dtype,
        enable_prefix_caching=False,
        max_num_seqs=args.decodes + 1,
        max_num_batched_tokens=args.prompt + args.decodes,
        num_kv_blocks=(args.decodes + 2) * per_seq,
        block_size=args.block_size,
    )
    work = Workload(engine, args)
    samples: dict[str, list[float]] = {"prefill": [], "decode": [], "mixed": []}
    for repeat in range(args.repeats + 1):
        if repeat % 2:
            prefill_s = work.prefill()
            decode_s, mixed_s = work.decode_then_mixed()
        else:
            decode_s, mixed_s = work.decode_then_mixed()
            prefill_s = work.prefill()
        if repeat:  # the first is a warm-up
            samples["prefill"].append(prefill_s)
            samples["decode"].append(decode_s)
            samples["mixed"].append(mixed_s)
    med = {k: statistics.median(v) for k, v in samples.items()}
    ratios = [m / (p + d) for p, d, m in zip(*samples.values(), strict=True)]
    med["mixed_vs_apart"] = statistics.median(ratios)
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--decodes", type=int, default=15)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # as `prefixcache serve` does: freed tensor memory stays in the heap
    results = {dtype: measure(args, dtype) for dtype in args.dtypes.split(",")}
    print(
        f"{args.model}: one {args.prompt}-token prefill, {args.decodes} decode tokens over "
        f"{args.context} each, threads={args.threads}, median of {args.repeats}"
    )
    print(f"{'dtype':<10}{'prefill ms':>12}{'decode ms':>12}{'mixed ms':>12}{'mixed/apart':>13}")
    for dtype, r in results.items():
        print(
            f"{dtype:<10}{1e3 * r['prefill']:>12.1f}{1e3 * r['decode']:>12.1f}"
            f"{1e3 * r['mixed']:>12.1f}{r['mixed_vs_apart']:>12.2f}x"
        )
    print(json.dumps({"bench": "mixed_steps", "model": args.model, "results": results}))


if __name__ == "__main__":
    main()
