"""Batched decode attention (block gather, length mask, cascade over shared blocks) against a
dense reference computed from each sequence's contiguous K/V."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from prefixcache.attention import (
    AttentionMetadata,
    PagedKVCache,
    paged_attention,
    write_kv,
)
from prefixcache.attention.decode_attention import DecodePlan, decode_attention

BLOCK_SIZE = 4


def _dense_decode(q, k, v, scale):  # noqa: ANN001
    """q: [H, D], k/v: [L, Hkv, D] -> [H, D]: the last position attends every key."""
    groups = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("hd,lhd->hl", q, k) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


class _Batch:
    """Decode sequences whose tables may start with common physical blocks holding common K/V."""

    def __init__(self, prefixes, lens, heads, kv_heads, dim, seed):  # noqa: ANN001
        """prefixes[b]: (group, shared block count) or None; lens[b]: keys of sequence b."""
        torch.manual_seed(seed)
        num_ids = sum(-(-n // BLOCK_SIZE) for n in lens) + sum(p[1] for p in prefixes if p) + 8
        ids = list(range(num_ids))
        random.Random(seed).shuffle(ids)
        cache = PagedKVCache(1, len(ids), BLOCK_SIZE, kv_heads, dim)
        self.k_cache, self.v_cache = cache.layer(0)
        group_blocks: dict[object, list[int]] = {}
        group_kv: dict[object, tuple[torch.Tensor, torch.Tensor]] = {}
        self.tables, self.full_k, self.full_v = [], [], []
        for prefix, n in zip(prefixes, lens, strict=True):
            k, v = torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
            table = [ids.pop() for _ in range(-(-n // BLOCK_SIZE))]
            if prefix is not None:
                group, count = prefix
                shared = group_blocks.setdefault(group, [ids.pop() for _ in range(count)])
                table[:count] = shared[:count]
                shared_k, shared_v = group_kv.setdefault(group, (k.clone(), v.clone()))
                k[: count * BLOCK_SIZE] = shared_k[: count * BLOCK_SIZE]
                v[: count * BLOCK_SIZE] = shared_v[: count * BLOCK_SIZE]
            slots = AttentionMetadata.build([table], [0], [n], BLOCK_SIZE).slot_mapping
            write_kv(k, v, self.k_cache, self.v_cache, slots)
            self.tables.append(table + [0] * random.Random(n).randrange(3))  # ragged padding
            self.full_k.append(k)
            self.full_v.append(v)
        self.lens = lens
        self.q = torch.randn(len(lens), heads, dim)

    def padded_tables(self) -> np.ndarray:
        width = max(len(t) for t in self.tables)
        return np.array([t + [0] * (width - len(t)) for t in self.tables], dtype=np.int64)

    def reference(self, scale: float) -> torch.Tensor:
        return torch.stack(
            [
                _dense_decode(self.q[b], self.full_k[b], self.full_v[b], scale)
                for b in range(len(self.lens))
            ]
        )


CASES = {
    # name: (prefixes, lens)
    "unshared": ([None] * 5, [1, 4, 9, 17, 30]),
    "one_shared_prefix": ([("a", 6)] * 5, [25, 26, 28, 29, 40]),
    "two_groups_and_a_loner": (
        [("a", 3), ("b", 5), ("a", 3), None, ("b", 5), ("b", 5)],
        [13, 21, 16, 7, 24, 33],
    ),
    "shared_block_holds_a_last_token": ([("a", 4)] * 3, [16, 17, 20]),
    "identical_tables": ([("a", 3)] * 2, [12, 12]),
}


# every test through the compiled kernel and through the torch paths (conftest.py)
pytestmark = pytest.mark.usefixtures("native_kernels")


@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(6, 2), (4, 4), (12, 4)], ids=["gqa", "mha", "small"]
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_attention_matches_dense_reference(case, heads, kv_heads):
    prefixes, lens = CASES[case]
    batch = _Batch(prefixes, lens, heads, kv_heads, 16, seed=len(case) + heads)
    plan = DecodePlan.build(batch.padded_tables(), np.array(lens), BLOCK_SIZE)
    out = decode_attention(batch.q, batch.k_cache, batch.v_cache, plan, 16**-0.5)
    assert torch.allclose(out, batch.reference(16**-0.5), atol=1e-5, rtol=0)


def test_plan_computes_shared_blocks_once_per_group():
    prefixes, lens = CASES["two_groups_and_a_loner"]
    batch = _Batch(prefixes, lens, 4, 2, 8, seed=0)
    plan = DecodePlan.build(batch.padded_tables(), np.array(lens), BLOCK_SIZE)
    groups = sorted((g.seq_indices.tolist(), g.block_ids.tolist()) for g in plan.shared)
    assert groups == [
        ([0, 2], batch.tables[0][:3]),
        ([1, 4, 5], batch.tables[1][:5]),
    ]
    # tails: seq 0 has 13 keys = 4 blocks, 3 shared -> 1 own; the loner keeps its 2 blocks
    assert plan.tail_block_ids.shape == (6, 4)  # seq 5: 9 blocks, 5 shared
    assert plan.tail_block_ids[3, :2].tolist() == batch.tables[3][:2]
    assert plan.tail_mask[3, 0, 0].sum().item() == 7


def test_paged_attention_routes_a_mixed_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill chunks and decode tokens of one step: each output equals its dense reference."""
    torch.manual_seed(1)
    heads, kv_heads, dim = 6, 2, 8
    computed, new = [24, 0, 24, 11, 24], [1, 6, 1, 3, 1]
    ids = list(range(40))
    random.Random(1).shuffle(ids)
    prefix_blocks = ids[:6]
    tables = [prefix_blocks + ids[6:7], ids[7:9], prefix_blocks + ids[9:10], ids[10:14]]
    tables.append(prefix_blocks + ids[14:15])
    cache = PagedKVCache(1, 40, BLOCK_SIZE, kv_heads, dim)
    k_cache, v_cache = cache.layer(0)
    prefix_k, prefix_v = torch.randn(24, kv_heads, dim), torch.randn(24, kv_heads, dim)
    full_k, full_v = [], []
    for b, (c, n) in enumerate(zip(computed, new, strict=True)):
        own_k, own_v = torch.randn(c + n, kv_heads, dim), torch.randn(c + n, kv_heads, dim)
        if c == 24:
            own_k[:24], own_v[:24] = prefix_k, prefix_v
        full_k.append(own_k)
        full_v.append(own_v)
        if c:
            prior = AttentionMetadata.build([tables[b]], [0], [c], BLOCK_SIZE)
            write_kv(own_k[:c], own_v[:c], k_cache, v_cache, prior.slot_mapping)
    meta = AttentionMetadata.build(tables, computed, new, BLOCK_SIZE)
    k = torch.cat([fk[c:] for fk, c in zip(full_k, computed, strict=True)])
    v = torch.cat([fv[c:] for fv, c in zip(full_v, computed, strict=True)])
    q = torch.randn(sum(new), heads, dim)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=dim**-0.5)
    for b in range(len(new)):
        s, e = meta.query_starts[b], meta.query_starts[b + 1]
        for i in range(e - s):
            pos = computed[b] + i + 1
            ref = _dense_decode(q[s + i], full_k[b][:pos], full_v[b][:pos], dim**-0.5)
            assert torch.allclose(out[s + i], ref, atol=1e-5, rtol=0), f"sequence {b} token {i}"
    assert math.isfinite(out.abs().sum().item())
    # the step's second layer (same metadata) reuses the decode plan and gets the same output
    builds: list[int] = []
    real_build = DecodePlan.build

    def counted_build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        builds.append(1)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(DecodePlan, "build", counted_build)
    assert torch.equal(paged_attention(q, k, v, k_cache, v_cache, meta, scale=dim**-0.5), out)
    assert builds == []
