"""Public prefixes: the token runs an operator declares shareable across tenants, and the exact
rule for how many of a prompt's leading blocks are public.

A prompt's public blocks are the whole blocks it shares token for token with one declared prefix
its caller may use: ``min(common tokens, len(prefix)) // block_size`` for the declared prefix that
gives the most. A prompt that diverges inside a declared prefix keeps the whole blocks before the
divergence public and nothing after it; the partial block at the end of a declared prefix is the
caller's own. The cache gives those blocks the public namespace (`Sequence.public_blocks`); which
prefixes a caller may use is the server's business (its tenants file), not this module's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from collections.abc import Sequence as SequenceABC

__all__ = ["PublicPrefixes", "num_common_tokens"]


def num_common_tokens(token_ids: SequenceABC[int], prefix: SequenceABC[int]) -> int:
    """How many leading tokens ``token_ids`` and ``prefix`` share."""
    limit = min(len(token_ids), len(prefix))
    if list(token_ids[:limit]) == list(prefix[:limit]):
        return limit
    lo, hi = 0, limit  # the first mismatch lies in [lo, hi): bisect on equal slices
    while hi - lo > 64:
        mid = (lo + hi) // 2
        if list(token_ids[lo:mid]) == list(prefix[lo:mid]):
            lo = mid
        else:
            hi = mid
    while lo < hi and token_ids[lo] == prefix[lo]:
        lo += 1
    return lo


class PublicPrefixes:
    """The declared public prefixes by name, as token ids."""

    def __init__(self, prefixes: Mapping[str, SequenceABC[int]]) -> None:
        self._prefixes = {name: list(ids) for name, ids in prefixes.items()}

    def __len__(self) -> int:
        return len(self._prefixes)

    @property
    def names(self) -> list[str]:
        return list(self._prefixes)

    def token_ids(self, name: str) -> list[int]:
        """The declared prefix ``name``'s token ids (a copy)."""
        return list(self._prefixes[name])

    def num_public_blocks(
        self, token_ids: SequenceABC[int], names: Collection[str], block_size: int
    ) -> int:
        """How many leading blocks of ``token_ids`` are public for a caller who may use the
        prefixes ``names`` (unknown names count for nothing)."""
        best = 0
        for name in names:
            prefix = self._prefixes.get(name)
            if prefix is None or len(prefix) < block_size:
                continue
            best = max(best, num_common_tokens(token_ids, prefix) // block_size)
        return best
