"""Paged attention: write new K/V through the slot mapping, then attend.

Each sequence's queries attend its cached context (gathered from the paged cache through its
block table) plus its new tokens, causal within the new ones. A sequence without cached context
takes the fast path: causal attention on its fresh K/V, no gather, no explicit mask. Decode
sequences (one new token) are computed together by `decode_attention`, and on the torch paths
prefill sequences that share cached leading blocks by `cascade_prefill`: both read those shared
blocks once.

A prefill over cached context whose score matrix is small (`EXPLICIT_SCORES_MAX_BYTES`, the
typical cache hit: 128 new tokens over 2,048) is computed on CPU as two batched GEMMs and a
softmax (`_attend_explicit`), faster there than SDPA's fused kernel; larger ones go through SDPA
with an additive mask (`_attend_stacked`). Where the compiled CPU kernel builds
(`native_attention`, float32), it takes every prefill sequence instead, fresh or over cached
context, shared or not; the torch paths above are the reference and the fallback. Which path
takes which sequence is decided once per step, in the step's `AttentionPlan` (``plan.py``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from prefixcache.attention import native_attention
from prefixcache.attention.cascade_prefill import attend_group
from prefixcache.attention.decode_attention import DecodePlan, decode_attention
from prefixcache.attention.kv_format import KVFormat
from prefixcache.attention.metadata import AttentionMetadata, min_max
from prefixcache.attention.plan import EXPLICIT_SCORES_MAX_BYTES, AttentionPlan, attention_plan

__all__ = ["EXPLICIT_SCORES_MAX_BYTES", "paged_attention", "step_decode_plan", "write_kv"]


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_format: KVFormat | None = None,
) -> None:
    """Store the step's new K/V; k, v: [T, num_kv_heads, head_dim], caches paged, in
    ``kv_format`` (None: rows of the caches' dtype; a quantized layout quantizes each row)."""
    if kv_format is not None and (kv_format.quantized or kv_format.storage != k.dtype):
        kv_format.write(k, v, k_cache, v_cache, slot_mapping)
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Attention output [T, num_heads, head_dim], by the step's `AttentionPlan` (the one the
    caller built for the step, else one built here for ``q``).

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (this step's, already written);
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
    """
    if plan is None:
        plan = attention_plan(q, k_cache, v_cache, metadata)
    layout = plan.kv_format
    code = layout.code if layout is not None and layout.quantized else 0
    if layout is not None and not plan.native and (code or layout.storage != q.dtype):
        # the torch paths: over the values the step's blocks hold, in the queries' dtype
        k_cache, v_cache, k, v, metadata = _dequantized(layout, k_cache, v_cache, metadata,
                                                        q.dtype)  # fmt: skip
        plan = _torch_plan(q, k_cache, v_cache, metadata)
        code = 0
    num_kv_heads = k.shape[1]
    gqa = q.shape[1] != num_kv_heads
    if plan.whole_step_causal:
        return _attend_causal(q, k, v, scale, gqa)
    k_flat = k_cache.view(-1, num_kv_heads, k_cache.shape[-1])
    v_flat = v_cache.view(-1, num_kv_heads, v_cache.shape[-1])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.decode_rows:
        _attend_decodes(q, k_cache, v_cache, metadata, list(plan.decode_rows), scale, out, code)
    for group in plan.groups:
        attend_group(q, k, v, k_cache, v_cache, metadata, group, scale, out)
    group_size = q.shape[1] // num_kv_heads
    for work in plan.prefill:
        b, start, end, slots = work.seq, work.start, work.end, work.slots
        if work.path == "native":
            assert slots is not None
            _attend_native(q[start:end], k_flat, v_flat, metadata, b, slots, scale,
                           out[start:end], code)
        elif work.path == "causal":
            out[start:end] = _attend_causal(q[start:end], k[start:end], v[start:end], scale, gqa)
        else:
            assert slots is not None
            k_ctx = k_flat.index_select(0, slots)  # [seq_len, num_kv_heads, head_dim]
            v_ctx = v_flat.index_select(0, slots)
            if work.path == "explicit":
                bias = metadata.new_token_bias(b, group_size, q.dtype)
                _attend_explicit(q[start:end], k_ctx, v_ctx, bias, scale, out[start:end])
            else:
                mask = metadata.stacked_mask(b, group_size, q.dtype)
                out[start:end] = _attend_stacked(q[start:end], k_ctx, v_ctx, mask, scale)
    return out


def _dequantized(
    layout: KVFormat,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The blocks the step reads (`AttentionMetadata.compacted`) as the values they hold, in
    ``dtype``, the step's own K/V as they were stored (what the torch paths attend, so that
    they see what a later step reads), and the step's metadata over those blocks: the
    reference and the fallback where the kernel does not run, copying what the step reads as
    a float cache's gather does, never the whole cache."""
    blocks, step = metadata.compacted()
    k_read = layout.dequantize(k_cache.index_select(0, blocks), dtype)
    v_read = layout.dequantize(v_cache.index_select(0, blocks), dtype)
    num_kv_heads = k_cache.shape[2]
    slots = step.slot_mapping
    k_new = k_read.view(-1, num_kv_heads, k_read.shape[-1]).index_select(0, slots)
    v_new = v_read.view(-1, num_kv_heads, v_read.shape[-1]).index_select(0, slots)
    return k_read, v_read, k_new, v_new, step


def _torch_plan(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: AttentionMetadata
) -> AttentionPlan:
    """The torch paths' plan over the dequantized blocks of a step (once per step)."""
    key = ("torch_plan", q.shape[1], q.dtype, q.device)
    return step.derived(key, lambda: attention_plan(q, k_cache, v_cache, step))


def _attend_native(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    metadata: AttentionMetadata,
    b: int,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    kv_code: int = 0,
) -> None:
    """Sequence b's prefill through the kernel, checked and set up in the step's first layer
    (`native_attention.PreparedAttend`); the step's sequences share one scratch buffer."""

    def prepare() -> native_attention.PreparedAttend:
        # the step's one scratch buffer, grown to the largest need
        pool = metadata.derived(("native_scratch",), dict[str, torch.Tensor])
        prepared = native_attention.PreparedAttend(
            q, k_flat, v_flat, slots, out, min_max(slots), pool.get("buffer"), kv_code
        )
        pool["buffer"] = prepared.scratch
        return prepared

    metadata.derived(("native_prefill", b), prepare)(q, k_flat, v_flat, scale, out)


def _attend_decodes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    rows: list[int],
    scale: float,
    out: torch.Tensor,
    kv_code: int = 0,
) -> None:
    """Fill ``out`` at the decode sequences' tokens; their K/V are already in the cache."""
    plan = step_decode_plan(metadata, rows, q.device)
    if len(rows) == metadata.num_seqs:  # a pure decode step: token i belongs to sequence i
        out.copy_(decode_attention(q, k_cache, v_cache, plan, scale, kv_code))
        return
    tokens = torch.tensor([metadata.query_starts[b] for b in rows], device=q.device)
    out[tokens] = decode_attention(q[tokens], k_cache, v_cache, plan, scale, kv_code)


