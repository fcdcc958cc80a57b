"""Batch invariance: whether the kernels must give a row of a step the same bits whatever else
the step holds (its batch, its chunk, where its cached part ends).

The compiled attention kernel is invariant whatever this says: a row's keys are reduced in
fixed segments, in the same order in a prefill and a decode step (docs/model.md, "Batch
invariance"). On (the default), the projections also multiply through GEMMs whose per-row sums
run in one order for any row count (the panel GEMM, where it is vector code). With
``PREFIXCACHE_BATCH_INVARIANT=0`` or ``set_enabled(False)`` they take whichever GEMM a start-up
timing finds fastest (oneDNN's and MKL's pick kernels by the row count), for side-by-side
measurements of what the rule costs.
"""

from __future__ import annotations

from prefixcache.native import Switch

__all__ = ["disabled_by_env", "enabled", "set_enabled"]

_switch = Switch("PREFIXCACHE_BATCH_INVARIANT", lambda: True)
set_enabled = _switch.set_enabled


def disabled_by_env() -> bool:
    return _switch.disabled_by_env()


def enabled() -> bool:
    """Whether steps are batch invariant now: not turned off by the environment or a caller."""
    return _switch.on and not _switch.disabled_by_env()
