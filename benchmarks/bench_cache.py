"""How much does the hash-chain prefix cache cost next to hashing, and next to a bare LRU?

(a) The whole life of a 4,096-token prompt at block size 16 (build the Sequence, hash, match,
    allocate, commit, free) with 0%, 50% and 100% of it cached, next to hashing alone, measured
    side by side (interleaved) in one run: microseconds per request, median of repeats.
(b) A replay of the Mooncake conversation trace at 512-token blocks through the real cache with
    unlimited, 50,000 and 10,000 blocks, next to a bare ``OrderedDict`` LRU of hash ids (the floor),
    in one interleaved pass. Hash id h names a block of 512 token ids derived from h (see
    `mooncake_tokens`); a partial tail block gets fresh ids (computed, never hit); requests run
    one after another. Token lists are built outside the timed region (one request at a time, to
    bound memory; each cache gets its own list, which the Sequence adopts without a copy, as in the
    simulator); "cache" time is match+allocate+commit+free on a pre-hashed sequence, "full" adds
    building and hashing it.

    .venv/bin/python benchmarks/bench_cache.py [--repeats 200] [--requests N]

Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.cache import BlockHasher, Sequence
from prefixcache.cache.hash_cache import HashPrefixCache

# the shared traces sit beside the checkout (../shared/traces)
SHARED = Path(__file__).resolve().parents[2] / "shared"
TRACE = SHARED / "traces" / "mooncake" / "conversation_trace.jsonl"
PROMPT_TOKENS = 4096
BS = 16
MOONCAKE_BS = 512
VOCAB = 128_256
MIX = np.uint64(0x9E3779B97F4A7C15)
TAIL_KEYS = np.uint64(2**40)


# -- (a) the life of one prompt ----------------------------------------------------------------


def prompt_life(cache: HashPrefixCache, tokens: list[int], seq_id: str) -> None:
    seq = Sequence(seq_id, tokens)
    hit = cache.match(seq)
    table = cache.allocate(seq, seq.num_tokens - hit.num_tokens, hit)
    assert table is not None
    cache.commit(seq, seq.num_tokens)
    cache.free(seq)


def bench_prompt(repeats: int) -> dict[str, Any]:
    hasher = BlockHasher(BS)
    shared = list(range(PROMPT_TOKENS))
    half = PROMPT_TOKENS // 2
    fresh = [
        list(range(10**6 + i * PROMPT_TOKENS, 10**6 + (i + 1) * PROMPT_TOKENS))
        for i in range(2 * repeats + 20)
    ]
    caches = {name: HashPrefixCache(4096, BS) for name in ("0%", "50%", "100%")}
    prompt_life(caches["50%"], shared[:half] + [0], "warm")
    prompt_life(caches["100%"], shared, "warm")
    cases: dict[str, Callable[[int], None]] = {
        "hash only": lambda i: Sequence("h", fresh[i]).digests(hasher, ""),
        "0%": lambda i: prompt_life(caches["0%"], fresh[i], "r"),
        "50%": lambda i: prompt_life(caches["50%"], shared[:half] + fresh[i][half:], "r"),
        "100%": lambda i: prompt_life(caches["100%"], shared, "r"),
    }
    samples: dict[str, list[int]] = {name: [] for name in cases}
    for i in range(repeats + 10):  # the first 10 rounds are warm-up
        for name, case in cases.items():
            start = time.perf_counter_ns()
            case(i)
            if i >= 10:
                samples[name].append(time.perf_counter_ns() - start)
    for cache in caches.values():
        cache.check_integrity()
    hit_rates = {name: round(c.stats.hit_rate, 3) for name, c in caches.items()}
    median_us = {name: statistics.median(v) / 1e3 for name, v in samples.items()}
    return {"median_us": median_us, "hit_rate": hit_rates}


# -- (b) the Mooncake replay -------------------------------------------------------------------


def mooncake_tokens(hash_ids: list[int], input_length: int, request_index: int) -> list[int]:
    """Request tokens: hash id h names the block whose i-th token is ``mix(h * 512 + i)``, an id in
    a Llama-3-size vocabulary (what a tokenizer returns: small ints, not h * 512 + i up to 2^31);
    the partial tail block gets keys past every hash id, unique to the request."""
    num_full = input_length // MOONCAKE_BS
    offsets = np.arange(MOONCAKE_BS, dtype=np.uint64)
    keys = np.asarray(hash_ids[:num_full], dtype=np.uint64)[:, None] * MOONCAKE_BS + offsets
    tail = input_length - num_full * MOONCAKE_BS
    tail_keys = (TAIL_KEYS + request_index) * MOONCAKE_BS + offsets[:tail]
    # a multiplicative hash (odd 64-bit constant, top bits): deterministic, and two hash ids
    # giving the same 512 tokens is as likely as a 512-fold collision
    mixed = np.concatenate((keys.ravel(), tail_keys)) * MIX >> np.uint64(40)
    tokens: list[int] = (mixed % VOCAB).tolist()
    return tokens


class LruFloor:
    """A bare OrderedDict LRU of hash ids; a request touches its full blocks tail-first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.hit_tokens = 0

    def run(self, hash_ids: list[int], input_length: int) -> None:
        lru = self.lru
        cap = (input_length - 1) // MOONCAKE_BS
        num_hit = 0
        while num_hit < cap and hash_ids[num_hit] in lru:
            num_hit += 1
        self.hit_tokens += num_hit * MOONCAKE_BS
        for h in reversed(hash_ids[: input_length // MOONCAKE_BS]):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                if len(lru) > self.capacity:
                    lru.popitem(last=False)


def replay_one(cache: HashPrefixCache, tokens: list[int], seq_id: str) -> tuple[int, int]:
    """One request through the cache: (full ns, cache-only ns)."""
    start = time.perf_counter_ns()
    seq = Sequence(seq_id, tokens, copy=False)  # a fresh list per request, as the simulator's
    cache.identity.block_digests(seq)
    hashed = time.perf_counter_ns()
    hit = cache.match(seq)
    table = cache.allocate(seq, seq.num_tokens - hit.num_tokens, hit)
    if table is None:
        raise RuntimeError(f"request {seq_id} does not fit in {cache.num_blocks} blocks")
    cache.commit(seq, seq.num_tokens)
    cache.free(seq)
    end = time.perf_counter_ns()
    return end - start, end - hashed


def bench_replay(requests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    total_blocks = sum(-(-r["input_length"] // MOONCAKE_BS) for r in requests)
    capacities = {"unlimited": total_blocks, "50000": 50_000, "10000": 10_000}
    caches = {
        k: HashPrefixCache(n, MOONCAKE_BS, enable_kv_events=False) for k, n in capacities.items()
    }
    floors = {k: LruFloor(n) for k, n in capacities.items()}
    full_ns = dict.fromkeys(capacities, 0)
    cache_ns = dict.fromkeys(capacities, 0)
    floor_ns = dict.fromkeys(capacities, 0)
    for i, req in enumerate(requests):
        ids, length = req["hash_ids"], req["input_length"]
        tokens = mooncake_tokens(ids, length, i)
        for k in capacities:
            full, only = replay_one(caches[k], list(tokens), str(i))
            full_ns[k] += full
            cache_ns[k] += only
            start = time.perf_counter_ns()
            floors[k].run(ids, length)
            floor_ns[k] += time.perf_counter_ns() - start
    input_tokens = sum(r["input_length"] for r in requests)
    out = {}
    for k, cache in caches.items():
        cache.check_integrity()
        out[k] = {
            "hit_ratio": cache.stats.num_hit_tokens / input_tokens,
            "floor_hit_ratio": floors[k].hit_tokens / input_tokens,
            "req_per_s_full": len(requests) / (full_ns[k] / 1e9),
            "req_per_s_cache": len(requests) / (cache_ns[k] / 1e9),
            "req_per_s_floor": len(requests) / (floor_ns[k] / 1e9),
            "ratio_full_vs_floor": full_ns[k] / floor_ns[k],
            "ratio_cache_vs_floor": cache_ns[k] / floor_ns[k],
            "evictions": cache.stats.num_evictions,
        }
    return out


# -- main --------------------------------------------------------------------------------------


def print_tables(prompt: dict[str, Any], replay: dict[str, dict[str, Any]] | None) -> None:
    med = prompt["median_us"]
    base = med["hash only"]
    print(f"(a) life of a {PROMPT_TOKENS}-token prompt, block size {BS}")
    print(f"{'case':<12}{'us/request':>12}{'x hashing':>12}{'hit rate':>10}")
    for name, us in med.items():
        rate = prompt["hit_rate"].get(name, "")
        print(f"{name:<12}{us:>12.1f}{us / base:>12.2f}{rate!s:>10}")
    if replay is None:
        return
    print("\n(b) Mooncake conversation replay, 512-token blocks")
    head = (
        "capacity",
        "hit",
        "LRU hit",
        "req/s full",
        "req/s cache",
        "req/s LRU",
        "full/LRU",
        "cache/LRU",
    )
    print("".join(f"{h:>12}" for h in head))
    for k, r in replay.items():
        row = (
            k,
            f"{r['hit_ratio']:.4f}",
            f"{r['floor_hit_ratio']:.4f}",
            f"{r['req_per_s_full']:.0f}",
            f"{r['req_per_s_cache']:.0f}",
            f"{r['req_per_s_floor']:.0f}",
            f"{r['ratio_full_vs_floor']:.1f}x",
            f"{r['ratio_cache_vs_floor']:.1f}x",
        )
        print("".join(f"{c:>12}" for c in row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200, help="prompt lives per case")
    parser.add_argument("--requests", type=int, default=0, help="trace prefix (0: all)")
    parser.add_argument("--skip-replay", action="store_true")
    args = parser.parse_args()
    prompt = bench_prompt(args.repeats)
    replay = None
    if not args.skip_replay:
        with TRACE.open() as f:
            requests = [json.loads(line) for line in f]
        if args.requests:
            requests = requests[: args.requests]
        replay = bench_replay(requests)
    print_tables(prompt, replay)
    print(json.dumps({"bench": "cache", "prompt": prompt, "replay": replay}))


if __name__ == "__main__":
    main()
