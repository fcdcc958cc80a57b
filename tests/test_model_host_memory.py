"""glibc malloc tuning: a prefill's freed temporaries are reused instead of faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="tunes glibc malloc (Linux)"
)

# Minor page faults of 5 rounds of (2,048-token prefill, 128-token step) on the tiny model,
# after 2 warm-up rounds, in a fresh process: malloc settings are process-wide.
_ROUNDS = """
import resource, sys, torch
from prefixcache.attention import AttentionMetadata
from prefixcache.model import load_model
from prefixcache.model.host_memory import retain_freed_memory
tuned = retain_freed_memory() if sys.argv[1] == "tune" else None
torch.set_num_threads(2)
loaded = load_model("tiny")
cache = loaded.make_kv_cache(num_blocks=160, block_size=16)
ids = torch.arange(2048) % 250
def step(first_block, num_tokens):
    table = list(range(first_block, first_block + num_tokens // 16))
    meta = AttentionMetadata.build([table], [0], [num_tokens], 16)
    loaded.model(ids[:num_tokens], meta.positions, cache, meta)
for _ in range(2):
    step(0, 2048), step(128, 128)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step(0, 2048), step(128, 128)
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, **env: str) -> tuple[str, int]:
    run = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    tuned, faults = run.stdout.split()
    return tuned, int(faults)


def test_tuned_process_reuses_a_prefills_freed_memory() -> None:
    tuned, tuned_faults = _faults("tune")
    assert tuned == "True"
    _, default_faults = _faults("default")
    # measured: 14,000-36,000 faults by default, 2-1,300 tuned
    assert tuned_faults * 4 < default_faults


def test_users_malloc_settings_win() -> None:
    tuned, _ = _faults("tune", MALLOC_TRIM_THRESHOLD_=str(64 << 20))
    assert tuned == "False"
