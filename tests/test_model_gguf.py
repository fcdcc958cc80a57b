"""GGUF checkpoints: every architecture and tensor type against transformers' own GGUF loading
(which dequantizes with the same `gguf` library), clear errors, identity, bounded memory.

Files are written here from random transformers models (`gguf_helpers`); the trained model's
file (SmolLM2) is checked in test_model_smollm2.py.
"""

from __future__ import annotations

import shutil
import tracemalloc

import numpy as np
import pytest
import torch
import transformers

from gguf_helpers import byte_level_tokens, write_gguf
from prefixcache import LLM, SamplingParams
from prefixcache.attention import AttentionMetadata, PagedKVCache
from prefixcache.model import load_model
from prefixcache.model.gguf_checkpoint import GGUFCheckpoint, GGUFError
from prefixcache.model.loader import ModelLoadError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4
_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,  # more rows than the 259-token vocabulary, as real checkpoints pad
    max_position_embeddings=512,
)
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=None),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    # transformers reads a qwen3 GGUF with Qwen3Config's default head_dim (128): keep it
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(hidden_size=512, head_dim=128),
    ),
}


def _random_model(arch: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(**{**_SHAPE, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model


def _ours_last_logits(loaded, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    c = loaded.config
    cache = PagedKVCache(c.num_hidden_layers, 8, 16, c.num_key_value_heads, c.head_dim)
    meta = AttentionMetadata.build([[3, 1, 7, 0, 5, 2, 6, 4]], [0], [len(ids)], 16)
    return loaded.model(torch.tensor(ids), meta.positions, cache, meta)[0].float()


def _theirs(path) -> torch.nn.Module:  # noqa: ANN001
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _assert_same_model(ours, theirs, ids: list[int]) -> None:  # noqa: ANN001
    """Identical weights (dequantized by the same library, q/k rows un-permuted alike) and
    logits within 1e-4 relative to their scale (random quantized blocks give logits of ~100s)."""
    sd = theirs.state_dict()
    c = ours.config
    for i, layer in enumerate(ours.model.model.layers):
        qkv = layer.self_attn.qkv_proj.weight
        q = sd[f"model.layers.{i}.self_attn.q_proj.weight"]
        k = sd[f"model.layers.{i}.self_attn.k_proj.weight"]
        assert torch.equal(qkv[: c.q_size], q)
        assert torch.equal(qkv[c.q_size : c.q_size + c.kv_size], k)
    assert torch.equal(ours.model.model.embed_tokens.weight, sd["model.embed_tokens.weight"])
    with torch.no_grad():
        expected = theirs(torch.tensor([ids])).logits[0, -1].float()
    diff = (_ours_last_logits(ours, ids) - expected).abs().max()
    assert diff < TOL * max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("family", list(ARCHS))
def test_each_architecture_matches_transformers_gguf_loading(family, tmp_path):
    arch = "llama" if family == "mistral" else family  # llama.cpp writes Mistral as llama
    file = write_gguf(tmp_path / f"{family}.gguf", _random_model(family), arch, "F32")
    ids = [5, 77, 200, 13, 99, 255, 42, 7] * 9
    ours = load_model(str(file))
    assert ours.config.family == ("llama" if family == "mistral" else family)
    _assert_same_model(ours, _theirs(file), ids)


@pytest.mark.parametrize(
    "qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]
)
def test_each_tensor_type_dequantizes_like_transformers(qtype, tmp_path):
    arch = "llama"
    file = write_gguf(tmp_path / f"{qtype}.gguf", _random_model(arch), arch, qtype, seed=3)
    ids = [11, 250, 3, 64, 128, 9, 17] * 6
    _assert_same_model(load_model(str(file)), _theirs(file), ids)
    types = set(GGUFCheckpoint(file).tensor_types().values())
    assert qtype in types
    # `--dtype auto` reads the file's precision: F16 is float16, BF16 and quantized bfloat16
    # (both served in bfloat16 where the CPU has native bfloat16 products)
    expected = "float16" if qtype == "F16" else "bfloat16"
    assert GGUFCheckpoint(file).weights_dtype() == expected


def test_dtype_auto_offers_a_gguf_files_own_blocks_where_it_has_them(tmp_path, monkeypatch):
    from prefixcache.model import loader, precision, quant_gemm

    model = _random_model("llama")
    f32 = write_gguf(tmp_path / "f32.gguf", model, "llama", "F32")
    q8 = write_gguf(tmp_path / "q8.gguf", model, "llama", "Q8_0")
    assert GGUFCheckpoint(f32).weights_dtype() == "float32"
    offered: list[list[str]] = []
    choose = precision.choose

    def record(config, options, form=0, fidelity=None):  # noqa: ANN001, ANN202
        offered.append([p.label for p in options])
        return choose(config, options, form, fidelity)

    monkeypatch.setattr(precision, "choose", record)
    assert load_model(str(f32), dtype="auto").precision in offered[-1]
    assert "float32+gguf" not in offered[-1]  # no blocks in an F32 file
    q8_auto = load_model(str(q8), dtype="auto")
    assert ("float32+gguf" in offered[-1]) == quant_gemm.vectorised()
    assert q8_auto.precision in offered[-1]
    # off the CPU nothing is measured: the file's precision where the CPU computes it natively
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    assert loader.resolve_dtype(GGUFCheckpoint(q8).weights_dtype()) == "bfloat16"


def test_tokenizer_from_metadata_matches_transformers(tmp_path):
    file = write_gguf(tmp_path / "tok.gguf", _random_model("llama"), "llama")
    ours = GGUFCheckpoint(file).tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=file.name)
    text = "def f(x):\n\treturn x**2  # ünïcode 東京 🚀\n\n<|im_start|>user hi<|im_end|>  "
    assert ours.encode(text) == theirs.encode(text)
    assert ours.vocab_size == len(byte_level_tokens())
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.eos_token_ids == (258,)
    assert ours.special_tokens["bos_token"] == "<|im_start|>"


def test_a_padded_embedding_generates_without_failing(tmp_path):
    """Rows past the tokenizer's vocabulary: the model may pick them; they decode to ''."""
    model = _random_model("qwen2")
    with torch.no_grad():  # make id 290 (no token) the likely next token everywhere
        model.lm_head.weight[290] = model.model.embed_tokens.weight.abs().mean(0) * 50
        model.model.norm.weight.fill_(1.0)
    file = write_gguf(tmp_path / "padded.gguf", model, "qwen2")
    llm = LLM(model=str(file), num_kv_blocks=32)
    (out,) = llm.generate(["hello"], SamplingParams(max_tokens=6, temperature=0.0))
    assert out.finish_reason == "length"
    assert any(t >= 259 for t in out.token_ids)
    assert out.text == llm.tokenizer.decode([t for t in out.token_ids if t < 259])


def test_identity_covers_the_file_content(tmp_path):
    file = write_gguf(tmp_path / "a.gguf", _random_model("llama"), "llama")
    copy = tmp_path / "elsewhere" / "b.gguf"
    copy.parent.mkdir()
    shutil.copy(file, copy)
    first, moved = load_model(str(file)), load_model(str(copy))
    assert first.identity == moved.identity  # same bytes, another path
    data = bytearray(copy.read_bytes())
    data[-5] ^= 0x10  # one bit of the last tensor
    copy.write_bytes(bytes(data))
    assert load_model(str(copy)).identity != first.identity
    assert load_model(str(file), dtype="bfloat16").identity != first.identity


def test_a_directory_holding_one_gguf_loads_it(tmp_path):
    file = write_gguf(tmp_path / "only.gguf", _random_model("qwen3"), "qwen3")
    assert load_model(str(tmp_path)).identity == load_model(str(file)).identity
    shutil.copy(file, tmp_path / "second.gguf")
    with pytest.raises(GGUFError, match="several .gguf files"):
        load_model(str(tmp_path))


def test_loading_holds_one_tensor_at_a_time_not_a_second_model(tmp_path):
    model = _random_model("llama", num_hidden_layers=6)
    file = write_gguf(tmp_path / "mem.gguf", model, "llama", "Q8_0")
    checkpoint = GGUFCheckpoint(file)
    config = checkpoint.config()
    largest = max(int(np.prod(t.shape)) for t in checkpoint.tensors.values()) * 4
    total = sum(int(np.prod(t.shape)) for t in checkpoint.tensors.values()) * 4
    from prefixcache.model.decoder import CausalLM

    model = CausalLM(config)
    tracemalloc.start()
    checkpoint.load_weights(model, config)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # dequantized arrays are numpy, so traced here: a few of the largest tensor's size in
    # temporaries (the library's block arithmetic), never a second copy of the model
    assert peak < 6 * largest < total / 2


def _edit_metadata(tmp_path, arch: str = "llama", **changes: object):  # noqa: ANN202
    """A GGUF whose metadata differs from the helper's in ``changes``."""
    import gguf

    src = write_gguf(tmp_path / "src.gguf", _random_model("llama"), "llama")
    reader = gguf.GGUFReader(str(src))
    out = tmp_path / "edited.gguf"
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        name = key.replace("llama.", f"{arch}.", 1)
        value = changes.pop(name, field.contents())
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, vtype)
    for tensor in reader.tensors:
        writer.add_tensor(
            tensor.name, np.array(tensor.data), raw_shape=list(reversed(tensor.shape.tolist())),
            raw_dtype=tensor.tensor_type,
        )
    for name, value in changes.items():
        writer.add_string(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_unsupported_parts_are_named(tmp_path):
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'gemma2'"):
        load_model(str(_edit_metadata(tmp_path, arch="gemma2")))
    with pytest.raises(GGUFError, match="tokenizer.ggml.model 'llama' is not supported"):
        load_model(str(_edit_metadata(tmp_path, **{"tokenizer.ggml.model": "llama"})))
    with pytest.raises(GGUFError, match="pre-tokenizer 'mystery'"):
        load_model(str(_edit_metadata(tmp_path, **{"tokenizer.ggml.pre": "mystery"})))
    with pytest.raises(GGUFError, match="rope scaling 'yarn'"):
        load_model(str(_edit_metadata(tmp_path, **{"llama.rope.scaling.type": "yarn"})))


def test_a_tensor_type_without_dequantization_is_named(tmp_path):
    file = write_gguf(tmp_path / "i8.gguf", _random_model("llama"), "llama", "I8")
    with pytest.raises(GGUFError, match="tensor 'token_embd.weight' has type I8"):
        load_model(str(file))


def test_an_unreadable_file_and_a_missing_one(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(GGUFError, match="cannot read GGUF file"):
        load_model(str(bad))
    with pytest.raises(ModelLoadError, match="neither a built-in model"):
        load_model(str(tmp_path / "absent.gguf"))
