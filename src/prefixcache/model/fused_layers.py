"""The decoder's layers as compiled calls for one step (CPU, float32, packed weights).

Between two compiled calls the decoder ran 50-100 Python operations (checks, allocations,
ctypes), and right after a GEMM has streamed megabytes of weights through the caches each of them
misses: on `small`, the gaps between the calls of a 128-token step took 8 ms, where the same
Python takes 2 ms with the caches warm (30 small torch calls: 43 us right after a 128-row GEMM,
13 us alone, 40 us after summing 16 MB; with one thread or two). So `FusedLayers.prepare` checks
the step once, in the first layer (shapes, dtypes, every layer's cache, the slots' range, the
packed weights), allocates the buffers once, and builds each layer's arguments. A layer is then
one call (`pc_layer` in prefixcache/native/layers.c: add + norm, qkv projection, rotary, K/V
write, the attention kernel, o projection, add + norm, MLP) when the step is one sequence's
prefill through the attention kernel, else two calls (`pc_attention_inputs`, `pc_mlp_block`)
around `paged_attention` (batches of sequences, decode, the torch attention paths). The
operations, their order and the GEMMs (MKL's packed compute, called from C) are those of the
separate steps, so the logits are the same bits.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from prefixcache.attention import AttentionMetadata, PagedKVCache, native_attention, paged_attention
from prefixcache.model import native_layers, packed_gemm
from prefixcache.model.packed_gemm import PackedWeight

if TYPE_CHECKING:
    from prefixcache.model.decoder import CausalLM, DecoderLayer

__all__ = ["FusedLayers"]


@dataclass(slots=True)
class _Layer:
    inputs: tuple  # pc_attention_inputs' arguments
    mlp: tuple  # pc_mlp_block's arguments from w_o on (it starts with gemm, attn, rows, q_size)
    whole: tuple | None  # pc_layer's arguments, for a step that is one sequence's prefill
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float


class FusedLayers:
    """One step's layers as compiled calls; `prepare` returns None where they do not apply."""

    def __init__(
        self,
        library: ctypes.CDLL,
        layers: list[_Layer],
        metadata: AttentionMetadata,
        qkv: torch.Tensor,
        out: torch.Tensor,
        num_kv_heads: int,
        buffers: tuple[object, ...],
    ) -> None:
        self._library, self._layers, self._metadata = library, layers, metadata
        self._qkv, self._out, self._kv_heads = qkv, out, num_kv_heads
        self._buffers = buffers  # the C calls write into these: kept alive with the arguments

    @property
    def one_call_per_layer(self) -> bool:
        """Whether each layer is one compiled call (the step is one sequence's prefill)."""
        return self._layers[0].whole is not None

    @classmethod
    def prepare(
        cls,
        model: CausalLM,
        h: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> FusedLayers | None:
        """Check the step and build each layer's calls; None where they do not apply (not
        float32 on the CPU, no packed weights or native layers, q/k norm, an empty step)."""
        c = model.config
        library = native_layers.library()
        if (
            library is None
            or c.qk_norm
            or h.dim() != 2
            or not h.is_contiguous()
            or h.shape[0] == 0
            or not native_layers.applies(h)
        ):
            return None
        layers: list[DecoderLayer] = list(model.model.layers)  # type: ignore[arg-type]
        weights = [_packed(layer) for layer in layers]
        if any(w is None for w in weights):
            return None
        _check_step(model, h, cos_sin, kv_cache, metadata, weights)  # type: ignore[arg-type]
        from prefixcache.model.decoder import MLP_CHUNK_ROWS  # read now: tests change it

        rows, hidden, inter = h.shape[0], c.hidden_size, c.intermediate_size
        heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        chunk, eps = min(rows, MLP_CHUNK_ROWS), model.model.norm.eps
        threads = torch.get_num_threads()
        x, o, out = torch.empty_like(h), torch.empty_like(h), torch.empty_like(h)
        qkv = h.new_empty(rows, heads + 2 * kv_heads, head_dim)
        gate_up, act = h.new_empty(chunk, 2 * inter), h.new_empty(chunk, inter)
        attn = h.new_empty(rows, heads, head_dim)
        gemm, cos, sin = packed_gemm.compute_address(), cos_sin[0], cos_sin[1]
        prepared = _one_sequence_prefill(qkv[:, :heads], kv_cache, metadata, attn)
        built = []
        for i, (layer, w) in enumerate(zip(layers, weights, strict=True)):
            w_qkv, w_o, w_gate_up, w_down = (p.buffer.data_ptr() for p in w)  # type: ignore[union-attr]
            k_cache, v_cache = kv_cache.layer(i)
            bias = layer.self_attn.qkv_proj.bias
            norm, post = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            delta = None if i == 0 else out.data_ptr()  # the previous layer's MLP output
            head = (gemm, h.data_ptr(), delta, norm.data_ptr())
            qkv_part = (
                eps, x.data_ptr(), rows, hidden, w_qkv, None if bias is None else bias.data_ptr(),
                qkv.data_ptr(), heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                k_cache.data_ptr(), v_cache.data_ptr(), metadata.slot_mapping.data_ptr(),
            )  # fmt: skip
            mlp = (
                w_o, h.data_ptr(), hidden, post.data_ptr(), eps, w_gate_up, inter, w_down,
                o.data_ptr(), x.data_ptr(), gate_up.data_ptr(), act.data_ptr(), out.data_ptr(),
                chunk, threads,
            )  # fmt: skip
            whole = None
            if prepared is not None:
                attention = prepared.kernel_arguments(layer.self_attn.scale, attn)
                whole = (
                    *head, post.data_ptr(), *qkv_part, *attention, w_o, w_gate_up, inter, w_down,
                    o.data_ptr(), gate_up.data_ptr(), act.data_ptr(), out.data_ptr(), chunk,
                    threads,
                )  # fmt: skip
            built.append(
                _Layer(
                    (*head, *qkv_part, threads), mlp, whole, k_cache, v_cache, layer.self_attn.scale
                )  # fmt: skip
            )
        buffers = (x, o, gate_up, act, attn, prepared)  # the C calls hold their addresses
        return cls(library, built, metadata, qkv, out, kv_heads, buffers)

    def run(self, i: int) -> torch.Tensor:
        """Layer i: the residual stream h updated in place; returns the layer's MLP output, a
        buffer that the next layer reads (adds to h) before it writes its own there."""
        layer = self._layers[i]
        if layer.whole is not None:
            self._library.pc_layer(*layer.whole)
            return self._out
        self._library.pc_attention_inputs(*layer.inputs)
        qkv, kv_heads = self._qkv, self._kv_heads
        heads = qkv.shape[1] - 2 * kv_heads
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        caches = (layer.k_cache, layer.v_cache)
        attended = paged_attention(q, k, v, *caches, self._metadata, layer.scale)
        attended = attended.reshape(qkv.shape[0], heads * qkv.shape[2]).contiguous()
        self._library.pc_mlp_block(
            layer.inputs[0], attended.data_ptr(), attended.shape[0], attended.shape[1], *layer.mlp
        )
        return self._out


def _packed(layer: DecoderLayer) -> list[PackedWeight] | None:
    """The layer's four packed weights (qkv, o, gate/up, down), or None if any is missing or
    stale."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    packed = [linear.current_packed() for linear in linears]
    return None if any(p is None for p in packed) else packed  # type: ignore[return-value]


def _one_sequence_prefill(
    q: torch.Tensor, kv_cache: PagedKVCache, metadata: AttentionMetadata, out: torch.Tensor
) -> native_attention.PreparedAttend | None:
    """The attention kernel set up for the step's one sequence, if the step is one prefill (or
    chunk) the kernel takes: what `paged_attention` would do with it, minus the Python."""
    k_cache, v_cache = kv_cache.layer(0)
    if metadata.num_seqs != 1 or not native_attention.applies(q, k_cache, v_cache):
        return None
    computed, new = metadata.num_computed[0], metadata.num_new[0]
    if computed and new == 1:  # a decode step: paged_attention's decode path
        return None
    slots = metadata.slot_mapping if computed == 0 else metadata.context_slots[0]
    kv_heads, head_dim = kv_cache.num_kv_heads, kv_cache.head_dim
    k_flat, v_flat = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    return native_attention.PreparedAttend(q, k_flat, v_flat, slots, out)


def _check_step(
    model: CausalLM,
    h: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    kv_cache: PagedKVCache,
    metadata: AttentionMetadata,
    weights: list[list[PackedWeight]],
) -> None:
    """What the compiled calls read through raw pointers, checked once for all layers."""
    c = model.config
    rows, hidden, head_dim = h.shape[0], c.hidden_size, c.head_dim
    heads, kv_heads, inter = c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    width, q_size = (heads + 2 * kv_heads) * head_dim, heads * head_dim
    shapes = [(hidden, width), (q_size, hidden), (hidden, 2 * inter), (inter, hidden)]
    cache_shape = (kv_cache.num_blocks, kv_cache.block_size, kv_heads, head_dim)
    caches = [t for i in range(kv_cache.num_layers) for t in kv_cache.layer(i)]
    norms = [
        norm
        for layer in model.model.layers
        for norm in (layer.input_layernorm, layer.post_attention_layernorm)  # type: ignore[union-attr]
    ]
    biases = [layer.self_attn.qkv_proj.bias for layer in model.model.layers]  # type: ignore[union-attr]
    slots = metadata.slot_mapping
    ok = (
        h.shape[1] == hidden
        and h.dtype == torch.float32
        and all(t.shape == (rows, 1, head_dim) and t.is_contiguous() for t in cos_sin)
        and all(t.dtype == torch.float32 and t.is_cpu for t in cos_sin)
        and kv_cache.num_layers == len(weights)
        and all(
            t.shape == cache_shape and t.is_contiguous() and t.dtype == torch.float32 and t.is_cpu
            for t in caches
        )
        and slots.shape == (rows,)
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and all([(p.in_features, p.out_features) for p in w] == shapes for w in weights)
        and all(
            n.weight.shape == (hidden,)
            and n.weight.is_contiguous()
            and n.weight.dtype == torch.float32
            and n.eps == model.model.norm.eps
            for n in norms
        )  # fmt: skip
        and all(
            b is None or (b.shape == (width,) and b.is_contiguous() and b.dtype == torch.float32)
            for b in biases
        )
    )
    if not ok:
        raise ValueError("fused layers: unsupported shapes, strides or dtypes")
    low, high = metadata.slot_range()
    if low < 0 or high >= kv_cache.num_blocks * kv_cache.block_size:
        raise ValueError("fused layers: slot out of range")
