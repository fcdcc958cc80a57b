"""`prefixcache lab`: the specification's hash-chain lab, computed with the real block identity.

Two requests share a prefix exactly as far as their chained block digests agree. Changing one
token changes that block's digest and, through the chain, every later one; a different cache salt
changes the namespace root, so no block is shared at all.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from prefixcache.cache.block_hash import HASH_ALGOS, BlockHasher, Namespace

BASE = list(range(1, 13))
SAME_PREFIX = list(range(1, 9)) + [90, 91, 92, 93]
CHANGED_ONE = [1, 2, 3, 4, 5, 6, 99, 8, 90, 91, 92, 93]
LAB_MODEL = "prefixcache-lab"


@dataclass(frozen=True, slots=True)
class Reuse:
    """How much of ``b`` could reuse ``a``'s cached blocks."""

    num_blocks: int
    num_tokens: int
    digests_a: list[bytes]
    digests_b: list[bytes]


def reusable(
    a: list[int],
    b: list[int],
    hasher: BlockHasher,
    salt_a: str | None = "tenant-a",
    salt_b: str | None = "tenant-a",
) -> Reuse:
    """Reusable blocks and tokens: the length of the common prefix of the two digest chains."""
    left = hasher.chain(a, Namespace(model=LAB_MODEL, salt=salt_a))
    right = hasher.chain(b, Namespace(model=LAB_MODEL, salt=salt_b))
    n = 0
    for x, y in zip(left, right, strict=False):
        if x != y:
            break
        n += 1
    return Reuse(n, n * hasher.block_size, left, right)


def explain_lines(a: list[int], b: list[int], reuse: Reuse, block_size: int) -> list[str]:
    """Per block: index, token span, a short digest prefix per side, and the first miss."""
    lines = []
    for i in range(max(len(reuse.digests_a), len(reuse.digests_b))):
        span = f"tokens [{i * block_size}, {(i + 1) * block_size})"
        da = reuse.digests_a[i].hex()[:12] if i < len(reuse.digests_a) else "-" * 12
        db = reuse.digests_b[i].hex()[:12] if i < len(reuse.digests_b) else "-" * 12
        mark = "hit" if i < reuse.num_blocks else "miss"
        if i == reuse.num_blocks:
            mark = "FIRST MISS"
        lines.append(f"    block {i}  {span:<20} a={da}  b={db}  {mark}")
    return lines


def run_lab(
    block_size: int = 4, use_salt: bool = True, hash_algo: str = "sha256", explain: bool = False
) -> list[str]:
    """The lab's output lines."""
    hasher = BlockHasher(block_size, hash_algo)
    salt_a = "tenant-a" if use_salt else None
    salt_b = "tenant-b" if use_salt else None
    cases = [
        ("same prefix", BASE, SAME_PREFIX, salt_a, salt_a),
        ("one token changed", BASE, CHANGED_ONE, salt_a, salt_a),
        ("different salt", BASE, SAME_PREFIX, salt_a, salt_b),
    ]
    lines = []
    for label, a, b, sa, sb in cases:
        reuse = reusable(a, b, hasher, sa, sb)
        lines.append(f"{label}: ({reuse.num_blocks}, {reuse.num_tokens})")
        if explain:
            lines.extend(explain_lines(a, b, reuse, block_size))
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=int, default=4, help="tokens per block (default 4)")
    parser.add_argument(
        "--no-salt", action="store_true", help="leave the salt out of the key (Variation 2)"
    )
    parser.add_argument("--hash-algo", default="sha256", choices=sorted(HASH_ALGOS))
    parser.add_argument(
        "--explain", action="store_true", help="per block: span, digest prefixes, first miss"
    )


def run(args: argparse.Namespace) -> int:
    from prefixcache.cli import CliError

    if args.block_size < 1:
        raise CliError(f"--block-size must be >= 1, got {args.block_size}")
    for line in run_lab(args.block_size, not args.no_salt, args.hash_algo, args.explain):
        print(line)
    return 0
