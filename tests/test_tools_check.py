"""`prefixcache check`: exit 0 on the healthy engine (both caches), a divergence when a cached
block's KV is corrupted (a fault this test injects through the check's step hook), 2 on a bad
workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prefixcache.cache import BlockRemoved, BlockStored
from prefixcache.cli import main
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.tools.check import (
    RunOutput,
    StepHook,
    WorkItem,
    compare,
    format_result,
    load_workload,
    run_check,
)  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SYSTEM = "System: answer briefly and cite the policy. Policy: refunds in 30 days. "
WORKLOAD = [
    {"prompt": SYSTEM + "Q: refund?"},
    {"prompt": SYSTEM + "Q: how long?", "max_tokens": 6},
    {"prompt": SYSTEM + "Q: refund?"},
    {"prompt": SYSTEM + "Q: a fee?", "cache_salt": "tenant-b"},
    {"prompt": SYSTEM + "Q: refund? And a fee?"},
    {"prompt": SYSTEM + "Q: data?"},
]


@pytest.fixture()
def workload(tmp_path: Path) -> str:
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(WORKLOAD))
    return str(path)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(["check", *argv])
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def test_check_passes_on_the_healthy_engine(
    workload: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "--workload", workload, "--num-kv-blocks", "16")
    assert code == 0, out + err
    assert "OK: outputs are identical" in out
    for name in ("hash cache", "radix cache"):
        line = next(x for x in out.splitlines() if x.strip().startswith(name))
        assert int(line.split("cached prompt tokens")[1].split()[0]) > 0  # the cache was used


def corrupt_first_committed_block() -> StepHook:
    """The fault: once the first wave is done, noise over the K/V of the oldest block that is
    still cached, so the next request that hits it reads wrong KV."""
    cached: list[int] = []  # block ids in the order they became hittable
    done: list[bool] = []

    def hook(engine: LLMEngine) -> None:
        if done:
            return
        for event in engine.take_kv_events():
            if isinstance(event, BlockStored):
                cached.extend(event.block_ids)
            elif isinstance(event, BlockRemoved):
                cached[:] = [b for b in cached if b not in event.block_ids]
        if cached and not engine.has_unfinished():
            gen = torch.Generator().manual_seed(0)
            kv = engine.kv_cache
            for cache in (*kv.k_caches, *kv.v_caches):
                noise = torch.randn(cache[cached[0]].shape, generator=gen) * 10.0
                cache[cached[0]] = noise.to(cache.dtype)
            done.append(True)

    return hook


def test_check_catches_a_corrupted_cached_block(workload: str) -> None:
    items = load_workload(workload)
    result = run_check("tiny", items, 16, ("hash",), step_hook=corrupt_first_committed_block)
    out = format_result(result, len(items))
    line = next(x for x in out if x.startswith("DIVERGENCE in hash cache"))
    assert "request 4," in line  # the first request of the second wave, which hit the block
    assert "cached prompt tokens" in line and "hit 0 cached" not in line


def test_compare_names_the_first_differing_request_and_position() -> None:
    ref = RunOutput("off", [[1, 2, 3], [4, 5, 6]], [0, 0])
    same = RunOutput("on", [[1, 2, 3], [4, 5, 6]], [0, 16])
    late = RunOutput("on", [[1, 2, 3], [4, 5, 7]], [0, 16])
    short = RunOutput("on", [[1, 2], [4, 5, 6]], [0, 16])
    assert compare(ref, same) is None
    d = compare(ref, late)
    assert d is not None and (d.request_index, d.token_position) == (1, 2)
    assert (d.expected_token, d.actual_token, d.num_cached_tokens) == (6, 7, 16)
    d = compare(ref, short)
    assert d is not None and (d.request_index, d.token_position, d.actual_token) == (0, 2, None)


def test_bad_workloads_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    for content in ("[]", '[{"prompt": ""}]', '[{"prompt": "x", "max_tokens": 0}]', "{nope"):
        bad.write_text(content)
        code, _, err = run_cli(capsys, "--workload", str(bad))
        assert code == 2 and "workload" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "--workload", str(tmp_path / "missing.json"))
    assert code == 2 and "cannot read" in err
    assert WorkItem("x").max_tokens > 0
