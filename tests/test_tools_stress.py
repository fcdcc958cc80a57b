"""`prefixcache stress`: clean for 30 s on the real engine, and a broken invariant exits 1."""

from __future__ import annotations

import json
from typing import Any

import pytest

from prefixcache.cli import main
from prefixcache.tools.stress import StressConfig, run_stress

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_stress_hash_runs_clean_for_30_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["stress", "--num-kv-blocks", "8", "--seconds", "30", "--seed", "1", "--json"])
    out = capsys.readouterr().out
    report = json.loads(out.splitlines()[-1])
    assert exc.value.code == 0, out
    assert "CLEAN" in out and report["violation"] is None
    # the pool is tiny: the run must really evict, preempt, fork and abort
    assert report["evictions"] > 10 and report["preemptions"] > 0
    assert report["forks"] > 0 and report["aborts"] > 0 and report["hit_tokens"] > 0
    assert report["integrity_checks"] >= report["steps"] > 100


def test_stress_reports_a_broken_invariant() -> None:
    def corrupt(engine: Any, step: int) -> None:
        if step == 20:  # a free block that claims an owner: a leaked reference
            free = [b for b in engine.cache.pool.blocks if b.ref_cnt == 0]
            free[0].ref_cnt += 1

    report = run_stress(StressConfig(num_kv_blocks=8, seconds=20, seed=2), after_step=corrupt)
    assert report.violation is not None
    assert report.violation.startswith("step 2")
    assert report.steps <= 21


def test_stress_bad_arguments_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--num-kv-blocks", "1"], ["--seconds", "0"], ["--prefix-cache", "nope"]):
        with pytest.raises(SystemExit) as exc:
            main(["stress", *argv])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "error:" in err and "Traceback" not in err


def test_stress_radix_runs_clean() -> None:
    report = run_stress(StressConfig(num_kv_blocks=8, seconds=8, prefix_cache="radix", seed=3))
    assert report.violation is None, report.violation
    assert report.evictions > 0 and report.preemptions > 0 and report.forks > 0
