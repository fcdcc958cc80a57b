"""``prefixcache simulate``: replay a trace through the real caches and report.

    prefixcache simulate TRACE [--format mooncake|agentic|record|synthetic:<name>]
        [--block-size N] [--capacity 1k,10k,50k,inf] [--prefix-cache hash,radix]
        [--eviction-policy lru,lfu] [--replicas 1,4] [--router cache-aware,round-robin] [--out DIR]

Prints a progress bar and a table; with ``--out`` writes results.json, results.csv and PNG plots.
Bad input is one line on stderr (exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefixcache.cache.config import EVICTION_POLICIES
from prefixcache.errors import have_extra
from prefixcache.sched import SCHEDULE_POLICIES
from prefixcache.sim.config import KV_BYTES_SCALE, RunSpec, format_blocks
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.errors import TraceFormatError
from prefixcache.sim.loader import FORMATS, load_trace, retime_poisson
from prefixcache.sim.output import format_table, write_results
from prefixcache.sim.report import ReplayResult
from prefixcache.sim.router import ROUTERS
from prefixcache.sim.sweep import SweepPlan, plan_sweep, run_sweep
from prefixcache.sim.timed import ReplicaConfig
from prefixcache.sim.trace import Trace
from prefixcache.tiers import TIERS

_SUFFIXES = {"k": 1_000, "m": 1_000_000}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``simulate``'s flags, in groups of what they set."""
    _trace_arguments(parser.add_argument_group("the trace"))
    _sweep_arguments(parser.add_argument_group("the configurations swept"))
    _cost_arguments(parser.add_argument_group("the cost model"))
    _tier_and_pin_arguments(parser.add_argument_group("tiers and pins (sequential mode)"))
    _timed_arguments(parser.add_argument_group("the timed mode's scheduler"))
    _output_arguments(parser.add_argument_group("output"))


def _trace_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("trace", help="trace file or directory, or synthetic:<name>[:k=v,...]")
    group.add_argument(
        "--format",
        dest="fmt",
        help=f"one of {', '.join(FORMATS)} (default: "
        "detected; with synthetic:<name>, TRACE holds its k=v parameters)",
    )
    group.add_argument("--block-size", type=int, help="tokens per hash id (mooncake: 512)")
    group.add_argument("--time-unit", default="auto", choices=("auto", "s", "ms", "us", "ns"),
                       help="unit of a mooncake-shaped trace's timestamps (auto: ns from 1e17, "
                            "us from 1e14, else ms, as Mooncake's)")
    group.add_argument("--rate", type=float, help="re-time arrivals as Poisson at this req/s")
    group.add_argument("--time-scale", type=float, help="multiply arrival times (0.5 = 2x rate)")
    group.add_argument("--limit", type=int, help="replay only the first N requests")
    group.add_argument("--seed", type=int, default=0, help="seed for --rate")


def _sweep_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--capacity", default="1k,10k,50k,inf", help="total cache blocks")
    group.add_argument("--prefix-cache", default="hash,radix", help="hash and/or radix")
    group.add_argument(
        "--eviction-policy",
        default="lru",
        help="lru and/or lfu (lfu: radix only)",
    )
    group.add_argument("--replicas", default="1", help="replica counts, e.g. 1,2,4,8")
    group.add_argument(
        "--router",
        default="cache-aware,round-robin",
        help=f"routers for replicas > 1: {', '.join(ROUTERS)}",
    )
    group.add_argument(
        "--cluster-capacity",
        help="total blocks for the cluster sweep (default: the largest finite --capacity)",
    )
    group.add_argument(
        "--mode",
        choices=("sequential", "timed"),
        default="sequential",
        help="sequential: one request at a time per replica, TTFT without "
        "queueing; timed: scheduler with token budget, concurrency and decode",
    )


def _cost_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--prefill-tps", type=float, default=20_000.0, help="prefill tokens/s")
    group.add_argument(
        "--decode-tps", type=float, default=50.0, help="decode tokens/s of one sequence"
    )
    group.add_argument("--cost-model", help="calibration JSON (e.g. bench_model.py output)")


