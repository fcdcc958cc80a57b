"""The decoder's layers as compiled calls for one step (CPU, packed weights: float32 MKL's or
the panel GEMM's, bfloat16 the panel GEMM's).

Between two compiled calls the decoder would run 50-100 Python operations (checks, allocations,
ctypes), and right after a GEMM has streamed megabytes of weights through the caches each of them
misses, so they cost several times what they cost with warm caches. So `FusedLayers.prepare` checks
the step once, in the first layer (shapes, dtypes, every layer's cache, the slots' range, the
packed weights), allocates the buffers once, and builds each layer's arguments. A layer is then
one call (`pc_layer` in prefixcache/native/layers.c: add + norm, qkv projection, rotary, K/V
write, the attention kernel, o projection, add + norm, MLP) when one attention kernel call
takes the whole step (one sequence's prefill in float32; decodes only, sharing one prefix or
none, in float32 or bfloat16: `pc_layer_bf16`), else two calls (`pc_layer_inputs`,
`pc_layer_outputs`, or their ``_bf16`` versions) around `paged_attention` (batches of
prefills, mixed steps, a bfloat16 prefill, the torch attention paths); each takes the layer's
`LayerArgs`, a C struct filled once per step. The operations, their order and the GEMMs (MKL's
packed compute or the panel GEMM, called from C) are those of the separate steps, so the logits
are the same bits.
Figures: docs/performance.md.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from prefixcache.attention import AttentionMetadata, PagedKVCache, native_attention, paged_attention
from prefixcache.attention.decode_attention import prepared_whole_step
from prefixcache.attention.paged_attention import step_decode_plan
from prefixcache.attention.plan import AttentionPlan
from prefixcache.model import native_layers, packed_gemm, panel_gemm, quant_gemm, tuning
from prefixcache.model.packed_gemm import PackedWeight
from prefixcache.model.panel_gemm import PanelWeight
from prefixcache.model.quant_gemm import QuantWeight

if TYPE_CHECKING:
    from prefixcache.model.config import ModelConfig
    from prefixcache.model.layers import LayerParts, Projection, RMSNorm
    from prefixcache.model.lora_batch import LoraStep

__all__ = ["QUANTIZED_KV_WRITTEN", "FusedLayers", "unsupported"]


_P, _F, _I = ctypes.c_void_p, ctypes.c_float, ctypes.c_int


class LayerArgs(ctypes.Structure):
    """``struct layer_args`` of prefixcache/native/layers.c (same fields, same order)."""

    _fields_ = [
        ("gemm", _P),
        ("h", _P),
        ("delta", _P),
        ("norm_w", _P),
        ("post_norm_w", _P),
        ("eps", _F),
        *[(name, _I) for name in ("rows", "hidden", "H", "KV", "D", "I", "chunk", "nthreads")],
        *[(name, _P) for name in ("w_qkv", "w_o", "w_gate_up", "w_down", "qkv_bias")],
        *[(name, _P) for name in ("cos", "signed_sin", "k_cache", "v_cache", "slot_mapping")],
        *[(name, _P) for name in ("x", "qkv", "o", "gate_up", "act", "out")],
        ("attention", _P),
        ("seq_slots", _P),
        ("S", _I),
        ("tile_tokens", _I),
        ("scale", _F),
        *[(name, _P) for name in ("attn", "scratch", "sgemm", "set_threads")],
        *[(name, _P) for name in ("decode", "shared_slots", "tail_slots", "tail_lens")],
        *[(name, _I) for name in ("shared", "max_tail", "decode_chunk", "products")],
        *[(name, _P) for name in ("q32", "out32")],
        ("lora_runs", _P),
        ("lora", _P),
        ("kv_write", _P),
        ("kv_format", _I),
    ]


def unsupported(config: ModelConfig) -> str | None:
    """Why the compiled calls never run a model of ``config`` (its layers then run as the
    PyTorch modules of `layers.py`, step by step), or None."""
    if config.qk_norm:
        return "q/k norm: the compiled calls have no per-head norm of q and k"
    return None


class FusedLayers:
    """One step's layers as compiled calls; `prepare` returns None where they do not apply."""

    def __init__(
        self,
        library: ctypes.CDLL,
        args: list[LayerArgs],
        layers: list[LayerParts],
        num_heads: tuple[int, int],
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
        plan: AttentionPlan,
        buffers: dict[str, torch.Tensor],
        attention: native_attention.PreparedAttend | native_attention.PreparedDecode | None,
        lora: LoraStep | None = None,
    ) -> None:
        self._library, self._args, self._layers = library, args, layers
        self._num_heads, self._num_kv_heads = num_heads
        self._kv_cache, self._metadata, self._buffers = kv_cache, metadata, buffers
        self._plan = plan
        self._attention = attention  # its slots and scratch: kept alive with the addresses
        self._lora = lora  # its runs and tables: likewise
        self._addresses = [ctypes.addressof(a) for a in args]
        suffix = "_bf16" if buffers["x"].dtype == torch.bfloat16 else ""
        self._inputs = getattr(library, "pc_layer_inputs" + suffix)
        self._outputs = getattr(library, "pc_layer_outputs" + suffix)
        self._layer = getattr(library, "pc_layer" + suffix)

    @property
    def one_call_per_layer(self) -> bool:
        """Whether each layer is one compiled call (the step is one sequence's prefill in
        float32, or decodes only that one kernel call attends)."""
        return self._attention is not None

    @classmethod
    def prepare(
        cls,
        config: ModelConfig,
        layers: list[LayerParts],
        h: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
        plan: AttentionPlan,
        lora: LoraStep | None = None,
    ) -> FusedLayers | None:
        """Check the step and fill each layer's arguments; None where the calls do not apply
        (not float32 or bfloat16 on the CPU, no packed weights of a kind the calls multiply
        through, no native layers, a model they do not run (`unsupported`), an empty step).
        ``lora``: the step's adapters, whose updates the calls add after each projection."""
        c = config
        library = native_layers.library()
        if library is None or unsupported(c) is not None or not _takes(h):
            return None
        writer = _kv_writer(kv_cache)  # a quantized cache: its writer, called from C
        if kv_cache.storage_dtype != h.dtype and writer is None:
            return None  # the calls copy rows of h's dtype, or quantize int8 and int4 ones
        static = _static_parts(c, layers, h.dtype, kv_cache)
        if static is None:
            return None
        _check_step(c, h, cos_sin, kv_cache, metadata)
        for w in static.parts[0].packed:
            if isinstance(w, QuantWeight):  # its scratch, for the calls from C
                w.reserve(h.shape[0])
        buffers = _step_buffers(c, h)
        heads = c.num_attention_heads
        attention = None if writer else _whole_step_kernel(  # the kernel inside the call
            buffers["qkv"][:, :heads], kv_cache, metadata, plan, buffers["attn"]
        )
        template = LayerArgs(
            gemm=static.gemm, h=h.data_ptr(), eps=static.parts[0].norm.eps,
            rows=h.shape[0], hidden=c.hidden_size, H=heads, KV=c.num_key_value_heads,
            D=c.head_dim, I=c.intermediate_size, chunk=buffers["act"].shape[0],
            nthreads=torch.get_num_threads(),
            cos=cos_sin[0].data_ptr(), signed_sin=cos_sin[1].data_ptr(),
            slot_mapping=metadata.slot_mapping.data_ptr(),
            kv_write=writer, kv_format=kv_cache.kv_format.code,
            **{name: t.data_ptr() for name, t in buffers.items()},
        )  # fmt: skip
        if attention is not None:
            for name, value in attention.kernel_arguments(buffers["attn"]).items():
                setattr(template, name, value)
        args = _layer_args(template, static.fields)
        if lora is not None:
            for i, a in enumerate(args):
                a.lora_runs, a.lora = lora.runs_address, lora.table_address(i)
        return cls(library, args, layers, (heads, c.num_key_value_heads), kv_cache, metadata,
                   plan, buffers, attention, lora)  # fmt: skip

    def run(self, i: int) -> torch.Tensor:
        """Layer i: the residual stream h updated in place; returns the layer's MLP output, a
        buffer that the next layer reads (adds to h) before it writes its own there."""
        address, buffers = self._addresses[i], self._buffers
        if self._attention is not None:
            self._layer(address)
            return buffers["out"]
        self._inputs(address)
        qkv, scale = buffers["qkv"], self._layers[i].scale
        heads, kv_heads = self._num_heads, self._num_kv_heads
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        k_cache, v_cache = self._kv_cache.layer(i)
        attended = paged_attention(q, k, v, k_cache, v_cache, self._metadata, scale, self._plan)
        attended = attended.reshape(qkv.shape[0], heads * qkv.shape[2]).contiguous()
        self._outputs(address, attended.data_ptr())
        return buffers["out"]


