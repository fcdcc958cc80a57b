"""Batched decode attention: every sequence of a step with one new query token, in one pass.

The keys of a decode sequence already sit in the paged cache (its new token was written before
attention), so its attention reads only the cache, reached through its block table. K/V are
gathered by block, not by slot, and all decode sequences are computed together with a length mask.
Sequences whose tables start with the same physical blocks (what prefix caching produces) form a
group: attention over those shared blocks is computed once for the group's queries and merged with
each sequence's own remainder by log-sum-exp (cascade attention), so a shared prefix is read once
per step instead of once per sequence. The module knows block ids and lengths, never requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from prefixcache.attention import native_attention
from prefixcache.attention.shared_prefix import SharedPrefix, find_shared_prefixes, merge_by_lse

__all__ = ["DecodePlan", "SharedPrefix", "decode_attention", "prepared_whole_step"]

# Without a merge, tails are gathered a few sequences at a time: a gather above glibc's mmap
# threshold (at most 32 MiB) gets fresh pages that fault on every call, so one large gather is
# slower than several of at most this size (any shape; docs/performance.md).
_MAX_GATHER_BYTES = 4 << 20


@dataclass(slots=True)
class DecodePlan:
    """Where each decode sequence's keys lie: a group's shared blocks, then its own tail blocks.

    A shared block never holds a sequence's last token, so every tail has at least one key.
    """

    tail_block_ids: torch.Tensor  # [B, R] int64: blocks after the shared ones, padded with 0
    tail_mask: torch.Tensor  # [B, 1, 1, R * block_size] bool: True for keys inside the sequence
    shared: list[SharedPrefix]
    # the compiled kernel's inputs, derived on first use (`_native_inputs`); the plan is built
    # once per step, so every layer after the first reuses them
    native: _NativeInputs | None = None

    @classmethod
    def build(
        cls,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> DecodePlan:
        """block_tables: [B, max_blocks] int, seq_lens: [B] int (keys per sequence, >= 1)."""
        lens = np.asarray(seq_lens, dtype=np.int64)
        # a shared block never holds a sequence's last token: full blocks before that one
        shareable = (lens - 1) // block_size
        shared_blocks, shared = find_shared_prefixes(block_tables, shareable, device)
        num_blocks = -(-lens // block_size)
        width = int((num_blocks - shared_blocks).max())
        offsets = shared_blocks[:, None] + np.arange(width)
        in_seq = offsets < num_blocks[:, None]
        rows = np.arange(len(lens))[:, None]
        tail = np.where(in_seq, block_tables[rows, np.minimum(offsets, num_blocks[:, None] - 1)], 0)
        key_pos = shared_blocks[:, None] * block_size + np.arange(width * block_size)
        inside = (key_pos < lens[:, None])[:, None, None, :]
        return cls(
            tail_block_ids=torch.as_tensor(tail, dtype=torch.int64, device=device),
            tail_mask=torch.as_tensor(inside, device=device),
            shared=shared,
        )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    kv_code: int = 0,
) -> torch.Tensor:
    """Attention output [B, num_heads, head_dim] for one query per sequence.

    q: [B, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    with every key of every sequence already written (``kv_code``: a quantized layout's, whose
    rows are bytes; the kernel alone reads those).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if kv_code or native_attention.applies(q, k_cache, v_cache):
        return _attend_native(q, k_cache, v_cache, plan, scale, kv_code)
    if not plan.shared:
        return _attend_tail_fused(q, k_cache, v_cache, plan, scale)
    # GQA without repeating K/V: the query heads of one kv head become rows of one matmul
    q_grouped = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out, lse = _attend_tail(q_grouped, k_cache, v_cache, plan, scale)
    for group in plan.shared:
        if len(group.seq_indices) == num_seqs:  # rows are ascending: the group is every row
            shared_out, shared_lse = _attend_shared(q_grouped, k_cache, v_cache, group, scale)
            out, lse = merge_by_lse(out, lse, shared_out, shared_lse)
            continue
        rows = group.seq_indices
        shared_out, shared_lse = _attend_shared(q_grouped[rows], k_cache, v_cache, group, scale)
        out[rows], lse[rows] = merge_by_lse(out[rows], lse[rows], shared_out, shared_lse)
    return out.reshape(num_seqs, num_heads, head_dim)


@dataclass(slots=True)
class _NativeInputs:
    tail_slots: torch.Tensor  # [B, R * block_size] int64: each tail's slots, padded
    tail_lens: torch.Tensor  # [B] int32: keys in each tail
    parts: list[tuple[torch.Tensor, torch.Tensor]]  # (rows, shared slots) per kernel call
    # per part, the kernel call prepared in the step's first layer, for every layer
    prepared: list[native_attention.PreparedDecode | None]


def _native_inputs(plan: DecodePlan, block_size: int, device: torch.device) -> _NativeInputs:
    """Slots and lengths in the kernel's terms: one call per group (its shared slots) and one
    for the sequences outside every group (no shared slots)."""
    if plan.native is not None:
        return plan.native
    num_seqs = plan.tail_block_ids.shape[0]
    offsets = torch.arange(block_size, device=device)
    tail_slots = (plan.tail_block_ids.unsqueeze(2) * block_size + offsets).view(num_seqs, -1)
    tail_lens = plan.tail_mask.view(num_seqs, -1).sum(1, dtype=torch.int32)
    ungrouped = torch.ones(num_seqs, dtype=torch.bool)
    parts = [(group.seq_indices, _block_slots(group.block_ids, offsets)) for group in plan.shared]
    for group in plan.shared:
        ungrouped[group.seq_indices] = False
    if ungrouped.any():
        no_shared = torch.empty(0, dtype=torch.int64, device=device)
        parts.append((ungrouped.nonzero().view(-1), no_shared))
    plan.native = _NativeInputs(tail_slots, tail_lens, parts, [None] * len(parts))
    return plan.native


def _attend_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    kv_code: int = 0,
) -> torch.Tensor:
    """The compiled kernel, once per group (its shared keys read once for all its queries, one
    softmax per row over shared and own keys, no log-sum-exp merge) and once for the rest."""
    num_seqs, block_size = q.shape[0], k_cache.shape[1]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    inputs = _native_inputs(plan, block_size, q.device)
    tail_slots, tail_lens = inputs.tail_slots, inputs.tail_lens
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for i, (rows, shared_slots) in enumerate(inputs.parts):
        every = len(rows) == num_seqs  # rows are ascending: every sequence, in order
        q_part = q if every else q[rows]
        part = out if every else torch.empty(q_part.shape, dtype=q.dtype, device=q.device)
        prepared = inputs.prepared[i]
        if prepared is None:  # the step's first layer
            tails = (tail_slots, tail_lens) if every else (tail_slots[rows], tail_lens[rows])
            prepared = native_attention.PreparedDecode(
                q_part, k_flat, v_flat, shared_slots, *tails, part, kv_code
            )
            inputs.prepared[i] = prepared
        prepared(q_part, k_flat, v_flat, scale, part)
        if not every:
            out[rows] = part
    return out


