"""Batch invariance: whether the kernels must give a row of a step the same bits whatever else
the step holds (its batch, its chunk, where its cached part ends).

On (the default), attention reads every row's keys in the order a prefill row reads them and the
projections multiply through GEMMs whose per-row sums run in one order for any row count
(docs/model.md, "Batch invariance"). ``PREFIXCACHE_BATCH_INVARIANT=0`` or ``set_enabled(False)``
lets decode steps split a shared prefix's keys between threads and the projections take whichever
library GEMM a start-up timing finds fastest, for side-by-side measurements of what the rule costs.
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