def _takes(h: torch.Tensor) -> bool:
    """Whether the calls take a step whose residual stream is ``h``: [rows, hidden], contiguous,
    at least one row, float32 or bfloat16, on the CPU with the native layers on."""
    return (
        h.dim() == 2
        and h.is_contiguous()
        and h.shape[0] > 0
        and h.dtype in (torch.float32, torch.bfloat16)
        and native_layers.applies(h)
    )


def _step_buffers(config: ModelConfig, h: torch.Tensor) -> dict[str, torch.Tensor]:
    """The step's intermediates, by `LayerArgs` field name, shared by every layer; the MLP's
    over row chunks of at most `tuning.mlp_chunk_rows`."""
    c, rows = config, h.shape[0]
    heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    chunk = min(rows, tuning.mlp_chunk_rows(c.intermediate_size, h.element_size()))
    return {
        "x": torch.empty_like(h),
        "o": torch.empty_like(h),
        "out": torch.empty_like(h),
        "qkv": h.new_empty(rows, heads + 2 * kv_heads, head_dim),
        "gate_up": h.new_empty(chunk, 2 * c.intermediate_size),
        "act": h.new_empty(chunk, c.intermediate_size),
        "attn": h.new_empty(rows, heads, head_dim),
    }


def _layer_args(template: LayerArgs, fields: list[tuple[Any, ...]]) -> list[LayerArgs]:
    """Each layer's arguments: the step's ``template`` with the layer's static ``fields``
    (`_Static.fields`), and from the second layer on the previous layer's MLP output to add."""
    args = []
    for i, layer_fields in enumerate(fields):
        a = LayerArgs.from_buffer_copy(template)
        a.delta = None if i == 0 else template.out
        (a.norm_w, a.post_norm_w, a.w_qkv, a.w_o, a.w_gate_up, a.w_down, a.qkv_bias,
         a.k_cache, a.v_cache, a.scale) = layer_fields  # fmt: skip
        args.append(a)
    return args


