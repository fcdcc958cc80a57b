"""`prefixcache bench`: the same shared-prefix batch with the cache off and on, side by side.

A quick answer to "what does prefix caching buy on this machine and model": ``num_prefixes``
shared prefixes, each followed by ``requests_per_prefix`` distinct suffixes, generated greedily
through the offline engine with the cache disabled and with each implementation. Reports total
time, mean TTFT, the cached share of prompt tokens, the speedup over cache-off (median of
repeats), and whether every output equals the cache-off one. The deeper benchmarks, with the
FLOPs ideal and Hugging Face transformers beside them, are in ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from prefixcache.catalog import model_help
from prefixcache.errors import CliError

__all__ = ["BenchResult", "add_arguments", "make_workload", "run", "run_bench"]


@dataclass(slots=True)
class BenchResult:
    """One configuration's medians over the repeats."""

    config: str
    total_s: float
    mean_ttft_s: float
    cached_fraction: float
    speedup: float = 1.0
    outputs_equal_off: bool = True


def make_workload(
    num_prefixes: int, requests_per_prefix: int, prefix_len: int, suffix_len: int,
    vocab_size: int, seed: int = 0,
) -> list[list[int]]:
    """Token-id prompts: each prefix repeated with distinct random suffixes, interleaved."""
    rng = random.Random(seed)
    ids = range(3, min(vocab_size, 250))  # plain byte tokens of the built-in models
    prefixes = [[rng.choice(ids) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        prefix + [rng.choice(ids) for _ in range(suffix_len)]
        for _ in range(requests_per_prefix)
        for prefix in prefixes
    ]


def _measure(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, float,
                                                                          list[list[int]]]:
    from prefixcache.engine.sampling_params import SamplingParams

    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                ignore_eos=True))
    total = time.perf_counter() - start
    ttfts = list(llm.stats()["ttft"].values())[-len(prompts):]
    cached = sum(o.num_cached_tokens for o in outs) / sum(len(p) for p in prompts)
    return total, statistics.fmean(t for t in ttfts if t is not None), cached, [
        list(o.token_ids) for o in outs
    ]


def run_bench(args: argparse.Namespace) -> list[BenchResult]:
    from prefixcache.engine.llm import LLM

    configs = [("off", None)] + [(kind, kind) for kind in args.prefix_cache]
    results: list[BenchResult] = []
    reference: list[list[int]] | None = None
    for name, kind in configs:
        llm = LLM(model=args.model, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                  enable_prefix_caching=kind is not None, prefix_cache=kind or "hash")
        prompts = make_workload(args.num_prefixes, args.requests_per_prefix, args.prefix_len,
                                args.suffix_len, llm.engine.model_config.vocab_size, args.seed)
        _measure(llm, prompts[:2], 2)  # warm-up
        runs = [_measure(llm, prompts, args.max_tokens) for _ in range(args.repeats)]
        outputs = runs[-1][3]
        reference = outputs if reference is None else reference
        results.append(BenchResult(
            name,
            statistics.median(r[0] for r in runs),
            statistics.median(r[1] for r in runs),
            statistics.median(r[2] for r in runs),
            outputs_equal_off=outputs == reference,
        ))
    for result in results:
        result.speedup = results[0].total_s / result.total_s
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help=model_help("tiny"))
    parser.add_argument("--prefix-cache", default="hash,radix",
                        help="implementations to compare with cache-off (comma list)")
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--requests-per-prefix", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)


def _validate(args: argparse.Namespace) -> None:
    args.prefix_cache = [k.strip() for k in args.prefix_cache.split(",") if k.strip()]
    unknown = sorted(set(args.prefix_cache) - {"hash", "radix"})
    if unknown:
        raise CliError(f"--prefix-cache: unknown implementation {unknown[0]!r} (hash, radix)")
    for name in ("num_prefixes", "requests_per_prefix", "prefix_len", "suffix_len",
                 "max_tokens", "block_size", "repeats"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")


def run(args: argparse.Namespace) -> int:
    _validate(args)
    try:
        results = run_bench(args)
    except (ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
    n = args.num_prefixes * args.requests_per_prefix
    print(f"{n} requests: {args.num_prefixes} prefixes x {args.requests_per_prefix}, prefix "
          f"{args.prefix_len} + suffix {args.suffix_len} tokens, {args.max_tokens} output tokens, "
          f"model {args.model}, median of {args.repeats}")
    print(f"{'config':<8} {'total s':>9} {'mean TTFT s':>12} {'cached':>7} {'speedup':>8} "
          f"{'== off':>7}")
    for r in results:
        print(f"{r.config:<8} {r.total_s:>9.3f} {r.mean_ttft_s:>12.3f} {r.cached_fraction:>7.1%} "
              f"{r.speedup:>7.2f}x {'yes' if r.outputs_equal_off else 'NO':>7}")
    print(json.dumps({"bench": "prefix-cache", "results": [asdict(r) for r in results]}))
    return 0 if all(r.outputs_equal_off for r in results) else 1
