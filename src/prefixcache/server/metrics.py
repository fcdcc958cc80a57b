"""Prometheus metrics of the server, on a private registry, names under ``prefixcache:``.

Names mirror vLLM's. Pool and cache figures come from an `EngineSnapshot` the engine thread takes
after each step (counters advance by the snapshot's delta); per-request figures (TTFT, end-to-end
latency, token counts) come from the serving layer. Histograms are labelled by isolation domain
(an operator-configured tenant class) and, for TTFT, by whether the prompt hit the cache — never
by prompt text, token ids or client-supplied strings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from prefixcache.cache import PUBLIC_DOMAIN
from prefixcache.engine.outputs import EngineSnapshot, RequestOutput
from prefixcache.server.protocol import JSONObject
from prefixcache.server.vllm_metrics import VllmMetrics
from prefixcache.sim.record import tenant_label

__all__ = ["CONTENT_TYPE", "DOMAIN_LABELS", "EngineSnapshot", "ServerMetrics"]

DOMAIN_LABELS = ("name", "digest", "off")  # how the `domain` label shows an isolation domain

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "prefixcache:"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 240.0)


class ServerMetrics:
    """Every metric of the server; ``render()`` is the /metrics body."""

    def __init__(self, model_name: str, block_bytes: int, domain_labels: str = "name",
                 vllm_max_model_len: int | None = None,
                 cache_config: dict[str, str] | None = None) -> None:
        """``vllm_max_model_len``: also export vLLM's names (`VllmMetrics`), token histograms up
        to that length; None: ours only. ``cache_config``: the KV cache's settings, the labels
        of ``cache_config_info`` (as vLLM's: ``cache_dtype``, ``block_size``, ...)."""
        if domain_labels not in DOMAIN_LABELS:
            raise ValueError(f"domain labels must be one of {DOMAIN_LABELS}, got {domain_labels!r}")
        self.domain_labels = domain_labels
        self.registry = CollectorRegistry(auto_describe=True)
        self.block_bytes = block_bytes
        self._lock = threading.Lock()
        self._last = EngineSnapshot()
        self._make_engine_metrics()
        self._make_request_metrics()
        info = Gauge(PREFIX + "model_info", "Served model (value 1).", ["model_name"],
                     registry=self.registry)
        info.labels(model_name=model_name).set(1)
        if cache_config:
            config = Gauge(PREFIX + "cache_config_info", "The KV cache's settings (value 1).",
                           sorted(cache_config), registry=self.registry)
            config.labels(**cache_config).set(1)
        self.vllm: VllmMetrics | None = None
        if vllm_max_model_len is not None:
            self.vllm = VllmMetrics(self.registry, model_name, vllm_max_model_len)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, registry=self.registry)

    def _make_engine_metrics(self) -> None:
        self.queries = self._counter("prefix_cache_queries", "Prompt tokens looked up in the "
                                     "prefix cache.")
        self.hits = self._counter("prefix_cache_hits", "Prompt tokens served from the cache.")
        self.evictions = self._counter("cache_evictions", "Cached blocks evicted for reuse.")
        self.preemptions = self._counter("num_preemptions", "Requests preempted for KV space.")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.running = self._gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.free_min = self._gauge("kv_free_blocks_min", "Low watermark of free KV blocks.")
        self.free_now = self._gauge("kv_free_blocks", "Free KV blocks now.")
        self.cached_now = self._gauge("kv_cached_blocks", "KV blocks holding a hittable cached "
                                      "prefix now (held or free).")
        self.dup_bytes = self._gauge(
            "duplicate_block_bytes",
            "KV bytes computed for blocks whose digest was already cached (cumulative).",
        )

    def _make_request_metrics(self) -> None:
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens.")
        self.requests = self._counter("request_success", "Finished requests by finish reason.",
                                      ("finished_reason",))
        self.domain_hits = self._counter(
            "prefix_cache_domain_hits", "Prompt tokens served from the cache, by the domain of "
            "the blocks: public (a declared public prefix's) or the caller's own.", ("domain",))
        self.miss_reasons = self._counter(
            "prefix_cache_miss_reasons", "Diagnosed requests by why the cache missed them "
            "(none: it did not; not_found: the earlier request is unknown), per domain.",
            ("domain", "reason"))
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token, server side.",
            ["domain", "cache"], buckets=_TTFT_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to last token.",
            ["domain"], buckets=_E2E_BUCKETS, registry=self.registry,
        )

    def update(self, snap: EngineSnapshot) -> None:
        """Apply an engine snapshot: counters advance by its delta, gauges take its levels."""
        with self._lock:
            last, self._last = self._last, snap
        if self.vllm is not None:
            self.vllm.update(snap, last)
        deltas = {f.name: getattr(snap, f.name) - getattr(last, f.name) for f in fields(snap)}
        for counter, name in ((self.queries, "queried_tokens"), (self.hits, "hit_tokens"),
                              (self.evictions, "evictions"), (self.preemptions, "preemptions")):
            if deltas[name] > 0:
                counter.inc(deltas[name])
        self.kv_usage.set(snap.kv_cache_usage)
        self.running.set(snap.num_running)
        self.waiting.set(snap.num_waiting)
        self.free_min.set(snap.min_free_blocks)
        self.free_now.set(snap.num_free_blocks)
        self.cached_now.set(snap.num_cached_blocks)
        self.dup_bytes.set(snap.duplicate_blocks * self.block_bytes)

    def domain_label(self, domain: str) -> str:
        """The ``domain`` label value: the name, a stable digest of it, or one value for all."""
        if self.domain_labels == "name":
            return domain
        if self.domain_labels == "digest":
            return tenant_label(domain)
        return "all"

    def observe_first_token(self, domain: str, seconds: float, num_cached: int) -> None:
        cache = "hit" if num_cached > 0 else "miss"
        self.ttft.labels(domain=self.domain_label(domain), cache=cache).observe(seconds)
        if self.vllm is not None:
            self.vllm.first_token(seconds)

    def observe_tokens(self, seconds: float, num_tokens: int) -> None:
        """``num_tokens`` more output tokens, ``seconds`` after a request's previous ones."""
        if self.vllm is not None and num_tokens > 0:
            self.vllm.token_gap(seconds, num_tokens)

    def observe_choice(self, output: RequestOutput, max_tokens: int | None) -> None:
        """A choice finished (its last `RequestOutput`)."""
        if self.vllm is not None:
            self.vllm.finished(output, max_tokens)

    def observe_finished(
        self, domain: str, seconds: float, reason: str | None
    ) -> None:
        self.e2e.labels(domain=self.domain_label(domain)).observe(seconds)
        self.requests.labels(finished_reason=reason or "unknown").inc()

    def count_tokens(self, num_prompt: int, num_generated: int, num_cached: int) -> None:
        """A request's tokens, when its job ends."""
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_generated)
        if self.vllm is not None:
            self.vllm.tokens(num_prompt, num_generated, num_cached)

    def count_hits(self, domain: str, num_own: int, num_public: int) -> None:
        """A request of isolation ``domain`` read ``num_own`` cached tokens of its own and
        ``num_public`` of public blocks."""
        if num_own:
            self.domain_hits.labels(domain=self.domain_label(domain)).inc(num_own)
        if num_public:
            self.domain_hits.labels(domain=PUBLIC_DOMAIN).inc(num_public)

    def counter_values(self) -> dict[str, float]:
        """Our request counters now, as ``/metrics`` shows them (for the dashboard)."""
        return {"prompt_tokens": _total(self.prompt_tokens),
                "generation_tokens": _total(self.generation_tokens),
                "requests_finished": _total(self.requests)}

    def count_miss_reason(self, domain: str, reason: str) -> None:
        """One diagnosed request of isolation ``domain`` missed for ``reason``."""
        self.miss_reasons.labels(domain=self.domain_label(domain), reason=reason).inc()

    def miss_reasons_by_domain(self) -> dict[str, dict[str, int]]:
        """Diagnosed requests per domain label and reason, as ``/metrics`` counts them."""
        out: dict[str, dict[str, int]] = {}
        for metric in self.miss_reasons.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    by_reason = out.setdefault(sample.labels["domain"], {})
                    by_reason[sample.labels["reason"]] = int(sample.value)
        return out

    def ttft_quantiles(self, label: str) -> tuple[float | None, float | None, int]:
        """p50 and p99 time to first token of the domain labelled ``label`` (hits and misses),
        estimated from the histogram's buckets as Prometheus' ``histogram_quantile`` does, and
        the number of requests."""
        buckets: dict[float, float] = {}
        for metric in self.ttft.collect():
            for sample in metric.samples:
                if sample.name.endswith("_bucket") and sample.labels.get("domain") == label:
                    le = float(sample.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + sample.value
        bounds = sorted(buckets)
        total = buckets[bounds[-1]] if bounds else 0.0
        if not total:
            return None, None, 0
        return (_quantile(0.5, bounds, buckets, total), _quantile(0.99, bounds, buckets, total),
                int(total))

    def add_tiers(self, read: Callable[[], JSONObject | None]) -> None:
        """Export the lower KV tiers' counters, read at each scrape through ``read``."""
        self.registry.register(_TierCollector(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _total(counter: Counter) -> float:
    """A counter's value summed over its labels, as a scrape reads it."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def _quantile(q: float, bounds: list[float], cumulative: dict[float, float],
              total: float) -> float:
    """Linear interpolation inside the bucket holding rank ``q * total``."""
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below
                                              else 0.0)
        lower, below = bound, count
    return lower


# tier counter -> (metric name, help); labelled by tier (disk, valkey)
_TIER_COUNTERS = {
    "hits": ("kv_tier_hits", "Blocks a lower KV tier returned intact."),
    "misses": ("kv_tier_misses", "Block runs a lower KV tier ended before their last block."),
    "bytes_read": ("kv_tier_read_bytes", "Bytes read from a lower KV tier."),
    "bytes_written": ("kv_tier_written_bytes", "Bytes written to a lower KV tier."),
    "blocks_written": ("kv_tier_written_blocks", "Blocks written to a lower KV tier."),
    "write_errors": ("kv_tier_write_errors", "Writes a lower KV tier refused (full, read-only, "
                     "unreachable)."),
    "read_errors": ("kv_tier_read_errors", "Reads a lower KV tier failed."),
    "dropped": ("kv_tier_dropped_blocks", "Blocks not written: the tier was backing off."),
    "quarantined": ("kv_tier_quarantined", "Entries that failed their checks (never served)."),
    "evicted": ("kv_tier_evicted_blocks", "Blocks a lower KV tier removed for capacity."),
}


class _TierCollector(Collector):
    """The tiers' counters at scrape time (they live in `TierStats`, not in this registry)."""

    def __init__(self, read: Callable[[], JSONObject | None]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        stats = self.read()
        if stats is None:
            return
        tiers: dict[str, JSONObject] = stats["tiers"]
        for key, (name, doc) in _TIER_COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=["tier"])
            for tier, values in tiers.items():
                family.add_metric([tier], values[key])
            yield family
        latency = SummaryMetricFamily(PREFIX + "kv_tier_read_seconds",
                                      "Time of a batched read from a lower KV tier.",
                                      labels=["tier"])
        up = GaugeMetricFamily(PREFIX + "kv_tier_up", "1 while a lower KV tier answers.",
                               labels=["tier"])
        for tier, values in tiers.items():
            latency.add_metric([tier], values["reads"], values["read_seconds"])
            up.add_metric([tier], 1.0 if values["up"] else 0.0)
        yield latency
        yield up
        engine = stats["engine"]
        loaded = CounterMetricFamily(PREFIX + "kv_tier_loaded_blocks",
                                     "Blocks adopted into the KV pool from a lower tier.",
                                     labels=["tier"])
        for tier in tiers:
            loaded.add_metric([tier], engine["blocks_loaded_by_tier"].get(tier, 0))
        yield loaded
        yield GaugeMetricFamily(PREFIX + "kv_offload_queue_blocks",
                                "Blocks queued for the lower tiers' writer.",
                                value=engine["pending_writes"])
        yield CounterMetricFamily(PREFIX + "kv_offload_dropped_blocks",
                                  "Blocks not queued for the tiers: the write queue was full.",
                                  value=engine["blocks_dropped"])
        yield GaugeMetricFamily(PREFIX + "kv_offload_loading_requests",
                                "Requests waiting for their blocks from a lower tier.",
                                value=engine["loading"])