class _Parts(NamedTuple):
    """What the calls read from one layer, looked up once (module attributes are slow)."""

    packed: list[GemmWeight]  # qkv, o, gate/up, down
    norm: RMSNorm
    post_norm: RMSNorm
    qkv_bias: torch.Tensor | None
    scale: float


GemmWeight = PackedWeight | PanelWeight | QuantWeight


def _layer_parts(layer: LayerParts, dtype: torch.dtype) -> _Parts | None:
    """The layer's parts, or None unless all four projections have a current packed copy of one
    kind that the compiled calls multiply through for ``dtype`` (float32: MKL's, the panel
    GEMM's in float32 or over bfloat16 weights, or quantized blocks; bfloat16: the panel
    GEMM's)."""
    copies = [p.current_copy() for p in layer.projections]
    if not all(isinstance(c, GemmWeight) and c.dtype == dtype for c in copies):
        return None
    packed: list[GemmWeight] = copies  # type: ignore[assignment]
    if len({w.gemm_kind for w in packed}) != 1:
        return None
    return _Parts(packed, layer.norm, layer.post_norm, layer.qkv_bias, layer.scale)


@dataclass(eq=False)
class _Static:
    """What a step's calls read that does not change between steps of one model over one KV
    cache, checked and looked up once: each layer's parts and static `LayerArgs` fields."""

    kv_cache: weakref.ref[PagedKVCache]  # weak: a dropped engine's KV memory is let go
    dtype: torch.dtype
    parts: list[_Parts]
    gemm: int
    fields: list[tuple[Any, ...]]  # norm_w, post_norm_w, the 4 weights, qkv_bias, K, V, scale
    # each projection, its copy, and the weight tensor, address and version it was packed from
    copies: list[tuple[Projection, GemmWeight, torch.Tensor, int, int]]

    def current(self) -> bool:
        """Whether every projection still multiplies through the copy looked up, over the same
        weight, unmodified (`Projection.current_copy`'s test, without its calls)."""
        return all(
            p.packed_copy is c and p._parameters["weight"] is w and w._version == v
            and w.data_ptr() == d
            for p, c, w, d, v in self.copies
        )  # fmt: skip


