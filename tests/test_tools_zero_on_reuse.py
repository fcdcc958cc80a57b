"""Zero-on-reuse: a KV block handed to another namespace holds zeros wherever the new owner has
not written yet, with ``zero_on_reuse=True``; without it the old tenant's KV is still there."""

from __future__ import annotations

import pytest
import torch

from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


BLOCK = 16


def unwritten_slots_after_reuse(zero: bool) -> list[torch.Tensor]:
    """Tenant a fills the whole pool, tenant b then reuses it: K/V of b's blocks beyond what b
    wrote (the slots a read-before-write would see), every layer."""
    engine = LLMEngine(
        "tiny", block_size=BLOCK, num_kv_blocks=4, zero_on_reuse=zero, check_integrity=True
    )
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.add_request(
        "a",
        prompt_token_ids=[7 + i % 200 for i in range(60)],
        sampling_params=params,
        cache_salt="tenant-a",
    )
    while engine.has_unfinished():
        engine.step()
    engine.add_request(
        "b", prompt_token_ids=[9] * 20, sampling_params=params, cache_salt="tenant-b"
    )
    engine.step()  # b's prefill: its blocks are taken, zeroed (or not), then written
    (chunk,) = engine.last_scheduled.chunks
    kv = engine.runner.kv_cache
    written = chunk.num_computed_tokens + chunk.num_new_tokens  # tokens b has KV for
    slots = []
    for index, block_id in enumerate(chunk.block_table):
        first_unwritten = max(written - index * BLOCK, 0)
        for cache in (*kv.k_caches, *kv.v_caches):
            slots.append(cache[block_id, first_unwritten:])
    while engine.has_unfinished():
        engine.step()
    return slots


def test_reused_block_reads_zeros_before_any_write_with_zeroing_on() -> None:
    slots = unwritten_slots_after_reuse(zero=True)
    assert sum(s.numel() for s in slots) > 0
    assert all(torch.count_nonzero(s) == 0 for s in slots)


def test_without_zeroing_the_previous_tenants_kv_is_still_there() -> None:
    # the contrast that makes the test above meaningful: logical eviction leaves the bytes
    slots = unwritten_slots_after_reuse(zero=False)
    assert any(torch.count_nonzero(s) > 0 for s in slots)


def test_server_flag_reaches_the_cache() -> None:
    import argparse

    from prefixcache.server.cli import _engine, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--zero-on-reuse", "--num-kv-blocks", "4"])
    assert _engine(args).cache.pool.zero_on_reuse is True
