"""Paged KV storage, attention metadata and paged attention against a dense reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from native_support import require_native_attention
from prefixcache.attention import (
    AttentionMetadata,
    PagedKVCache,
    native_attention,
    paged_attention,
    plan,
    write_kv,
)


def test_metadata_slots_positions_and_offsets():
    meta = AttentionMetadata.build([[7, 2, 5], [3], [4, 1, 6]], [5, 0, 8], [3, 2, 1], block_size=4)
    # seq 0: positions 5,6,7 -> block 2 (offsets 1..3); seq 1: block 3; seq 2: pos 8 -> block 6
    assert meta.positions.tolist() == [5, 6, 7, 0, 1, 8]
    assert meta.slot_mapping.tolist() == [9, 10, 11, 12, 13, 24]
    assert meta.query_start_loc.tolist() == [0, 3, 5, 6]
    assert meta.seq_lens.tolist() == [8, 2, 9]
    assert meta.logits_indices.tolist() == [2, 4, 5]
    assert meta.block_tables.tolist() == [[7, 2, 5], [3, 0, 0], [4, 1, 6]]
    assert meta.context_slots[1] is None and meta.causal_masks[1] is None  # fresh
    assert meta.context_slots[2] is None and meta.causal_masks[2] is None  # decode: block table
    assert meta.context_slots[0].tolist() == [28, 29, 30, 31, 8, 9, 10, 11]
    assert meta.causal_masks[0].tolist() == [
        [True] * 6 + [False] * 2,
        [True] * 7 + [False],
        [True] * 8,
    ]


@pytest.mark.parametrize(
    ("tables", "computed", "new", "message"),
    [
        ([[0]], [0], [5], "block table has 1 blocks"),
        ([[0]], [0], [0], "num_new=0 invalid"),
        ([[0], [1]], [0], [1, 1], "equal length"),
        ([[-1]], [0], [1], "negative block id"),
    ],
)
def test_metadata_rejects_bad_input(tables, computed, new, message):
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(tables, computed, new, block_size=4)


def test_copy_and_zero_blocks_touch_only_given_blocks():
    cache = PagedKVCache(2, 6, 4, 2, 8)
    for tensor in (*cache.k_caches, *cache.v_caches):
        tensor.copy_(torch.randn(tensor.shape))
    before = [t.clone() for t in (*cache.k_caches, *cache.v_caches)]
    cache.copy_blocks([(1, 4), (2, 1)])  # reads happen before writes
    for old, new in zip(before, (*cache.k_caches, *cache.v_caches), strict=True):
        assert torch.equal(new[4], old[1]) and torch.equal(new[1], old[2])
        assert torch.equal(new[[0, 2, 3, 5]], old[[0, 2, 3, 5]])
    cache.zero_blocks([0, 5])
    for tensor in (*cache.k_caches, *cache.v_caches):
        assert not tensor[[0, 5]].any() and tensor[[1, 2, 3, 4]].abs().sum() > 0
    with pytest.raises(ValueError, match="out of range"):
        cache.copy_blocks([(0, 6)])
    with pytest.raises(ValueError, match="appears twice"):
        cache.copy_blocks([(0, 1), (2, 1)])


def test_memory_budget_sizing():
    per_block = 2 * 3 * 16 * 2 * 8 * 4  # K and V, layers, block, heads, dim, float32
    cache = PagedKVCache.from_memory_budget(10 * per_block + 5, 3, 16, 2, 8)
    assert cache.num_blocks == 10 and cache.num_bytes == 10 * per_block
    with pytest.raises(ValueError, match="holds no block"):
        PagedKVCache.from_memory_budget(per_block - 1, 3, 16, 2, 8)


def _dense_reference(q, k, v, num_computed, scale):  # noqa: ANN001
    """Explicit softmax over a contiguous K/V; q: [n, H, D], k/v: [L, Hkv, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    query_pos = torch.arange(q.shape[0]).unsqueeze(1) + num_computed
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > query_pos, -math.inf)
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("path", ["native", "explicit", "sdpa"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (8, 1)])
def test_paged_attention_matches_dense_reference(
    heads: int, kv_heads: int, path: str, monkeypatch: pytest.MonkeyPatch
):
    # prefill sequences go through the compiled kernel where it builds; else, with cached
    # context, through GEMM-softmax-GEMM while their scores fit the limit, else through SDPA
    # with an additive mask: all must match the reference
    if path == "native":
        require_native_attention()
    else:
        monkeypatch.setattr(native_attention, "available", lambda: False)
        limit = 16 << 20 if path == "explicit" else 0
        monkeypatch.setattr(plan, "EXPLICIT_SCORES_MAX_BYTES", limit)
    torch.manual_seed(0)
    dim, block_size = 16, 4
    computed, new = [0, 9, 13, 3], [7, 1, 5, 1]
    ids = list(range(32))
    random.Random(0).shuffle(ids)
    tables = [ids[0:2], ids[2:5], ids[5:10], ids[10:11]]
    cache = PagedKVCache(1, 32, block_size, kv_heads, dim)
    k_cache, v_cache = cache.layer(0)
    full_k = [torch.randn(c + n, kv_heads, dim) for c, n in zip(computed, new, strict=True)]
    full_v = [torch.randn(c + n, kv_heads, dim) for c, n in zip(computed, new, strict=True)]
    for b, c in enumerate(computed):  # earlier steps wrote the context
        if c:
            prior = AttentionMetadata.build([tables[b]], [0], [c], block_size)
            write_kv(full_k[b][:c], full_v[b][:c], k_cache, v_cache, prior.slot_mapping)
    meta = AttentionMetadata.build(tables, computed, new, block_size)
    k = torch.cat([fk[c:] for fk, c in zip(full_k, computed, strict=True)])
    v = torch.cat([fv[c:] for fv, c in zip(full_v, computed, strict=True)])
    # q as the model passes it: a strided view of the fused q|k projection output
    q = torch.randn(sum(new), heads + kv_heads, dim)[:, :heads]
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=dim**-0.5)
    for b in range(len(new)):
        s, e = meta.query_starts[b], meta.query_starts[b + 1]
        ref = _dense_reference(q[s:e], full_k[b], full_v[b], computed[b], dim**-0.5)
        assert torch.allclose(out[s:e], ref, atol=1e-5), f"sequence {b}"
