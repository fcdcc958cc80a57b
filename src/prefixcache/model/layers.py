"""The decoder's layers: RMSNorm, the projections (with their packed CPU copies), attention over
paged KV, the SwiGLU MLP and the decoder layer that chains them.

Below both the PyTorch decoder (`decoder.py`, which stacks these) and the compiled path
(`fused_layers.py`, which runs a layer as one or two C calls over the parts `DecoderLayer.parts`
hands it): neither of those imports the other's module to reach a layer.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.attention import AttentionMetadata, PagedKVCache, paged_attention, write_kv
from prefixcache.attention.plan import AttentionPlan, attention_plan
from prefixcache.model import native_layers, onednn_gemm, packed_gemm, panel_gemm, tuning
from prefixcache.model.config import ModelConfig
from prefixcache.model.lora_batch import LoraStep
from prefixcache.model.onednn_gemm import OneDnnWeight
from prefixcache.model.packed_gemm import PackedWeight
from prefixcache.model.panel_gemm import PanelWeight
from prefixcache.model.rope import apply_rotary
from prefixcache.native import invariance

__all__ = [
    "MLP", "PACKED_DTYPES", "Attention", "DecoderLayer", "LayerParts", "LayerPartsList",
    "Projection", "RMSNorm", "choose_gemm",
]  # fmt: skip


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as transformers does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native(x):
            return native_layers.add_rms_norm(x, None, self.weight, self.eps)
        if x.dtype == torch.float32:  # the fused op: same bits, one pass
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The residual add and the norm: ``h += delta`` in place, returns ``self(h)``; one pass
        over the rows where the native layers apply."""
        if self._native(h) and delta.is_contiguous() and delta.shape == h.shape:
            return native_layers.add_rms_norm(h, delta, self.weight, self.eps)
        h += delta
        normed: torch.Tensor = self(h)
        return normed

    def _native(self, x: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and x.is_contiguous()
            and self.weight.dtype == x.dtype
            and native_layers.applies(x)
        )


PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedCopy(Protocol):
    """What a projection multiplies through instead of ``F.linear``: a packed copy of its
    weight [out_features, in_features] (`PanelWeight`, MKL's `PackedWeight`, `OneDnnWeight`),
    ``matmul(x, bias)`` equal to ``F.linear(x, weight, bias)`` up to float rounding."""

    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype: ...  # what it multiplies: x and the result

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...


def choose_gemm(in_features: int, out_features: int, dtype: torch.dtype) -> tuple[bool, bool]:
    """``(onednn, panel)`` for `Projection.pack` of a model's CPU projections of this shape and
    dtype. With batch invariance on (`prefixcache.native.invariance`, the default) the panel
    GEMM wherever its kernel for ``dtype`` is vector code here: each of its sums is one chain
    of multiply-adds in a fixed order for any row count and thread count, which no library
    promises (oneDNN and MKL pick kernels by the row count). Otherwise, or where the
    environment forces the choice (``PREFIXCACHE_PANEL_GEMM``, ``PREFIXCACHE_ONEDNN_LINEAR``),
    the fastest by a start-up timing (`onednn_gemm.prefer_onednn`, `panel_gemm.prefer_panel`)."""
    forced = [onednn_gemm.forced_by_env(v)
              for v in ("PREFIXCACHE_PANEL_GEMM", "PREFIXCACHE_ONEDNN_LINEAR")]  # fmt: skip
    if (invariance.enabled() and forced == [None, None] and panel_gemm.vectorised(dtype)
            and panel_gemm.available(dtype)):  # fmt: skip
        return False, True
    onednn = dtype == torch.float32 and onednn_gemm.prefer_onednn(in_features, out_features)
    return onednn, panel_gemm.prefer_panel(in_features, out_features, dtype, onednn)


