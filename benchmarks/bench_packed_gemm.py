"""Packed-weight GEMM vs ``F.linear``: the `small` preset's projections and whole model steps.

Question: on CPU in float32 (2 threads), how much time does multiplying through MKL-packed
projection weights (`prefixcache.model.packed_gemm`) save against ``F.linear`` on the same
weights (stored as the view of a contiguous transpose, F.linear's fastest layout)?
(a) the 48 projections of `small` (12 layers x qkv, o, gate/up, down) at 1 to 2,048 rows, each
weight streamed once per pass as in a real step; (b) whole model steps: a 2,048-token prefill,
128 tokens after 1,920 cached ones, and 128 tokens with no context, switching the projections
and the LM head between packed and plain before each timed step (untimed). Every case
alternates with its twin, so load drift hits both alike. Prints a table and a final JSON line.
Usage: python benchmarks/bench_packed_gemm.py [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench_model import Case, Ours, median_ms  # benchmarks/ is the script's directory
from prefixcache.model import LoadedModel, load_model
from prefixcache.model.decoder import Projection
from prefixcache.model.host_memory import retain_freed_memory

ROWS = (1, 8, 32, 128, 512, 2048)


def projection_cases(projections: list[Projection], rows: int) -> list[Case]:
    inputs = {p.in_features: torch.randn(rows, p.in_features) for p in projections}

    def plain() -> None:
        for p in projections:
            F.linear(inputs[p.in_features], p.weight)

    def packed() -> None:
        for p in projections:
            assert p.packed is not None
            p.packed.matmul(inputs[p.in_features])

    return [Case("plain", plain), Case("packed", packed)]


def step_cases(loaded: LoadedModel) -> list[Case]:
    """Model steps (bench_model's shapes), each with packed and with plain weights; the
    packing switch is the untimed setup of each case."""
    ids = torch.randint(0, loaded.config.vocab_size, (2048,), generator=torch.Generator())
    cached, scratch = Ours(loaded, len(ids)), Ours(loaded, len(ids))
    cached.step(ids[:1920], 0)
    shapes = {
        "full 2048": lambda: scratch.step(ids, 0),
        "1920 cached + 128": lambda: cached.step(ids[1920:], 1920),
        "128, no context": lambda: scratch.step(ids[:128], 0),
    }
    linears = [*loaded.model.projections(), loaded.model.lm_head]

    def packing(enable: bool) -> Callable[[], None]:
        def setup() -> None:
            for linear in linears:
                linear.pack(enable)

        return setup

    return [
        Case(f"{label}|{mode}", lambda _, run=run: run(), setup=packing(mode == "packed"))
        for label, run in shapes.items()
        for mode in ("plain", "packed")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # as `prefixcache serve` does
    loaded = load_model(args.model)
    projections = loaded.model.projections()
    if any(p.packed is None for p in projections):
        raise SystemExit("packed GEMM is not available here (needs torch with MKL, x86)")
    load_start = os.getloadavg()[0]
    gemm = {rows: median_ms(projection_cases(projections, rows), args.repeats) for rows in ROWS}
    steps = median_ms(step_cases(loaded), args.repeats)
    for linear in (*projections, loaded.model.lm_head):
        linear.pack(True)
    result = {
        "bench": "packed_gemm",
        "model": args.model,
        "threads": args.threads,
        "repeats": args.repeats,
        "load_avg_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "projections_ms": {str(r): {k: round(v, 2) for k, v in m.items()} for r, m in gemm.items()},
        "steps_ms": {k: round(v, 1) for k, v in steps.items()},
    }
    print_table(result)
    print(json.dumps(result))


def print_table(result: dict) -> None:
    print(
        f"model={result['model']} threads={result['threads']} median of {result['repeats']}, ms; "
        f"1-min load avg {result['load_avg_1min'][0]} at start, {result['load_avg_1min'][1]} at end"
    )
    print(f"{'48 projections, rows':<28}{'F.linear':>10}{'packed':>10}{'packed/plain':>14}")
    for rows, m in result["projections_ms"].items():
        print(f"{rows:<28}{m['plain']:>10.2f}{m['packed']:>10.2f}{m['packed'] / m['plain']:>14.2f}")
    print(f"{'model step':<28}{'F.linear':>10}{'packed':>10}{'packed/plain':>14}")
    steps = result["steps_ms"]
    for label in dict.fromkeys(k.split("|")[0] for k in steps):
        plain, packed = steps[f"{label}|plain"], steps[f"{label}|packed"]
        print(f"{label:<28}{plain:>10.1f}{packed:>10.1f}{packed / plain:>14.2f}")
    full, cached = "full 2048", "1920 cached + 128"
    for mode in ("plain", "packed"):
        speedup = steps[f"{full}|{mode}"] / steps[f"{cached}|{mode}"]
        print(f"cached-step speedup over the full prefill, {mode}: {speedup:.2f}x")


if __name__ == "__main__":
    main()
