"""`prefixcache audit`: the prompt-caching timing audit of Gu et al. (ICML 2025), against a server.

"Auditing Prompt Caching in Language Model APIs" detects cache sharing from time to first token
alone. Each sample is one procedure, hit or miss, in random order:

* a victim request (key V) sends a fresh random prompt P;
* hit: the attacker (key A) sends P's first ``prefix_fraction`` followed by a fresh random tail;
* miss: the attacker sends an unrelated fresh random prompt of the same length.

The attacker's request streams with ``max_tokens = 1`` and its TTFT is recorded. If the attacker
can hit the victim's cache, hit TTFTs are stochastically smaller than miss TTFTs, which a
one-sided two-sample Kolmogorov-Smirnov test detects: ``ks_2samp(hit, miss, alternative="greater")``
tests H1 "the hit CDF lies above the miss CDF somewhere", i.e. hits tend to be faster. The audit
runs twice: same key (V = A, the positive control: it must detect the cache, or the audit is
blind) and cross key (V != A: isolation holds when it detects nothing). It also reports every
``cached_tokens`` the server returned to the attacker across keys, which must be 0.

With ``--public-prefix-file`` every prompt (the victim's, the hit's and the miss's) starts with
that text, a public prefix the server's tenants file declares for both keys' tenants: the
cross-key test then asks whether anything *after* the declared prefix is shared. Both keys read
the declared blocks, so the attacker's hit and miss requests get the same ``cached_tokens``, all
of them public (the server's ``public_cached_tokens``); a cached token beyond those is a leak.

A third test asks whether the cache diagnostics are an oracle: the attacker names, as the earlier
request to compare with (``prompt_cache_options.comparison_response_id``), either the id the
victim's chat completion just got or an id never issued, of the same shape. Both must be answered
alike: the same ``prompt_cache_diagnostics`` body every time, and request times that a two-sided
KS test cannot tell apart.

This module is an HTTP client of the OpenAI-compatible API; it knows nothing of the server's code.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixcache.errors import CliError, require_extra

__all__ = ["AuditConfig", "AuditReport", "TestResult", "ks_test", "run_audit"]

DEFAULT_ALPHA = 1e-8  # Gu et al.'s significance level: many tests, false alarms must be rare


@dataclass(frozen=True, slots=True)
class AuditConfig:
    """What to audit and how hard."""

    url: str
    key_a: str
    key_b: str
    samples: int = 250
    prompt_tokens: int = 5000
    prefix_fraction: float = 0.95
    model: str | None = None
    seed: int = 0
    alpha: float = DEFAULT_ALPHA
    timeout_s: float = 120.0
    public_prefix: str = ""  # text every prompt starts with: a declared public prefix

    def __post_init__(self) -> None:
        if self.samples < 2:
            raise ValueError(f"--samples must be >= 2, got {self.samples}")
        if self.prompt_tokens < 8:
            raise ValueError(f"--prompt-tokens must be >= 8, got {self.prompt_tokens}")
        if not 0.0 < self.prefix_fraction < 1.0:
            raise ValueError(f"--prefix-fraction must be in (0, 1), got {self.prefix_fraction}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"--alpha must be in (0, 1), got {self.alpha}")


@dataclass(slots=True)
class Measurement:
    """One attacker request: its TTFT and the cached_tokens the server reported (-1: none), of
    them ``public_cached_tokens`` read from a declared public prefix's blocks."""

    ttft_s: float
    cached_tokens: int
    public_cached_tokens: int = 0


