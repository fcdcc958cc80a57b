"""Fixtures shared by the test modules."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

_GROWTH_BEFORE_COLLECT = 1 << 30
_rss_after_collect = [0]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(autouse=True)
def _collect_dropped_engines() -> Iterator[None]:
    """Run the cycle collector once the process has grown by a GiB since it last ran.

    An engine is freed by the cycle collector, not by reference counting (its parts call back
    into it), and Python runs its oldest generation rarely: the engines tests drop without
    ``close`` (each with its KV pool, 512 MiB for ``tiny``) would pile up for the whole suite
    (20 GB by its end, measured). A look at RSS per test costs microseconds."""
    yield
    if _rss_bytes() - _rss_after_collect[0] > _GROWTH_BEFORE_COLLECT:
        gc.collect()
        _rss_after_collect[0] = _rss_bytes()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run a module's model work on one torch thread, restored afterwards.

    The tiny model's ops are too small to split: extra threads only spin, and on a loaded 2-core
    machine they thrash (about 10x slower). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["native", "torch"])
def native_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through the compiled kernels (attention and layers) and again through the
    torch code alone.

    Modules opt in with ``pytestmark = pytest.mark.usefixtures("native_kernels")``.
    """
    from native_support import require_native_attention, require_native_layers
    from prefixcache.attention import native_attention
    from prefixcache.model import native_layers

    if request.param == "native":
        require_native_attention()
        require_native_layers()
    else:
        monkeypatch.setattr(native_attention, "available", lambda: False)
        monkeypatch.setattr(native_layers, "available", lambda: False)
    return str(request.param)


@pytest.fixture
def gemm_library(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Force the start-up choice of GEMM (per test): a model loaded after
    ``gemm_library("mkl")``, ``("onednn")`` or ``("panel")`` packs its projections for MKL's
    packed GEMM, oneDNN's or the panel GEMM (`model.panel_gemm`). The choice is otherwise a
    timing, which on a tiny shape may go either way."""
    from prefixcache.model import onednn_gemm, panel_gemm

    def clear() -> None:
        onednn_gemm.prefer_onednn.cache_clear()
        panel_gemm.prefer_panel.cache_clear()

    def force(name: str) -> None:
        assert name in ("mkl", "onednn", "panel")
        monkeypatch.setenv("PREFIXCACHE_ONEDNN_LINEAR", "1" if name == "onednn" else "0")
        monkeypatch.setenv("PREFIXCACHE_PANEL_GEMM", "1" if name == "panel" else "0")
        clear()

    yield force
    clear()
