"""`prefixcache top --url URL`: the dashboard's numbers in a terminal, refreshed live (like htop).

Reads the server's ``GET /dashboard/data`` (the same document the browser page polls, behind the
same admin or metrics key) every ``--interval`` seconds and draws it with rich: the KV pool's
occupancy, hit ratio in tokens (overall and over the last interval), prefill tokens saved,
evictions and preemptions per second, queue and batch, per-domain hit ratio, TTFT and diagnosed
misses by reason (counts, never text), the most
shared prefixes (digests) and the last admissions' first-miss reasons. Works over SSH; ``--once``
prints one frame and exits (for scripts and logs). Ctrl-C quits.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING, Any

from prefixcache.errors import CliError

if TYPE_CHECKING:  # rich is the `top` extra's, imported where a frame is drawn
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text
    from rich.tree import Tree

__all__ = ["add_arguments", "render", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--api-key", default=None,
                        help="an admin or metrics key (default: $PREFIXCACHE_API_KEY)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--count", type=int, default=None, metavar="N",
                        help="stop after N refreshes")


def _fetch(client: Any, url: str) -> dict[str, Any]:
    import httpx

    try:
        reply = client.get(url.rstrip("/") + "/dashboard/data")
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach {url}: {exc.__class__.__name__}: {exc}") from None
    if reply.status_code in (401, 403):
        raise CliError(f"{url} refused the key ({reply.status_code}): give an admin or metrics "
                       "key with --api-key or $PREFIXCACHE_API_KEY")
    if reply.status_code == 404:
        raise CliError(f"{url} serves no dashboard (started with --no-dashboard, or not "
                       "prefixcache)")
    if reply.status_code != 200:
        raise CliError(f"{url}/dashboard/data answered {reply.status_code}")
    try:
        data: dict[str, Any] = reply.json()
    except ValueError:
        raise CliError(f"{url}/dashboard/data is not JSON") from None
    return data


def _rate(now: dict[str, Any], before: dict[str, Any] | None, key: str) -> float | None:
    if before is None or now["time"] <= before["time"]:
        return None
    delta = float(now["counters"][key] - before["counters"][key])
    return max(delta, 0.0) / float(now["time"] - before["time"])


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def render(data: dict[str, Any], before: dict[str, Any] | None = None) -> Group:
    """One frame (a rich renderable) for ``data``; ``before``: the previous sample, for rates."""
    from rich.console import Group

    parts: list[Table | Tree] = [
        _header(data), _summary(data, before), _domains(data), _shared_prefixes(data),
        _recent(data),
    ]  # fmt: skip
    if data.get("tiers"):
        parts.append(_tiers(data))
    return Group(*parts)


def _header(data: dict[str, Any]) -> Table:
    from rich.table import Table
    from rich.text import Text

    head = Table.grid(padding=(0, 2))
    head.add_row(Text(f"prefixcache · {data['model']} · step {data['step']:,}", style="bold"),
                 time.strftime("%H:%M:%S", time.localtime(data["time"])))
    return head


def _summary(data: dict[str, Any], before: dict[str, Any] | None) -> Table:
    """The KV pool's occupancy, hit ratio, prefill saved, churn and requests."""
    from rich.table import Table

    pool, counters, requests = data["pool"], data["counters"], data["requests"]
    queries, hits = counters["prefix_cache_queries"], counters["prefix_cache_hits"]
    interval = None
    if before is not None:
        dq = queries - before["counters"]["prefix_cache_queries"]
        interval = (hits - before["counters"]["prefix_cache_hits"]) / dq if dq > 0 else None
    summary = Table(show_header=False, box=None, padding=(0, 1))
    summary.add_row("KV pool", _pool_bar(pool), f"{pool['used']:,} used · {pool['cached_free']:,} "
                    f"cached free · {pool['free']:,} free · {pool['pinned']:,} pinned / "
                    f"{pool['blocks']:,}")
    summary.add_row("hit ratio", f"{hits / queries:.1%}" if queries else "-",
                    f"last interval {interval:.1%}" if interval is not None else "")
    summary.add_row("prefill saved", f"{_num(_rate(data, before, 'prefix_cache_hits'))} tok/s",
                    f"{hits:,} tokens so far")
    summary.add_row("churn", f"{_num(_rate(data, before, 'evictions'), 1)} evictions/s",
                    f"{_num(_rate(data, before, 'preemptions'), 1)} preemptions/s")
    summary.add_row("requests", f"{requests['running']} running",
                    f"{requests['waiting']} waiting · {requests['queued_http']} queued · "
                    f"{counters['requests_finished']:,.0f} finished")
    return summary


