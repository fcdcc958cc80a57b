"""Checkpoint loading: clear errors, sharding, dtypes, identity, the built-in models."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from prefixcache.attention import AttentionMetadata, PagedKVCache
from prefixcache.model import ConfigError, ModelLoadError, WeightLoadError, load_model
from prefixcache.model.builtin import ensure_builtin
from prefixcache.model.byte_tokenizer import write_byte_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    write_byte_tokenizer(path)
    return path


@pytest.fixture
def copy(checkpoint, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(checkpoint, target)
    return target


def _edit_weights(path, edit) -> None:  # noqa: ANN001
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _last_logits(loaded, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    c = loaded.config
    cache = PagedKVCache(
        c.num_hidden_layers, 8, 16, c.num_key_value_heads, c.head_dim, dtype=loaded.dtype
    )
    meta = AttentionMetadata.build([list(range(8))], [0], [len(ids)], 16)
    return loaded.model(torch.tensor(ids), meta.positions, cache, meta)[0].float()


def test_missing_tensor_is_named(copy):
    _edit_weights(copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj"):
        load_model(str(copy))


def test_unexpected_tensor_is_named(copy):
    _edit_weights(copy, lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))
    with pytest.raises(WeightLoadError, match=r"unexpected tensor 'model\.layers\.0\.extra"):
        load_model(str(copy))


def test_wrong_shape_is_named(copy):
    _edit_weights(copy, lambda t: t.__setitem__("model.norm.weight", torch.ones(31)))
    with pytest.raises(WeightLoadError, match=r"'model\.norm\.weight' has shape \(31,\)"):
        load_model(str(copy))


def test_unsupported_architecture_is_named(copy):
    raw = json.loads((copy / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(copy))


def test_unsupported_rope_type_and_missing_field(copy):
    raw = json.loads((copy / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="unsupported rope type 'yarn'"):
        load_model(str(copy))
    del raw["rope_parameters"], raw["hidden_size"]
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="lacks required field 'hidden_size'"):
        load_model(str(copy))


def test_unknown_model_name_and_dtype(copy):
    with pytest.raises(ModelLoadError, match="neither a built-in model"):
        load_model("no-such-model-dir")
    with pytest.raises(ModelLoadError, match="unsupported dtype 'int8'"):
        load_model(str(copy), dtype="int8")


def _shard(path) -> None:  # noqa: ANN001
    tensors = load_file(str(path / "model.safetensors"))
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    (path / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_checkpoint_loads_identically(checkpoint, copy):
    _shard(copy)
    ids = list(range(1, 40))
    single, sharded = load_model(str(checkpoint)), load_model(str(copy))
    assert torch.equal(_last_logits(single, ids), _last_logits(sharded, ids))
    (copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="shard model-00002-of-00002.safetensors .* missing"):
        load_model(str(copy))
    (copy / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(WeightLoadError, match="invalid sharded index"):
        load_model(str(copy))


def test_no_weights_at_all(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="no model.safetensors"):
        load_model(str(copy))


def test_projection_weights_are_stored_transposed_with_the_checkpoint_values(checkpoint):
    loaded = load_model(str(checkpoint))
    tensors = load_file(str(checkpoint / "model.safetensors"))
    attn, mlp = loaded.model.model.layers[1].self_attn, loaded.model.model.layers[1].mlp
    for weight in (attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight):
        assert weight.t().is_contiguous() and not weight.is_contiguous()
    assert torch.equal(mlp.down_proj.weight, tensors["model.layers.1.mlp.down_proj.weight"])
    q_rows = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(attn.qkv_proj.weight[: len(q_rows)], q_rows)
    ids = list(range(3, 50))
    transposed = _last_logits(loaded, ids)
    for layer in loaded.model.model.layers:  # back to plain row-major storage: same logits
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj):
            linear.weight.data = linear.weight.data.contiguous()
    assert torch.allclose(_last_logits(loaded, ids), transposed, atol=1e-5)


def test_bfloat16_close_to_float32(checkpoint):
    ids = list(range(5, 60))
    f32, bf16 = load_model(str(checkpoint)), load_model(str(checkpoint), dtype="bfloat16")
    assert bf16.model.lm_head.weight.dtype == torch.bfloat16
    assert (_last_logits(f32, ids) - _last_logits(bf16, ids)).abs().max() < 0.1
    assert f32.identity != bf16.identity


def test_identity_tracks_weights_and_is_stable(checkpoint, copy):
    first, again = load_model(str(checkpoint)), load_model(str(copy))
    assert first.identity == again.identity  # same content, different directory
    assert first.identity.startswith("LlamaForCausalLM:")
    _edit_weights(copy, lambda t: t["model.norm.weight"].mul_(2))
    assert load_model(str(copy)).identity != first.identity


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path_factory.mktemp("cache_a")))
    yield load_model("tiny")
    mp.undo()


def test_tiny_is_a_normal_checkpoint(tiny):
    names = {p.name for p in tiny.path.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    num_params = sum(p.numel() for p in tiny.model.parameters())
    assert 1_000_000 <= num_params <= 5_000_000
    assert tiny.config.max_position_embeddings == 8192
    assert tiny.tokenizer.eos_token_ids == tiny.config.eos_token_ids


def test_tiny_has_wide_logit_margins_and_varied_outputs(tiny):
    prompts = ["Hello there", "The capital of France is", "def foo(x):", "1 2 3 4 5"]
    firsts, margins = set(), []
    for prompt in prompts:
        logits = _last_logits(tiny, tiny.tokenizer.encode(prompt))
        top = logits.topk(2).values
        margins.append(float(top[0] - top[1]))
        assert logits.std() > 3.0
        firsts.add(int(logits.argmax()))
    assert len(firsts) >= 3
    assert min(margins) > 1e-3


def test_builtin_creation_is_deterministic_and_race_safe(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path))
    paths, errors = [], []

    def create() -> None:
        try:
            paths.append(ensure_builtin("tiny"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(paths)) == 1
    assert [p.name for p in (tmp_path / "models").iterdir()] == [paths[0].name]  # no temp left
    assert load_model("tiny").identity == tiny.identity


def test_dtype_auto_runs_what_it_measured_and_off_the_cpu_the_checkpoints(checkpoint, copy,
                                                                           monkeypatch):
    from prefixcache.model import loader
    from prefixcache.model.precision import Precision

    config = json.loads((copy / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"  # new and old transformers keys
    (copy / "config.json").write_text(json.dumps(config))
    auto = load_model(str(copy), dtype="auto")
    assert auto.choice is not None and auto.precision == auto.choice.precision.label
    forced = Precision.parse(auto.precision)
    same = load_model(str(copy), forced.dtype, weight_dtype=forced.weights)
    assert auto.identity == same.identity
    # where nothing is measured (another device), the checkpoint's dtype where the CPU has
    # native bfloat16 products
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    assert loader.resolve_dtype("bfloat16") == "float32"
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    assert [loader.resolve_dtype(d) for d in ("bfloat16", "float16", "float32", None)] == [
        "bfloat16", "bfloat16", "float32", "float32"]


def test_loading_a_model_starts_light(checkpoint):
    # a model is built on the meta device and given storage in its dtype directly: no float32
    # copy first, and none of the meta device's reference implementations, which import sympy
    # and torch._dynamo (tens of MB resident and seconds of start-up in every server)
    code = (
        "import sys; from prefixcache.model import load_model; "
        f"m = load_model({str(checkpoint)!r}, dtype='bfloat16'); "
        "assert all(p.dtype == __import__('torch').bfloat16 for p in m.model.parameters()); "
        "print(sorted(n for n in ('sympy', 'torch._dynamo') if n in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"
