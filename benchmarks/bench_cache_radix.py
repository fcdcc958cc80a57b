"""Hash-chain versus radix-tree prefix cache on the same inputs, side by side in one run.

(a) The whole life of a 4,096-token prompt at block size 16 (build the Sequence, hash, match,
    allocate, commit, free) with 0%, 50% and 100% of it cached: microseconds per request, median
    of repeats, the two caches interleaved.
(b) The Mooncake conversation replay at 512-token blocks with unlimited, 50,000 and 10,000 blocks
    (the replay semantics and token derivation of ``bench_cache.py``, whose helpers this imports):
    each request is built once and replayed through every cache in turn, so both see the same
    machine; "full" time includes building and hashing the sequence, "cache" time is
    match+allocate+commit+free on the pre-hashed sequence.
(c) Two branching workloads at block size 16, at three capacities each, through hash, radix (LRU)
    and radix (LFU), requests one after another (match, allocate, commit, free):
    few-shot: 8 shared 1,024-token example sets x 64 questions of 64 tokens, round robin over the
    sets; tree-of-thought: 8 trees, a 256-token root prompt, depth 4, branching 3, 256-token
    steps, expanded level by level (each node's prompt is its parent's plus one step).
    Median of repeats, interleaved.

    .venv/bin/python benchmarks/bench_cache_radix.py [--repeats 200] [--requests N]

Prints tables and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench_cache import (
    BS,
    MOONCAKE_BS,
    PROMPT_TOKENS,
    TRACE,
    mooncake_tokens,
    prompt_life,
    replay_one,
)
from prefixcache.cache import PrefixCache, Sequence, make_prefix_cache

KINDS = ("hash", "radix")
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "hash": ("hash", {}),
    "radix": ("radix", {}),
    "radix-lfu": ("radix", {"eviction_policy": "lfu"}),
}


def make(variant: str, num_blocks: int, block_size: int) -> PrefixCache:
    kind, kwargs = VARIANTS[variant]
    return make_prefix_cache(
        kind, num_blocks=num_blocks, block_size=block_size, enable_kv_events=False, **kwargs
    )


# -- (a) the life of one prompt ----------------------------------------------------------------


def bench_prompt(repeats: int) -> dict[str, dict[str, float]]:
    shared = list(range(PROMPT_TOKENS))
    half = PROMPT_TOKENS // 2
    fresh = [
        list(range(10**6 + i * PROMPT_TOKENS, 10**6 + (i + 1) * PROMPT_TOKENS))
        for i in range(repeats + 10)
    ]
    cases: dict[tuple[str, str], Callable[[int], None]] = {}
    for kind in KINDS:
        caches = {name: make(kind, 4096, BS) for name in ("0%", "50%", "100%")}
        prompt_life(caches["50%"], shared[:half] + [0], "warm")  # type: ignore[arg-type]
        prompt_life(caches["100%"], shared, "warm")  # type: ignore[arg-type]
        for name, cache in caches.items():
            cases[(kind, name)] = _prompt_case(cache, name, shared, fresh)
    samples: dict[tuple[str, str], list[int]] = {key: [] for key in cases}
    for i in range(repeats + 10):  # the first 10 rounds are warm-up
        for key, case in cases.items():
            start = time.perf_counter_ns()
            case(i)
            if i >= 10:
                samples[key].append(time.perf_counter_ns() - start)
    out: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}
    for (kind, name), values in samples.items():
        out[kind][name] = statistics.median(values) / 1e3
    return out


def _prompt_case(
    cache: PrefixCache, name: str, shared: list[int], fresh: list[list[int]]
) -> Callable[[int], None]:
    half = len(shared) // 2
    if name == "0%":
        return lambda i: prompt_life(cache, fresh[i], "r")  # type: ignore[arg-type]
    if name == "50%":
        return lambda i: prompt_life(cache, shared[:half] + fresh[i][half:], "r")  # type: ignore[arg-type]
    return lambda i: prompt_life(cache, shared, "r")  # type: ignore[arg-type]


# -- (b) the Mooncake replay, both caches -------------------------------------------------------


def bench_replay(requests: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    total_blocks = sum(-(-r["input_length"] // MOONCAKE_BS) for r in requests)
    capacities = {"unlimited": total_blocks, "50000": 50_000, "10000": 10_000}
    keys = [(cap, kind) for cap in capacities for kind in KINDS]
    caches = {(cap, kind): make(kind, capacities[cap], MOONCAKE_BS) for cap, kind in keys}
    full_ns = dict.fromkeys(keys, 0)
    cache_ns = dict.fromkeys(keys, 0)
    for i, req in enumerate(requests):
        tokens = mooncake_tokens(req["hash_ids"], req["input_length"], i)
        for key in keys:
            full, only = replay_one(caches[key], list(tokens), str(i))  # type: ignore[arg-type]
            full_ns[key] += full
            cache_ns[key] += only
    input_tokens = sum(r["input_length"] for r in requests)
    out: dict[str, dict[str, dict[str, float]]] = {cap: {} for cap in capacities}
    for cap, kind in keys:
        cache = caches[(cap, kind)]
        cache.check_integrity()
        out[cap][kind] = {
            "hit_tokens": cache.stats.num_hit_tokens,
            "hit_ratio": cache.stats.num_hit_tokens / input_tokens,
            "seconds_full": full_ns[(cap, kind)] / 1e9,
            "seconds_cache": cache_ns[(cap, kind)] / 1e9,
            "req_per_s_full": len(requests) / (full_ns[(cap, kind)] / 1e9),
            "req_per_s_cache": len(requests) / (cache_ns[(cap, kind)] / 1e9),
            "evictions": cache.stats.num_evictions,
        }
    return out


# -- (c) branching workloads --------------------------------------------------------------------


def few_shot(
    num_sets: int = 8, set_tokens: int = 1024, num_questions: int = 64, question_tokens: int = 64
) -> list[list[int]]:
    """Question q of every example set in turn: the sets are the shared prefixes."""
    sets = [list(range(10**6 + s * set_tokens, 10**6 + (s + 1) * set_tokens)) for s in range(8)]
    prompts = []
    next_token = 2 * 10**6
    for _ in range(num_questions):
        for shots in sets[:num_sets]:
            prompts.append(shots + list(range(next_token, next_token + question_tokens)))
            next_token += question_tokens
    return prompts


def tree_of_thought(
    num_trees: int = 8, depth: int = 4, branching: int = 3, step_tokens: int = 256
) -> list[list[int]]:
    """Each tree: a root prompt, then ``branching`` continuations of every node, level by level."""
    prompts = []
    next_token = 3 * 10**6
    for _ in range(num_trees):
        level = [list(range(next_token, next_token + step_tokens))]
        next_token += step_tokens
        prompts += level
        for _ in range(depth):
            children = []
            for parent in level:
                for _ in range(branching):
                    children.append(parent + list(range(next_token, next_token + step_tokens)))
                    next_token += step_tokens
            prompts += children
            level = children
    return prompts


def run_workload(cache: PrefixCache, prompts: list[list[int]]) -> None:
    for i, tokens in enumerate(prompts):
        seq = Sequence(str(i), tokens)
        hit = cache.match(seq)
        if cache.allocate(seq, seq.num_tokens - hit.num_tokens, hit) is None:
            raise RuntimeError(f"prompt {i} does not fit in {cache.num_blocks} blocks")
        cache.commit(seq, seq.num_tokens)
        cache.free(seq)


def bench_branching(
    prompts: list[list[int]], capacities: dict[str, int], repeats: int
) -> dict[str, dict[str, dict[str, float]]]:
    keys = [(cap, v) for cap in capacities for v in VARIANTS]
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    last: dict[tuple[str, str], PrefixCache] = {}
    for r in range(repeats + 1):  # round 0 is warm-up
        for cap, variant in keys:
            cache = make(variant, capacities[cap], BS)
            start = time.perf_counter()
            run_workload(cache, prompts)
            if r:
                seconds[(cap, variant)].append(time.perf_counter() - start)
            last[(cap, variant)] = cache
    out: dict[str, dict[str, dict[str, float]]] = {cap: {} for cap in capacities}
    for cap, variant in keys:
        cache = last[(cap, variant)]
        cache.check_integrity()
        median_s = statistics.median(seconds[(cap, variant)])
        out[cap][variant] = {
            "hit_tokens": cache.stats.num_hit_tokens,
            "hit_ratio": cache.stats.hit_rate,
            "seconds": median_s,
            "req_per_s": len(prompts) / median_s,
            "evictions": cache.stats.num_evictions,
        }
    return out


def unique_blocks(prompts: list[list[int]]) -> int:
    return len({tuple(p[: (i + 1) * BS]) for p in prompts for i in range(len(p) // BS)})


# -- output -------------------------------------------------------------------------------------


def print_prompt(prompt: dict[str, dict[str, float]]) -> None:
    print(f"(a) life of a {PROMPT_TOKENS}-token prompt, block size {BS}, median us/request")
    print(f"{'cached':<8}{'hash':>10}{'radix':>10}{'radix/hash':>12}")
    for name, us in prompt["hash"].items():
        radix = prompt["radix"][name]
        print(f"{name:<8}{us:>10.1f}{radix:>10.1f}{radix / us:>11.2f}x")


def print_replay(replay: dict[str, dict[str, dict[str, float]]]) -> None:
    print(f"\n(b) Mooncake conversation replay, {MOONCAKE_BS}-token blocks")
    head = ("capacity", "hit hash", "hit radix", "rps hash", "rps radix", "full r/h", "cache r/h")
    print("".join(f"{h:>12}" for h in head))
    for cap, by_kind in replay.items():
        h, r = by_kind["hash"], by_kind["radix"]
        row = (
            cap,
            f"{h['hit_ratio']:.4f}",
            f"{r['hit_ratio']:.4f}",
            f"{h['req_per_s_full']:.0f}",
            f"{r['req_per_s_full']:.0f}",
            f"{r['seconds_full'] / h['seconds_full']:.2f}x",
            f"{r['seconds_cache'] / h['seconds_cache']:.2f}x",
        )
        print("".join(f"{c:>12}" for c in row))


def print_branching(name: str, result: dict[str, dict[str, dict[str, float]]]) -> None:
    print(f"\n(c) {name}, block size {BS}: token hit ratio | requests per second")
    variants = list(VARIANTS)
    head = ["capacity"] + [f"hit {v}" for v in variants] + [f"rps {v}" for v in variants]
    print("".join(f"{h:>14}" for h in head))
    for cap, by_variant in result.items():
        hits = [f"{by_variant[v]['hit_ratio']:.4f}" for v in variants]
        rps = [f"{by_variant[v]['req_per_s']:.0f}" for v in variants]
        print("".join(f"{c:>14}" for c in [cap, *hits, *rps]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200, help="prompt lives per case")
    parser.add_argument("--workload-repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=0, help="trace prefix (0: all)")
    parser.add_argument("--skip-replay", action="store_true")
    args = parser.parse_args()
    prompt = bench_prompt(args.repeats)
    shots, thoughts = few_shot(), tree_of_thought()
    branching = {
        "few-shot": bench_branching(
            shots,
            {"unlimited": unique_blocks(shots), "640": 640, "400": 400},
            args.workload_repeats,
        ),
        "tree-of-thought": bench_branching(
            thoughts,
            {"unlimited": unique_blocks(thoughts), "1000": 1000, "200": 200},
            args.workload_repeats,
        ),
    }
    replay = None
    if not args.skip_replay:
        with TRACE.open() as f:
            requests = [json.loads(line) for line in f]
        replay = bench_replay(requests[: args.requests] if args.requests else requests)
    print(
        f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}"
    )
    print_prompt(prompt)
    if replay is not None:
        print_replay(replay)
    for name, result in branching.items():
        print_branching(name, result)
    print(
        json.dumps(
            {"bench": "cache_radix", "prompt": prompt, "replay": replay, "branching": branching}
        )
    )


if __name__ == "__main__":
    main()
