"""Cascade prefill: sequences of a step that share cached leading blocks attend them in one call.

Prefix caching leaves many prefill sequences whose block tables start with the same physical
blocks and whose new tokens all come after them. Every new token sees the whole shared prefix, so
the queries of all those sequences are stacked against the shared K/V in one unmasked attention
(one large call instead of one masked call per sequence); each sequence then attends its own
remainder (unshared cached blocks, then its new tokens, causal) and the partial results are merged
by log-sum-exp. Sequences without such a group keep the per-sequence path in `paged_attention`.
"""

from __future__ import annotations

import numpy as np
import torch

from prefixcache.attention.metadata import AttentionMetadata
from prefixcache.attention.shared_prefix import SharedPrefix, find_shared_prefixes, merge_by_lse

__all__ = ["attend_group", "cascade_prefill", "prefill_groups"]

# SDPA's fused CPU kernel, which also returns the log-sum-exp of each query row:
# (q, k, v [B, heads, len, head_dim], dropout, is_causal, *, attn_mask, scale) -> (out, lse)
# with out [B, heads, q_len, head_dim] and lse [B, heads, q_len] (float32); kv heads may divide
# heads (GQA). is_causal is upper-left, which is right only when q_len == k_len.
_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def cascade_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> list[int]:
    """Fill ``out`` at the tokens of grouped prefill sequences; returns the sequences done.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (this step's);
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
    """
    if q.device.type != "cpu":
        return []
    done: list[int] = []
    for group in prefill_groups(metadata, q.device):
        attend_group(q, k, v, k_cache, v_cache, metadata, group, scale, out)
        done.extend(group.seq_indices.tolist())
    return done


def prefill_groups(metadata: AttentionMetadata, device: torch.device) -> list[SharedPrefix]:
    """The step's groups of prefill sequences sharing cached blocks (built once per step)."""
    return metadata.derived(("prefill_groups", device), lambda: _groups(metadata, device))


def _groups(metadata: AttentionMetadata, device: torch.device) -> list[SharedPrefix]:
    computed = np.asarray(metadata.num_computed)
    # only blocks wholly before a sequence's first new token, and only prefill sequences
    shareable = np.where(np.asarray(metadata.num_new) > 1, computed // metadata.block_size, 0)
    if np.count_nonzero(shareable) < 2:
        return []
    _, groups = find_shared_prefixes(metadata.block_tables.cpu().numpy(), shareable, device)
    return groups


def attend_group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    group: SharedPrefix,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Fill ``out`` at the tokens of ``group``'s sequences."""
    rows = group.seq_indices.tolist()
    starts = metadata.query_starts
    tokens = torch.cat([torch.arange(starts[b], starts[b + 1], device=q.device) for b in rows])
    shared_out, shared_lse = _attend_shared(q[tokens], k_cache, v_cache, group.block_ids, scale)
    num_shared = len(group.block_ids) * metadata.block_size
    num_new = {metadata.num_new[b] for b in rows}
    if len(num_new) == 1 and all(metadata.num_computed[b] == num_shared for b in rows):
        own_out, own_lse = _attend_new_batched(q[tokens], k[tokens], v[tokens], len(rows), scale)
    else:
        own = [_attend_own(q, k, v, k_cache, v_cache, metadata, b, num_shared, scale) for b in rows]
        own_out = torch.cat([o for o, _ in own])
        own_lse = torch.cat([lse for _, lse in own])
    merged, _ = merge_by_lse(shared_out, shared_lse, own_out, own_lse)
    out.index_copy_(0, tokens, merged.to(out.dtype))


def _attend_new_batched(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of num_seqs equal-length sequences on their new tokens only, in one call.

    q: [num_seqs * n, heads, head_dim]; k, v: [num_seqs * n, kv_heads, head_dim].
    """

    def batched(x: torch.Tensor) -> torch.Tensor:  # -> [num_seqs, heads, n, head_dim]
        return x.view(num_seqs, -1, x.shape[1], x.shape[2]).transpose(1, 2)

    out, lse = _flash_with_lse(batched(q), batched(k), batched(v), 0.0, True, scale=scale)
    return out.transpose(1, 2).reshape(q.shape), lse.transpose(1, 2).reshape(q.shape[:2])


def _attend_shared(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of the stacked queries q [n, heads, head_dim] over the shared blocks."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    # no mask, so row order is free: the query heads of one kv head stack as rows (GQA, no repeat)
    rows = q.view(num_tokens, num_kv_heads, group_size, head_dim).permute(1, 0, 2, 3)
    rows = rows.reshape(1, num_kv_heads, num_tokens * group_size, head_dim)
    # [num_shared_blocks, block_size, kv_heads, head_dim] -> [1, kv_heads, keys, head_dim]
    k_shared = k_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)
    v_shared = v_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)
    shared_out, shared_lse = _flash_with_lse(
        rows,
        k_shared.transpose(0, 1).unsqueeze(0),
        v_shared.transpose(0, 1).unsqueeze(0),
        0.0,
        False,
        attn_mask=None,
        scale=scale,
    )
    shared_out = shared_out.view(num_kv_heads, num_tokens, group_size, head_dim).transpose(0, 1)
    shared_lse = shared_lse.view(num_kv_heads, num_tokens, group_size).transpose(0, 1)
    return shared_out.reshape(q.shape), shared_lse.reshape(num_tokens, num_heads)


def _attend_own(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    b: int,
    num_shared: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's attention after the shared keys: [n, heads, head_dim] and lse [n, heads]."""
    start, end = metadata.query_starts[b], metadata.query_starts[b + 1]
    out, lse = _flash(q[start:end], k[start:end], v[start:end], True, scale)
    num_computed = metadata.num_computed[b]
    if num_computed == num_shared:
        return out, lse
    # unshared cached tokens: every new token sees all of them
    slots = metadata.context_slots[b]
    assert slots is not None  # a grouped sequence has cached context
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    cached = slots[num_shared:num_computed]
    k_own = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, cached)
    v_own = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, cached)
    cached_out, cached_lse = _flash(q[start:end], k_own, v_own, False, scale)
    return merge_by_lse(out, lse, cached_out, cached_lse)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, heads, head_dim] in; out [tokens, heads, head_dim] and lse [tokens, heads]."""
    out, lse = _flash_with_lse(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        0.0,
        is_causal,
        attn_mask=None,
        scale=scale,
    )
    return out.squeeze(0).transpose(0, 1), lse.squeeze(0).transpose(0, 1)
