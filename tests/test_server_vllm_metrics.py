"""vLLM's metric names beside ours: every series that vLLM's own Grafana dashboards query
(`examples/observability` of vLLM 0.34: `prometheus_grafana/grafana.json`,
`dashboards/grafana/performance_statistics.json` and `query_statistics.json`, plus the KV-cache
dashboard of its main branch) resolves against our /metrics with vLLM's types and the
``model_name`` label, the figures agree with our own names, and ``--no-vllm-metric-names``
turns them off."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import RunningServer, start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "served-tiny"

# the dashboards' queries, as they are written there (templating variables kept)
DASHBOARD_QUERIES = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',  # noqa: E501
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval]) / rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',  # noqa: E501
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',  # noqa: E501
    'rate(vllm:inter_token_latency_seconds_sum{model_name="$model_name"}[$__rate_interval]) / rate(vllm:inter_token_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',  # noqa: E501
    'histogram_quantile(0.99, sum by(le) (rate(vllm:request_time_per_output_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',  # noqa: E501
    'rate(vllm:request_time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval]) / rate(vllm:request_time_per_output_token_seconds_count{model_name="$model_name"}[$__rate_interval])',  # noqa: E501
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',  # noqa: E501
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval]) / rate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',  # noqa: E501
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',  # noqa: E501
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',  # noqa: E501
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',  # noqa: E501
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',  # noqa: E501
    'rate(vllm:iteration_tokens_total_count[$__interval])',
    'sum by (le, model_name) (rate(vllm:request_prompt_tokens_bucket{model_name=~"$Deployment_id"}[$__rate_interval]))',  # noqa: E501
    'sum(rate(vllm:prompt_tokens_total{model_name=~"$Deployment_id"}[$__rate_interval])) / sum(rate(vllm:request_success_total{model_name=~"$Deployment_id"}[$__rate_interval]))',  # noqa: E501
    # the KV-cache dashboard (vllm_kv_cache.json)
    'max(vllm:kv_cache_usage_perc{job=~"$job", model_name=~"$model_name", instance=~"$instance", engine=~"$engine"})',  # noqa: E501
    'sum(rate(vllm:prefix_cache_hits_total{job=~"$job", model_name=~"$model_name", instance=~"$instance", engine=~"$engine"}[$__rate_interval])) / (sum(rate(vllm:prefix_cache_queries_total{job=~"$job", model_name=~"$model_name", instance=~"$instance", engine=~"$engine"}[$__rate_interval])) > 0)',  # noqa: E501
    'sum(rate(vllm:prompt_tokens_cached_total{job=~"$job", model_name=~"$model_name", instance=~"$instance", engine=~"$engine"}[$__rate_interval])) / (sum(rate(vllm:prompt_tokens_total{job=~"$job", model_name=~"$model_name", instance=~"$instance", engine=~"$engine"}[$__rate_interval])) > 0)',  # noqa: E501
    'sum(rate(vllm:num_preemptions_total{job=~"$job", model_name=~"$model_name", instance=~"$instance", engine=~"$engine"}[$__rate_interval]))',  # noqa: E501
    'sum(vllm:num_requests_waiting_by_reason{job=~"$job", model_name=~"$model_name", instance=~"$instance", engine=~"$engine", reason="capacity"})',  # noqa: E501
]

TYPES = {"vllm:kv_cache_usage_perc": "gauge", "vllm:num_requests_running": "gauge",
         "vllm:prefix_cache_hits": "counter", "vllm:prompt_tokens": "counter",
         "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
         "vllm:e2e_request_latency_seconds": "histogram", "vllm:iteration_tokens_total":
         "histogram"}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server(["--model", "tiny", "--served-model-name", MODEL])
    yield running
    running.stop()


def _scrape(server: RunningServer) -> dict[str, list]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    samples: dict[str, list] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    samples["__types__"] = [types]
    return samples


def _value(samples: dict[str, list], name: str, **labels: str) -> float:
    return sum(s.value for s in samples.get(name, [])
               if all(s.labels.get(k) == v for k, v in labels.items()))


def _traffic(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    system = "A system prompt that the requests share, over several blocks. " * 4
    for i in range(3):
        client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": f"Q{i}?"}])
    list(client.completions.create(model=MODEL, prompt=system, max_tokens=5, stream=True))


def test_every_series_vllms_dashboards_query_exists_with_vllms_types(server) -> None:
    _traffic(server)
    samples = _scrape(server)
    types = samples["__types__"][0]
    missing = []
    for query in DASHBOARD_QUERIES:
        for name in re.findall(r"vllm:[A-Za-z_:0-9]+", query):
            found = [s for s in samples.get(name, []) if s.labels.get("model_name") == MODEL]
            if not found or not all(s.labels.get("engine") == "0" for s in found):
                missing.append(name)
    assert missing == []
    for name, kind in TYPES.items():
        assert types.get(name) == kind, name
    reasons = {s.labels["finished_reason"] for s in samples["vllm:request_success_total"]}
    assert "length" in reasons
    # vLLM's names carry no tenant or request detail
    assert not any(set(s.labels) - {"model_name", "engine", "finished_reason", "reason", "le"}
                   for name, group in samples.items() if name.startswith("vllm:")
                   for s in group)


def test_vllms_names_agree_with_ours(server) -> None:
    _traffic(server)
    samples = _scrape(server)
    for ours, theirs in (("prefixcache:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
                         ("prefixcache:prefix_cache_queries_total",
                          "vllm:prefix_cache_queries_total"),
                         ("prefixcache:prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("prefixcache:generation_tokens_total", "vllm:generation_tokens_total"),
                         ("prefixcache:num_preemptions_total", "vllm:num_preemptions_total")):
        assert _value(samples, ours) == _value(samples, theirs, model_name=MODEL), theirs
    assert _value(samples, "vllm:prefix_cache_hits_total") > 0  # the shared system prompt
    finished = _value(samples, "vllm:request_success_total")
    assert finished == _value(samples, "vllm:e2e_request_latency_seconds_count") >= 8
    assert _value(samples, "vllm:time_to_first_token_seconds_count") == finished
    # 6 tokens per chat request: 5 gaps each; 5 tokens per stream: 4
    assert _value(samples, "vllm:inter_token_latency_seconds_count") >= 3 * 5
    cached = _value(samples, "vllm:prompt_tokens_cached_total")
    computed = _value(samples, "vllm:request_prefill_kv_computed_tokens_sum")
    assert cached > 0 and cached + computed == _value(samples, "vllm:prompt_tokens_total")
    assert _value(samples, "vllm:iteration_tokens_total_count") > 0


def test_no_vllm_metric_names_leaves_them_out() -> None:
    running = start_server(["--model", "tiny", "--no-vllm-metric-names"])
    try:
        text = httpx.get(running.base_url + "/metrics", timeout=30).text
        assert "vllm:" not in text and "prefixcache:prefix_cache_hits_total" in text
    finally:
        running.stop()