class Projection(nn.Linear):
    """``nn.Linear`` that can also multiply through a packed copy of its weight.

    ``pack()`` (CPU) keeps a packed copy next to the parameter: the package's own panel GEMM's
    (`panel_gemm`, float32 or bfloat16) where a start-up timing finds it no slower, else for a
    float32 weight MKL's `PackedWeight` or oneDNN's, for a bfloat16 weight oneDNN's (bfloat16
    products, float32 accumulation: the same bits as ``F.linear``). Forward then uses it for
    2-D input of the weight's dtype and any row count. Same parameters and state dict as
    ``nn.Linear``; the packed copy is dropped, never used stale, once the weight is replaced or
    modified in place.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed_copy: PackedCopy | None = None
        self._packed_from = (0, -1)  # (data_ptr, version) of the weight that was packed

    @property
    def packed(self) -> PackedWeight | None:
        """The packed copy if it is MKL's."""
        copy = self.packed_copy
        return copy if isinstance(copy, PackedWeight) else None

    @property
    def onednn(self) -> OneDnnWeight | None:
        """The packed copy if it is oneDNN's."""
        copy = self.packed_copy
        return copy if isinstance(copy, OneDnnWeight) else None

    @property
    def panel(self) -> PanelWeight | None:
        """The packed copy if it is the panel GEMM's."""
        copy = self.packed_copy
        return copy if isinstance(copy, PanelWeight) else None

    def pack(self, enable: bool = True, onednn: bool = False, panel: bool = False) -> bool:
        """Keep a packed copy of the current weight (or drop it): with ``panel`` the panel
        GEMM's (`panel_gemm`), else for float32 MKL's or, with ``onednn``, oneDNN's
        (`onednn_gemm`), for bfloat16 oneDNN's. False where none applies (not a float32 or
        bfloat16 CPU weight, or the library is missing)."""
        self.packed_copy = None
        weight, dtype = self.weight, self.weight.dtype
        if not enable or weight.device.type != "cpu" or dtype not in PACKED_DTYPES:
            return False
        if panel and panel_gemm.available(dtype):
            self.packed_copy = PanelWeight.pack(weight)
        elif (onednn or dtype == torch.bfloat16) and onednn_gemm.available(dtype):
            self.packed_copy = OneDnnWeight.pack(weight)
        elif dtype == torch.float32 and packed_gemm.available():
            self.packed_copy = PackedWeight.pack(weight)
        else:
            return False
        self._packed_from = (weight.data_ptr(), weight._version)
        return True

    def keep(self, copy: PackedCopy, cast_parameter: bool = True) -> None:
        """Multiply float32 inputs through ``copy``, a weight kept in another form than the
        float32 parameter (`PanelWeight` of bfloat16 weights, `QuantWeight` blocks): the
        parameter becomes bfloat16 too (half the memory; what other inputs and a stale copy
        fall back to), unless ``cast_parameter`` is False (a weight shared with the embedding)."""
        if cast_parameter and self.weight.dtype == torch.float32:
            self.weight.data = self.weight.data.to(torch.bfloat16)
        self.packed_copy = copy
        self._packed_from = (self.weight.data_ptr(), self.weight._version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.device.type == "cpu":
            copy = self.current_copy()
            if copy is not None and copy.dtype == x.dtype:
                return copy.matmul(x, self.bias)
        weight = self.weight
        if weight.dtype != x.dtype:  # a float32 model's bfloat16 parameter (`keep`)
            weight = weight.to(x.dtype)
        return F.linear(x, weight, self.bias)

    @property
    def packed_from(self) -> tuple[int, int]:
        """The (address, version) of the weight the packed copy was made from."""
        return self._packed_from

    def current_copy(self) -> PackedCopy | None:
        """The packed copy if it still holds the current weight, else None (and dropped: the
        weight changed, a stale copy is never used)."""
        if self.packed_copy is not None and not self._is_current():
            self.packed_copy = None
        return self.packed_copy

    def _is_current(self) -> bool:
        weight = self._parameters["weight"]  # not self.weight: nn.Module's slow lookup, per step
        return weight is not None and self._packed_from == (weight.data_ptr(), weight._version)


class Attention(nn.Module):
    """Grouped-query attention with fused qkv, optional qkv bias (Qwen2) and q/k norm (Qwen3)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        qkv_out = self.q_size + 2 * self.kv_size
        self.qkv_proj = Projection(config.hidden_size, qkv_out, bias=config.attention_bias)
        self.o_proj = Projection(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
        plan: AttentionPlan | None = None,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """``lora``: the step's adapters, whose updates follow each projection."""
        num_tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        projected_qkv: torch.Tensor = self.qkv_proj(x)
        if lora is not None:
            lora.apply(self.layer_index, 0, x, projected_qkv)
        qkv = projected_qkv.view(num_tokens, heads + 2 * kv_heads, self.head_dim)
        if self.qk_norm:
            q = _rotate(self.q_norm(qkv[:, :heads]), cos_sin)  # [T, heads, head_dim]
            k = _rotate(self.k_norm(qkv[:, heads : heads + kv_heads]), cos_sin)
        else:  # q and k rotated in one pass: [T, heads + kv_heads, head_dim]
            qk = _rotate(qkv[:, : heads + kv_heads], cos_sin)
            q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, heads + kv_heads :]  # [T, kv_heads, head_dim]
        k_cache, v_cache = kv_cache.layer(self.layer_index)
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping, kv_cache.kv_format)
        if plan is None:
            plan = attention_plan(q, k_cache, v_cache, metadata, kv_cache.kv_format)
        out = paged_attention(q, k, v, k_cache, v_cache, metadata, self.scale, plan)
        attended = out.reshape(num_tokens, self.q_size)
        projected: torch.Tensor = self.o_proj(attended)
        if lora is not None:
            lora.apply(self.layer_index, 1, attended, projected)
        return projected


