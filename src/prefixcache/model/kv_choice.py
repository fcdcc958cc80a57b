"""``--kv-cache-dtype``: which layout the paged KV cache keeps, and what ``auto`` picks.

A name (``float32``, ``bfloat16``, ``int8``, ``int4``, ``fp8``/``fp8_e4m3``, ``fp8_e5m2``) is
that layout (`prefixcache.attention.kv_format`). ``auto`` keeps the activations' dtype, as
vLLM's ``auto`` does, except where the precision itself is measured (``--dtype auto``): there
the smaller layouts are checked, smallest first, against the same gate as ``--dtype auto``'s
(`precision.within_bounds`: mean KL divergence of the next-token distributions at most 0.01
nats from float32's over `precision.FIDELITY_TEXT`, float32's top token at 90% of the positions
or more, both through the model's own weights in the chosen precision), and the first that
passes is kept. The measurement is made once per model, precision, layout, CPU and kernel build
and kept beside `--dtype auto`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixcache.attention.kv_format import KVFormat, format_of_dtype, kv_format
from prefixcache.model import precision

__all__ = ["AUTO_CANDIDATES", "KVChoice", "choose", "measured", "resolve"]

# what ``auto`` may pick below the activations' dtype, smallest first
AUTO_CANDIDATES = ("int4", "int8")


@dataclass(slots=True)
class KVChoice:
    """What was measured of the KV layouts: each checked layout's fidelity
    (`precision.fidelity_of`, with ``eligible``: within the gate), and the layout kept;
    ``auto``: ``auto`` chose it (else it was asked for by name)."""

    layout: str
    fidelity: dict[str, dict[str, Any]] = field(default_factory=dict)
    reason: str = ""
    auto: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {"chosen": self.layout, "reason": self.reason,
                "fidelity": {k: dict(v) for k, v in self.fidelity.items()}}  # fmt: skip


def resolve(name: str, dtype: torch.dtype) -> KVFormat:
    """The layout ``name`` (not ``auto``) for activations of ``dtype``, or a clear
    `ValueError`: a float layout other than the activations' is float32 activations over a
    bfloat16 cache only (the kernel widens its rows)."""
    found = kv_format(name)
    own = format_of_dtype(dtype)
    if found.quantized or found == own:
        return found
    if own.name == "float32" and found.name == "bfloat16":
        return found
    raise ValueError(f"--kv-cache-dtype {name} with --dtype {own.name}: a model keeps its KV in "
                     f"its own dtype, bfloat16 under float32, or a quantized layout "
                     f"(int8, int4, fp8)")  # fmt: skip


def measured(name: str, fidelity: Callable[[KVFormat], dict[str, Any]]) -> KVChoice:
    """A layout asked for by name, with its fidelity measured (for `/v1/models`)."""
    figures = dict(fidelity(kv_format(name)))
    figures["eligible"] = precision.within_bounds(figures)
    return KVChoice(name, {name: figures}, f"{name}: asked for", auto=False)


def choose(
    dtype: torch.dtype, head_dim: int, fidelity: Callable[[KVFormat], dict[str, Any]]
) -> KVChoice:
    """``auto`` under a measured precision: the smallest of `AUTO_CANDIDATES` the model's
    head_dim can take whose ``fidelity`` (`precision.fidelity_of` against float32 with
    float32 KV) passes the gate, else the activations' own layout."""
    choice = KVChoice(format_of_dtype(dtype).name)
    for name in AUTO_CANDIDATES:
        candidate = kv_format(name)
        try:
            candidate.check_head_dim(head_dim)
        except ValueError as exc:
            choice.fidelity[name] = {"eligible": False, "why": str(exc)}
            continue
        figures = dict(fidelity(candidate))
        figures["eligible"] = precision.within_bounds(figures)
        choice.fidelity[name] = figures
        if figures["eligible"]:
            choice.layout = name
            choice.reason = (f"{name}: the smallest KV layout within the fidelity gate "
                             f"(mean KL {figures['mean_kl']:.4f}, top-1 "
                             f"{100 * figures['top1_agreement']:.1f}%)")  # fmt: skip
            return choice
    choice.reason = f"{choice.layout}: no smaller KV layout passed the fidelity gate"
    return choice
