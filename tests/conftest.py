"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


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
