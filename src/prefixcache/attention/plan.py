"""One step's attention plan: which path computes each sequence, decided once per step.

The decoder builds it with `build_plan` from the step's `AttentionMetadata`, the KV cache and
the queries' kind (heads, dtype, device: the same in every layer) before its first layer, and
hands it to every layer's `paged_attention` and to the fused layers, so the dispatch is decided
once, in one place. (`attention_plan` builds one from a query tensor, for a caller of
`paged_attention` that has none.) Paths:

- ``whole_step_causal``: the step is one sequence without cached context, on the torch paths:
  causal SDPA over its fresh K/V, nothing gathered;
- ``whole_step_native``: the step is one sequence's prefill (or chunk) through the compiled
  kernel (the fused layers then run each layer as one call);
- otherwise ``decode_rows`` (one new token: batched by `decode_attention`), ``groups`` (torch
  paths: prefills sharing cached leading blocks, by `cascade_prefill`), and one `SeqWork` per
  remaining prefill sequence: ``native`` (the kernel), ``causal`` (no context), ``explicit``
  (GEMM + softmax + GEMM, a small score matrix on the CPU) or ``stacked`` (SDPA with a mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache.attention import native_attention
from prefixcache.attention.cascade_prefill import prefill_groups
from prefixcache.attention.kv_format import KVFormat, format_of_dtype
from prefixcache.attention.metadata import AttentionMetadata
from prefixcache.attention.shared_prefix import SharedPrefix

__all__ = [
    "EXPLICIT_SCORES_MAX_BYTES", "SEQ_PATHS", "AttentionPlan", "SeqWork", "attention_plan",
    "build_plan",
]  # fmt: skip

SEQ_PATHS = ("native", "causal", "explicit", "stacked")

# Largest score matrix (all heads of one sequence, bytes) that the ``explicit`` path takes on the
# CPU. Up to about this size the whole matrix stays in cache between the GEMMs and the softmax,
# and two large GEMMs beat SDPA's fused kernel, which tiles 64 query rows by 512 keys and adds
# the mask in every tile; beyond it SDPA is faster and needs no score memory. Set on 2 threads
# for 12 x 64 heads over 4 kv heads and 32 x 128 over 8 (figures: docs/performance.md).
EXPLICIT_SCORES_MAX_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class SeqWork:
    """Prefill sequence ``seq`` (query tokens ``start..end-1``) by ``path``. ``slots``: the keys
    it reads (``native``: context and new tokens; ``explicit``/``stacked``: context slots)."""

    seq: int
    start: int
    end: int
    path: str
    slots: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    native: bool
    whole_step_causal: bool
    whole_step_native: bool
    decode_rows: tuple[int, ...]
    groups: tuple[SharedPrefix, ...]
    prefill: tuple[SeqWork, ...]
    kv_format: KVFormat | None = None  # the cache's layout; None: rows of the caches' dtype


def build_plan(
    metadata: AttentionMetadata,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_format: KVFormat | None = None,
) -> AttentionPlan:
    """The step's plan for queries [T, num_heads, head_dim] of ``dtype`` on ``device`` with
    contiguous heads (the decoder's), over caches like ``k_cache`` / ``v_cache`` in
    ``kv_format`` (None: rows of their dtype)."""
    layout = kv_format or format_of_dtype(k_cache.dtype)
    native = native_attention.applies_to(dtype, device, k_cache, v_cache, layout.code)
    return _build(metadata, num_heads, dtype, device, native, layout)


def attention_plan(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_format: KVFormat | None = None,
) -> AttentionPlan:
    """The plan for the queries ``q`` [T, heads, head_dim] themselves."""
    layout = kv_format or format_of_dtype(k_cache.dtype)
    native = native_attention.applies(q, k_cache, v_cache, layout.code)
    return _build(metadata, q.shape[1], q.dtype, q.device, native, layout)


def _build(
    metadata: AttentionMetadata,
    num_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    native: bool,
    layout: KVFormat,
) -> AttentionPlan:
    if metadata.num_seqs == 1:
        computed, new = metadata.num_computed[0], metadata.num_new[0]
        if computed == 0 and not native:
            return AttentionPlan(native, True, False, (), (), (), layout)
        if native and not (computed and new == 1):
            slots = metadata.slot_mapping if computed == 0 else metadata.context_slots[0]
            work = SeqWork(0, 0, metadata.num_tokens, "native", slots)
            return AttentionPlan(native, False, True, (), (), (work,), layout)
    decode_rows = tuple(b for b, n in enumerate(metadata.num_new) if n == 1)
    # sequences sharing cached blocks: one cascade over the shared part on the torch paths; the
    # kernel takes each on its own (gathering the shared keys per sequence into L2 costs less
    # than the cascade's log-sum-exp merge)
    groups = () if native or device.type != "cpu" else tuple(prefill_groups(metadata, device))
    grouped = {b for group in groups for b in group.seq_indices.tolist()}
    starts = metadata.query_starts
    prefill = []
    for b, slots in enumerate(metadata.context_slots):
        start, end = starts[b], starts[b + 1]
        if end - start == 1 or b in grouped:
            continue
        if native:
            seq_slots = metadata.slot_mapping[start:end] if slots is None else slots
            prefill.append(SeqWork(b, start, end, "native", seq_slots))
        elif slots is None:
            prefill.append(SeqWork(b, start, end, "causal", None))
        else:
            score_bytes = num_heads * (end - start) * len(slots) * dtype.itemsize
            small = device.type == "cpu" and score_bytes <= EXPLICIT_SCORES_MAX_BYTES
            prefill.append(SeqWork(b, start, end, "explicit" if small else "stacked", slots))
    return AttentionPlan(native, False, False, decode_rows, groups, tuple(prefill), layout)
