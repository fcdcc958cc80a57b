"""Whether a test may expect the compiled attention kernel (`attention.native_attention`)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from prefixcache.attention import native_attention


def require_native_attention() -> None:
    """Skip where the kernel cannot exist (no C compiler, no MKL in torch, or switched off by
    the environment); everywhere else it must build and pass its probe."""
    if (
        shutil.which(os.environ.get("CC", "cc")) is None
        or not torch.backends.mkl.is_available()
        or native_attention.disabled_by_env()
    ):
        pytest.skip("native attention kernel unavailable: no C compiler or MKL, or switched off")
    assert native_attention.available(), "native attention kernel did not build or match"