@dataclass(slots=True)
class TestResult:
    """One KS test: hit vs miss TTFTs (seconds) of the attacker."""

    name: str
    hit_ttft_s: list[float] = field(default_factory=list)
    miss_ttft_s: list[float] = field(default_factory=list)
    hit_cached_tokens: list[int] = field(default_factory=list)
    miss_cached_tokens: list[int] = field(default_factory=list)
    # of each request's cached tokens, those beyond the public ones (its own or leaked)
    hit_private_cached_tokens: list[int] = field(default_factory=list)
    miss_private_cached_tokens: list[int] = field(default_factory=list)
    ks_statistic: float = 0.0
    p_value: float = 1.0

    @property
    def median_hit_s(self) -> float:
        return statistics.median(self.hit_ttft_s)

    @property
    def median_miss_s(self) -> float:
        return statistics.median(self.miss_ttft_s)

    def add(self, kind: str, m: Measurement) -> None:
        hit = kind == "hit"
        (self.hit_ttft_s if hit else self.miss_ttft_s).append(m.ttft_s)
        (self.hit_cached_tokens if hit else self.miss_cached_tokens).append(m.cached_tokens)
        (self.hit_private_cached_tokens if hit else self.miss_private_cached_tokens).append(
            max(0, m.cached_tokens - m.public_cached_tokens))


@dataclass(slots=True)
class AuditReport:
    """Both tests, the leak count and the verdict."""

    config: dict[str, Any]
    same_key: TestResult
    cross_key: TestResult
    leaked_cached_tokens: int
    prompt_tokens_measured: int
    diagnostics: TestResult | None = None  # "hit": the victim's id, "miss": one never issued
    diagnostics_bodies: list[str] = field(default_factory=list)  # each distinct answer
    verdict: str = ""
    isolated: bool = True
    control_detects_cache: bool = False

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"config": self.config}
        tests = (self.same_key, self.cross_key, *([self.diagnostics] if self.diagnostics else []))
        for test in tests:
            entry = asdict(test)
            entry.update(median_hit_s=test.median_hit_s, median_miss_s=test.median_miss_s)
            out[test.name] = entry
        out.update(
            diagnostics_bodies=self.diagnostics_bodies,
            leaked_cached_tokens=self.leaked_cached_tokens,
            prompt_tokens_measured=self.prompt_tokens_measured,
            control_detects_cache=self.control_detects_cache,
            isolated=self.isolated,
            verdict=self.verdict,
        )
        return out


# ---- statistics -------------------------------------------------------------------------------


def ks_test(hit: list[float], miss: list[float]) -> tuple[float, float]:
    """One-sided two-sample KS: H1 = hit times are stochastically smaller than miss times.

    scipy's ``alternative="greater"`` means the first sample's CDF exceeds the second's somewhere;
    a CDF that rises earlier belongs to smaller values, i.e. faster hits.
    """
    from scipy.stats import ks_2samp  # type: ignore[import-untyped]

    result = ks_2samp(hit, miss, alternative="greater")
    return float(result.statistic), float(result.pvalue)


def ks_two_sided(one: list[float], other: list[float]) -> tuple[float, float]:
    """Two-sample KS, either direction: do the samples come from one distribution?"""
    from scipy.stats import ks_2samp

    result = ks_2samp(one, other)
    return float(result.statistic), float(result.pvalue)


# ---- prompts and requests ---------------------------------------------------------------------


class PromptMaker:
    """Fresh random prompts of a target token length (characters per token measured once)."""

    def __init__(self, rng: random.Random, chars_per_token: float = 1.0) -> None:
        self.rng = rng
        self.chars_per_token = chars_per_token

    def text(self, num_tokens: int) -> str:
        num_chars = max(int(num_tokens * self.chars_per_token), 1)
        words: list[str] = []
        size = 0
        while size < num_chars:
            word = "".join(self.rng.choices(string.ascii_lowercase, k=self.rng.randint(2, 9)))
            words.append(word)
            size += len(word) + 1
        return " ".join(words)[:num_chars]

    def pair(self, num_tokens: int, prefix_fraction: float) -> tuple[str, str, str]:
        """(victim prompt, attacker hit prompt sharing its prefix, attacker miss prompt)."""
        victim = self.text(num_tokens)
        cut = int(len(victim) * prefix_fraction)
        hit = victim[:cut] + self.text(num_tokens)[: len(victim) - cut]
        return victim, hit, self.text(num_tokens)