_STATIC_ENTRIES = 4  # KV caches x dtypes one model's layers keep checked parts for


def _static_parts(
    config: ModelConfig, layers: list[LayerParts], dtype: torch.dtype, kv_cache: PagedKVCache
) -> _Static | None:
    """The step-independent part of `FusedLayers.prepare`: kept on the model's `layer_parts`
    list (`LayerPartsList`, the same object every step, so it lives and dies with the model),
    reused while it still holds, else looked up, checked and kept; None where the calls do not
    apply."""
    store: dict[tuple[torch.dtype, int], _Static] | None = getattr(layers, "fused_static", None)
    key = (dtype, id(kv_cache))
    static = store.get(key) if store is not None else None
    if static is not None and static.kv_cache() is kv_cache:
        if static.current():
            return static
        del store[key]  # type: ignore[union-attr]
    parts: list[_Parts] = []
    for layer in layers:
        part = _layer_parts(layer, dtype)
        if part is None:
            return None
        parts.append(part)
    gemm = _gemm_address(parts)
    if gemm is None:
        return None
    _check_static(config, dtype, kv_cache, parts)
    fields = [
        (part.norm.weight.data_ptr(), part.post_norm.weight.data_ptr(),
         *(w.operand for w in part.packed),
         None if part.qkv_bias is None else part.qkv_bias.data_ptr(),
         *(t.data_ptr() for t in kv_cache.layer(i)), part.scale)
        for i, part in enumerate(parts)
    ]  # fmt: skip
    copies = [(p, p.current_copy(), p.weight, *p.packed_from)
              for layer in layers for p in layer.projections]  # fmt: skip
    static = _Static(weakref.ref(kv_cache), dtype, parts, gemm, fields, copies)  # type: ignore[arg-type]
    if store is not None:
        for stale in [k for k, v in store.items() if v.kv_cache() is None]:
            del store[stale]  # an engine's KV cache that is gone
        if len(store) >= _STATIC_ENTRIES:
            store.pop(next(iter(store)))
        store[key] = static
    return static


def _gemm_address(parts: list[_Parts]) -> int | None:
    """The C GEMM that multiplies every layer's float32 packed weights (0 for bfloat16: the
    bfloat16 calls call the panel GEMM themselves), or None if the kinds differ."""
    kinds = {w.gemm_kind for p in parts for w in p.packed}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind == "mkl":
        return packed_gemm.compute_address()
    if kind == "quant":
        return quant_gemm.compute_address()
    if kind == "panel-bfloat16":
        return 0
    return panel_gemm.compute_address(bf16w=kind == "panel-bf16w")


def _kv_writer(kv_cache: PagedKVCache) -> int | None:
    """The address of the kernel's writer of a quantized cache the calls write through
    (int8, int4: `native_attention.kv_write_address`), else None (a float cache: its rows are
    copied; other layouts: the calls do not apply)."""
    if kv_cache.kv_format.name not in QUANTIZED_KV_WRITTEN:
        return None
    return native_attention.kv_write_address()


# the quantized KV layouts the calls write (through the kernel's writer); over another layout
# than the activations' dtype the layers run as torch modules
QUANTIZED_KV_WRITTEN = ("int8", "int4")


