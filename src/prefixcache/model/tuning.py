"""Tuned sizes of the model's CPU paths, each with what it trades and the shapes it was set on.
Read at call time (``tuning.X``), so a test or an experiment can change one for a run."""

from __future__ import annotations

__all__ = ["MLP_CHUNK_ROWS"]

# The MLP runs at most this many tokens at a time. Chunking keeps the [rows, 2 * intermediate]
# activation cache-sized during long prefills, at the cost of one more GEMM call per chunk.
# Set on `small` (intermediate 2,816) with 2 threads; on narrower MLPs (SmolLM2: 1,536) any
# value from 256 up ties. Figures: docs/performance.md.
MLP_CHUNK_ROWS = 512
