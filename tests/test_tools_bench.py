"""`prefixcache bench`: cache off vs on, side by side, on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

from prefixcache.tools.bench import make_workload

RUN = [sys.executable, "-m", "prefixcache", "bench"]


def test_workload_shares_each_prefix() -> None:
    prompts = make_workload(3, 4, prefix_len=20, suffix_len=5, vocab_size=300)
    assert len(prompts) == 12 and all(len(p) == 25 for p in prompts)
    assert prompts[0][:20] == prompts[3][:20] != prompts[1][:20]
    assert len({tuple(p) for p in prompts}) == 12  # distinct suffixes


def test_bench_reports_reuse_and_equal_outputs() -> None:
    out = subprocess.run(
        [*RUN, "--num-prefixes", "2", "--requests-per-prefix", "4", "--prefix-len", "128",
         "--suffix-len", "8", "--max-tokens", "3", "--repeats", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    results = {r["config"]: r for r in json.loads(out.stdout.splitlines()[-1])["results"]}
    assert list(results) == ["off", "hash", "radix"]
    assert results["off"]["cached_fraction"] == 0.0
    for kind in ("hash", "radix"):
        # 6 of the 8 prompts reuse 128 of their 136 tokens (8 cached blocks)
        assert results[kind]["cached_fraction"] == 6 * 128 / (8 * 136)
        assert results[kind]["outputs_equal_off"]


def test_bad_arguments_are_one_line_errors() -> None:
    out = subprocess.run([*RUN, "--prefix-cache", "lru"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "unknown implementation 'lru'" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([*RUN, "--repeats", "0"], capture_output=True, text=True)
    assert out.returncode == 2 and "--repeats must be >= 1" in out.stderr
