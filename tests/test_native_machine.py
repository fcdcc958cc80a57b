"""The sizes the kernels take from the machine: cache sizes, memory latency and streaming rate,
and the rules that turn them into the prefetch distance and the MLP's row chunk."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest

from prefixcache.model import tuning
from prefixcache.native import machine


def test_cache_sizes_are_read_from_the_system() -> None:
    caches = machine.caches()
    assert 4 << 10 <= caches.l1d <= caches.l2 <= max(caches.l3, caches.l2)
    assert caches.line in (32, 64, 128, 256)
    assert [machine._size(t) for t in ("32K", "1024K", "2M", "512\n")] == [
        32 << 10, 1 << 20, 2 << 20, 512
    ]  # fmt: skip


def test_prefetch_distance_is_latency_times_streaming_rate() -> None:
    # bytes in flight to cover a load's latency at the streaming rate, the nearer power of two
    def distance(latency_ns: float, gb_per_s: float) -> int:
        return machine.prefetch_distance(machine.Memory(latency_ns, gb_per_s))

    assert distance(100, 20) == 2048  # 2,000 bytes
    assert distance(184, 18.8) == 4096  # 3,459
    assert distance(80, 12) == 1024  # 960
    assert distance(10, 5) == 512 and distance(400, 60) == 8192  # the bounds
    assert machine.prefetch_distance(None) == 2048  # not measured


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
def test_memory_is_measured_once_per_machine() -> None:
    found = machine.memory()
    assert found is not None
    # a load past every cache costs tens to hundreds of nanoseconds; one core streams GB/s
    assert 20 < found.latency_ns < 2000
    assert 1 < found.bytes_per_ns < 500
    assert machine.prefetch_bytes() in (512, 1024, 2048, 4096, 8192)


def _measure_in_child(path: str, log: str) -> None:  # a separate process: the lock's users
    def measure() -> dict[str, int]:
        with open(log, "a") as f:
            f.write("measured\n")
        return {"value": os.getpid()}

    machine.measured_once(Path(path), measure)


def test_measured_once_measures_once_across_processes(tmp_path: Path) -> None:
    path, log = tmp_path / "m" / "figures.json", tmp_path / "log"
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(target=_measure_in_child, args=(str(path), str(log))) for _ in range(3)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    assert log.read_text() == "measured\n"  # the others waited and read it
    data, fresh = machine.measured_once(path, lambda: {"value": -1})
    assert not fresh and data == json.loads(path.read_text()) and data["value"] > 0
    path.write_text("{not json")  # a damaged file is measured again, not trusted
    assert machine.measured_once(path, lambda: {"value": -1}) == ({"value": -1}, True)


def test_mlp_chunk_keeps_the_activation_in_half_the_l3(monkeypatch: pytest.MonkeyPatch) -> None:
    def chunk(l3_mib: int, intermediate: int, element_size: int = 4) -> int:
        caches = machine.Caches(l1d=32 << 10, l2=1 << 20, l3=l3_mib << 20, line=64)
        monkeypatch.setattr(machine, "caches", lambda: caches)
        return tuning.mlp_chunk_rows(intermediate, element_size)

    assert chunk(32, 2816) == 512  # `small`: 11.5 MB of activation
    assert chunk(32, 1536) == 1024  # SmolLM2
    assert chunk(32, 1536, element_size=2) == 2048  # bfloat16: half the bytes a row
    assert chunk(8, 8192) == 64 and chunk(1024, 256) == 2048  # the bounds
    monkeypatch.setattr(tuning, "MLP_CHUNK_ROWS", 48)
    assert chunk(32, 1536) == 48  # set for a run
