"""The server's figures under vLLM's metric names, so the dashboards built for vLLM work as they
are (``serve --no-vllm-metric-names`` leaves them out).

Names, types, units and labels are vLLM's (its v1 ``PrometheusStatLogger``): every series has
``model_name`` and ``engine`` (``"0"``: one engine per server) and nothing else but vLLM's own
extra labels (``finished_reason`` on ``request_success``). Counters carry ``_total`` as
Prometheus clients write them. Fed by the same hooks as our own names (`ServerMetrics`): the
engine's snapshot after each step, the serving layer's first token, token gaps and each finished
choice's timing. No tenant, domain or request detail appears here: vLLM's names have no label
for it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from prefixcache.engine.outputs import EngineSnapshot, RequestOutput

__all__ = ["VLLM_SERIES", "VllmMetrics"]

_P = "vllm:"
_LABELS = ("model_name", "engine")
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
         7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0)
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_STEP_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _token_buckets(max_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_len`` (vLLM's request-token buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return out
            out.append(float(m * scale))
        scale *= 10


# every vLLM series we export, as a scrape shows it (what the dashboard test checks against)
VLLM_SERIES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:prompt_tokens_cached_total", "vllm:request_success_total",
    "vllm:iteration_tokens_total", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
    "vllm:request_prefill_kv_computed_tokens",
)  # fmt: skip


class VllmMetrics:
    """vLLM's series on ``registry`` for ``model_name``, registered in vLLM's order: the
    scheduler's state, the token counters, then the latency and per-request histograms."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.values = (model_name, "0")
        self._registry = registry
        self._add_scheduler_series()
        self._add_token_counters()
        self._add_latency_histograms()
        self._add_request_histograms(_token_buckets(max_model_len))
        for family in (self.running, self.waiting, self.kv_usage, self.queries, self.hits,
                       self.preemptions, self.prompt_tokens, self.generation_tokens,
                       self.prompt_cached):
            family.labels(*self.values)  # every series present from the first scrape

    def _gauge(self, name: str, doc: str, *extra_labels: str) -> Gauge:
        return Gauge(_P + name, doc, (*_LABELS, *extra_labels), registry=self._registry)

    def _counter(self, name: str, doc: str, *extra_labels: str) -> Counter:
        return Counter(_P + name, doc, (*_LABELS, *extra_labels), registry=self._registry)

    def _histogram(
        self, name: str, doc: str, buckets: tuple[float, ...] | list[float]
    ) -> Histogram:
        return Histogram(_P + name, doc, _LABELS, buckets=buckets, registry=self._registry)

    def _add_scheduler_series(self) -> None:
        self.running = self._gauge("num_requests_running", "Number of requests in model "
                                   "execution batches.")
        self.waiting = self._gauge("num_requests_waiting", "Number of requests waiting to be "
                                   "processed.")
        self.waiting_by_reason = self._gauge(
            "num_requests_waiting_by_reason", "Number of requests waiting, by reason "
            "(capacity: KV cache or batch room; deferred: held back by a transient constraint).",
            "reason")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 "
                                    "percent usage.")
        self.queries = self._counter("prefix_cache_queries", "Prefix cache queries, in terms "
                                     "of number of queried tokens.")
        self.hits = self._counter("prefix_cache_hits", "Prefix cache hits, in terms of number "
                                  "of cached tokens.")
        self.preemptions = self._counter("num_preemptions", "Cumulative number of preemption "
                                         "from the engine.")

    def _add_token_counters(self) -> None:
        self.prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens "
                                           "processed.")
        self.generation_tokens = self._counter("generation_tokens", "Number of generation "
                                               "tokens processed.")
        self.prompt_cached = self._counter("prompt_tokens_cached", "Number of cached prompt "
                                           "tokens (local prefix cache and lower tiers).")
        self.success = self._counter("request_success", "Count of successfully processed "
                                     "requests.", "finished_reason")
        self.step_tokens = self._histogram("iteration_tokens_total", "Histogram of number of "
                                           "tokens per engine_step.", _STEP_TOKENS)

    def _add_latency_histograms(self) -> None:
        histogram = self._histogram
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token "
                              "in seconds.", _TTFT)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency "
                             "in seconds.", _ITL)
        self.tpot = histogram("request_time_per_output_token_seconds", "Histogram of "
                              "time_per_output_token_seconds per request.", _ITL)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency "
                             "in seconds.", _LATENCY)
        self.queue = histogram("request_queue_time_seconds", "Histogram of time spent in "
                               "WAITING phase for request.", _LATENCY)
        self.inference = histogram("request_inference_time_seconds", "Histogram of time spent "
                                   "in RUNNING phase for request.", _LATENCY)
        self.prefill = histogram("request_prefill_time_seconds", "Histogram of time spent in "
                                 "PREFILL phase for request.", _LATENCY)
        self.decode = histogram("request_decode_time_seconds", "Histogram of time spent in "
                                "DECODE phase for request.", _LATENCY)

    def _add_request_histograms(self, tokens: list[float]) -> None:
        histogram = self._histogram
        self.req_prompt = histogram("request_prompt_tokens", "Number of prefill tokens "
                                    "processed.", tokens)
        self.req_generation = histogram("request_generation_tokens", "Number of generation "
                                        "tokens processed.", tokens)
        self.req_max_generation = histogram("request_max_num_generation_tokens", "Histogram of "
                                            "maximum number of requested generation tokens.",
                                            tokens)
        self.req_computed = histogram("request_prefill_kv_computed_tokens", "Histogram of new "
                                      "KV tokens computed during prefill (excluding cached "
                                      "tokens).", tokens)

    def update(self, snap: EngineSnapshot, last: EngineSnapshot) -> None:
        v = self.values
        self.running.labels(*v).set(snap.num_running)
        self.waiting.labels(*v).set(snap.num_waiting)
        self.waiting_by_reason.labels(*v, "capacity").set(snap.num_waiting)
        self.waiting_by_reason.labels(*v, "deferred").set(0)  # ours wait one step at most
        self.kv_usage.labels(*v).set(snap.kv_cache_usage)
        for counter, now, before in ((self.queries, snap.queried_tokens, last.queried_tokens),
                                     (self.hits, snap.hit_tokens, last.hit_tokens),
                                     (self.preemptions, snap.preemptions, last.preemptions)):
            if now > before:
                counter.labels(*v).inc(now - before)
        if snap.num_steps > last.num_steps and snap.last_step_tokens:
            self.step_tokens.labels(*v).observe(snap.last_step_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(*self.values).observe(seconds)

    def token_gap(self, seconds: float, num_tokens: int) -> None:
        """``num_tokens`` arrived ``seconds`` after the previous ones."""
        per_token = seconds / num_tokens
        histogram = self.itl.labels(*self.values)
        for _ in range(num_tokens):
            histogram.observe(per_token)

    def tokens(self, num_prompt: int, num_generated: int, num_cached: int) -> None:
        v = self.values
        self.prompt_tokens.labels(*v).inc(num_prompt)
        self.generation_tokens.labels(*v).inc(num_generated)
        self.prompt_cached.labels(*v).inc(num_cached)

    def finished(self, output: RequestOutput, max_tokens: int | None) -> None:
        """A choice finished (``output.timing`` set): its latencies and token counts."""
        v = self.values
        self.success.labels(*v, output.finish_reason or "abort").inc()
        if output.timing is None:
            return
        arrival, scheduled, first, finish = output.timing
        self.e2e.labels(*v).observe(max(finish - arrival, 0.0) if finish else 0.0)
        if scheduled is not None:
            self.queue.labels(*v).observe(max(scheduled - arrival, 0.0))
            if finish is not None:
                self.inference.labels(*v).observe(max(finish - scheduled, 0.0))
            if first is not None:
                self.prefill.labels(*v).observe(max(first - scheduled, 0.0))
        if first is not None and finish is not None:
            decode = max(finish - first, 0.0)
            self.decode.labels(*v).observe(decode)
            if output.num_output_tokens > 1:
                self.tpot.labels(*v).observe(decode / (output.num_output_tokens - 1))
        self.req_prompt.labels(*v).observe(output.num_prompt_tokens)
        self.req_generation.labels(*v).observe(output.num_output_tokens)
        if max_tokens is not None:
            self.req_max_generation.labels(*v).observe(max_tokens)
        self.req_computed.labels(*v).observe(
            max(output.num_prompt_tokens - output.num_cached_tokens, 0))
