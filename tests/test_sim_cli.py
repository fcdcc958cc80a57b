"""``prefixcache simulate``: outputs (table, JSON, CSV, valid PNG plots) and one-line errors."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.sim.cli import parse_capacity
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.errors import TraceFormatError
from prefixcache.sim.plots import PLOT_FILES

FIXTURES = Path(__file__).parent / "fixtures"
SYNTHETIC = FIXTURES / "mooncake_synthetic_150.jsonl"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _simulate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", *argv, "--no-progress"])
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def test_sweep_writes_table_json_csv_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        str(SYNTHETIC),
        "--capacity",
        "300,inf",
        "--eviction-policy",
        "lru,lfu",
        "--replicas",
        "1,2",
        "--router",
        "round-robin,cache-aware",
        "--out",
        str(tmp_path),
    ]
    code, out, _ = _simulate(argv, capsys)
    assert code == 0
    assert "skipped lfu x hash" in out and "cache-aware" in out
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    # (hash lru, radix lru, radix lfu) x 2 capacities + 2 routers at 2 replicas
    assert len(rows) == 8
    with (tmp_path / "results.csv").open() as file:
        assert len(list(csv.DictReader(file))) == 8
    unlimited = [r for r in rows if r["capacity_label"] == "inf"]
    assert all(r["hit_ratio"] == pytest.approx(r["ideal_hit_ratio"]) for r in unlimited)
    import matplotlib.image

    for name in PLOT_FILES:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        image = matplotlib.image.imread(tmp_path / name)
        assert image.shape[0] > 100 and image.shape[1] > 100


def test_synthetic_workload_in_timed_mode(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "synthetic:few-shot:num_requests=40,rate=20",
        "--capacity",
        "200",
        "--mode",
        "timed",
        "--prefix-cache",
        "radix",
    ]
    code, out, _ = _simulate(argv, capsys)
    assert code == 0 and "few-shot" in out and "radix" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["/nonexistent/trace.jsonl"], "does not exist"),
        ([str(SYNTHETIC), "--router", "sticky", "--replicas", "2"], "unknown --router"),
        ([str(SYNTHETIC), "--capacity", "lots"], "bad capacity"),
        ([str(SYNTHETIC), "--prefix-cache", "btree"], "unknown prefix cache"),
        ([str(SYNTHETIC), "--eviction-policy", "lfu", "--prefix-cache", "hash"],
         "nothing to simulate"),
        (["synthetic:nope"], "unknown synthetic workload"),
    ],
)
def test_bad_input_is_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _simulate(argv, capsys)
    assert code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_malformed_line_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(SYNTHETIC.read_text().splitlines()[0] + "\n{oops\n")
    code, _, err = _simulate([str(path)], capsys)
    assert code == 2 and "bad.jsonl:2" in err and err.count("\n") == 1


def test_parse_capacity() -> None:
    assert [parse_capacity(s) for s in ("1k", "10K", "1.5M", "750", "inf")] == [
        1000,
        10000,
        1_500_000,
        750,
        None,
    ]
    with pytest.raises(ValueError):
        parse_capacity("0")


def test_cost_model_from_json_fits_measurements(tmp_path: Path) -> None:
    path = tmp_path / "bench.txt"
    calibration = {
        "cost_model": {
            "prefill": [{"tokens": 1000, "seconds": 0.06}, {"tokens": 3000, "seconds": 0.16}],
            "decode": [{"batch": 1, "seconds": 0.011}, {"batch": 9, "seconds": 0.015}],
        }
    }
    path.write_text("some table\n" + json.dumps(calibration) + "\n")
    model = CostModel.from_json(path)
    assert model.prefill_tokens_per_s == pytest.approx(20_000)
    assert model.overhead_s == pytest.approx(0.01)
    assert model.decode_per_seq_s == pytest.approx(0.0005)
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(TraceFormatError, match="no cost-model keys"):
        CostModel.from_json(tmp_path / "empty.json")


def test_without_the_sim_extra_there_are_tables_but_no_plots(tmp_path: Path) -> None:
    # matplotlib and tqdm come with `prefixcache[sim]`; a lean install still simulates
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.modules['tqdm'] = None\n"
        "from prefixcache.cli import main\n"
        f"sys.exit(main(['simulate', {str(SYNTHETIC)!r}, '--capacity', '300', "
        f"'--prefix-cache', 'hash', '--out', {str(tmp_path)!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "hash" in out.stdout and "prefixcache[sim]" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv", "results.json"]


def test_kv_layouts_size_the_pool_from_its_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # each --kv-cache-dtype gets the blocks of its own size in --kv-cache-gib; smaller rows
    # hold more of the trace and hit more
    code, out, _ = _simulate([str(SYNTHETIC), "--kv-cache-dtype", "float32,int8,int4",
                              "--kv-cache-gib", "8", "--prefix-cache", "hash",
                              "--out", str(tmp_path), "--no-plots"], capsys)  # fmt: skip
    assert code == 0 and "@int8" in out
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    blocks = {r["capacity_label"].split("@")[1]: r["capacity_blocks"] for r in rows}
    hits = {r["capacity_label"].split("@")[1]: r["hit_ratio"] for r in rows}
    assert blocks["int8"] == int(8 * 2**30 // (131072 * 34 / 64 * 512))
    assert blocks["float32"] < blocks["int8"] < blocks["int4"]
    assert hits["float32"] < hits["int8"] <= hits["int4"]
    code, _, err = _simulate([str(SYNTHETIC), "--kv-cache-dtype", "int8"], capsys)
    assert code == 2 and "needs --kv-cache-gib" in err
    code, _, err = _simulate([str(SYNTHETIC), "--kv-cache-dtype", "int3", "--kv-cache-gib", "1"],
                             capsys)  # fmt: skip
    assert code == 2 and "int3" in err
