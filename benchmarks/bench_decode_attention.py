"""Decode attention, one layer: per-sequence slot gather + SDPA vs batched block gather vs cascade.

Question: with the `small` preset's attention shapes (12 heads, 4 kv heads, head_dim 64, float32,
block size 16), how long does one layer's attention take for 16 decode sequences of ~2,048 keys,
(a) the pre-batching reference path (each sequence's context gathered slot by slot, one SDPA per
sequence), (b) `decode_attention` with no shared blocks (batched, gather by block), and (c)
`decode_attention` when the sequences share a 1,920-token prefix's blocks (cascade: the prefix is
attended once for all 16 queries)? Same cache contents, outputs checked equal.

(b) and (c) run through the compiled kernel (`native_attention`, where it builds) and through
the torch paths. Warm-up, then the median of interleaved repeats; prints a table and a final
JSON line.
Other shapes: ``--heads 9 --kv-heads 3`` (SmolLM2); ``--layers 30`` runs each case over 30
layers' caches in turn (K and V from memory, as in a step; times per layer).
Usage: python benchmarks/bench_decode_attention.py [--repeats 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from prefixcache.attention import native_attention
from prefixcache.attention.decode_attention import DecodePlan, decode_attention


def per_sequence_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: list[torch.Tensor]
) -> torch.Tensor:
    """The reference path before batching: slot gather and one SDPA per sequence."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    for b, seq_slots in enumerate(slots):
        k = k_flat.index_select(0, seq_slots).transpose(0, 1).unsqueeze(0)
        v = v_flat.index_select(0, seq_slots).transpose(0, 1).unsqueeze(0)
        out[b] = F.scaled_dot_product_attention(
            q[b : b + 1].transpose(0, 1).unsqueeze(0), k, v, scale=head_dim**-0.5, enable_gqa=True
        )[0, :, 0]
    return out


def _torch_paths(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    native_attention.set_enabled(False)
    try:
        return fn()
    finally:
        native_attention.set_enabled(True)


def make_tables(args: argparse.Namespace, shared: bool) -> tuple[np.ndarray, np.ndarray]:
    """Block tables [B, blocks] (shuffled ids) and lengths; with ``shared`` all start alike."""
    bs = args.block_size
    lens = np.array([args.context + b % bs for b in range(args.seqs)])  # varied tails
    per_seq = -(-lens.max() // bs)
    prefix_blocks = args.prefix // bs if shared else 0
    ids = np.random.default_rng(0).permutation(args.seqs * per_seq + prefix_blocks)
    table = ids[prefix_blocks:].reshape(args.seqs, per_seq).copy()
    table[:, :prefix_blocks] = ids[:prefix_blocks]
    return table, lens


def time_ms(fn: Callable[[], torch.Tensor], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return times


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bs, heads, kv_heads, dim = args.block_size, args.heads, args.kv_heads, args.head_dim
    num_blocks = args.seqs * (-(-(args.context + bs) // bs)) + args.prefix // bs
    # one cache per layer: with --layers N each case runs over N layers' caches in turn, so K
    # and V come from memory as in a model's step rather than from the last case's reads
    caches = [
        (torch.randn(num_blocks, bs, kv_heads, dim), torch.randn(num_blocks, bs, kv_heads, dim))
        for _ in range(args.layers)
    ]
    q = torch.randn(args.seqs, heads, dim)
    scale = dim**-0.5
    cases: dict[str, Callable[[], torch.Tensor]] = {}
    outputs = {}

    def add(name: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        cases[name] = lambda: [fn(k, v) for k, v in caches][-1]  # the last layer's output

    for shared in (False, True):
        table, lens = make_tables(args, shared)
        pos = [np.arange(n) for n in lens]
        slots = [torch.as_tensor(table[b, p // bs] * bs + p % bs) for b, p in enumerate(pos)]
        plan = DecodePlan.build(table, lens, bs)
        tag = "shared" if shared else "unshared"
        add(
            f"per-sequence slot gather, {tag}",
            lambda k, v, s=slots: per_sequence_reference(q, k, v, s),
        )
        add(f"decode_attention, {tag}", lambda k, v, p=plan: decode_attention(q, k, v, p, scale))
        add(
            f"decode_attention incl. plan, {tag}",
            lambda k, v, t=table, n=lens: decode_attention(
                q, k, v, DecodePlan.build(t, n, bs), scale
            ),
        )
        if native_attention.available():
            add(
                f"decode_attention, torch paths, {tag}",
                lambda k, v, p=plan: _torch_paths(lambda: decode_attention(q, k, v, p, scale)),
            )
    for name, fn in cases.items():
        outputs[name] = fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so machine load hits every case alike
        for name, fn in cases.items():
            times[name].extend(t / args.layers for t in time_ms(fn, 1))
    max_diff = {
        name: (out - outputs[f"per-sequence slot gather, {name.rsplit(', ', 1)[1]}"])
        .abs()
        .max()
        .item()
        for name, out in outputs.items()
        if name.startswith("decode_attention")
    }
    return {
        "bench": "decode_attention_layer",
        "threads": args.threads,
        "seqs": args.seqs,
        "context": args.context,
        "shared_prefix": args.prefix,
        "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": dim},
        "layers": args.layers,
        "repeats": args.repeats,
        "compiled_kernel": native_attention.available(),
        "median_ms": {name: round(statistics.median(t), 3) for name, t in times.items()},
        "max_abs_diff_vs_reference": max_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefix", type=int, default=1920)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--layers", type=int, default=1, help="caches to run over in turn (times are per layer)"
    )
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    summary = run(parser.parse_args())
    ref = summary["median_ms"]
    print(
        f"one layer, {summary['seqs']} decode seqs x ~{summary['context']} keys, "
        f"threads={summary['threads']}, median of {summary['repeats']}"
    )
    print(f"decode_attention through the compiled kernel: {summary['compiled_kernel']}")
    print(f"{'path':<44}{'ms':>9}{'vs reference':>14}")
    for name, ms in ref.items():
        tag = name.rsplit(", ", 1)[1]
        base = ref[f"per-sequence slot gather, {tag}"]
        print(f"{name:<44}{ms:>9.2f}{base / ms:>13.2f}x")
    print(f"max |diff| vs reference: {summary['max_abs_diff_vs_reference']}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
