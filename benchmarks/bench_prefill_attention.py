"""Prefill attention, one layer: per-sequence masked SDPA vs cascade prefill on a shared prefix.

Question: with the `small` preset's attention shapes (12 heads, 4 kv heads, head_dim 64, float32,
block size 16), how long does one layer's `paged_attention` take for the step that prefills 15
requests of 128 new tokens each after a cached, shared 1,920-token prefix (what the engine runs
after the first request of bench_engine's workload), (a) with each sequence's own masked SDPA
call (the path before cascade prefill) and (b) with `cascade_prefill` (the prefix attended once,
unmasked, for all 1,920 queries; each suffix causal on its own; merged by log-sum-exp)? Same
inputs, outputs checked equal.

Warm-up, then the median of interleaved repeats; prints a table and a final JSON line.
Usage: python benchmarks/bench_prefill_attention.py [--repeats 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from prefixcache.attention import AttentionMetadata, write_kv

# the package re-exports the function under the module's name, so reach the module itself
paged = importlib.import_module("prefixcache.attention.paged_attention")


def without_cascade(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        original = paged.cascade_prefill
        paged.cascade_prefill = lambda *args: []
        try:
            return fn()
        finally:
            paged.cascade_prefill = original

    return run


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bs, heads, kv_heads, dim = args.block_size, 12, 4, 64
    prefix_blocks, own_blocks = args.prefix // bs, -(-args.suffix // bs)
    ids = np.random.default_rng(0).permutation(prefix_blocks + args.seqs * own_blocks)
    tables = [
        [*ids[:prefix_blocks], *ids[prefix_blocks + b * own_blocks :][:own_blocks]]
        for b in range(args.seqs)
    ]
    meta = AttentionMetadata.build(tables, [args.prefix] * args.seqs, [args.suffix] * args.seqs, bs)
    k_cache = torch.randn(len(ids), bs, kv_heads, dim)
    v_cache = torch.randn(len(ids), bs, kv_heads, dim)
    q = torch.randn(meta.num_tokens, heads, dim)
    k, v = torch.randn(meta.num_tokens, kv_heads, dim), torch.randn(meta.num_tokens, kv_heads, dim)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = dim**-0.5

    def attend() -> torch.Tensor:
        return paged.paged_attention(q, k, v, k_cache, v_cache, meta, scale)

    cases = {"per-sequence masked SDPA": without_cascade(attend), "cascade prefill": attend}
    outputs = {name: fn() for name, fn in cases.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so machine load hits every case alike
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - start))
    diff = (outputs["cascade prefill"] - outputs["per-sequence masked SDPA"]).abs().max().item()
    return {
        "bench": "prefill_attention_layer",
        "threads": args.threads,
        "seqs": args.seqs,
        "suffix": args.suffix,
        "shared_prefix": args.prefix,
        "repeats": args.repeats,
        "median_ms": {name: round(statistics.median(t), 3) for name, t in times.items()},
        "max_abs_diff_vs_reference": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seqs", type=int, default=15)
    parser.add_argument("--suffix", type=int, default=128)
    parser.add_argument("--prefix", type=int, default=1920)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    summary = run(parser.parse_args())
    ms = summary["median_ms"]
    print(
        f"one layer, {summary['seqs']} prefill seqs x {summary['suffix']} new tokens after a "
        f"shared {summary['shared_prefix']}-token prefix, threads={summary['threads']}, "
        f"median of {summary['repeats']}"
    )
    print(f"{'path':<28}{'ms':>9}{'vs reference':>14}")
    base = ms["per-sequence masked SDPA"]
    for name, value in ms.items():
        print(f"{name:<28}{value:>9.2f}{base / value:>13.2f}x")
    print(f"max |diff| vs reference: {summary['max_abs_diff_vs_reference']:.2e}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
