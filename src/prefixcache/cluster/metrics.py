"""One /metrics page for the cluster: every replica's series labelled ``replica``, plus the sum
over replicas (``replica="all"``) of each counter, histogram and gauge (a ratio gauge takes the
mean, ``model_info`` one value), parsed and re-rendered with ``prometheus_client``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["belief_beside_truth", "merge_replica_metrics", "router_belief"]


def merge_replica_metrics(pages: dict[str, str]) -> bytes:
    """``pages``: replica name -> its /metrics text. Returns the merged exposition."""
    families: dict[str, Metric] = {}
    totals: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}
    for replica, text in sorted(pages.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
                totals[family.name] = {}
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": replica},
                                  sample.value)
                key = (sample.name, tuple(sorted(sample.labels.items())))
                totals[family.name].setdefault(key, []).append(sample.value)
    for name, merged in families.items():
        for (sample_name, labels), values in totals[name].items():
            merged.add_sample(sample_name, {**dict(labels), "replica": "all"},
                              _combine(name, merged.type, values))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


def _combine(name: str, kind: str, values: list[float]) -> float:
    if name.endswith("model_info"):
        return max(values)
    if kind == "gauge" and name.endswith("_perc"):
        return sum(values) / len(values)
    return sum(values)


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def router_belief(replicas: dict[str, dict[str, object]]) -> bytes:
    """``prefixcache:router_mirror_blocks{replica}``: the blocks the cache-aware router believes
    each replica holds (its mirror of the replica's KV events), to plot beside the replica's own
    ``prefixcache:kv_cached_blocks``; nothing for a router without mirrors."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily("prefixcache:router_mirror_blocks",
                               "KV blocks the router believes a replica holds (from its events).",
                               labels=["replica"])
    found = False
    for name, info in sorted(replicas.items()):
        blocks = info.get("mirror_blocks")
        if isinstance(blocks, int):
            family.add_metric([name], blocks)
            found = True
    if not found:
        return b""
    registry = CollectorRegistry()

    class _One:
        def collect(self) -> Iterator[Metric]:
            yield family

    registry.register(_One())
    return generate_latest(registry)


def belief_beside_truth(
    believed: dict[str, int] | None, doc: dict[str, Any] | None
) -> dict[str, dict[str, int | None]]:
    """Per medium (``POOL``, ``DISK``, ``VALKEY``): the blocks the router believes a replica holds
    (``believed``, its `CacheAware.held_blocks`), the blocks the replica says it holds (``doc``,
    its dashboard document: the pool's cached blocks, each tier's ``blocks_held``, None where
    the tier cannot count them, as Valkey), and ``drift``, belief minus truth where both are
    known."""
    truth: dict[str, int | None] = {}
    if doc is not None:
        truth["POOL"] = doc["pool"]["cached"]
        for name, tier in (doc.get("tiers") or {}).items():
            truth[str(name).upper()] = tier.get("blocks_held")
    out: dict[str, dict[str, int | None]] = {}
    for medium in sorted({*(believed or {}), *truth}, key=lambda m: (m != "POOL", m)):
        believes, holds = (believed or {}).get(medium), truth.get(medium)
        drift = believes - holds if believes is not None and holds is not None else None
        out[medium] = {"believes": believes, "holds": holds, "drift": drift}
    return out
