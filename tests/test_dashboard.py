"""``GET /dashboard`` over HTTP and in a real browser (Debian's Chromium, headless, driven by
Playwright): sign-in and 401s, the data document against /metrics under load, the tree of shared
prefixes (digests only), and the page itself: no console errors, charts that move, a screenshot
that is not blank."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import RunningServer, start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tenants.toml"
ADMIN = {"Authorization": "Bearer dashboard-metrics-key"}
ACME = "sk-acme-example-key-1"
SYSTEM = "Shared system prompt of the dashboard test, long enough for blocks. " * 4
VENDOR = Path(__file__).resolve().parents[1] / "src/prefixcache/server/dashboard/static/vendor"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    secret = tmp_path_factory.mktemp("secret") / "secret"
    secret.write_text("a-dashboard-secret-of-enough-bytes")
    running = start_server(["--model", "tiny", "--tenants", str(EXAMPLE), "--secret-file",
                            str(secret), "--metrics-key", "dashboard-metrics-key",
                            "--num-kv-blocks", "256"])
    yield running
    running.stop()


def _ask(server: RunningServer, i: int, key: str = ACME) -> None:
    reply = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {key}"}, json={
                           "model": "tiny", "max_tokens": 3, "messages": [
                               {"role": "system", "content": SYSTEM},
                               {"role": "user", "content": f"Question number {i}?"}]})
    assert reply.status_code == 200, reply.text


def _metrics(server: RunningServer) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", headers=ADMIN, timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _data(server: RunningServer, headers: dict | None = None) -> dict:
    reply = httpx.get(server.base_url + "/dashboard/data", headers=headers or ADMIN, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


PAIRS = {  # dashboard counter -> the /metrics series it must equal
    "prefix_cache_hits": "prefixcache:prefix_cache_hits_total",
    "prefix_cache_queries": "prefixcache:prefix_cache_queries_total",
    "evictions": "prefixcache:cache_evictions_total",
    "preemptions": "prefixcache:num_preemptions_total",
    "prompt_tokens": "prefixcache:prompt_tokens_total",
    "generation_tokens": "prefixcache:generation_tokens_total",
    "requests_finished": "prefixcache:request_success_total",
}


def test_the_vendored_chart_library_is_uplot_1_6_32_unchanged() -> None:
    sums = {"uPlot.iife.min.js": "19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f",
            "uPlot.min.css": "df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04"}
    for name, digest in sums.items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == digest, name
    assert "MIT" in (VENDOR / "uPlot.LICENSE").read_text()


def test_anonymous_and_tenant_callers_get_no_data(server) -> None:
    base = server.base_url
    page = httpx.get(base + "/dashboard")
    assert page.status_code == 401 and "Sign in" in page.text and "prefix_cache" not in page.text
    assert httpx.get(base + "/dashboard/data").status_code == 401
    tenant = {"Authorization": f"Bearer {ACME}"}  # a tenant, not an admin
    assert httpx.get(base + "/dashboard/data", headers=tenant).status_code == 401
    refused = httpx.post(base + "/dashboard/login", json={"key": ACME})
    assert refused.status_code == 403 and refused.json()["error"]["message"]
    assert httpx.post(base + "/dashboard/login", json={"key": "nope"}).status_code == 401
    assert httpx.post(base + "/dashboard/login", content=b"{bad").status_code == 400
    assert httpx.get(base + "/dashboard/static/../app.py").status_code == 404
    with httpx.Client(base_url=base) as browser:  # the sign-in sets a session cookie
        assert browser.post("/dashboard/login", json={"key": "dashboard-metrics-key"}
                            ).status_code == 204
        assert browser.get("/dashboard").status_code == 200
        assert browser.get("/dashboard/data").status_code == 200
        assert browser.post("/dashboard/logout").status_code == 204
        assert browser.get("/dashboard/data").status_code == 401


def _bench_serve_load(server: RunningServer, stop: threading.Event) -> None:
    """``benchmarks/bench_serve.py``'s own load (prefix repetition, streamed, 3 concurrent) in
    rounds until ``stop``."""
    import asyncio
    import math
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_serve import PrefixRepetition, run_load

    prompts = PrefixRepetition(prefix_len=160, suffix_len=16, num_prefixes=2, output_len=4,
                               num_requests=12).prompts()
    while not stop.is_set():
        results, _ = asyncio.run(run_load(
            server.base_url, prompts, 4, math.inf, 3, "dashboard test",
            headers={"Authorization": f"Bearer {ACME}"}, model="tiny"))
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:2]


def test_the_data_agrees_with_metrics_under_load_and_equals_them_at_rest(server) -> None:
    stop = threading.Event()
    errors: list[BaseException] = []

    def load() -> None:
        try:
            _bench_serve_load(server, stop)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    thread = threading.Thread(target=load)
    thread.start()
    try:
        for _ in range(6):  # each /metrics read lies between the two dashboard reads around it
            before = _data(server)["counters"]
            metrics = _metrics(server)
            after = _data(server)["counters"]
            for key, name in PAIRS.items():
                assert before[key] <= metrics.get(name, 0.0) <= after[key], (key, before, after)
        assert after["prefix_cache_queries"] > 0  # the load was running meanwhile
    finally:
        stop.set()
        thread.join()
    assert errors == []
    data, metrics = _data(server), _metrics(server)
    for key, name in PAIRS.items():
        assert data["counters"][key] == metrics[name], key
    pool = data["pool"]
    assert pool["used"] + pool["cached_free"] + pool["free"] == pool["blocks"] == 256
    assert pool["usage"] == metrics["prefixcache:kv_cache_usage_perc"]
    acme = next(d for d in data["domains"] if d["domain"] == "tenant:acme")
    assert acme["hit_ratio"] > 0.5 and acme["ttft_p50_s"] is not None
    assert acme["requests"] == metrics["prefixcache:time_to_first_token_seconds_count"]


def test_diagnosed_misses_are_shown_by_reason_per_tenant(server) -> None:
    def chat(system: str, previous: str | None) -> str:
        body = {"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "Diagnose me"}]}
        if previous is not None:
            body["prompt_cache_options"] = {"comparison_response_id": previous}
        reply = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json=body,
                           headers={"Authorization": f"Bearer {ACME}"})
        assert reply.status_code == 200, reply.text
        return reply.json()["id"]

    before = next((d["miss_reasons"] for d in _data(server)["domains"]
                   if d["domain"] == "tenant:acme"), {})
    first = chat(SYSTEM, None)
    chat("A different system prompt. " + SYSTEM, first)  # the messages changed
    chat(SYSTEM, "chatcmpl-never-issued")  # not_found
    acme = next(d for d in _data(server)["domains"] if d["domain"] == "tenant:acme")
    counts = acme["miss_reasons"]
    assert counts["messages_changed"] == before.get("messages_changed", 0) + 1
    assert counts["not_found"] == before.get("not_found", 0) + 1
    metrics = _metrics(server)
    total = sum(v for k, v in metrics.items()
                if k.startswith("prefixcache:prefix_cache_miss_reasons"))
    assert total >= 2
    assert "Diagnose me" not in httpx.get(server.base_url + "/dashboard/data", headers=ADMIN).text


def test_the_tree_shows_the_shared_prefix_by_digest_never_text(server) -> None:
    for i in range(3):
        _ask(server, 5000 + i)
    data = _data(server)
    top = data["tree"][0]
    assert top["domain"] == "tenant:acme" and top["requests"] >= 3 and top["blocks"] >= 4
    assert re.fullmatch(r"[0-9a-f]{12}", top["digest"])
    latest = data["recent"][0]
    assert latest["reason"] == "diverged" and latest["cached_tokens"] >= 4 * 16
    text = httpx.get(server.base_url + "/dashboard/data", headers=ADMIN).text
    assert "Shared system prompt" not in text and "Question number" not in text


def _browser_or_skip() -> str:
    if shutil.which(CHROMIUM) is None:
        if os.environ.get("PREFIXCACHE_REQUIRE_BROWSER"):
            pytest.fail(f"{CHROMIUM} is missing (apt-get install -y chromium)")
        pytest.skip(f"no {CHROMIUM} here (.ci/run installs it)")
    return CHROMIUM


def test_the_page_runs_live_in_headless_chromium(server, tmp_path: Path) -> None:
    from PIL import Image, ImageStat
    from playwright.sync_api import sync_playwright

    executable = _browser_or_skip()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            anonymous = browser.new_page()
            anonymous.goto(server.base_url + "/dashboard")
            assert anonymous.locator("#key").count() == 1  # the sign-in form, no data
            assert anonymous.locator("#hits-total").count() == 0
            status = anonymous.evaluate("fetch('/dashboard/data').then(r => r.status)")
            assert status == 401

            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.base_url + "/dashboard")
            page.fill("#key", "dashboard-metrics-key")
            errors.clear()  # the sign-in page itself came with its 401
            page.click("button[type=submit]")
            page.wait_for_function("window.dashboard && window.dashboard.polls >= 2",
                                   timeout=30_000)
            hits_before = page.locator("#hits-total").inner_text()
            stop = threading.Event()  # bench_serve's load while the page is watched
            load = threading.Thread(target=_bench_serve_load, args=(server, stop))
            load.start()
            try:
                page.wait_for_function(f"document.getElementById('hits-total').textContent "
                                       f"!== {hits_before!r}", timeout=30_000)
                seen = page.evaluate("window.dashboard.last.counters.prefix_cache_hits")
                page.wait_for_function("window.dashboard.last.counters.prefix_cache_hits > "
                                       f"{seen}", timeout=30_000)  # and again: it is live
            finally:
                stop.set()
                load.join()
            polls = page.evaluate("window.dashboard.polls")
            page.wait_for_function(f"window.dashboard.polls >= {polls + 2}", timeout=30_000)
            shown = int(page.locator("#hits-total").inner_text().replace(",", ""))
            assert shown == page.evaluate("window.dashboard.last.counters.prefix_cache_hits")
            assert shown <= _metrics(server)["prefixcache:prefix_cache_hits_total"]
            assert page.locator("#tree rect").count() >= 1  # the shared prefix drawn
            assert "tenant:acme" in page.locator("#domains").inner_text()
            assert page.locator("#chart-hit canvas").count() == 1
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert errors == []
        finally:
            browser.close()
    image = Image.open(shot).convert("L")
    assert image.width >= 1400 and image.height >= 900
    assert ImageStat.Stat(image).stddev[0] > 10  # text and charts, not a blank page


GRAFANA = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "prefixcache.json"


def test_our_grafana_dashboard_queries_only_series_we_export(tmp_path: Path) -> None:
    import json

    dashboard = json.loads(GRAFANA.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    names = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
             for e in exprs for n in re.findall(r"prefixcache:[a-z0-9_]+", e)}
    running = start_server(["--model", "tiny", "--kv-disk", str(tmp_path / "kv")])
    try:
        _ask_plain(running)
        text = httpx.get(running.base_url + "/metrics", timeout=30).text
    finally:
        running.stop()
    exported = {f.name for f in text_string_to_metric_families(text)}
    exported |= {n + "_total" for n in exported}  # counters are queried with their suffix
    # the router's belief exists on a cluster's ingress (tests/test_cluster_ray.py)
    assert names - exported == {"prefixcache:router_mirror_blocks"}


def _ask_plain(server: RunningServer) -> None:
    reply = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": SYSTEM, "max_tokens": 2})
    assert reply.status_code == 200, reply.text


def test_a_session_signed_on_one_replica_is_valid_on_another_and_expires() -> None:
    from prefixcache.server.dashboard import SESSION_S, Sessions

    now = [1_000_000.0]
    one, two = Sessions(b"k" * 32, lambda: now[0]), Sessions(b"k" * 32, lambda: now[0])
    token = one.new()
    assert two.valid(token) and not Sessions(b"x" * 32, lambda: now[0]).valid(token)
    expiry, _, signature = token.partition(".")
    assert not two.valid(f"{int(expiry) + 3600}.{signature}")  # a longer expiry is not signed
    assert not two.valid("garbage") and not two.valid(None)
    one.end(token)
    assert not one.valid(token)
    now[0] += SESSION_S + 1
    assert not two.valid(token)