def _whole_step_kernel(
    q: torch.Tensor,
    kv_cache: PagedKVCache,
    metadata: AttentionMetadata,
    plan: AttentionPlan,
    out: torch.Tensor,
) -> native_attention.PreparedAttend | native_attention.PreparedDecode | None:
    """The attention kernel set up for the whole step where one kernel call attends all of it:
    one sequence's prefill in float32 (the step's `AttentionPlan` gives it to the kernel), or
    decodes only with one shared prefix or none (`decode_attention.prepared_whole_step`)."""
    k_cache, v_cache = kv_cache.layer(0)
    if plan.whole_step_native and q.dtype == torch.float32:
        (work,) = plan.prefill
        assert work.slots is not None
        kv_heads, head_dim = kv_cache.num_kv_heads, kv_cache.head_dim
        k_flat = k_cache.view(-1, kv_heads, head_dim)
        v_flat = v_cache.view(-1, kv_heads, head_dim)
        return native_attention.PreparedAttend(q, k_flat, v_flat, work.slots, out)
    if not plan.native or plan.prefill or len(plan.decode_rows) != metadata.num_seqs:
        return None
    decodes = step_decode_plan(metadata, plan.decode_rows, q.device)
    return prepared_whole_step(q, k_cache, v_cache, decodes, out)


def _check_step(
    config: ModelConfig,
    h: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    kv_cache: PagedKVCache,
    metadata: AttentionMetadata,
) -> None:
    """What the compiled calls read through raw pointers that changes with the step, checked
    once for all layers (the rest: `_check_static`)."""
    rows, head_dim, dtype = h.shape[0], config.head_dim, h.dtype
    slots = metadata.slot_mapping
    ok = (
        h.shape[1] == config.hidden_size
        and all(t.shape == (rows, 1, head_dim) and t.is_contiguous() for t in cos_sin)
        and all(t.dtype == dtype and t.is_cpu for t in cos_sin)
        and slots.shape == (rows,)
        and slots.dtype == torch.int64
        and slots.is_contiguous()
    )
    if not ok:
        raise ValueError("fused layers: unsupported shapes, strides or dtypes")
    low, high = metadata.slot_range()
    if low < 0 or high >= kv_cache.num_blocks * kv_cache.block_size:
        raise ValueError("fused layers: slot out of range")


def _check_static(
    config: ModelConfig, dtype: torch.dtype, kv_cache: PagedKVCache, parts: list[_Parts]
) -> None:
    """The weights, norms, biases and KV caches the calls read through raw pointers, checked
    once per model, KV cache and dtype."""
    c = config
    hidden, head_dim = c.hidden_size, c.head_dim
    heads, kv_heads, inter = c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    width, q_size = (heads + 2 * kv_heads) * head_dim, heads * head_dim
    shapes = [(hidden, width), (q_size, hidden), (hidden, 2 * inter), (inter, hidden)]
    # rows of head_dim values in the model's dtype, or a quantized layout's bytes
    cache_shape = (kv_cache.num_blocks, kv_cache.block_size, kv_heads, kv_cache.row_width)
    cache_dtype = dtype if _kv_writer(kv_cache) is None else torch.uint8
    caches = [t for i in range(kv_cache.num_layers) for t in kv_cache.layer(i)]
    norms = [norm for p in parts for norm in (p.norm, p.post_norm)]
    eps = norms[0].eps
    ok = (
        all(w.dtype == dtype for p in parts for w in p.packed)
        and kv_cache.num_layers == len(parts)
        and all(
            t.shape == cache_shape and t.is_contiguous() and t.dtype == cache_dtype and t.is_cpu
            for t in caches
        )
        and all([(w.in_features, w.out_features) for w in p.packed] == shapes for p in parts)
        and all(
            w.shape == (hidden,) and w.is_contiguous() and w.dtype == dtype
            for w in (n.weight for n in norms)
        )
        and all(n.eps == eps for n in norms)
        and all(
            b is None or (b.shape == (width,) and b.is_contiguous() and b.dtype == dtype)
            for b in (p.qkv_bias for p in parts)
        )
    )
    if not ok:
        raise ValueError("fused layers: unsupported shapes, strides or dtypes")
