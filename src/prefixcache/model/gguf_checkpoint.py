"""GGUF checkpoints (llama.cpp's single-file format): config, tokenizer and weights from one file.

A `.gguf` file carries the model's hyper-parameters and tokenizer as metadata and its tensors in
llama.cpp's naming, possibly quantized. This module turns it into what a checkpoint directory
gives the rest of the runtime: a `ModelConfig` (through the same validation as config.json), a
`Tokenizer` (a `tokenizers` byte-level BPE built from the vocabulary, merges and pre-tokenizer
named in the metadata) and the decoder's parameters, dequantized one tensor at a time by the
`gguf` library (maintained with llama.cpp) straight into the model's own storage, so a load never
holds a second float copy of the model. Knows nothing about the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefixcache.model.arch import ARCHITECTURES, by_gguf_name
from prefixcache.model.config import ConfigError, ModelConfig
from prefixcache.model.decoder import CausalLM
from prefixcache.model.gguf_layout import GGUFError, check_gguf_layout
from prefixcache.model.quant_gemm import QuantBlocks
from prefixcache.model.tokenizer import Tokenizer, TokenizerError
from prefixcache.model.weights import load_tensors

__all__ = [
    "GGUF_PRE_TOKENIZERS",
    "GGUFCheckpoint",
    "GGUFError",
    "convert_to_directory",
    "find_gguf",
]

# The splits llama.cpp's BPE pre-tokenizer applies for each `tokenizer.ggml.pre` value
# (llama-vocab.cpp), as `tokenizers` regexes applied in sequence, each splitting the pieces the
# previous one left. Case-insensitive contractions are written with `(?i:...)`, as the models'
# own tokenizer.json files have them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT = r"\p{N}"
GGUF_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
    "dbrx": (_LLAMA3,),
    "smollm": (_DIGIT, _GPT2),
    "starcoder": (_DIGIT, _GPT2),
    "refact": (_DIGIT, _GPT2),
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
    "stablelm2": (_QWEN2,),
    "tekken": (_TEKKEN,),
}
# pre-tokenizers whose BPE looks a whole piece up in the vocabulary before merging (llama 3)
_IGNORE_MERGES = ("llama-bpe", "llama3", "smaug-bpe", "dbrx")

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def find_gguf(path: Path) -> Path | None:
    """``path`` itself if it is a .gguf file; the one .gguf in a directory; else None."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise GGUFError(f"{path} holds several .gguf files ({names}): name one")
    return found[0] if found else None