def _tier_and_pin_arguments(group: argparse._ArgumentGroup) -> None:
    for kind in TIERS.values():
        where = "one shared by the replicas" if kind.shared else "one under each replica's cache"
        group.add_argument(f"--kv-{kind.name}-gib", type=float, default=None, metavar="G",
                           help=f"sequential: a {kind.name} tier of G GiB, {where}")
    group.add_argument("--kv-bytes-per-token", type=float, default=None, metavar="B",
                       help="KV bytes of one token, all layers, in bfloat16 (sizes the tiers in "
                            "blocks and their reads; default 131072, an 8B Llama)")
    group.add_argument("--kv-cache-dtype", default=None, metavar="float32,int8,...",
                       help=f"KV layouts to compare ({', '.join(KV_BYTES_SCALE)}): each sizes "
                            "the RAM pool from --kv-cache-gib and scales a tier's bytes per "
                            "block")
    group.add_argument("--kv-cache-gib", type=float, default=None, metavar="G",
                       help="the KV pool in GiB (total over replicas), in blocks of each "
                            "--kv-cache-dtype's size (replaces --capacity)")
    group.add_argument("--pins", default="on", metavar="on,off",
                       help="honour the trace's cache breakpoints (tenant pins): on, off, or "
                            "on,off to compare (sequential mode)")
    group.add_argument("--max-pinned-blocks", type=int, default=None, metavar="N",
                       help="blocks each tenant may pin per replica (default: a quarter)")


def _timed_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--max-num-seqs", type=int, default=128, help="timed: concurrency limit")
    group.add_argument(
        "--max-batched-tokens", type=int, default=8192, help="timed: token budget per step"
    )
    group.add_argument(
        "--no-decode-kv", action="store_true", help="timed: keep generated tokens out of the cache"
    )
    group.add_argument(
        "--schedule-policy",
        choices=SCHEDULE_POLICIES,
        default="fcfs",
        help="timed: admission order, fcfs or lpm (longest cached prefix first, aged)",
    )
    group.add_argument("--n", type=int, default=1, help="timed: choices sampled per request")
    group.add_argument(
        "--no-dedup",
        action="store_true",
        help="timed: no in-batch dedup (a request may compute a block another computes now)",
    )


def _output_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--out", help="directory for results.json, results.csv and plots")
    group.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")

def run(args: argparse.Namespace) -> int:
    from prefixcache.errors import CliError

    try:
        return _run(args)
    except (TraceFormatError, ValueError, OverflowError) as exc:
        raise CliError(str(exc)) from exc


def _run(args: argparse.Namespace) -> int:
    trace = _load(args)
    plan = _plan(args, trace.block_size)
    cost = _cost_model(args)
    config = ReplicaConfig(
        args.max_batched_tokens,
        args.max_num_seqs,
        not args.no_decode_kv,
        schedule_policy=args.schedule_policy,
        dedup=not args.no_dedup,
        n=args.n,
    )
    total = len(trace) * (1 if args.mode == "sequential" else len(plan.specs))
    with _progress(total, args.no_progress, trace.name) as bar:
        results = run_sweep(trace, plan.specs, args.mode, cost, config, bar.update)
    print(
        f"trace {trace.name}: {len(trace):,} requests, block size {trace.block_size}, "
        f"mode {args.mode}"
    )
    print(format_table(results))
    for note in plan.notes:
        print(f"note: {note}")
    if args.out:
        _write(Path(args.out), trace, results, _meta(args, trace, cost, plan), args.no_plots)
    return 0


def _load(args: argparse.Namespace) -> Trace:
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1")
    trace = load_trace(args.trace, args.fmt, args.block_size, args.limit, args.time_unit)
    if args.rate is not None:
        retime_poisson(trace, args.rate, args.seed)
    if args.time_scale is not None:
        if args.time_scale <= 0:
            raise ValueError("--time-scale must be > 0")
        trace.scale_arrivals(args.time_scale)
    return trace


def _plan(args: argparse.Namespace, block_size: int) -> SweepPlan:
    capacities = [parse_capacity(c) for c in _items(args.capacity, "--capacity")]
    kinds = _items(args.prefix_cache, "--prefix-cache")
    policies = _choices(args.eviction_policy, "--eviction-policy", EVICTION_POLICIES)
    replicas = [_positive_int(r, "--replicas") for r in _items(args.replicas, "--replicas")]
    routers = _choices(args.router, "--router", tuple(ROUTERS))
    cluster = (
        parse_capacity(args.cluster_capacity)
        if args.cluster_capacity
        else max((c for c in capacities if c is not None), default=None)
    )
    plan = plan_sweep(capacities, kinds, policies, replicas, routers, cluster)
    if not plan.specs:
        raise ValueError("nothing to simulate: " + "; ".join(plan.notes))
    tier_gib = tuple((name, gib) for name in TIERS
                     if (gib := getattr(args, f"kv_{name}_gib", None)) is not None)
    if tier_gib:
        plan.specs = [replace(s, tier_gib=tier_gib) for s in plan.specs]
    pins = [p == "on" for p in _choices(args.pins, "--pins", ("on", "off"))]
    plan.specs = [replace(s, pins=p, max_pinned_blocks=args.max_pinned_blocks)
                  for s in plan.specs for p in dict.fromkeys(pins)]
    plan.specs = _layout_specs(args, plan.specs, block_size)
    return plan


