"""The compiled CPU attention kernel: builds where a compiler and MKL exist, equals a float64
reference for any shape, thread count and slot order, over float32 and bfloat16 caches, and
refuses input it would misread. (Its build and switch: tests/test_native_build.py.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from native_support import require_native_attention
from prefixcache.attention import native_attention
from prefixcache.native import machine


@pytest.fixture(autouse=True)
def _native() -> None:
    require_native_attention()


def _reference(q, k_flat, v_flat, slots, scale) -> torch.Tensor:  # noqa: ANN001
    """Float64 attention of the new tokens: token t sees positions 0 .. S - T + t."""
    new, heads, _ = q.shape
    group = heads // k_flat.shape[1]
    keys = k_flat[slots].double().repeat_interleave(group, 1)  # [S, heads, D]
    values = v_flat[slots].double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), keys) * scale
    context = len(slots) - new
    visible = torch.arange(len(slots)) <= (torch.arange(new) + context).unsqueeze(1)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, values)


# How far the kernel's result may be from the float64 reference: float32 rounding. With
# bfloat16 queries (a bfloat16 model), where the CPU has AVX512_BF16 the probabilities are
# rounded to bfloat16 for the P V products (each by at most 2^-9 of itself, which moves the
# output by at most 2^-9 of the largest |V|), and the output is rounded to bfloat16 (2^-9 of
# itself): 2^-8 of each bounds both.
def _assert_close(
    out: torch.Tensor, ref: torch.Tensor, v_flat: torch.Tensor, tolerance: float = 1e-5
) -> None:
    if out.dtype == torch.bfloat16:
        atol = max(tolerance, 2**-8 * float(v_flat.abs().max()))
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=atol)
    else:
        torch.testing.assert_close(out.double(), ref, rtol=tolerance, atol=tolerance)


# (queries and outputs, caches): float32 throughout; float32 queries over bfloat16 caches; a
# bfloat16 model's (everything bfloat16)
DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
          (torch.bfloat16, torch.bfloat16)]  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 3, 8]),
    head_dim=st.sampled_from([8, 16, 64, 80, 128]),
    context=st.integers(0, 300),
    new=st.integers(1, 100),
    threads=st.sampled_from([1, 2, 3]),
    strided_q=st.booleans(),
    dtypes=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_reference(
    kv_heads, group, head_dim, context, new, threads, strided_q, dtypes, seed
) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(seed)
    heads, seq_len = kv_heads * group, context + new
    num_slots = seq_len + 37
    k_flat = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtypes[1])
    v_flat = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtypes[1])
    slots = torch.randperm(num_slots, generator=gen)[:seq_len]  # any physical order
    # the model hands q over as a column slice of the fused qkv output (strided rows)
    fused = (torch.randn(new, heads + 2 * kv_heads, head_dim, generator=gen) * 3).to(dtypes[0])
    q = fused[:, :heads] if strided_q else fused[:, :heads].contiguous()
    out = torch.full((new, heads, head_dim), float("nan"), dtype=dtypes[0])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native_attention.attend(q, k_flat, v_flat, slots, head_dim**-0.5, out)
    finally:
        torch.set_num_threads(before)
    ref = _reference(q, k_flat, v_flat, slots, head_dim**-0.5)
    # float32 rounding: torch's own SDPA in float32 is up to 7.8e-6 off on these cases
    _assert_close(out, ref, v_flat)


@settings(max_examples=30, deadline=None)
@given(
    kv_heads=st.sampled_from([2, 3, 4]),
    group=st.sampled_from([1, 2, 3, 5, 8, 9, 16]),
    new=st.integers(1, 200),
    extra_context=st.integers(0, 150),
    threads=st.sampled_from([1, 2]),
    magnitude=st.sampled_from([1.0, 3.0, 30.0]),
    dtypes=st.sampled_from(DTYPES),
    head_dim=st.sampled_from([32, 64, 96, 128]),
    seed=st.integers(0, 2**16),
)
def test_cache_hit_path_equals_reference(
    kv_heads, group, new, extra_context, threads, magnitude, dtypes, head_dim, seed
) -> None:  # noqa: ANN001
    # After a cache hit (context >= new tokens) with head_dim 64 or 128 (the same loops compiled
    # for each: P V register tiles of 6 rows x 4 vectors, or 3 x 8), an AVX-512 build reads K
    # and V straight from the cache (no gather; a bfloat16 cache widened per 32-key block), in
    # tiles of about 128 stacked rows (`tile_tokens`): 32-key blocks with an online softmax,
    # shared by up to 4 tiles of a work item (a kv head's tiles split into items that spread
    # evenly over the threads, e.g. 3 kv heads on 2), register tiles of 8 keys x 48 rows and 6
    # rows x 64 dims, a masked tail. Row counts, key counts and tiles that do not divide evenly,
    # maxima that grow from block to block, and scores large enough to need the max subtraction.
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    context = new + extra_context
    seq_len = context + new
    num_slots = seq_len + 50
    k_flat = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtypes[1])
    v_flat = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtypes[1])
    slots = torch.randperm(num_slots, generator=gen)[:seq_len]
    q = (torch.randn(new, heads, head_dim, generator=gen) * magnitude).to(dtypes[0])
    out = torch.full((new, heads, head_dim), float("nan"), dtype=dtypes[0])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        path = native_attention.prefill_path(
            new, seq_len, heads, kv_heads, head_dim, k_flat.dtype
        )
        native_attention.attend(q, k_flat, v_flat, slots, head_dim**-0.5, out)
    finally:
        torch.set_num_threads(before)
    direct = head_dim in (16, 32, 64, 80, 96, 128)
    per_head = "gather per kv head" if kv_heads % threads == 0 else "shared gather"
    assert path == ("direct per kv head" if direct else per_head)
    ref = _reference(q, k_flat, v_flat, slots, head_dim**-0.5)
    # float32 rounding of the scores grows with them: torch's float32 SDPA is as far off
    # (2e-5 at magnitude 30 where it is 3e-6 at 3)
    _assert_close(out, ref, v_flat, 1e-5 * max(1.0, magnitude / 3))


def test_prefill_path_choice() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # head_dim 72: no register tiles of that width
        assert native_attention.prefill_path(2048, 2048, 36, 4, 72) == "shared gather"
        fresh = native_attention.prefill_path(2048, 2048, 12, 4, 64)  # no hit: direct too
        assert fresh == "direct per kv head"
        # 9 and 12 query heads per kv head: tiles of 8 tokens keep them on the direct path
        for heads, kv_heads in ((36, 4), (12, 1)):
            wide = native_attention.prefill_path(128, 2048, heads, kv_heads, 64)
            assert wide == "direct per kv head"
        qwen2 = native_attention.prefill_path(128, 2048, 8, 1, 128)  # head_dim 128, 8:1 GQA
        assert qwen2 == "direct per kv head"
        # after a hit, without the direct path, 2 threads gather a kv head each where they
        # divide the heads, else one shared gather
        assert native_attention.prefill_path(128, 2048, 24, 4, 72) == "gather per kv head"
        assert native_attention.prefill_path(128, 2048, 27, 3, 72) == "shared gather"
        # SmolLM2's 3 kv heads on 2 threads: the direct path splits heads' tiles between them
        for dtype in (torch.float32, torch.bfloat16):
            hit = native_attention.prefill_path(128, 2048, 9, 3, 64, dtype)
            assert hit == "direct per kv head"
    finally:
        torch.set_num_threads(before)


def test_tile_size_follows_the_query_heads_per_kv_head() -> None:
    # 128 stacked query rows per tile with a 32 KiB L1d and 1 MiB L2, in a power of two of tokens
    zen4 = machine.Caches(l1d=32 << 10, l2=1 << 20, l3=32 << 20, line=64)
    sizes = {
        g: native_attention.tile_tokens(g * 2, 2, 64, zen4) for g in (1, 2, 3, 4, 7, 8, 9, 16, 200)
    }
    assert sizes == {1: 128, 2: 64, 3: 32, 4: 32, 7: 16, 8: 16, 9: 8, 16: 8, 200: 1}


def test_tile_rows_follow_the_cache_sizes() -> None:
    # a key block's scores in half the L1d, four tiles' queries and sums in half the L2
    def rows(l1d_kib: int, l2_kib: int, head_dim: int) -> int:
        caches = machine.Caches(l1d=l1d_kib << 10, l2=l2_kib << 10, l3=32 << 20, line=64)
        return native_attention.tile_rows(head_dim, caches)

    assert rows(32, 1024, 64) == rows(32, 1024, 128) == rows(48, 2048, 128) == 128
    assert rows(64, 2048, 64) == 256  # a direct-path tile's most
    assert rows(64, 1024, 128) == 128  # the L2 bounds it at head_dim 128
    assert rows(32, 512, 128) == 64
    assert rows(8, 256, 64) == 32


def test_decode_work_items_spread_evenly_over_the_threads() -> None:
    # kv heads x chunks of sequences: the chunk size that leaves the busiest thread the least
    # work (its rows, plus a fixed cost per item: each reads the shared keys again), the larger
    # one on a tie
    assert native_attention.decode_chunk(16, 4, 2) == 16  # 4 items: 2 per thread
    # SmolLM2 (3 kv heads of 3): 3 items (2 on one thread) cost less than 6 (3 per thread)
    assert native_attention.decode_chunk(16, 3, 2, group=3) == 16
    assert native_attention.decode_chunk(16, 1, 2) == 8  # MQA: 2 items, not 1
    assert native_attention.decode_chunk(16, 1, 2, group=8) == 8  # Qwen2-style, one kv head
    assert native_attention.decode_chunk(3, 2, 2) == 16  # few sequences: one chunk per head
    assert native_attention.decode_chunk(16, 3, 1) == 16  # one thread: the largest GEMMs
    # 32 query heads per kv head: chunks of at most 8 (256 stacked rows, a direct-path tile)
    assert native_attention.decode_chunk(16, 1, 1, group=32) == 8
    assert native_attention.decode_chunk(16, 1, 1, group=300) == 1


def test_large_scores_do_not_overflow() -> None:
    # logits in the hundreds (exp would overflow float32): the softmax must subtract each row's
    # max first; float32 scores of that size carry ~1e-5 absolute rounding
    gen = torch.Generator().manual_seed(1)
    k_flat = torch.randn(64, 1, 16, generator=gen) * 10
    v_flat = torch.randn(64, 1, 16, generator=gen)
    slots = torch.arange(64)
    q = torch.randn(8, 2, 16, generator=gen) * 10
    out = torch.empty(8, 2, 16)
    native_attention.attend(q, k_flat, v_flat, slots, 1.0, out)
    assert torch.isfinite(out).all()
    ref = _reference(q, k_flat, v_flat, slots, 1.0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_rejects_input_it_would_misread() -> None:
    k_flat, v_flat = torch.randn(32, 2, 16), torch.randn(32, 2, 16)
    q, out, slots = torch.randn(4, 4, 16), torch.empty(4, 4, 16), torch.arange(10)
    with pytest.raises(ValueError, match="unsupported"):
        native_attention.attend(q.double(), k_flat, v_flat, slots, 0.25, out)
    with pytest.raises(ValueError, match="unsupported"):  # bfloat16 queries, float32 caches
        native_attention.attend(q.bfloat16(), k_flat, v_flat, slots, 0.25, out.bfloat16())
    with pytest.raises(ValueError, match="unsupported"):  # the caches' dtypes differ
        native_attention.attend(q, k_flat.bfloat16(), v_flat, slots, 0.25, out)
    with pytest.raises(ValueError, match="unsupported"):
        native_attention.attend(q, k_flat, v_flat, slots.int(), 0.25, out)
    with pytest.raises(ValueError, match="unsupported"):  # more new tokens than positions
        native_attention.attend(q, k_flat, v_flat, slots[:3], 0.25, out)
    with pytest.raises(ValueError, match="unsupported"):  # 4 heads over 3 kv heads
        native_attention.attend(q, torch.randn(32, 3, 16), torch.randn(32, 3, 16), slots, 1, out)
    with pytest.raises(ValueError, match="slot out of range"):
        native_attention.attend(q, k_flat, v_flat, torch.arange(30, 40), 0.25, out)


@settings(max_examples=30, deadline=None)
@given(
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 3, 8, 20]),
    head_dim=st.sampled_from([16, 64, 128]),
    num_seqs=st.integers(1, 40),
    shared=st.just(0) | st.integers(1, 200) | st.integers(256, 1100),
    max_tail=st.integers(1, 150),
    threads=st.sampled_from([1, 2, 3]),
    dtypes=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_decode_equals_reference(
    kv_heads, group, head_dim, num_seqs, shared, max_tail, threads, dtypes, seed
) -> None:  # noqa: ANN001
    # a head_dim of the direct path (16, 64, 128): every item's keys in segments of 256, one
    # unit each, the shared keys of a segment (if any) by one tile of all its rows, each
    # sequence's own keys by a tile of its G rows (more than one vector at G = 20), the
    # segments merged in key order; head_dim 16 past 256 rows (G = 20): the gather path
    gen = torch.Generator().manual_seed(seed)
    heads, num_slots = kv_heads * group, shared + num_seqs * max_tail + 11
    k_flat = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtypes[1])
    v_flat = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtypes[1])
    order = torch.randperm(num_slots, generator=gen)
    shared_slots = order[:shared].contiguous()
    tail_slots = order[shared : shared + num_seqs * max_tail].view(num_seqs, max_tail).contiguous()
    tail_lens = torch.randint(1, max_tail + 1, (num_seqs,), generator=gen, dtype=torch.int32)
    fused = torch.randn(num_seqs, heads + 2 * kv_heads, head_dim, generator=gen) * 3
    q = fused[:, :heads].to(dtypes[0])  # strided rows, as the model hands it over
    out = torch.full((num_seqs, heads, head_dim), float("nan"), dtype=dtypes[0])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native_attention.decode(
            q, k_flat, v_flat, shared_slots, tail_slots, tail_lens, head_dim**-0.5, out
        )
    finally:
        torch.set_num_threads(before)
    for b in range(num_seqs):  # one query at the last position sees every key
        slots = torch.cat([shared_slots, tail_slots[b, : tail_lens[b]]])
        ref = _reference(q[b : b + 1], k_flat, v_flat, slots, head_dim**-0.5)
        _assert_close(out[b : b + 1], ref, v_flat)


@settings(max_examples=40, deadline=None)
@given(
    kv_heads=st.sampled_from([1, 3]),
    group=st.sampled_from([1, 3, 8]),
    head_dim=st.sampled_from([16, 32, 64, 80, 96, 128]),
    shared=st.integers(0, 300) | st.integers(500, 800),  # 256-key segments: up to 4
    tails=st.lists(st.integers(1, 90), min_size=1, max_size=6),
    chunk=st.integers(1, 120),
    threads=st.sampled_from([1, 2, 3]),
    dtypes=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_a_row_is_the_same_bits_in_any_decode_step_and_any_prefill(
    kv_heads, group, head_dim, shared, tails, chunk, threads, dtypes, seed
) -> None:  # noqa: ANN001
    # batch invariance (docs/model.md): a query row's output does not depend on the sequences
    # beside it in a decode step, on how many keys they share (split anywhere, block-aligned or
    # not), on the thread count, or on whether it is computed as a decode step (its segments of
    # keys spread over the threads) or as the last token of a prefill chunk of any length over
    # the same keys (its segments in turn)
    check_row_invariance(kv_heads, group, head_dim, shared, tails, chunk, threads, dtypes, seed)


def check_row_invariance(kv_heads, group, head_dim, shared, tails, chunk, threads, dtypes,
                         seed) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(seed)
    heads, num_seqs, max_tail = kv_heads * group, len(tails), max(tails)
    num_slots = shared + num_seqs * max_tail + 7
    k_flat = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtypes[1])
    v_flat = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtypes[1])
    order = torch.randperm(num_slots, generator=gen)
    shared_slots = order[:shared].contiguous()
    tail_slots = order[shared : shared + num_seqs * max_tail].view(num_seqs, max_tail).contiguous()
    tail_lens = torch.tensor(tails, dtype=torch.int32)
    q = (torch.randn(num_seqs, heads, head_dim, generator=gen) * 3).to(dtypes[0])
    scale = head_dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = torch.empty_like(q)
        native_attention.decode(q, k_flat, v_flat, shared_slots, tail_slots, tail_lens, scale,
                                together)
        for b in range(num_seqs):
            slots = torch.cat([shared_slots, tail_slots[b, : tails[b]]])
            alone = torch.empty_like(q[b : b + 1])
            own = torch.tensor([len(slots)], dtype=torch.int32)
            native_attention.decode(q[b : b + 1], k_flat, v_flat, slots[:0], slots[None], own,
                                    scale, alone)
            # the same token as the last of a prefill chunk of `new` tokens over these keys
            new = min(chunk, len(slots))
            rows = torch.randn(new, heads, head_dim, generator=gen).to(dtypes[0])
            rows[-1] = q[b]
            prefill = torch.empty_like(rows)
            native_attention.attend(rows, k_flat, v_flat, slots, scale, prefill)
            assert torch.equal(together[b], alone[0])
            assert torch.equal(alone[0], prefill[-1])
    finally:
        torch.set_num_threads(before)


def test_decode_rejects_input_it_would_misread() -> None:
    k_flat, v_flat = torch.randn(32, 2, 16), torch.randn(32, 2, 16)
    q, out = torch.randn(3, 4, 16), torch.empty(3, 4, 16)
    shared, tails = torch.arange(4), torch.arange(4, 13).view(3, 3)
    lens = torch.tensor([1, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="unsupported"):
        native_attention.decode(q, k_flat, v_flat, shared, tails, lens.long(), 0.25, out)
    with pytest.raises(ValueError, match="tail lengths"):
        native_attention.decode(q, k_flat, v_flat, shared, tails, lens * 2, 0.25, out)
    with pytest.raises(ValueError, match="slot out of range"):
        native_attention.decode(q, k_flat, v_flat, shared + 30, tails, lens, 0.25, out)


def test_prepared_attend_takes_only_tensors_like_the_first() -> None:
    # paged_attention prepares a sequence's prefill once per step and calls it in every layer
    gen = torch.Generator().manual_seed(0)
    k_flat, v_flat = torch.randn(90, 2, 16, generator=gen), torch.randn(90, 2, 16, generator=gen)
    slots = torch.randperm(90, generator=gen)[:50]
    q = torch.randn(20, 4, 16, generator=gen)
    out, expected = torch.empty(20, 4, 16), torch.empty(20, 4, 16)
    prepared = native_attention.PreparedAttend(q, k_flat, v_flat, slots, out)
    for layer in range(2):  # another layer's cache: same shape, other values
        k_layer, v_layer = k_flat * (layer + 1), v_flat - layer
        prepared(q, k_layer, v_layer, 0.25, out)
        native_attention.attend(q, k_layer, v_layer, slots, 0.25, expected)
        assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="unlike"):
        prepared(q[:10], k_flat, v_flat, 0.25, out[:10])
    with pytest.raises(ValueError, match="unlike"):
        prepared(q, k_flat[:80], v_flat[:80], 0.25, out)  # a smaller cache: slots would overrun
    with pytest.raises(ValueError, match="unlike"):
        prepared(q, k_flat.double(), v_flat.double(), 0.25, out)
    with pytest.raises(ValueError, match="unlike"):
        prepared(q, k_flat, v_flat, 0.25, torch.empty(4, 20, 16).transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepared_decode_takes_only_tensors_like_the_first(dtype: torch.dtype) -> None:
    # the decode attention prepares a step's batch once (checks, scratch, widening buffers) and
    # calls it in every layer: the same outputs as an unprepared decode, layer after layer
    gen = torch.Generator().manual_seed(0)
    k_flat = torch.randn(90, 2, 64, generator=gen).to(dtype)
    v_flat = torch.randn(90, 2, 64, generator=gen).to(dtype)
    order = torch.randperm(90, generator=gen)
    shared, tails = order[:40].contiguous(), order[40:64].view(3, 8).contiguous()
    lens = torch.tensor([8, 1, 5], dtype=torch.int32)
    fused = torch.randn(3, 8 + 4, 64, generator=gen).to(dtype)
    q = fused[:, :8]  # strided rows, as the model hands them over
    out, expected = torch.empty(3, 8, 64, dtype=dtype), torch.empty(3, 8, 64, dtype=dtype)
    prepared = native_attention.PreparedDecode(q, k_flat, v_flat, shared, tails, lens, out)
    for layer in range(2):  # another layer's cache and queries: same shapes, other values
        k_layer, v_layer = k_flat * (layer + 1), v_flat - layer
        q_layer = (fused * (layer + 1))[:, :8]
        prepared(q_layer, k_layer, v_layer, 0.125, out)
        native_attention.decode(q_layer, k_layer, v_layer, shared, tails, lens, 0.125, expected)
        assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="unlike"):
        prepared(q[:2], k_flat, v_flat, 0.125, out[:2])
    with pytest.raises(ValueError, match="unlike"):
        prepared(q, k_flat[:80], v_flat[:80], 0.125, out)  # a smaller cache: slots would overrun
    with pytest.raises(ValueError, match="unlike"):
        prepared(q.contiguous(), k_flat, v_flat, 0.125, out)
