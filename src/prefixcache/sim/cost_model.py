"""How long a scheduler step takes, from the tokens it computes: the simulator's only clock.

``step_s = overhead_s + prefill_tokens / prefill_tokens_per_s + [decode] decode_step_s
+ decode_seqs * decode_per_seq_s``. Give it as rates (``--prefill-tps``, ``--decode-tps``) or
calibrate it from a JSON file, e.g. the final JSON line of ``benchmarks/bench_model.py``; see
`CostModel.from_json` for the accepted keys. Knows nothing about caches or traces.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixcache.sim.errors import TraceFormatError
from prefixcache.tiers import TIERS


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per scheduler step. Defaults: roughly an 8B model on one modern GPU."""

    prefill_tokens_per_s: float = 20_000.0
    decode_step_s: float = 0.02  # a decode step of one sequence (1 / per-sequence tokens/s)
    decode_per_seq_s: float = 0.0001  # extra per sequence in a decode batch
    overhead_s: float = 0.002  # per step, whatever it holds
    # the lower tiers (`sim/tiers.py`): K and V bytes of one token over all layers (an 8B
    # Llama in bfloat16: 32 layers x 8 KV heads x 128 x 2 x 2 bytes), and each tier's reads
    kv_bytes_per_token: float = 131_072.0
    # per tier of `prefixcache.tiers.TIERS`: (read bytes/s, latency s); absent: the tier's own
    tier_reads: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill tokens/s must be > 0")
        if min(self.decode_step_s, self.decode_per_seq_s, self.overhead_s) < 0:
            raise ValueError("decode and overhead times must be >= 0")
        reads = [self.reads(name) for name in TIERS]
        if self.kv_bytes_per_token <= 0 or any(bw <= 0 or lat < 0 for bw, lat in reads):
            raise ValueError("tier bandwidths and KV bytes per token must be > 0, latencies >= 0")

    def reads(self, tier: str) -> tuple[float, float]:
        """Read bandwidth (bytes/s) and latency (s) of ``tier``."""
        kind = TIERS[tier]
        return self.tier_reads.get(tier, (kind.read_bytes_per_s, kind.latency_s))

    @classmethod
    def from_rates(cls, prefill_tps: float, decode_tps: float) -> CostModel:
        if decode_tps <= 0:
            raise ValueError("decode tokens/s must be > 0")
        return cls(prefill_tokens_per_s=prefill_tps, decode_step_s=1.0 / decode_tps)

    def step_seconds(self, num_prefill_tokens: int, num_decode_seqs: int) -> float:
        seconds = self.overhead_s + num_prefill_tokens / self.prefill_tokens_per_s
        if num_decode_seqs:
            seconds += self.decode_step_s + num_decode_seqs * self.decode_per_seq_s
        return seconds

    def prefill_seconds(self, num_tokens: int) -> float:
        """A lone prefill of ``num_tokens`` (one step, no batching)."""
        return self.overhead_s + num_tokens / self.prefill_tokens_per_s

    @classmethod
    def from_json(cls, path: str | Path) -> CostModel:
        """Read a calibration file: a JSON object, or text whose last JSON line is one.

        Accepted keys (optionally under ``"cost_model"``): the field names of this class,
        ``decode_tokens_per_s`` (sets ``decode_step_s``), or measurement lists
        ``"prefill": [{"tokens": n, "seconds": s}, ...]`` and
        ``"decode": [{"batch": b, "seconds": s}, ...]`` fitted by least squares.
        """
        obj = _load_object(Path(path))
        obj = obj.get("cost_model", obj) if isinstance(obj.get("cost_model"), dict) else obj
        fields: dict[str, float] = {}
        for key in ("prefill_tokens_per_s", "decode_step_s", "decode_per_seq_s", "overhead_s",
                    "kv_bytes_per_token"):
            if key in obj:
                fields[key] = _positive(obj[key], key, path)
        tier_reads = {}  # <tier>_read_bytes_per_s and <tier>_latency_s, per tier
        for name, kind in TIERS.items():
            bandwidth, latency = obj.get(f"{name}_read_bytes_per_s"), obj.get(f"{name}_latency_s")
            if bandwidth is not None or latency is not None:
                tier_reads[name] = (
                    kind.read_bytes_per_s if bandwidth is None
                    else _positive(bandwidth, f"{name}_read_bytes_per_s", path),
                    kind.latency_s if latency is None
                    else _positive(latency, f"{name}_latency_s", path))  # fmt: skip
        if "decode_tokens_per_s" in obj:
            fields["decode_step_s"] = 1.0 / _positive(obj["decode_tokens_per_s"], "decode", path)
        fields.update(_fit_prefill(obj.get("prefill"), path))
        fields.update(_fit_decode(obj.get("decode"), path))
        if not fields and not tier_reads:
            raise TraceFormatError(f"{path}: no cost-model keys found (see CostModel.from_json)")
        try:
            return cls(**fields, tier_reads=tier_reads)
        except ValueError as exc:
            raise TraceFormatError(f"{path}: {exc}") from exc


def _load_object(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(f"cannot read cost model {path}: {exc.strerror}") from exc
    for candidate in [text, *reversed(text.strip().splitlines())]:
        try:
            obj = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    raise TraceFormatError(f"{path}: no JSON object found")


def _positive(value: Any, key: str, path: str | Path) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise TraceFormatError(f"{path}: {key!r} must be a non-negative number")
    return float(value)


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns (a, b)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
    return mean_y - slope * mean_x, slope


def _points(value: Any, x_key: str, path: str | Path) -> list[tuple[float, float]]:
    try:
        points = [(float(p[x_key]), float(p["seconds"])) for p in value]
    except (TypeError, KeyError, ValueError) as exc:
        raise TraceFormatError(f"{path}: measurements need {x_key!r} and 'seconds'") from exc
    if not points:
        raise TraceFormatError(f"{path}: empty measurement list")
    return points


def _fit_prefill(value: Any, path: str | Path) -> dict[str, float]:
    if value is None:
        return {}
    points = _points(value, "tokens", path)
    if len(points) == 1:
        return {"prefill_tokens_per_s": points[0][0] / points[0][1]}
    intercept, slope = _fit_line(points)
    if slope <= 0:
        raise TraceFormatError(f"{path}: prefill time does not grow with tokens")
    return {"prefill_tokens_per_s": 1.0 / slope, "overhead_s": max(intercept, 0.0)}


def _fit_decode(value: Any, path: str | Path) -> dict[str, float]:
    if value is None:
        return {}
    points = _points(value, "batch", path)
    if len(points) == 1:
        return {"decode_step_s": points[0][1], "decode_per_seq_s": 0.0}
    intercept, slope = _fit_line(points)
    return {"decode_step_s": max(intercept, 0.0), "decode_per_seq_s": max(slope, 0.0)}
