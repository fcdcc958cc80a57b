"""Write a sweep's results: the human table, results.json and results.csv. No plotting here."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefixcache.sim.report import ReplayResult

Column = tuple[str, int, Callable[[ReplayResult], str]]  # (name, width, cell)

_COLUMNS: tuple[Column, ...] = (
    ("cache", 6, lambda r: r.prefix_cache),
    ("evict", 6, lambda r: r.eviction_policy),
    ("capacity", 8, lambda r: r.capacity_label),
    ("repl", 4, lambda r: str(r.replicas)),
    ("router", 15, lambda r: r.router),
    ("hit", 6, lambda r: f"{r.hit_ratio:.3f}"),
    ("ideal", 6, lambda r: f"{r.ideal_hit_ratio:.3f}"),
    ("tok saved", 12, lambda r: f"{r.prefill_tokens_saved:,}"),
    ("ttft p50", 9, lambda r: _seconds(r.ttft_p50_s)),
    ("ttft p99", 9, lambda r: _seconds(r.ttft_p99_s)),
    ("evictions", 10, lambda r: f"{r.num_evictions:,}"),
    ("peak", 5, lambda r: f"{r.peak_usage:.2f}"),
    ("imbal", 5, lambda r: f"{r.load_imbalance:.2f}"),
    ("rej", 4, lambda r: str(r.num_rejected)),
    ("wall s", 6, lambda r: f"{r.wall_s:.1f}"),
)
_TIER_COLUMN: Column = ("ram/disk/valkey", 17, lambda r: "/".join(
    f"{r.tier_hit_ratios.get(k, 0.0):.3f}" for k in ("ram", "disk", "valkey")))


def _seconds(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value * 1000:.0f}ms" if value < 10 else f"{value:.0f}s"


def format_table(results: list[ReplayResult]) -> str:
    """One line per configuration, right-aligned columns."""
    columns = list(_COLUMNS)
    if any(r.tier_hit_ratios for r in results):  # the hit split by source, after "hit"
        columns.insert(6, _TIER_COLUMN)
    if any(r.num_pins for r in results):
        columns.insert(6, ("pins", 6, lambda r: f"{r.num_pins:,}"))
    header = " ".join(name.rjust(width) for name, width, _ in columns)
    lines = [header, "-" * len(header)]
    for result in results:
        lines.append(" ".join(fn(result).rjust(width) for _, width, fn in columns))
    tenants = sorted({t for r in results for t in r.tenant_hit_ratios})
    if tenants:  # what one tenant's pins do to the others: the hit ratio of each, per row
        names = [t or "(none)" for t in tenants]
        width = max(6, *(len(n) for n in names))
        head = " ".join(n.rjust(w) for n, w in (("cache", 6), ("capacity", 8), ("router", 15)))
        lines += ["", "hit ratio by tenant:",
                  head + " " + " ".join(n.rjust(width) for n in names)]
        for r in results:
            row = " ".join(v.rjust(w) for v, w in ((r.prefix_cache, 6), (r.capacity_label, 8),
                                                   (r.router, 15)))
            lines.append(row + " " + " ".join(
                f"{r.tenant_hit_ratios.get(t, 0.0):.3f}".rjust(width) for t in tenants))
    return "\n".join(lines)


def write_results(
    out_dir: Path, results: list[ReplayResult], meta: dict[str, Any]
) -> tuple[Path, Path]:
    """results.json (meta + rows) and results.csv (rows) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{k: _no_nan(v) for k, v in r.as_dict().items()} for r in results]
    json_path, csv_path = out_dir / "results.json", out_dir / "results.csv"
    json_path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2, allow_nan=False))
    with csv_path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in row.items()})
    return json_path, csv_path


def _csv_value(value: object) -> object:
    return ";".join(map(str, value)) if isinstance(value, list) else value


def _no_nan(value: object) -> object:
    """NaN (no TTFT measured) becomes null: strict JSON has no NaN."""
    return None if isinstance(value, float) and math.isnan(value) else value