class GGUFCheckpoint:
    """One opened .gguf file: ``config()``, ``tokenizer()``, ``load_weights(model)``."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            check_gguf_layout(self.path)  # the reader itself trusts every count it reads
            self.reader = GGUFReader(str(self.path), "r")
        except GGUFError:
            raise
        except Exception as exc:  # the reader raises bare ValueError/struct errors on bad bytes
            raise GGUFError(f"cannot read GGUF file {self.path}: {exc}") from None
        self.arch = str(self._field("general.architecture", required=True))
        architecture = by_gguf_name(self.arch)
        if architecture is None:
            supported = [a.gguf_name for a in ARCHITECTURES.values() if a.gguf_name]
            raise GGUFError(
                f"unsupported GGUF architecture {self.arch!r} (supported: {', '.join(supported)})"
            )
        self.architecture = architecture
        self.tensors = {t.name: t for t in self.reader.tensors}

    # ---- metadata -------------------------------------------------------------------------------

    def _field(self, key: str, required: bool = False, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if required:
                raise GGUFError(f"{self.path.name}: metadata key {key!r} is missing")
            return default
        try:
            return field.contents()
        except UnicodeDecodeError as exc:  # strings are UTF-8 by the format
            raise GGUFError(f"{self.path.name}: metadata {key!r} is not UTF-8 text (byte "
                            f"{exc.start})") from None

    def _arch_field(self, key: str, required: bool = False, default: Any = None) -> Any:
        return self._field(f"{self.arch}.{key}", required, default)

    def config(self) -> ModelConfig:
        """The decoder's configuration, from the architecture's metadata keys."""
        raw = self.hf_config()
        try:
            return ModelConfig.from_dict(raw, {})
        except ConfigError as exc:
            raise GGUFError(f"{self.path.name}: {exc}") from None

    def hf_config(self) -> dict[str, Any]:
        """The metadata as a transformers-style config.json dict (validated by `config`)."""
        self._check_rope()
        heads = int(self._arch_field("attention.head_count", required=True))
        kv_heads = self._arch_field("attention.head_count_kv", default=heads)
        if isinstance(kv_heads, list):
            raise GGUFError(f"{self.path.name}: per-layer KV head counts are not supported")
        hidden = int(self._arch_field("embedding_length", required=True))
        head_dim = int(self._arch_field("attention.key_length", default=hidden // heads))
        rotary_dim = int(self._arch_field("rope.dimension_count", default=head_dim))
        if rotary_dim != head_dim:
            raise GGUFError(
                f"{self.path.name}: partial rotary embeddings (rope.dimension_count "
                f"{rotary_dim} of head_dim {head_dim}) are not supported"
            )
        embed = self._tensor("token_embd.weight")
        raw: dict[str, Any] = {
            "architectures": [self.architecture.name],
            "model_type": self.architecture.model_type,
            "vocab_size": int(embed.shape[-1]),  # ggml order: [hidden, vocab]
            "hidden_size": hidden,
            "intermediate_size": int(self._arch_field("feed_forward_length", required=True)),
            "num_hidden_layers": int(self._arch_field("block_count", required=True)),
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads),
            "head_dim": head_dim,
            "max_position_embeddings": int(self._arch_field("context_length", required=True)),
            "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon", True)),
            "rope_theta": float(self._arch_field("rope.freq_base", default=10000.0)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._eos_ids(),
        }
        window = self._arch_field("attention.sliding_window")
        if window:
            raw["sliding_window"] = int(window)
            raw["use_sliding_window"] = True
        raw["torch_dtype"] = self.weights_dtype()
        return raw

    def weights_dtype(self) -> str:
        """The precision the weights were stored in, as ``--dtype auto`` reads it: float32 when
        every tensor is F32, float16 when the others are F16, else bfloat16 (BF16 or quantized
        weights: they carry less than bfloat16's precision, and vLLM's CPU backend also runs
        them in bfloat16)."""
        kinds = {t.tensor_type.name for t in self.tensors.values()} - {"F32"}
        if not kinds:
            return "float32"
        return "float16" if kinds == {"F16"} else "bfloat16"

    def _check_rope(self) -> None:
        scaling = self._arch_field("rope.scaling.type", default="none")
        if scaling not in ("none", "", None):
            raise GGUFError(f"{self.path.name}: rope scaling {scaling!r} is not supported")
        if "rope_freqs.weight" in self.tensors:
            raise GGUFError(
                f"{self.path.name}: per-frequency rope factors (rope_freqs.weight, as llama 3.1 "
                "GGUFs carry) are not supported"
            )

    def _eos_ids(self) -> list[int]:
        """eos plus the end-of-turn ids llama.cpp also stops on."""
        ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self._field(f"tokenizer.ggml.{key}")
            if value is not None and int(value) not in ids:
                ids.append(int(value))
        return ids

    # ---- tokenizer ------------------------------------------------------------------------------

    def tokenizer(self) -> Tokenizer:
        """The file's byte-level BPE tokenizer and chat template, as a `Tokenizer`."""
        model = self._field("tokenizer.ggml.model", required=True)
        if model != "gpt2":
            raise GGUFError(
                f"{self.path.name}: tokenizer.ggml.model {model!r} is not supported "
                "(supported: 'gpt2', byte-level BPE)"
            )
        pre = str(self._field("tokenizer.ggml.pre", default="default"))
        if pre not in GGUF_PRE_TOKENIZERS:
            raise GGUFError(
                f"{self.path.name}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported "
                f"(supported: {', '.join(GGUF_PRE_TOKENIZERS)})"
            )
        tokens = [str(t) for t in self._field("tokenizer.ggml.tokens", required=True)]
        merges = [str(m) for m in self._field("tokenizer.ggml.merges", default=[])]
        types = list(self._field("tokenizer.ggml.token_type", default=[]))
        added = self._added_ids()
        backend = build_bpe_tokenizer(tokens, merges, types, pre, *added)
        special = {
            name: tokens[token_id]
            for name, token_id in self._special_ids().items()
            if token_id is not None and 0 <= token_id < len(tokens)
        }
        template = self._field("tokenizer.chat_template")
        return Tokenizer(backend, special, template, self._eos_ids())

    def _special_ids(self) -> dict[str, int | None]:
        names = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
        out: dict[str, int | None] = {}
        for name, key in names.items():
            value = self._field(f"tokenizer.ggml.{key}_token_id")
            out[f"{name}_token"] = None if value is None else int(value)
        return out

    def _added_ids(self) -> tuple[int | None, int | None]:
        """The bos and eos ids `encode` adds around a text, as the metadata asks."""
        ids = self._special_ids()
        add_bos = self._field("tokenizer.ggml.add_bos_token", default=False)
        add_eos = self._field("tokenizer.ggml.add_eos_token", default=False)
        return (ids["bos_token"] if add_bos else None, ids["eos_token"] if add_eos else None)

    # ---- weights --------------------------------------------------------------------------------

    def _tensor(self, name: str) -> Any:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise GGUFError(f"{self.path.name}: tensor {name!r} is missing")
        return tensor

    def tensor_types(self) -> dict[str, str]:
        """GGUF tensor name -> its storage type's name (F32, Q4_1, ...)."""
        return {name: t.tensor_type.name for name, t in self.tensors.items()}

    def load_weights(self, model: CausalLM, config: ModelConfig) -> None:
        """Dequantize every tensor into ``model``'s parameters, one tensor in memory at a time."""
        load_tensors(model, self.hf_tensors(config), self.path.name)

    def hf_tensors(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor as float32 under its transformers name, in transformers' row layout."""
        self._check_types()
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        for name, tensor in self.tensors.items():
            hf_name = _hf_name(name)
            if hf_name is None:
                raise GGUFError(f"{self.path.name}: unexpected tensor {name!r}")
            values = self._dequantize(tensor)
            module = hf_name.rsplit(".", 2)[-2]
            if self.architecture.gguf_permuted_qk and module in heads:
                values = _unpermute_rows(values, heads[module])
            yield hf_name, torch.from_numpy(values)

    def projection_blocks(
        self, config: ModelConfig
    ) -> Callable[[str], QuantBlocks | None]:
        """A `prefixcache.model.decoder.BlockSource`: a projection's quantized blocks read
        straight from the file (`quant_gemm.gguf_blocks`: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K),
        fused parts stacked, q/k rows un-permuted; None where a part has another type."""
        from prefixcache.model.quant_gemm import GGUF_NATIVE_TYPES, gguf_blocks

        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
        fused = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
                 "self_attn.o_proj": ("attn_output",), "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
                 "mlp.down_proj": ("ffn_down",)}  # fmt: skip

        def blocks(name: str) -> QuantBlocks | None:
            if name == "lm_head":
                tied = "output.weight" not in self.tensors
                tensors = ["token_embd.weight" if tied else "output.weight"]
            else:
                _, _, layer, module = name.split(".", 3)
                tensors = [f"blk.{layer}.{kind}.weight" for kind in fused[module]]
            parts = []
            for tensor_name in tensors:
                tensor = self._tensor(tensor_name)
                kind = tensor.tensor_type.name
                if kind not in GGUF_NATIVE_TYPES:
                    return None
                cols, rows = (int(v) for v in tensor.shape)
                q, d, m = gguf_blocks(np.asarray(tensor.data), kind, rows, cols)
                if m is None:
                    m = np.zeros_like(d)
                kind_name = tensor_name.split(".")[-2]
                if self.architecture.gguf_permuted_qk and kind_name in heads:
                    q, d, m = (_unpermute_rows(a, heads[kind_name]) for a in (q, d, m))
                parts.append((q, d, m, kind))
            q, d, m = (np.concatenate([p[i] for p in parts]) for i in range(3))
            kinds = sorted({p[3] for p in parts})
            return q, d, (m if m.any() else None), "+".join(k.lower() for k in kinds)

        return blocks

    def _check_types(self) -> None:
        from gguf import GGMLQuantizationType, quants

        # checked before any tensor is read, so a multi-GB file fails at once; the library has
        # no public query for this, so without its registry `_dequantize` reports the type
        traits = getattr(quants, "_type_traits", None)
        if traits is None:
            return
        plain = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        for tensor in self.tensors.values():
            if tensor.tensor_type not in plain and tensor.tensor_type not in traits:
                raise self._type_error(tensor)

    def _type_error(self, tensor: Any) -> GGUFError:
        return GGUFError(
            f"{self.path.name}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which "
            "the gguf library cannot dequantize"
        )

    def _dequantize(self, tensor: Any) -> np.ndarray:
        """float32 values in torch's dimension order ([rows, cols] for a matrix)."""
        from gguf import quants

        try:
            values = quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise self._type_error(tensor) from None
        shape = [int(d) for d in reversed(tensor.shape)]  # ggml lists the fastest dim first
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if not values.flags.writeable:  # an F32 tensor comes back as a view of the mapped file
            values = values.copy()
        return values


