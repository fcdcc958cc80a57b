"""The decoder: every architecture of `prefixcache.model.arch` as one PyTorch module over paged
KV (an architecture's differences are `ModelConfig` fields: qkv bias, q/k norm).

``CausalLM(input_ids [T], positions [T], kv_cache, attn_metadata) -> logits [B, vocab]``:
linear layers run over all T tokens of the step at once (the MLP over at most
`tuning.mlp_chunk_rows` at a time); attention writes the new K/V through the slot mapping and
reads context through block tables (`prefixcache.attention`). Parameter names follow
transformers except the fused ``qkv_proj`` and ``gate_up_proj`` (see weights.py). On CPU the
projections also hold a packed copy of their weight (`Projection`: the panel GEMM's, MKL's or
oneDNN's), and the element-wise steps (residual add + RMSNorm, rotary, SwiGLU) run as
compiled one-pass kernels (`native_layers`) where they build; the residual stream is updated in
place, each add fused with the norm after it.
With both, each layer runs as one or two compiled calls (`fused_layers`), where they run the
model (`fused_layers.unsupported`; the kernels report says which and why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from prefixcache.attention import AttentionMetadata, PagedKVCache, native_attention
from prefixcache.attention.plan import build_plan
from prefixcache.model import native_layers, panel_gemm, quant_gemm
from prefixcache.model.config import ModelConfig
from prefixcache.model.fused_layers import FusedLayers, unsupported
from prefixcache.model.layers import (
    PACKED_DTYPES,
    DecoderLayer,
    LayerParts,
    LayerPartsList,
    Projection,
    RMSNorm,
    choose_gemm,
)
from prefixcache.model.lora_batch import LoraStep
from prefixcache.model.panel_gemm import PanelWeight
from prefixcache.model.quant_gemm import QuantBlocks, QuantWeight
from prefixcache.model.rope import RotaryEmbedding
from prefixcache.native import invariance

__all__ = ["WEIGHT_DTYPES", "BlockSource", "CausalLM", "DecoderLayer", "Projection", "RMSNorm"]

# How a float32 model can keep its projection weights (`CausalLM.store_weights`): float32 (the
# parameters themselves), bfloat16 (widened in the GEMM), q8_0 (8-bit blocks made from the
# float weights), gguf (the GGUF file's own quantized blocks, q8_0 where a tensor has none).
WEIGHT_DTYPES = ("float32", "bfloat16", "q8_0", "gguf")

# a projection's module name ("model.layers.3.mlp.gate_up_proj", "lm_head") -> its quantized
# blocks (q, d, m, kind: `quant_gemm.gguf_blocks` and the GGUF type) or None where it has none
BlockSource = Callable[[str], QuantBlocks | None]



class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # the weight comes from the checkpoint: no random init (on the meta device the loader
        # builds on, Embedding's normal_ would import torch._dynamo: start-up time for nothing)
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        layers = [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def decoder_layers(self) -> list[DecoderLayer]:
        """``layers`` as their type (an ``nn.ModuleList`` yields ``nn.Module``)."""
        layers: list[DecoderLayer] = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layers.append(layer)
        return layers


class CausalLM(nn.Module):
    """Decoder plus LM head; ``forward`` returns logits only at ``logits_indices``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = Projection(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary: RotaryEmbedding | None = None

    def layer_parts(self) -> list[LayerParts]:
        """What the compiled layer calls read from each layer: looked up once (the same list
        every step, which `FusedLayers` keys its checked step-independent part on) and again
        only where a layer module was replaced."""
        layers = self.model.decoder_layers()
        cached: tuple[list[int], LayerPartsList] | None = self.__dict__.get("_layer_parts")
        if cached is None or cached[0] != [id(m) for m in layers]:
            cached = ([id(m) for m in layers], LayerPartsList([layer.parts() for layer in layers]))
            self.__dict__["_layer_parts"] = cached
        return cached[1]

    def projections(self) -> list[Projection]:
        """The 4 projections of every layer: qkv, o, gate/up, down."""
        return [
            linear
            for layer in self.model.decoder_layers()
            for linear in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        ]

    def kernels(self, kv_cache: str | None = None) -> dict[str, Any]:
        """Which kernels run this model's steps here (`kernels_report`), from the packed copies
        its projections hold; ``kv_cache``: a KV layout other than the activations' dtype
        (its name), which the compiled layer calls do not write."""
        layer_gemms = {_gemm_name(p) for p in self.projections()}
        gemms = layer_gemms | {_gemm_name(self.lm_head)}
        layers = _layers_kernel(self.config, layer_gemms)
        if kv_cache is not None and layers == "compiled":
            layers = f"torch modules (the compiled calls write no {kv_cache} KV rows)"
        return kernels_report(gemms, self.config.head_dim, self.lm_head.weight.dtype, layers)

    def prepare_cpu_projections(self, pack: bool = True) -> None:
        """CPU only: float32 weights laid out for MKL's sgemm, and with ``pack`` every
        projection's packed copy (`Projection.pack`; no-op elsewhere).

        Each float32 weight [out, in] becomes a view of its contiguous transpose [in, out], so
        that ``x @ W^T`` hands sgemm an untransposed right operand (same values, shapes and
        names); that is the layout ``F.linear`` uses where packed GEMM is off or unavailable.
        With ``pack``, each also keeps a packed copy, which is faster still, of the GEMM
        `choose_gemm` picks on the model's MLP shape (the panel GEMM's wherever it is vector
        code, for batch invariance; else a timing's choice); so does the LM head (its weight
        left as it is: it may be the embedding's).
        """
        layers = self.model.decoder_layers()
        mlp = layers[0].mlp.gate_up_proj if layers else None
        onednn = panel = False
        if pack and mlp is not None and mlp.weight.device.type == "cpu":
            if mlp.weight.dtype in PACKED_DTYPES:
                onednn, panel = choose_gemm(mlp.in_features, mlp.out_features, mlp.weight.dtype)
        for linear in self.projections():
            weight = linear.weight
            if weight.device.type != "cpu":
                continue
            if weight.dtype == torch.float32 and weight.is_contiguous():
                weight.data = weight.data.t().contiguous().t()
            linear.pack(pack, onednn, panel)
        self.lm_head.pack(pack, onednn, panel)

    def store_weights(self, weight_dtype: str, blocks: BlockSource | None = None) -> dict[str, int]:
        """A float32 CPU model keeps every projection's weight, and the LM head's, as
        ``weight_dtype`` (`WEIGHT_DTYPES`) and multiplies its float32 activations through it
        (`Projection.keep`): bfloat16 panels (`PanelWeight`), or 8-bit blocks (`QuantWeight`)
        from ``blocks`` with ``gguf``, else made from the weight as Q8_0 (a width not a
        multiple of 32 keeps bfloat16 panels). Returns how many projections each kind holds."""
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"unknown weight dtype {weight_dtype!r} (one of {WEIGHT_DTYPES})")
        named = [(n, m) for n, m in self.named_modules() if isinstance(m, Projection)]
        if any(m.weight.dtype != torch.float32 or not m.weight.is_cpu for _, m in named):
            raise ValueError("stored weights need a float32 model on the CPU")
        counts: dict[str, int] = {}
        if weight_dtype == "float32":
            self.prepare_cpu_projections()
            return {"float32": len(named)}
        shared = self.lm_head.weight is self.model.embed_tokens.weight
        for name, linear in named:
            copy = _stored_copy(name, linear.weight, weight_dtype, blocks)
            linear.keep(copy, cast_parameter=not (shared and linear is self.lm_head))
            kind = copy.kind if isinstance(copy, QuantWeight) else "bfloat16"
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def init_rotary(self) -> None:
        """Build rotary tables on the parameters' device (call after weights are in place)."""
        device = self.model.embed_tokens.weight.device
        self.rotary = RotaryEmbedding(self.config.head_dim, self.config.rope, device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        attn_metadata: AttentionMetadata,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> logits [B, vocab] at each sequence's last new token;
        ``lora``: the rows that run under LoRA adapters (`lora_batch`), None: none."""
        if self.rotary is None:
            self.init_rotary()
        assert self.rotary is not None
        _check_inputs(input_ids, positions, kv_cache, attn_metadata, self.config)
        h = self.model.embed_tokens(input_ids)  # [T, hidden], the residual stream
        cos_sin = self.rotary.cos_sin(positions, h.dtype)
        delta: torch.Tensor | None = None  # the last layer's output, not yet added to h
        c = self.config
        plan = build_plan(attn_metadata, *kv_cache.layer(0), c.num_attention_heads, h.dtype,
                          h.device, kv_cache.kv_format)  # every layer's path, decided once
        fused = FusedLayers.prepare(
            c, self.layer_parts(), h, cos_sin, kv_cache, attn_metadata, plan, lora
        )
        for i, layer in enumerate(self.model.layers):
            if fused is not None:
                delta = fused.run(i)
            else:
                delta = layer(h, delta, cos_sin, kv_cache, attn_metadata, plan, lora)
        rows = attn_metadata.logits_indices
        last = h.index_select(0, rows)  # [B, hidden]: only these rows need the last add
        if delta is not None:
            last += delta.index_select(0, rows)
        logits: torch.Tensor = self.lm_head(self.model.norm(last))
        return logits



def kernels_report(
    gemms: set[str], head_dim: int, dtype: torch.dtype, layers: str
) -> dict[str, Any]:
    """The projections' GEMMs (`_gemm_name`'s names), the attention path for ``head_dim`` and
    the activations' ``dtype``, how the layers run (``layers``: `_layers_kernel`), and whether
    the GEMMs and attention keep a row's result independent of the rest of its batch: the panel
    and quantized GEMMs and the compiled direct attention path do by construction, the
    libraries' GEMMs and the other attention paths promise nothing; ``batch_invariant`` is
    both, with `invariance` on."""
    attention = native_attention.kernel_name(head_dim, dtype)
    invariant_gemm = all(name.startswith(("panel", "quantized")) for name in gemms)
    invariant = invariance.enabled() and invariant_gemm and attention.startswith("direct")
    return {"gemm": ", ".join(sorted(gemms)), "attention": attention, "layers": layers,
            "batch_invariant": invariant}  # fmt: skip


# the GEMMs (`_gemm_name`'s names) the compiled layer calls multiply through
_COMPILED_LAYER_GEMMS = ("panel GEMM", "quantized blocks", "MKL")


def _layers_kernel(config: ModelConfig, layer_gemms: set[str]) -> str:
    """``compiled``: each layer one or two calls into layers.c (`FusedLayers`), or ``torch
    modules`` and why not: a model the calls do not run (`fused_layers.unsupported`), the
    native layers off or not built here, or a GEMM of the layers' the calls do not call."""
    why = unsupported(config)
    if why is None and not native_layers.enabled():
        why = "the native layers are off or do not build here"
    if why is None and not all(g.startswith(_COMPILED_LAYER_GEMMS) for g in layer_gemms):
        why = f"the calls do not multiply through {', '.join(sorted(layer_gemms))}"
    return "compiled" if why is None else f"torch modules ({why})"


