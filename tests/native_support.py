"""Whether a test may expect the compiled kernels (`attention.native_attention`,
`model.native_layers`)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from prefixcache.attention import native_attention
from prefixcache.model import native_layers


def _require_compiler(switched_off: bool, what: str) -> None:
    if shutil.which(os.environ.get("CC", "cc")) is None or switched_off:
        pytest.skip(f"native {what} unavailable: no C compiler, or switched off")


def require_native_attention() -> None:
    """Skip where the kernel cannot exist (no C compiler, no MKL in torch, or switched off by
    the environment); everywhere else it must build and pass its probe."""
    if not torch.backends.mkl.is_available():
        pytest.skip("native attention kernel unavailable: no MKL in torch")
    _require_compiler(native_attention.disabled_by_env(), "attention kernel")
    assert native_attention.available(), "native attention kernel did not build or match"


def require_native_layers() -> None:
    """As `require_native_attention`, for the element-wise kernels (no MKL needed)."""
    _require_compiler(native_layers.disabled_by_env(), "layers")
    assert native_layers.available(), "native layers did not build or match"
