"""The model runtime: HF and GGUF checkpoints of the architectures in `ARCHITECTURES` (Llama,
Mistral, Qwen2, Qwen3: `prefixcache.model.arch`), tokenizer and chat template, the built-in
``tiny``/``small`` models, and the decoder over paged KV.

    from prefixcache.model import load_model
    loaded = load_model("tiny")            # or a checkpoint directory
    logits = loaded.model(input_ids, positions, kv_cache, attn_metadata)   # [B, vocab]
"""

from prefixcache.model.arch import ARCHITECTURES
from prefixcache.model.config import ConfigError, ModelConfig, RopeConfig
from prefixcache.model.decoder import CausalLM
from prefixcache.model.detokenizer import IncrementalDetokenizer
from prefixcache.model.loader import DTYPES, LoadedModel, ModelLoadError, load_model
from prefixcache.model.tokenizer import Tokenizer, TokenizerError
from prefixcache.model.weights import WeightLoadError

__all__ = [
    "ARCHITECTURES",
    "DTYPES",
    "CausalLM",
    "ConfigError",
    "IncrementalDetokenizer",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "RopeConfig",
    "Tokenizer",
    "TokenizerError",
    "WeightLoadError",
    "load_model",
]
