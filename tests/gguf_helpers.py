"""Write small GGUF files from transformers models, the way llama.cpp's converter lays them out.

Used to test the GGUF loader on every supported architecture and tensor type without a
download: q/k rows permuted for the llama family, 2-D weights stored in the requested type
(quantized with the `gguf` library where it can; K-quants as random blocks with sane scales,
since the library only dequantizes those), and a byte-level BPE vocabulary in the metadata.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

BYTE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_LAYER_KINDS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
# K-quant block layouts (bytes per 256 values) and where their float16 scales sit
_K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def byte_level_tokens() -> list[str]:
    """GPT-2's 256 byte symbols (in byte order) followed by three ChatML control tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)] + BYTE_SPECIALS


def gguf_name(hf_name: str) -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    module, suffix = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_LAYER_KINDS[module]}.{suffix}"


def permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (rotate-half pairs -> interleaved)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    arch: str,
    qtype: str = "F32",
    pre: str = "gpt2",
    seed: int = 0,
) -> Path:
    """``model`` (a transformers causal LM) as a GGUF file of architecture ``arch``."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    _add_tokenizer(writer, pre)
    rng = np.random.default_rng(seed)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            values = permute_rows(values, heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            values = permute_rows(values, kv_heads)
        _add_tensor(writer, gguf_name(hf_name), values, qtype if values.ndim == 2 else "F32", rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: object, pre: str) -> None:
    tokens = byte_level_tokens()
    writer.add_tokenizer_model("gpt2")  # type: ignore[attr-defined]
    writer.add_tokenizer_pre(pre)  # type: ignore[attr-defined]
    writer.add_token_list(tokens)  # type: ignore[attr-defined]
    writer.add_token_types([1] * 256 + [3] * len(BYTE_SPECIALS))  # type: ignore[attr-defined]
    writer.add_token_merges([])  # type: ignore[attr-defined]
    writer.add_token_scores([0.0] * len(tokens))  # type: ignore[attr-defined]
    writer.add_bos_token_id(256 + 1)  # type: ignore[attr-defined]
    writer.add_eos_token_id(256 + 2)  # type: ignore[attr-defined]
    writer.add_chat_template(CHATML)  # type: ignore[attr-defined]


def _add_tensor(writer: object, name: str, values: np.ndarray, qtype: str, rng: object) -> None:
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        writer.add_tensor(name, values.astype(np.float32))  # type: ignore[attr-defined]
    elif qtype == "I8":  # a type that holds integers, not weights: no dequantization exists
        writer.add_tensor(name, values.astype(np.int8))  # type: ignore[attr-defined]
    elif qtype == "F16":
        writer.add_tensor(name, values.astype(np.float16))  # type: ignore[attr-defined]
    elif qtype in _K_BLOCKS:
        writer.add_tensor(name, _random_k_blocks(values.shape, qtype, rng), raw_dtype=kind)  # type: ignore[attr-defined]
    else:
        data = gguf.quants.quantize(values.astype(np.float32), kind)
        writer.add_tensor(name, data, raw_dtype=kind)  # type: ignore[attr-defined]


def _random_k_blocks(shape: tuple[int, ...], qtype: str, rng: object) -> np.ndarray:
    """Random K-quant blocks whose float16 scales are small finite numbers."""
    block_bytes, scale_offsets = _K_BLOCKS[qtype]
    rows, cols = shape
    assert cols % 256 == 0, "K-quants need rows of a multiple of 256 values"
    blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)  # type: ignore[attr-defined]
    for offset in scale_offsets:
        scales = (rng.random((rows, cols // 256)) * 0.004 + 0.001).astype(np.float16)  # type: ignore[attr-defined]
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // 256, 2)
    if qtype != "Q6_K":  # dmin right after d
        mins = (rng.random((rows, cols // 256)) * 0.004).astype(np.float16)  # type: ignore[attr-defined]
        blocks[:, :, 2:4] = mins.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)
