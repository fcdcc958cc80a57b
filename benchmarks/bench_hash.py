"""Chained block hashing: cost per token, and the encoding's overhead over the bare digest.

For each algorithm, hash a 50,000-token prompt (a list of Python ints, as a tokenizer returns it) at
block size 16 with `BlockHasher.chain` (the real code path: packing the ids, canonical encoding,
chaining), and compare with the bare digest function applied to the very same payload bytes,
precomputed. The two are timed alternately, median of the repeats. The ratio is the price of the
canonical encoding.

    python benchmarks/bench_hash.py [--tokens 50000] [--block-size 16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import statistics
import time
import warnings
from collections.abc import Callable

from prefixcache.cache.block_hash import BlockHasher, Namespace, encode_block


def bare_digest(algo: str) -> Callable[[bytes], bytes]:
    """The digest function itself, called directly (no wrapper of ours)."""
    if algo == "sha256":
        return lambda p: hashlib.sha256(p).digest()
    if algo == "blake2b":
        return lambda p: hashlib.blake2b(p, digest_size=32).digest()
    import xxhash

    fn: Callable[[bytes], bytes] = xxhash.xxh3_128_digest
    return fn


def paired_medians(
    first: Callable[[], object], second: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Median seconds of each, timed alternately so that drift in machine load hits both alike."""
    first(), second()  # warm-up
    a, b = [], []
    for _ in range(repeats):
        for fn, times in ((first, a), (second, b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def payloads_of(hasher: BlockHasher, tokens: list[int], namespace: Namespace) -> list[bytes]:
    """The exact bytes each block's digest is computed over."""
    digests = hasher.chain(tokens, namespace)
    parents = [hasher.root(namespace), *digests[:-1]]
    bs = hasher.block_size
    return [encode_block(p, tokens[i * bs : (i + 1) * bs]) for i, p in enumerate(parents)]


def bench_algo(algo: str, tokens: list[int], block_size: int, repeats: int) -> dict[str, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hasher = BlockHasher(block_size, algo)
    namespace = Namespace(model="bench", salt="tenant")
    payloads = payloads_of(hasher, tokens, namespace)
    bare = bare_digest(algo)
    if algo == "sha256":  # the loop as tight as Python allows: the constructor bound locally
        sha = hashlib.sha256

        def bare_loop() -> object:
            return [sha(p).digest() for p in payloads]
    else:

        def bare_loop() -> object:
            return [bare(p) for p in payloads]

    chained_s, bare_s = paired_medians(lambda: hasher.chain(tokens, namespace), bare_loop, repeats)
    n = len(tokens)
    return {
        "chained_ns_per_token": chained_s / n * 1e9,
        "bare_ns_per_token": bare_s / n * 1e9,
        "overhead_ratio": chained_s / bare_s,
        "payload_bytes_per_block": float(len(payloads[0])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=50_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(150_000) for _ in range(args.tokens)]
    results = {
        algo: bench_algo(algo, tokens, args.block_size, args.repeats)
        for algo in ("sha256", "blake2b", "xxh3_128")
    }
    print(f"chained hashing, {args.tokens} tokens, block size {args.block_size}, "
          f"median of {args.repeats} ({platform.processor() or platform.machine()})")
    print(f"{'algo':<10} {'chained ns/tok':>15} {'bare ns/tok':>12} {'overhead':>9}")
    for algo, r in results.items():
        print(f"{algo:<10} {r['chained_ns_per_token']:>15.1f} {r['bare_ns_per_token']:>12.1f} "
              f"{r['overhead_ratio']:>8.2f}x")
    print(json.dumps({"bench": "hash", "tokens": args.tokens, "block_size": args.block_size,
                      "results": results}))


if __name__ == "__main__":
    main()
