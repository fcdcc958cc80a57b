"""The one exception trace readers and generators raise for bad input."""

from __future__ import annotations


class TraceFormatError(ValueError):
    """A trace file or workload spec that cannot be read; the message names file and line."""