def expected_kernels(
    config: ModelConfig, dtype: torch.dtype, weights: str, kv_cache: str | None = None
) -> dict[str, Any]:
    """`CausalLM.kernels` of a model of ``config`` loaded in ``dtype`` with its projections kept
    as ``weights`` (`WEIGHT_DTYPES`) and its KV as ``kv_cache`` (a layout other than ``dtype``,
    by name), without its weights: what `choose_gemm` picks for its MLP shape, or the narrow
    forms' kernels."""
    if weights in ("q8_0", "gguf"):
        gemm = _quant_name()
    elif dtype == torch.float32 and weights == "bfloat16":
        gemm = f"panel GEMM ({panel_gemm.kernel_name(torch.float32)})"
    else:
        onednn, panel = choose_gemm(config.hidden_size, 2 * config.intermediate_size, dtype)
        gemm = (f"panel GEMM ({panel_gemm.kernel_name(dtype)})" if panel
                else "oneDNN" if onednn or dtype == torch.bfloat16 else "MKL")  # fmt: skip
    layers = _layers_kernel(config, {gemm})
    if kv_cache is not None and layers == "compiled":
        layers = f"torch modules (the compiled calls write no {kv_cache} KV rows)"
    return kernels_report({gemm}, config.head_dim, dtype, layers)


