"""Cascade prefill (the torch paths' way with sequences sharing cached blocks) against the
per-sequence masked path, on shapes prefix caching produces; and the compiled kernel, which takes
such sequences one by one, against the cascade."""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from native_support import require_native_attention
from prefixcache.attention import AttentionMetadata, native_attention, plan, write_kv
from prefixcache.attention.cascade_prefill import cascade_prefill

# the package re-exports the function under the module's name, so reach the module itself
paged = importlib.import_module("prefixcache.attention.paged_attention")

BLOCK_SIZE = 4
NUM_BLOCKS = 64
HEAD_DIM = 8


@pytest.fixture(autouse=True)
def _torch_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cascade belongs to the torch paths: the kernel, where it builds, bypasses it."""
    if "kernel" not in request.node.name:
        monkeypatch.setattr(native_attention, "available", lambda: False)


def _run(tables, computed, new, num_heads, num_kv_heads, seed=0):  # noqa: ANN001, ANN202
    """paged_attention with and without cascade prefill, and the sequences it grouped."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    meta = AttentionMetadata.build(tables, computed, new, BLOCK_SIZE)
    q = torch.randn(meta.num_tokens, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(meta.num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(meta.num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = HEAD_DIM**-0.5
    out = paged.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    grouped = cascade_prefill(q, k, v, k_cache, v_cache, meta, scale, torch.empty_like(q))
    original = plan.prefill_groups
    plan.prefill_groups = lambda *args: []  # a step planned without the cascade
    try:
        fresh = AttentionMetadata.build(tables, computed, new, BLOCK_SIZE)
        reference = paged.paged_attention(q, k, v, k_cache, v_cache, fresh, scale)
    finally:
        plan.prefill_groups = original
    return out, reference, sorted(grouped)


def _blocks(count: int, rng: random.Random, used: set[int]) -> list[int]:
    """Shuffled physical block ids not used yet (block 0 included: it is not a sentinel here)."""
    ids = rng.sample(sorted(set(range(NUM_BLOCKS)) - used), count)
    used.update(ids)
    return ids


def _shared_batch(num_seqs, num_shared, extra_cached, new, rng):  # noqa: ANN001, ANN202
    """Tables starting with the same num_shared blocks; each sequence then has its own blocks."""
    used: set[int] = set()
    prefix = _blocks(num_shared, rng, used)
    tables, computed = [], []
    for b in range(num_seqs):
        n_computed = num_shared * BLOCK_SIZE + extra_cached[b]
        own = -(-(n_computed + new[b]) // BLOCK_SIZE) - num_shared
        tables.append(prefix + _blocks(own, rng, used))
        computed.append(n_computed)
    return tables, computed


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (4, 4), (6, 1)])
def test_shared_prefix_equal_suffixes_match_reference(num_heads, num_kv_heads):
    rng = random.Random(1)
    tables, computed = _shared_batch(5, 6, [0] * 5, [7] * 5, rng)
    out, reference, grouped = _run(tables, computed, [7] * 5, num_heads, num_kv_heads)
    assert grouped == [0, 1, 2, 3, 4]
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (4, 4)])
def test_unshared_cached_tokens_and_uneven_suffixes_match_reference(num_heads, num_kv_heads):
    rng = random.Random(2)
    # cached tokens past the shared blocks, some ending mid-block; new lengths differ
    extra, new = [0, 3, 5, 9], [2, 6, 9, 4]
    tables, computed = _shared_batch(4, 3, extra, new, rng)
    out, reference, grouped = _run(tables, computed, new, num_heads, num_kv_heads, seed=2)
    assert grouped == [0, 1, 2, 3]
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_tables_diverging_mid_prefix_share_only_common_blocks():
    rng = random.Random(3)
    used: set[int] = set()
    common, a, b = _blocks(2, rng, used), _blocks(5, rng, used), _blocks(5, rng, used)
    # sequences 0 and 2 also share block a[0], which sequence 1 does not hold
    tables = [common + a, common + b, common + a[:1] + _blocks(3, rng, used)]
    computed, new = [4 * BLOCK_SIZE, 4 * BLOCK_SIZE + 2, 3 * BLOCK_SIZE + 1], [3, 5, 8]
    out, reference, grouped = _run(tables, computed, new, 4, 2, seed=3)
    assert grouped == [0, 1, 2]
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_mixed_batch_with_decodes_fresh_and_lone_prefills_matches_reference():
    rng = random.Random(4)
    used: set[int] = set()
    prefix = _blocks(4, rng, used)
    tables = [
        prefix + _blocks(2, rng, used),  # grouped prefill
        _blocks(3, rng, used),  # fresh prefill: no cached context
        prefix + _blocks(2, rng, used),  # decode over the same prefix: not a prefill group
        prefix + _blocks(2, rng, used),  # grouped prefill
        _blocks(4, rng, used),  # prefill with cached context of its own: per-sequence path
        prefix + _blocks(1, rng, used),  # decode
    ]
    computed = [16, 0, 21, 18, 9, 17]
    new = [6, 10, 1, 5, 4, 1]
    out, reference, grouped = _run(tables, computed, new, 4, 2, seed=4)
    assert grouped == [0, 3]
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_lone_or_unshared_prefills_keep_the_per_sequence_path():
    rng = random.Random(5)
    used: set[int] = set()
    tables = [_blocks(4, rng, used), _blocks(4, rng, used), _blocks(1, rng, used)]
    # distinct first blocks; a sequence with fewer than one full cached block shares nothing
    out, reference, grouped = _run(tables, [8, 6, 3], [5, 7, 1], 4, 2, seed=5)
    assert grouped == []
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_kernel_takes_shared_sequences_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    require_native_attention()
    rng = random.Random(6)
    extra, new = [0, 3, 5, 9, 0], [2, 6, 9, 4, 1]  # the last one a decode over the prefix
    tables, computed = _shared_batch(5, 3, extra, new, rng)
    gen = torch.Generator().manual_seed(6)
    shape = (NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    meta = AttentionMetadata.build(tables, computed, new, BLOCK_SIZE)
    q = torch.randn(meta.num_tokens, 6, HEAD_DIM, generator=gen)
    k = torch.randn(meta.num_tokens, 2, HEAD_DIM, generator=gen)
    v = torch.randn(meta.num_tokens, 2, HEAD_DIM, generator=gen)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend() -> torch.Tensor:
        return paged.paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)

    native_attention.set_enabled(False)
    try:
        cascade = attend()
    finally:
        native_attention.set_enabled(True)
    monkeypatch.setattr(plan, "prefill_groups", lambda *args: pytest.fail("cascade planned"))
    torch.testing.assert_close(attend(), cascade, atol=1e-5, rtol=1e-5)
