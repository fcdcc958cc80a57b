"""Token ids for trace requests, derived deterministically from hash ids.

Block ``h`` of a trace becomes the tokens ``range(h * bs, h * bs + bs)``, so equal hash ids give
equal blocks and the real cache's chained digests reproduce the trace's prefix sharing. Hash ids
too large for that (arbitrary 32-bit ids at any block size) are first renumbered densely, in order
of first appearance: the same equalities, so the same sharing. Tokens a
trace does not name (a partial tail, blocks past the listed ids, generated output) come from a
counter above every hash-derived id: they are unique, so they are never hittable by another
request. This module knows nothing about caches.
"""

from __future__ import annotations

from prefixcache.sim.trace import Trace, TraceRequest

MAX_TOKEN_ID = 2**32 - 1


class TokenSource:
    """Builds prompt token lists and hands out unique filler tokens for one trace."""

    __slots__ = ("block_size", "_next_unique", "_dense")

    def __init__(self, trace: Trace) -> None:
        self.block_size = trace.block_size
        self._dense: dict[int, int] | None = None  # hash id -> dense id, when renumbered
        self._next_unique = (trace.max_hash_id + 1) * trace.block_size
        if self._next_unique > MAX_TOKEN_ID:
            dense: dict[int, int] = {}
            for request in trace.requests:
                for h in request.hash_ids:
                    dense.setdefault(h, len(dense))
            self._dense = dense
            self._next_unique = len(dense) * trace.block_size
            if self._next_unique > MAX_TOKEN_ID:
                raise ValueError(
                    f"trace {trace.name}: {len(dense):,} distinct hash ids at block size "
                    f"{trace.block_size} do not fit 32-bit token ids"
                )

    def unique(self, n: int) -> range:
        """``n`` tokens never used before (by this source)."""
        start = self._next_unique
        self._next_unique = start + n
        if self._next_unique > MAX_TOKEN_ID:
            raise OverflowError("ran out of 32-bit token ids for unique trace tokens")
        return range(start, start + n)

    def prompt(self, request: TraceRequest) -> list[int]:
        """The request's prompt: one run of tokens per complete block, then unique filler."""
        bs = self.block_size
        num_full = request.num_full_blocks(bs)
        token_ids: list[int] = []
        extend = token_ids.extend
        dense = self._dense
        for h in request.hash_ids[:num_full]:
            if dense is not None:
                h = dense[h]
            extend(range(h * bs, h * bs + bs))
        extend(self.unique(request.input_length - num_full * bs))
        return token_ids