def _quant_name() -> str:
    return f"quantized blocks ({quant_gemm.kernel_name()})"


def _gemm_name(linear: Projection) -> str:
    """How one projection multiplies: ``panel GEMM (<instruction set>)``, ``quantized blocks
    (...)``, ``oneDNN``, ``MKL`` or ``torch``."""
    copy = linear.packed_copy
    if isinstance(copy, PanelWeight):
        return f"panel GEMM ({panel_gemm.kernel_name(copy.dtype)})"
    if isinstance(copy, QuantWeight):
        return _quant_name()
    if linear.onednn is not None:
        return "oneDNN"
    return "MKL" if linear.packed is not None else "torch"


def _check_inputs(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: PagedKVCache,
    metadata: AttentionMetadata,
    config: ModelConfig,
) -> None:
    if input_ids.dim() != 1 or input_ids.shape != positions.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
            "must be equal 1-D shapes"
        )
    if input_ids.shape[0] != metadata.num_tokens:
        raise ValueError(
            f"{input_ids.shape[0]} input ids for {metadata.num_tokens} scheduled tokens"
        )
    if kv_cache.num_layers != config.num_hidden_layers or (
        kv_cache.num_kv_heads,
        kv_cache.head_dim,
    ) != (config.num_key_value_heads, config.head_dim):
        raise ValueError("KV cache shape does not match the model config")


def _stored_copy(
    name: str, weight: torch.Tensor, weight_dtype: str, blocks: BlockSource | None
) -> PanelWeight | QuantWeight:
    found = blocks(name) if weight_dtype == "gguf" and blocks is not None else None
    if found is not None:
        q, d, m, kind = found
        return QuantWeight.pack(q, d, m, kind)
    if weight_dtype != "bfloat16" and weight.shape[1] % quant_gemm.BLOCK == 0:
        return QuantWeight.from_float(weight)
    return PanelWeight.pack(weight.to(torch.bfloat16), torch.float32)