def _layout_specs(
    args: argparse.Namespace, specs: list[RunSpec], block_size: int
) -> list[RunSpec]:
    """Each spec once per ``--kv-cache-dtype``, its capacity the blocks of that layout's size
    in ``--kv-cache-gib`` (where given)."""
    if args.kv_cache_dtype is None:
        if args.kv_cache_gib is not None:
            raise ValueError("--kv-cache-gib sizes the pool per --kv-cache-dtype: name them")
        return specs
    layouts = _choices(args.kv_cache_dtype, "--kv-cache-dtype", tuple(KV_BYTES_SCALE))
    if args.kv_cache_gib is None or not args.kv_cache_gib > 0:
        raise ValueError("--kv-cache-dtype needs --kv-cache-gib G > 0 (the pool's memory)")
    per_token = args.kv_bytes_per_token or CostModel().kv_bytes_per_token
    out: list[RunSpec] = []
    for spec in specs:
        for layout in layouts:
            blocks = int(args.kv_cache_gib * (1 << 30)
                         // (per_token * KV_BYTES_SCALE[layout] * block_size))  # fmt: skip
            sized = replace(spec, capacity_blocks=max(blocks, spec.replicas),
                            kv_cache_dtype=layout)
            if sized not in out:
                out.append(sized)
    return out


def _cost_model(args: argparse.Namespace) -> CostModel:
    model = (CostModel.from_json(args.cost_model) if args.cost_model
             else CostModel.from_rates(args.prefill_tps, args.decode_tps))
    if args.kv_bytes_per_token is not None:
        model = replace(model, kv_bytes_per_token=args.kv_bytes_per_token)
    return model


def _items(text: str, flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ValueError(f"{flag} needs at least one value")
    return items


def _choices(text: str, flag: str, allowed: tuple[str, ...]) -> list[str]:
    items = _items(text, flag)
    for item in items:
        if item not in allowed:
            raise ValueError(f"unknown {flag} value {item!r}; choose from {', '.join(allowed)}")
    return items


def _positive_int(text: str, flag: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{flag}: {value} must be >= 1")
    return value


def parse_capacity(text: str) -> int | None:
    """``"10k"`` -> 10000, ``"1.5M"`` -> 1500000, ``"inf"`` -> None (unlimited)."""
    text = text.strip().lower()
    if text in ("inf", "unlimited"):
        return None
    scale = _SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"bad capacity {text!r}: use e.g. 1000, 10k, 1.5M or inf") from None
    if value < 1 or value != int(value):
        raise ValueError(f"bad capacity {text!r}: must be a whole number of blocks >= 1")
    return int(value)


class _NoBar:
    def update(self, n: int = 1) -> None:
        """No progress display."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _progress(total: int, disabled: bool, name: str) -> Any:
    if disabled or not have_extra("tqdm"):  # the bar comes with the `sim` extra
        return _NoBar()
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=f"simulate {name}",
        unit="req",
        file=sys.stderr,
        leave=False,
        mininterval=1.0,
    )


def _meta(
    args: argparse.Namespace, trace: Trace, cost: CostModel, plan: SweepPlan
) -> dict[str, Any]:
    return {
        "trace": trace.name,
        "num_requests": len(trace),
        "block_size": trace.block_size,
        "mode": args.mode,
        "cost_model": {f: getattr(cost, f) for f in cost.__slots__},
        "scheduler": {
            "max_num_seqs": args.max_num_seqs,
            "max_batched_tokens": args.max_batched_tokens,
            "decode_kv": not args.no_decode_kv,
            "schedule_policy": args.schedule_policy,
            "n": args.n,
            "dedup": not args.no_dedup,
        },
        "notes": plan.notes,
        "argv": sys.argv[1:],
    }


def _write(
    out_dir: Path,
    trace: Trace,
    results: list[ReplayResult],
    meta: dict[str, Any],
    no_plots: bool,
) -> None:
    try:
        paths = list(write_results(out_dir, results, meta))
        if not no_plots and not have_extra("matplotlib"):
            print(
                "note: no plots: they need matplotlib (pip install 'prefixcache[sim]')",
                file=sys.stderr,
            )
        elif not no_plots:
            from prefixcache.sim.plots import write_plots

            paths += write_plots(results, out_dir, f"{trace.name} ({meta['mode']})")
    except OSError as exc:
        raise ValueError(f"cannot write to {out_dir}: {exc.strerror or exc}") from exc
    print(json.dumps({"out": str(out_dir), "files": [p.name for p in paths]}))


__all__ = ["add_arguments", "format_blocks", "parse_capacity", "run", "RunSpec"]