def _pool_bar(pool: dict[str, int], width: int = 40) -> Text:
    """Used, cached free and free blocks as one bar of ``width`` characters."""
    from rich.text import Text

    bar = Text()
    for key, style in (("used", "blue"), ("cached_free", "yellow"), ("free", "grey50")):
        bar.append("█" * round(width * pool[key] / max(pool["blocks"], 1)), style=style)
    return bar


def _domains(data: dict[str, Any]) -> Table:
    from rich.table import Table

    domains = Table(title="isolation domains", title_justify="left", expand=False)
    for column in ("domain", "hit ratio", "queried", "TTFT p50", "TTFT p99", "requests",
                   "misses by reason"):
        domains.add_column(column)
    for d in data["domains"]:
        domains.add_row(d["domain"] or "(single tenant)", f"{d['hit_ratio']:.1%}",
                        f"{d['queried_tokens']:,}", _secs(d["ttft_p50_s"]),
                        _secs(d["ttft_p99_s"]), str(d["requests"]),
                        _reasons(d.get("miss_reasons", {})))
    return domains


def _reasons(counts: dict[str, int]) -> str:
    """Diagnosed misses by reason, most first (``none``: diagnosed hits, left out)."""
    misses = sorted(((n, r) for r, n in counts.items() if r != "none" and n), reverse=True)
    return " ".join(f"{r} {n}" for n, r in misses) or "-"


def _shared_prefixes(data: dict[str, Any]) -> Tree:
    """The most shared prefixes: 4 roots, 6 children a node."""
    from rich.tree import Tree

    tree = Tree("shared prefixes (digest · blocks · requests · live)")

    def add(node: Tree, segment: dict[str, Any]) -> None:
        child = node.add(f"{segment['digest']} · blocks {segment['start_block']}+"
                         f"{segment['blocks']} · {segment['requests']} req · {segment['live']} "
                         f"live · {segment['domain'] or '-'}")
        for sub in segment["children"][:6]:
            add(child, sub)

    for root in data["tree"][:4]:
        add(tree, root)
    return tree


def _recent(data: dict[str, Any]) -> Table:
    from rich.table import Table

    recent = Table(title="last admissions", title_justify="left")
    for column in ("time", "domain", "prompt", "cached", "first miss", "reason"):
        recent.add_column(column)
    for a in data["recent"][:10]:
        recent.add_row(time.strftime("%H:%M:%S", time.localtime(a["t"])), a["domain"] or "-",
                       f"{a['prompt_tokens']:,}", f"{a['cached_tokens']:,}",
                       f"block {a['first_miss_block']}", a["reason"])
    return recent


def _tiers(data: dict[str, Any]) -> Table:
    from rich.table import Table

    tiers = Table(title="lower tiers", title_justify="left")
    for column in ("tier", "up", "blocks held", "hits", "misses", "written", "evicted"):
        tiers.add_column(column)
    for name, t in data["tiers"].items():
        held = t.get("blocks_held")
        tiers.add_row(name, "yes" if t["up"] else "no", "-" if held is None else f"{held:,}",
                      f"{t['hits']:,}", f"{t['misses']:,}", f"{t['blocks_written']:,}",
                      f"{t['evicted'] or 0:,}")
    return tiers


def run(args: argparse.Namespace) -> int:
    try:
        import httpx
        from rich.console import Console
        from rich.live import Live
    except ImportError as exc:
        raise CliError(f"prefixcache top needs {exc.name}: pip install "
                       "'prefixcache[top]'") from None
    if args.interval <= 0:
        raise CliError("--interval must be > 0")
    if args.count is not None and args.count < 1:
        raise CliError("--count must be >= 1")
    key = args.api_key or os.environ.get("PREFIXCACHE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    console = Console()
    with httpx.Client(headers=headers, timeout=10.0) as client:
        data = _fetch(client, args.url)
        if args.once:
            console.print(render(data))
            return 0
        before = None
        shown = 1
        try:
            with Live(render(data), console=console, screen=console.is_terminal,
                      auto_refresh=False) as live:
                while args.count is None or shown < args.count:
                    time.sleep(args.interval)
                    before, data = data, _fetch(client, args.url)
                    live.update(render(data, before), refresh=True)
                    shown += 1
        except KeyboardInterrupt:
            pass
    return 0