def prepared_whole_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    out: torch.Tensor,
) -> native_attention.PreparedDecode | None:
    """The kernel prepared for a step whose sequences all decode in one call (they share one
    prefix, or none shares any), for compiled callers (`pc_layer`); None otherwise. q: the
    first layer's [B, num_heads, head_dim] (rows may be strided), ``out`` the output."""
    if not native_attention.applies(q, k_cache, v_cache):
        return None
    num_seqs, block_size = q.shape[0], k_cache.shape[1]
    inputs = _native_inputs(plan, block_size, q.device)
    if len(inputs.parts) != 1 or len(inputs.parts[0][0]) != num_seqs:
        return None
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    shared_slots = inputs.parts[0][1]
    return native_attention.PreparedDecode(
        q, k_flat, v_flat, shared_slots, inputs.tail_slots, inputs.tail_lens, out
    )


def _block_slots(block_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return (block_ids.unsqueeze(1) * len(offsets) + offsets).view(-1)


def _gather_tails(
    k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every tail: [B, kv_heads, R * block_size, head_dim] (views of one gather)."""
    num_seqs = plan.tail_block_ids.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # [B, R, block_size, kv_heads, head_dim] -> [B, R * block_size, kv_heads, head_dim]
    block_ids = plan.tail_block_ids.view(-1)
    k = k_cache.index_select(0, block_ids).view(num_seqs, -1, num_kv_heads, head_dim)
    v = v_cache.index_select(0, block_ids).view(num_seqs, -1, num_kv_heads, head_dim)
    return k.transpose(1, 2), v.transpose(1, 2)


def _attend_tail_fused(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
) -> torch.Tensor:
    # no merge follows, so no log-sum-exp is needed: SDPA's fused kernel reads the strided views
    num_seqs = q.shape[0]
    step = max(1, _MAX_GATHER_BYTES // max(1, k_cache[0].nbytes * plan.tail_block_ids.shape[1]))
    out = torch.empty_like(q)
    for start in range(0, num_seqs, step):
        chunk = DecodePlan(
            plan.tail_block_ids[start : start + step], plan.tail_mask[start : start + step], []
        )
        k, v = _gather_tails(k_cache, v_cache, chunk)
        out[start : start + step] = F.scaled_dot_product_attention(
            q[start : start + step].unsqueeze(2),
            k,
            v,
            attn_mask=chunk.tail_mask,
            scale=scale,
            enable_gqa=True,
        ).squeeze(2)
    return out


def _attend_tail(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = _gather_tails(k_cache, v_cache, plan)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [B, kv_heads, group, keys]
    scores.masked_fill_(plan.tail_mask.logical_not(), -torch.inf)
    return _softmax_values(scores, v)


def _attend_shared(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: SharedPrefix,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_seqs, num_kv_heads, group_size, head_dim = q.shape
    # every sequence of the group sees the same keys: its queries stack as rows per kv head
    rows = q.permute(1, 0, 2, 3).reshape(num_kv_heads, num_seqs * group_size, head_dim)
    k = k_cache.index_select(0, group.block_ids).view(-1, num_kv_heads, head_dim).permute(1, 2, 0)
    v = v_cache.index_select(0, group.block_ids).view(-1, num_kv_heads, head_dim).transpose(0, 1)
    scores = torch.matmul(rows, k).mul_(scale)  # [kv_heads, n * group, shared keys]
    out, lse = _softmax_values(scores, v)
    out = out.view(num_kv_heads, num_seqs, group_size, head_dim).transpose(0, 1)
    return out, lse.view(num_kv_heads, num_seqs, group_size).transpose(0, 1)


def _softmax_values(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scores) @ v and the log-sum-exp of each row (scores are overwritten)."""
    row_max = scores.amax(-1, keepdim=True)
    probs = scores.sub_(row_max).exp_()
    total = probs.sum(-1, keepdim=True)
    out = torch.matmul(probs, v).div_(total)
    return out, (row_max + total.log()).squeeze(-1)
