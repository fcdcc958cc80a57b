"""Sizes of the model's CPU paths that follow from the machine, each with its rule. Read at call
time (``tuning.X``), so a test or an experiment can set one for a run."""

from __future__ import annotations

from prefixcache.native import machine

__all__ = ["MLP_CHUNK_ROWS", "mlp_chunk_rows"]

# Set to a row count to override `mlp_chunk_rows` (tests, experiments); None: derived.
MLP_CHUNK_ROWS: int | None = None
_CHUNK_RANGE = (64, 2048)


def mlp_chunk_rows(intermediate_size: int, element_size: int = 4) -> int:
    """Tokens the MLP takes at a time: chunking keeps the [rows, 2 x intermediate] activation
    that the gate/up GEMM writes and the SiLU and down GEMM read in the L3 cache, at the cost of
    streaming the weights once more per chunk. Rule: the largest power of two of rows (64 to
    2,048) whose activation takes at most half the L3 the system reports, e.g. 512 for
    intermediate 2,816 and 1,024 for 1,536 with 32 MiB (figures: docs/performance.md)."""
    if MLP_CHUNK_ROWS is not None:
        return MLP_CHUNK_ROWS
    budget = machine.caches().l3 // 2
    row_bytes = 2 * intermediate_size * element_size
    low, high = _CHUNK_RANGE
    rows = low
    while rows < high and 2 * rows * row_bytes <= budget:
        rows *= 2
    return rows
