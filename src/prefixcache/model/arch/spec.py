"""`Architecture`: what one checkpoint architecture is to this runtime, as plain data.

Its names (config.json's ``architectures`` and ``model_type``, GGUF's ``general.architecture``)
and how its decoder differs from Llama's. The config reader, the decoder and the GGUF reader read
these fields; none of them names an architecture. Knows nothing about tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Architecture"]


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # config.json's "architectures"[0], e.g. "Qwen2ForCausalLM"
    model_type: str  # config.json's "model_type" (transformers' name for it)
    family: str  # the decoder it shares with compatible architectures ("llama" for Mistral)
    gguf_name: str | None = None  # the GGUF "general.architecture" read as this one, if any
    # q, k and v projections with biases where config.json has no "attention_bias"
    attention_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and of k before the rotary embedding
    # config.json's "sliding_window" applies unless its "use_sliding_window" says otherwise
    sliding_window_by_default: bool = False
    # llama.cpp stores the q and k rows of each head interleaved for its rotary kernel
    gguf_permuted_qk: bool = False