class MLP(nn.Module):
    """SwiGLU with a fused gate/up projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Projection(
            config.hidden_size, 2 * config.intermediate_size, bias=False
        )
        self.down_proj = Projection(config.intermediate_size, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, lora: LoraStep | None = None, layer_index: int = 0
    ) -> torch.Tensor:
        """``lora``: the step's adapters (their updates of layer ``layer_index``)."""
        num_tokens = x.shape[0]
        chunk = tuning.mlp_chunk_rows(self.intermediate_size, x.element_size())
        if num_tokens <= chunk:
            return self._swiglu(x, lora, layer_index, 0)
        # long prefills go through in row chunks: the activation stays cache-sized
        out = x.new_empty(num_tokens, x.shape[1])
        for start in range(0, num_tokens, chunk):
            rows = slice(start, start + chunk)
            out[rows] = self._swiglu(x[rows], lora, layer_index, start)
        return out

    def _swiglu(
        self, x: torch.Tensor, lora: LoraStep | None, layer_index: int, first_row: int
    ) -> torch.Tensor:
        gate_up: torch.Tensor = self.gate_up_proj(x)
        if lora is not None:
            lora.apply(layer_index, 2, x, gate_up, first_row)
        if gate_up.is_contiguous() and native_layers.applies(gate_up):
            activated = native_layers.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            activated = F.silu(gate) * up
        out: torch.Tensor = self.down_proj(activated)
        if lora is not None:
            lora.apply(layer_index, 3, activated, out, first_row)
        return out


class LayerParts(NamedTuple):
    """What a compiled layer call reads from one decoder layer (`DecoderLayer.parts`)."""

    projections: tuple[Projection, Projection, Projection, Projection]  # qkv, o, gate/up, down
    norm: RMSNorm
    post_norm: RMSNorm
    qkv_bias: torch.Tensor | None
    scale: float


class LayerPartsList(list[LayerParts]):
    """A model's `LayerParts`, one per layer, as `CausalLM.layer_parts` keeps them: the
    compiled layers keep what they checked once on it (``fused_static``), so that it lives and
    dies with the model."""

    def __init__(self, parts: list[LayerParts]) -> None:
        super().__init__(parts)
        self.fused_static: dict[object, object] = {}


class DecoderLayer(nn.Module):
    def parts(self) -> LayerParts:
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return LayerParts(projections, self.input_layernorm, self.post_attention_layernorm,
                          attn.qkv_proj.bias, attn.scale)

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
        plan: AttentionPlan | None = None,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """One layer on the residual stream h [T, hidden], updated in place: ``h += delta`` (the
        previous layer's MLP output; None for the first layer), then ``h += attention``. Returns
        this layer's MLP output, the next delta: each residual add is fused with the norm after
        it (`RMSNorm.add_forward`), as vLLM's layers do. ``lora``: the step's adapters."""
        norm = self.input_layernorm
        x = norm(h) if delta is None else norm.add_forward(h, delta)
        attended = self.self_attn(x, cos_sin, kv_cache, metadata, plan, lora)
        normed = self.post_attention_layernorm.add_forward(h, attended)
        out: torch.Tensor = self.mlp(normed, lora, self.self_attn.layer_index)
        return out


def _rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding of x [T, heads, head_dim]: in place through the native layers (x is
    this step's own projection output or norm), else torch's `apply_rotary` (a new tensor)."""
    if native_layers.applies(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return native_layers.rotary_(x, *cos_sin)
    return apply_rotary(x, *cos_sin)