def step_decode_plan(
    metadata: AttentionMetadata, rows: list[int] | tuple[int, ...], device: torch.device
) -> DecodePlan:
    """The step's `DecodePlan` for its decode sequences ``rows``, built once per step (every
    layer, and the fused layers, read the same one)."""

    def build() -> DecodePlan:
        table = metadata.block_tables.cpu().numpy()[list(rows)]
        seq_lens = np.asarray(metadata.num_computed)[list(rows)] + 1
        return DecodePlan.build(table, seq_lens, metadata.block_size, device=device)

    return metadata.derived(("decode_plan", tuple(rows), device), build)


def _attend_explicit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    new_token_bias: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Attention as GEMM, softmax, GEMM over the whole score matrix, written into ``out``; query
    heads stacked per kv head (as in `_attend_stacked`).

    q, out: [T, num_heads, head_dim]; k, v: [S, num_kv_heads, head_dim], the S - T cached tokens
    then the T new ones; new_token_bias: [G * T, T] additive (0 / -inf), the causal mask of the new
    tokens among themselves, tiled for the G stacked heads. Only those last T key columns need a
    mask: every new token sees all of the context.
    """
    num_tokens, num_heads, head_dim = q.shape
    seq_len, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads

    def head_major(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [kv_heads, G, T, D] view
        return x.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)

    stacked = q.new_empty(num_kv_heads, group, num_tokens, head_dim)
    torch.mul(head_major(q), scale, out=stacked)  # one pass: stack and scale
    # k.permute: [kv_heads, D, S], a transposed view that the GEMM reads in place
    scores = torch.bmm(stacked.view(num_kv_heads, -1, head_dim), k.permute(1, 2, 0))
    scores[:, :, seq_len - num_tokens :].add_(new_token_bias)  # [kv_heads, G * T, T]
    # softmax in place (the CPU kernel reads each row before writing it): no second score matrix
    probs = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    heads_out = torch.bmm(probs, v.transpose(0, 1))  # [kv_heads, G * T, D]
    head_major(out).copy_(heads_out.view(num_kv_heads, group, num_tokens, head_dim))


def _attend_stacked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked attention with the query heads of each kv head stacked into one query block.

    q: [T, num_heads, head_dim]; k, v: [S, num_kv_heads, head_dim]; mask: [G * T, S] additive, for
    G = num_heads / num_kv_heads. One attention per kv head over G * T rows instead of G per
    head over T rows: the CPU kernel tiles more query rows at a time and reads each K/V once.
    Head h uses kv head h // G, as in transformers.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    stacked = (
        q.view(num_tokens, num_kv_heads, group, head_dim)
        .permute(1, 2, 0, 3)  # [kv_heads, G, T, D]
        .reshape(1, num_kv_heads, group * num_tokens, head_dim)
    )
    out = F.scaled_dot_product_attention(
        stacked,
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
    )
    return (
        out.view(num_kv_heads, group, num_tokens, head_dim)
        .permute(2, 0, 1, 3)
        .reshape(num_tokens, num_heads, head_dim)
    )


def _attend_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool
) -> torch.Tensor:
    """Causal attention over fresh K/V only: q [T, heads, D]; k, v [T, kv_heads, D]."""
    # [tokens, heads, head_dim] -> [1, heads, tokens, head_dim]: SDPA's fused CPU kernel wants 4-D.
    # k and v arrive as column slices of the fused projection; packed rows make the kernel's
    # K/V reads denser
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.contiguous().transpose(0, 1).unsqueeze(0),
        v.contiguous().transpose(0, 1).unsqueeze(0),
        is_causal=q.shape[0] > 1,
        scale=scale,
        enable_gqa=gqa,
    )
    return out.squeeze(0).transpose(0, 1)
