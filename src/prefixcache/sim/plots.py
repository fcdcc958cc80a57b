"""PNG plots of a sweep (matplotlib, Agg backend): hit ratio and TTFT vs capacity, and the
cluster hit ratio per router vs number of replicas. Reads results; runs nothing."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType

from prefixcache.sim.report import ReplayResult

PLOT_FILES = ("hit_ratio_vs_capacity.png", "ttft_vs_capacity.png", "cluster_hit_ratio.png")


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _capacity_key(result: ReplayResult) -> float:
    return math.inf if result.capacity_label == "inf" else float(result.capacity_blocks)


def _single_by_impl(results: list[ReplayResult]) -> dict[str, list[ReplayResult]]:
    lines: dict[str, list[ReplayResult]] = {}
    for result in results:
        if result.replicas == 1:
            lines.setdefault(f"{result.prefix_cache}/{result.eviction_policy}", []).append(result)
    for rows in lines.values():
        rows.sort(key=_capacity_key)
    return lines


def _capacity_axis(lines: dict[str, list[ReplayResult]]) -> list[str]:
    labels = {r.capacity_label: _capacity_key(r) for rows in lines.values() for r in rows}
    return sorted(labels, key=labels.__getitem__)


def plot_hit_ratio(results: list[ReplayResult], path: Path, title: str) -> Path | None:
    lines = _single_by_impl(results)
    if not lines:
        return None
    plt = _pyplot()
    axis = _capacity_axis(lines)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for name, rows in lines.items():
        ax.plot(
            [axis.index(r.capacity_label) for r in rows],
            [r.hit_ratio for r in rows],
            marker="o",
            label=name,
        )
    ideal = next(iter(lines.values()))[0].ideal_hit_ratio
    ax.axhline(ideal, linestyle="--", color="grey", label=f"ideal (unlimited) {ideal:.3f}")
    _finish(ax, axis, "token hit ratio", title)
    return _save(plt, fig, path)


def plot_ttft(results: list[ReplayResult], path: Path, title: str) -> Path | None:
    lines = _single_by_impl(results)
    if not lines or all(math.isnan(r.ttft_p50_s) for rows in lines.values() for r in rows):
        return None
    plt = _pyplot()
    axis = _capacity_axis(lines)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for name, rows in lines.items():
        xs = [axis.index(r.capacity_label) for r in rows]
        ax.plot(xs, [r.ttft_p50_s for r in rows], marker="o", label=f"{name} p50")
        ax.plot(xs, [r.ttft_p99_s for r in rows], marker="^", linestyle=":", label=f"{name} p99")
    ax.set_yscale("log")
    _finish(ax, axis, "estimated TTFT (s)", title)
    return _save(plt, fig, path)


def plot_cluster(results: list[ReplayResult], path: Path, title: str) -> Path | None:
    clustered = [r for r in results if r.replicas > 1]
    if not clustered:
        return None
    label = clustered[0].capacity_label
    singles = [
        r
        for r in results
        if r.replicas == 1
        and r.capacity_label == label
        and r.prefix_cache == clustered[0].prefix_cache
        and r.eviction_policy == "lru"
    ]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for router in sorted({r.router for r in clustered}):
        rows = singles[:1] + sorted(
            (r for r in clustered if r.router == router), key=lambda r: r.replicas
        )
        ax.plot([r.replicas for r in rows], [r.hit_ratio for r in rows], marker="o", label=router)
    ax.set_xlabel("replicas (same total capacity)")
    ax.set_ylabel("cluster token hit ratio")
    ax.set_title(f"{title}: {label} blocks in total")
    ax.set_xticks(sorted({r.replicas for r in clustered} | {1}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _finish(ax, axis: list[str], ylabel: str, title: str) -> None:  # type: ignore[no-untyped-def]
    ax.set_xticks(range(len(axis)), axis)
    ax.set_xlabel("cache capacity (blocks, per replica)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(plt, fig, path: Path) -> Path:  # type: ignore[no-untyped-def]
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def write_plots(results: list[ReplayResult], out_dir: Path, title: str) -> list[Path]:
    """Every plot the results allow; returns the files written."""
    makers = (plot_hit_ratio, plot_ttft, plot_cluster)
    written = [
        fn(results, out_dir / name, title) for fn, name in zip(makers, PLOT_FILES, strict=True)
    ]
    return [p for p in written if p is not None]
