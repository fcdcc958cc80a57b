"""Building the compiled kernels (`prefixcache.native`): the portable vector code (no AVX-512)
is right too, a build is cached by its inputs, and the environment switches each family off."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from native_support import require_native_attention, require_native_layers
from prefixcache import native
from prefixcache.attention import native_attention
from prefixcache.model import native_layers, panel_gemm, quant_gemm
from test_attention_native import check_row_invariance


@pytest.fixture
def without_avx512(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Both kernel libraries rebuilt without AVX-512 (their portable vector code), for the
    test; the normal build again afterwards."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX-512 switch is x86-only")
    require_native_attention()
    require_native_layers()
    flags = native.compile_flags()
    monkeypatch.setattr(native, "compile_flags", lambda: [*flags, "-mno-avx512f"])
    caches = [native_layers._library, native_layers.available, native_attention._kernel]
    caches += [native_attention.available, panel_gemm._library, panel_gemm.available]
    caches += [quant_gemm._library, quant_gemm.available]
    for cached in caches:
        cached.cache_clear()
    yield
    monkeypatch.undo()
    for cached in caches:
        cached.cache_clear()


@pytest.mark.usefixtures("without_avx512")
def test_portable_vector_code_passes_the_probes() -> None:
    # the probes compare against torch and a float64 reference: rms norm, silu (the clamped
    # exp), rotary, and the attention softmax over a causal tail with shuffled slots
    assert native_layers.available()
    assert native_attention.available()
    # the path that reads the cache directly is portable vector code too, and as invariant
    assert native_attention.prefill_path(128, 2048, 12, 4, 64) == "direct per kv head"
    for dtypes in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16)):
        for head_dim, shared, tails in ((64, 45, [3, 70, 1]), (128, 300, [33, 2])):
            check_row_invariance(3, 3, head_dim, shared, tails, 17, 2, dtypes, seed=5)
    gate_up = torch.tensor([[-200.0, -20.0, 0.0, 30.0, 1.0, 2.0, 3.0, 4.0]])
    gate, up = gate_up.split(4, dim=-1)
    torch.testing.assert_close(native_layers.silu_mul(gate_up), F.silu(gate) * up)
    # the panel GEMM's AVX2 kernels (bfloat16 widened): right, and a row's result the same bits
    # at any row count (so the model's projections take them, for batch invariance)
    for dtype in (torch.float32, torch.bfloat16):
        assert panel_gemm.available(dtype) and panel_gemm.kernel_name(dtype) == "AVX2"
        check_panel_rows_invariant(dtype)
    # the quantized blocks' AVX2 kernel (vpmaddubsw): its probe, and row invariance in every form
    assert quant_gemm.kernel_name() == "AVX2" and quant_gemm.available()
    check_quant_rows_invariant()


def check_quant_rows_invariant() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(100, 96, generator=gen).numpy()
    q, d, _ = quant_gemm.quantize_q8_0(weight)
    nibbles = (q.astype("int16") // 16 + 8).clip(0, 15).astype("int8")
    minimums = (d.astype("float32") * -8).astype("float16")
    x = torch.randn(23, 96, generator=gen)
    for packed in (quant_gemm.QuantWeight.pack(q, d, None), quant_gemm.QuantWeight.pack(
            nibbles, d, minimums, "q4_0")):  # fmt: skip
        every = packed.matmul(x)
        for rows in (1, 3, 4, 5, 9):
            for start in (0, 6):
                part = packed.matmul(x[start : start + rows])
                assert torch.equal(part, every[start : start + rows])


def check_panel_rows_invariant(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    for out_features, in_features in ((100, 33), (200, 130)):
        weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
        bias = torch.randn(out_features, generator=gen).to(dtype)
        packed = panel_gemm.PanelWeight.pack(weight)
        x = torch.randn(70, in_features, generator=gen).to(dtype)
        every = packed.matmul(x, bias)
        tol = 1e-4 if dtype == torch.float32 else 2**-6
        torch.testing.assert_close(every.float(), F.linear(x, weight, bias).float(), rtol=tol,
                                   atol=tol * in_features ** 0.5)
        for rows in (1, 3, 4, 5, 9, 17):
            for start in (0, 6):
                part = packed.matmul(x[start : start + rows], bias)
                assert torch.equal(part, every[start : start + rows])


def test_without_avx512_bf16_the_bfloat16_panel_gemm_is_the_avx2_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # an AVX-512 CPU without AVX512_BF16 (Skylake-X, Ice Lake): float32 on AVX-512F, bfloat16
    # widened in the AVX2 kernel, both right and batch invariant
    flags = native.compile_flags()
    if " avx512f" not in native.cpu_signature() or "-mno-avx512f" in flags:
        pytest.skip("needs an AVX-512 CPU and a build for it (not an AVX2 build)")
    require_native_layers()
    monkeypatch.setattr(native, "compile_flags", lambda: [*flags, "-mno-avx512bf16"])
    monkeypatch.delenv("PREFIXCACHE_PANEL_GEMM", raising=False)  # the choice measured, not forced
    caches = [native_layers._library, native_layers.available, panel_gemm._library]
    caches += [panel_gemm.available, panel_gemm.prefer_panel]
    for cached in caches:
        cached.cache_clear()
    try:
        assert panel_gemm.kernel_name(torch.float32) == "AVX-512F"
        assert panel_gemm.kernel_name(torch.bfloat16) == "AVX2"
        assert panel_gemm.available(torch.float32) and panel_gemm.available(torch.bfloat16)
        check_panel_rows_invariant(torch.bfloat16)
    finally:
        monkeypatch.undo()
        for cached in caches:
            cached.cache_clear()


def test_build_is_cached_by_its_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_native_layers()
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path))
    compiler = os.environ.get("CC", "cc")
    first = native._build(compiler, "layers")
    assert native._build(compiler, "layers") == first  # found, not rebuilt
    assert first.parent == tmp_path / "kernels" and first.name.startswith("layers-")
    monkeypatch.setenv("PREFIXCACHE_NATIVE_CFLAGS", "-DPREFIXCACHE_TEST_FLAG")
    assert native._build(compiler, "layers") != first  # the user's flags: another library
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 2  # no staging files left


@pytest.mark.parametrize(
    ("module", "variable"),
    [
        ("prefixcache.attention.native_attention", "PREFIXCACHE_NATIVE_ATTENTION"),
        ("prefixcache.model.native_layers", "PREFIXCACHE_NATIVE_LAYERS"),
    ],
)
def test_switched_off_by_the_environment(module: str, variable: str) -> None:
    code = f"import {module} as n; print(n.available())"
    env = dict(os.environ, **{variable: "0"})
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