class Client:
    """Streams completions with ``max_tokens = 1`` and times the first token."""

    def __init__(self, config: AuditConfig) -> None:
        import httpx

        self.config = config
        self.http = httpx.Client(base_url=config.url.rstrip("/"), timeout=config.timeout_s)
        self.model = config.model or self._first_model()

    def _first_model(self) -> str:
        response = self._checked(self.http.get("/v1/models", headers=self._auth(self.config.key_a)))
        models = response.json().get("data") or []
        if not models:
            raise CliError(f"{self.config.url}/v1/models lists no model")
        return str(models[0]["id"])

    def _auth(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def _checked(self, response: Any) -> Any:
        if response.status_code != 200:
            raise CliError(f"server answered {response.status_code}: {response.text[:200]}")
        return response

    def prompt_tokens(self, key: str, prompt: str) -> int:
        """The server's token count of ``prompt`` (one non-streaming request)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        response = self._checked(
            self.http.post("/v1/completions", json=body, headers=self._auth(key))
        )
        return int(response.json()["usage"]["prompt_tokens"])

    def measure(self, key: str, prompt: str) -> Measurement:
        """Stream one completion; TTFT is the time to the first chunk carrying a token."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        ttft, cached, public = None, -1, 0
        start = time.perf_counter()
        with self.http.stream("POST", "/v1/completions", json=body, headers=self._auth(key)) as r:
            if r.status_code != 200:
                raise CliError(f"server answered {r.status_code}: {r.read()[:200]!r}")
            for chunk in _sse_chunks(r.iter_lines()):
                if ttft is None and chunk.get("choices"):
                    ttft = time.perf_counter() - start
                cached = _cached_tokens(chunk, cached)
                public = _cached_tokens(chunk, public, "public_cached_tokens")
        if ttft is None:
            raise CliError("the stream ended without a token")
        return Measurement(ttft, cached, public)

    def chat(self, key: str, prompt: str, comparison_id: str | None = None,
             ) -> tuple[str, float, str]:  # fmt: skip
        """One chat completion (``max_tokens = 1``) compared with ``comparison_id``: its id,
        the request's time, and its ``prompt_cache_diagnostics`` as canonical JSON."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": 1, "temperature": 0.0,
                                "messages": [{"role": "user", "content": prompt}]}
        if comparison_id is not None:
            body["prompt_cache_options"] = {"comparison_response_id": comparison_id}
        start = time.perf_counter()
        response = self._checked(
            self.http.post("/v1/chat/completions", json=body, headers=self._auth(key)))
        seconds = time.perf_counter() - start
        reply = response.json()
        diagnostics = json.dumps(reply.get("prompt_cache_diagnostics"), sort_keys=True)
        return str(reply.get("id", "")), seconds, diagnostics

    def close(self) -> None:
        self.http.close()


def _sse_chunks(lines: Any) -> Any:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _cached_tokens(chunk: dict[str, Any], default: int, name: str = "cached_tokens") -> int:
    usage = chunk.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    value = details.get(name)
    return int(value) if value is not None else default


# ---- the audit --------------------------------------------------------------------------------


def _calibrate(client: Client, maker: PromptMaker, config: AuditConfig) -> int:
    """Measure characters per token on this server's tokenizer; returns the measured length."""
    probe = maker.text(config.prompt_tokens)
    num_tokens = client.prompt_tokens(config.key_b, probe)
    maker.chars_per_token = len(probe) / max(num_tokens, 1)
    return client.prompt_tokens(config.key_b, maker.text(config.prompt_tokens))


def _procedure(
    client: Client, maker: PromptMaker, config: AuditConfig, attacker: str, kind: str
) -> Measurement:
    victim, hit, miss = maker.pair(config.prompt_tokens, config.prefix_fraction)
    public = config.public_prefix
    client.measure(config.key_a, public + victim)
    return client.measure(attacker, public + (hit if kind == "hit" else miss))


def _run_test(
    client: Client,
    maker: PromptMaker,
    config: AuditConfig,
    name: str,
    attacker: str,
    rng: random.Random,
) -> TestResult:
    kinds = ["hit"] * config.samples + ["miss"] * config.samples
    rng.shuffle(kinds)  # hit and miss procedures randomly interleaved
    result = TestResult(name)
    for kind in kinds:
        result.add(kind, _procedure(client, maker, config, attacker, kind))
    result.ks_statistic, result.p_value = ks_test(result.hit_ttft_s, result.miss_ttft_s)
    return result


def _run_diagnostics_test(client: Client, maker: PromptMaker, config: AuditConfig,
                          rng: random.Random) -> tuple[TestResult, list[str]]:  # fmt: skip
    """The attacker compares with the victim's fresh id ("hit") or an id never issued of the
    same shape ("miss"): request times, and every distinct diagnostics body."""
    kinds = ["hit"] * config.samples + ["miss"] * config.samples
    rng.shuffle(kinds)
    result, bodies = TestResult("diagnostics"), set()
    length = min(config.prompt_tokens, 256)  # the comparison, not the prefill, is measured
    for kind in kinds:
        victim_id, _, _ = client.chat(config.key_a, maker.text(length))
        head, _, tail = victim_id.rpartition("-")
        unknown = f"{head}-" + "".join(rng.choices("0123456789abcdef", k=len(tail) or 32))
        _, seconds, body = client.chat(config.key_b, maker.text(length),
                                       victim_id if kind == "hit" else unknown)
        result.add(kind, Measurement(seconds, -1))
        bodies.add(body)
    result.ks_statistic, result.p_value = ks_two_sided(result.hit_ttft_s, result.miss_ttft_s)
    return result, sorted(bodies)


def run_audit(config: AuditConfig, progress: bool = False) -> AuditReport:
    """Warm up, calibrate, then the same-key and cross-key tests, in random order."""
    rng = random.Random(config.seed)
    maker = PromptMaker(random.Random(rng.getrandbits(64)))
    client = Client(config)
    try:
        measured = _calibrate(client, maker, config)
        for _ in range(3):  # warm-up: first requests pay one-off costs
            _procedure(client, maker, config, config.key_b, "miss")
        tests = [("same_key", config.key_a), ("cross_key", config.key_b)]
        results = {}
        for name, attacker in rng.sample(tests, k=2):
            if progress:
                print(f"audit: {name} test, {2 * config.samples} procedures ...", flush=True)
            results[name] = _run_test(client, maker, config, name, attacker, rng)
        if progress:
            print(f"audit: diagnostics test, {2 * config.samples} procedures ...", flush=True)
        diagnostics, bodies = _run_diagnostics_test(client, maker, config, rng)
    finally:
        client.close()
    report = _report(config, results["same_key"], results["cross_key"], measured)
    report.diagnostics, report.diagnostics_bodies = diagnostics, bodies
    report.isolated = report.isolated and diagnostics.p_value >= config.alpha and len(bodies) == 1
    report.verdict = _verdict(report, config.alpha)
    return report


def _report(config: AuditConfig, same: TestResult, cross: TestResult, measured: int) -> AuditReport:
    leaked = sum(cross.hit_private_cached_tokens + cross.miss_private_cached_tokens)
    public = asdict(config) | {"key_a": "<redacted>", "key_b": "<redacted>",
                               "public_prefix": (f"<{len(config.public_prefix)} characters>"
                                                 if config.public_prefix else None)}
    report = AuditReport(public, same, cross, leaked, measured)
    report.control_detects_cache = same.p_value < config.alpha
    report.isolated = cross.p_value >= config.alpha and leaked == 0
    report.verdict = _verdict(report, config.alpha)
    return report


def _verdict(report: AuditReport, alpha: float) -> str:
    if not report.isolated:
        if report.leaked_cached_tokens:
            why = "cached_tokens leaked"
        elif len(report.diagnostics_bodies) > 1:
            why = "diagnostics answer another key's id unlike an unknown one"
        elif report.diagnostics is not None and report.diagnostics.p_value < alpha:
            why = f"diagnostics timing p < {alpha:g}"
        else:
            why = f"p < {alpha:g}"
        return f"CACHE SHARED ACROSS KEYS ({why})"
    if not report.control_detects_cache:
        return "INCONCLUSIVE: the same-key control does not detect the cache (longer prompts?)"
    return "ISOLATED: the cache is detectable within a key and not across keys"


# ---- output -----------------------------------------------------------------------------------


def format_report(report: AuditReport) -> list[str]:
    lines = [f"audit: {report.prompt_tokens_measured} prompt tokens per request"]
    for test in (report.same_key, report.cross_key):
        lines.append(
            f"  {test.name:<9} median TTFT hit {test.median_hit_s * 1e3:8.2f} ms, miss "
            f"{test.median_miss_s * 1e3:8.2f} ms, KS D={test.ks_statistic:.3f} "
            f"p={test.p_value:.3g}"
        )
    if report.diagnostics is not None:
        test = report.diagnostics
        lines.append(
            f"  diagnostics: another key's id vs an unknown id, median time "
            f"{test.median_hit_s * 1e3:.2f} vs {test.median_miss_s * 1e3:.2f} ms, KS "
            f"(two-sided) D={test.ks_statistic:.3f} p={test.p_value:.3g}, "
            f"{len(report.diagnostics_bodies)} distinct answer(s)")
    if report.config.get("public_prefix"):
        lines.append("  every prompt starts with the declared public prefix: cached_tokens "
                     "beyond its public blocks count as leaked")
    lines.append(f"  cached_tokens leaked across keys: {report.leaked_cached_tokens}")
    lines.append(f"verdict: {report.verdict}")
    return lines


def plot_report(report: AuditReport, path: str) -> None:
    """Empirical CDFs of hit and miss TTFT, one panel per test."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for ax, test in zip(axes, (report.same_key, report.cross_key), strict=True):
        for label, values in (("hit", test.hit_ttft_s), ("miss", test.miss_ttft_s)):
            xs = sorted(v * 1e3 for v in values)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
        ax.set_title(f"{test.name.replace('_', '-')}: KS p = {test.p_value:.2g}")
        ax.set_xlabel("time to first token (ms)")
        ax.set_ylabel("empirical CDF")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--key-a", required=True, help="victim's API key (and the control's)")
    parser.add_argument("--key-b", required=True, help="attacker's API key (another tenant)")
    parser.add_argument("--samples", type=int, default=250, help="procedures per kind and test")
    parser.add_argument("--prompt-tokens", type=int, default=5000)
    parser.add_argument("--prefix-fraction", type=float, default=0.95)
    parser.add_argument("--public-prefix-file", default=None, metavar="FILE",
                        help="text every prompt starts with: a public prefix the server's "
                             "tenants file declares (prompt_file) for both keys' tenants")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="significance (1e-8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, metavar="FILE.json", help="write the full report")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw the TTFT CDFs")


def _public_prefix(path: str | None) -> str:
    if path is None:
        return ""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read --public-prefix-file {path}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    for module in ("httpx", "scipy", *(("matplotlib",) if args.plot else ())):
        require_extra(module, "audit", "prefixcache audit")
    import httpx

    try:
        config = AuditConfig(
            args.url,
            args.key_a,
            args.key_b,
            args.samples,
            args.prompt_tokens,
            args.prefix_fraction,
            args.model,
            args.seed,
            args.alpha,
            public_prefix=_public_prefix(args.public_prefix_file),
        )
        report = run_audit(config, progress=True)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    except httpx.HTTPError as exc:
        raise CliError(f"cannot talk to {args.url}: {type(exc).__name__}: {exc}") from None
    for line in format_report(report):
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(report.as_dict(), indent=1))
    if args.plot:
        plot_report(report, args.plot)
    return 0 if report.isolated else 1