# GGUF per-layer tensor kinds -> transformers module names (blk.N.<kind>.<weight|bias>)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str) -> str | None:
    """transformers' name for a GGUF tensor, or None for a tensor we do not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: within each head, rows (2j, 2j+1) of GGUF's interleaved
    pairs go back to (j, j + head_dim/2), transformers' rotate-half layout."""
    rows = values.shape[0]
    head_dim = rows // num_heads
    rest = values.shape[1:]
    out = values.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2)
    return np.ascontiguousarray(out.reshape(rows, *rest))


def _merge_pair(merge: str) -> tuple[str, str]:
    """A GGUF merge, ``"left right"``, as BPE's pair."""
    left, space, right = merge.partition(" ")
    if not space:
        raise TokenizerError(f"invalid GGUF merge {merge!r}: no space between the pair")
    return left, right


def build_bpe_tokenizer(
    tokens: list[str],
    merges: list[str],
    token_types: list[int],
    pre: str,
    add_bos: int | None = None,
    add_eos: int | None = None,
) -> Any:
    """A `tokenizers.Tokenizer` for a GGUF byte-level BPE vocabulary.

    Tokens are already spelled in GPT-2's byte alphabet; control tokens (type 3) become special
    added tokens and user-defined ones (type 4) plain added tokens, both matched whole in the
    text as llama.cpp does.
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [_merge_pair(m) for m in merges]
    try:
        bpe = models.BPE(vocab, pairs, ignore_merges=pre in _IGNORE_MERGES)
    except Exception as exc:  # the Rust error type is not importable
        raise TokenizerError(f"invalid GGUF vocabulary or merges: {exc}") from None
    backend = Backend(bpe)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in GGUF_PRE_TOKENIZERS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    types = token_types or [1] * len(tokens)
    control = [t for t, ty in zip(tokens, types, strict=False) if ty == _TOKEN_CONTROL]
    user = [t for t, ty in zip(tokens, types, strict=False) if ty == _TOKEN_USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    backend.post_processor = _post_processor(tokens, add_bos, add_eos)
    return backend


def _post_processor(tokens: list[str], bos: int | None, eos: int | None) -> Any:
    from tokenizers import processors

    single, pair, specials = "$A:0", "$A:0 $B:1", []
    if bos is not None:
        single, pair = f"{tokens[bos]}:0 {single}", f"{tokens[bos]}:0 {pair}"
        specials.append((tokens[bos], bos))
    if eos is not None:
        single, pair = f"{single} {tokens[eos]}:0", f"{pair} {tokens[eos]}:1"
        if eos != bos:
            specials.append((tokens[eos], eos))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def convert_to_directory(checkpoint: GGUFCheckpoint, target: Path, source_digest: str) -> None:
    """Write ``checkpoint`` as a transformers-style directory of float32 tensors at ``target``
    (config.json's ``torch_dtype`` is the file's own precision, `GGUFCheckpoint.weights_dtype`).

    Loading that directory skips the GGUF metadata parse and the dequantization (the built-in
    model's start-up). config.json records ``source_digest``, the GGUF file's SHA-256, so the
    model identity, which covers config.json, still names the file it came from.
    """
    import json

    from safetensors.torch import save_file

    config = checkpoint.config()
    # the tensors are float32; torch_dtype names the file's own precision (for ``--dtype auto``)
    raw = {**checkpoint.hf_config(), "gguf_sha256": source_digest}
    tensors = dict(checkpoint.hf_tensors(config))
    tokenizer = checkpoint.tokenizer()
    tokenizer_config = {**tokenizer.special_tokens, "chat_template": tokenizer.chat_template}
    generation = {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]}
    for name, data in (
        ("config.json", raw),
        ("generation_config.json", generation),
        ("tokenizer_config.json", tokenizer_config),
    ):
        (target / name).write_text(json.dumps(data, indent=2), encoding="utf-8")
    tokenizer.backend.save(str(target / "tokenizer.json"))
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
