"""Weights kept narrower than the float32 activations they multiply, and ``--dtype auto``.

bfloat16 weights widened in the float32 GEMM; 8-bit blocks (`quant_gemm`) read exactly from
GGUF's block types or made as Q8_0, multiplied with 8-bit activations as llama.cpp does; both
through the compiled layers with the same bits as the separate calls; accuracy against
transformers' float32 and by perplexity; ``--dtype auto`` choosing the fastest measured
precision, cached per machine and shape, with memory deciding where float32 does not fit.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import transformers

from native_support import require_native_layers
from prefixcache.attention import native_attention
from prefixcache.model import load_model, panel_gemm, precision, quant_gemm
from prefixcache.model.loader import ModelLoadError
from prefixcache.model.precision import Precision
from prefixcache.model.quant_gemm import QuantWeight

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _native() -> None:
    require_native_layers()
    if not quant_gemm.available():
        pytest.skip("the quantized GEMM does not run here")


def _reference(x: torch.Tensor, q: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> torch.Tensor:
    """x W^T with x rounded to 8 bits per 32-value block, as the kernel (and llama.cpp) does."""
    rows, k = x.shape
    n = q.shape[0]
    w = q.astype(np.float64).reshape(n, -1, 32) * d.astype(np.float64)[..., None]
    if m is not None:
        w = w + m.astype(np.float64)[..., None]
    blocks = x.double().reshape(rows, -1, 32)
    dx = blocks.abs().amax(-1) / 127
    xq = torch.round(blocks * torch.where(dx > 0, 1 / dx, 0)[..., None]) * dx[..., None]
    return xq.reshape(rows, k) @ torch.from_numpy(w.reshape(n, k)).t()


@pytest.mark.parametrize("form", ["bytes", "bytes_min", "nibbles", "signed_nibbles"])
@pytest.mark.parametrize(("n", "k"), [(50, 96), (960, 576), (97, 1536)])
def test_quantized_gemm_is_the_block_products_whatever_the_batch(n, k, form) -> None:
    # every layout the kernel keeps: 8-bit values (Q8_0, Q5_0), with minimums (Q5_1), 4-bit
    # values in nibbles (Q4_1, Q4_K) and signed 4-bit ones (Q4_0, kept as nibbles + an offset)
    gen = torch.Generator().manual_seed(n + k)
    rng = np.random.default_rng(n)
    q, d, _ = quant_gemm.quantize_q8_0(torch.randn(n, k, generator=gen).numpy())
    m = (rng.standard_normal(d.shape) * 0.01).astype(np.float16)
    if form in ("nibbles", "signed_nibbles"):
        q = rng.integers(0, 16, q.shape).astype(np.int8) - (8 if form == "signed_nibbles" else 0)
    m = m if form in ("bytes_min", "nibbles") else None
    packed = QuantWeight.pack(q, d, m)
    expected_form = {"bytes": quant_gemm.BYTES, "bytes_min": quant_gemm.BYTES_MIN}
    assert packed.form == expected_form.get(form, quant_gemm.NIBBLES)
    x = torch.randn(37, k, generator=gen)
    x[3] = 0  # an all-zero row quantizes to zeros, not NaN
    bias = torch.randn(n, generator=gen)
    got = packed.matmul(x, bias)
    want = (_reference(x, q, d, m) + bias.double()).float()
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert torch.equal(got[3], (want[3]).float()) or float((got[3] - bias).abs().max()) == 0
    for rows in (1, 4, 5, 16):  # a row's result does not depend on its batch
        assert torch.equal(packed.matmul(x[:rows], bias), got[:rows])
    with pytest.raises(ValueError, match="float32"):
        packed.matmul(x.bfloat16())
    with pytest.raises(ValueError, match="x"):
        packed.matmul(x[:, :-1])


def test_q8_0_of_floats_is_within_llama_cpps_rounding() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    packed = QuantWeight.from_float(w)
    step = w.abs().reshape(64, -1, 32).amax(-1, keepdim=True) / 127
    error = (packed.dequantize() - w).abs().reshape(64, -1, 32)
    # half a step, and the scale's own rounding to float16 (2^-11 of it) times up to 127
    assert bool((error <= step * (0.5 + 127 * 2**-11) + 1e-7).all())
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantWeight.from_float(torch.randn(4, 40))


@pytest.mark.parametrize("type_name", quant_gemm.GGUF_NATIVE_TYPES)
def test_gguf_blocks_read_exactly_what_the_gguf_library_dequantizes(type_name) -> None:
    from gguf import GGMLQuantizationType, quants

    per_block, size, _ = quant_gemm._DECODERS[type_name]
    rows, cols = 6, 2 * max(per_block, 64)
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (rows, cols // per_block, size), dtype=np.uint8)
    # scales and minimums: small finite float16 values (random bytes could be NaN)
    halves = 2 if type_name in ("Q8_0", "Q4_0", "Q5_0") else 4
    raw[..., :halves] = (
        rng.uniform(-0.05, 0.05, (rows, cols // per_block, halves // 2)).astype(np.float16)
        .view(np.uint8)  # fmt: skip
    )
    raw = raw.reshape(rows, -1)
    want = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols)
    q, d, m = quant_gemm.gguf_blocks(raw, type_name, rows, cols)
    got = q.astype(np.float32).reshape(rows, -1, 32) * d.astype(np.float32)[..., None]
    if m is not None:
        got = got + m.astype(np.float32)[..., None]
    # exact, but for Q4_K's products of two scales kept as float16 (2^-11 relative)
    tol = 2**-10 * np.abs(want).max() if type_name == "Q4_K" else 1e-6
    assert np.abs(got.reshape(rows, cols) - want).max() <= tol
    with pytest.raises(ValueError, match="is not"):
        quant_gemm.gguf_blocks(raw[:, :-1], type_name, rows, cols)


def _tiny_llama(tmp_path_factory):  # noqa: ANN001, ANN202
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    from prefixcache.model.byte_tokenizer import write_byte_tokenizer

    write_byte_tokenizer(path)
    return path, model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return _tiny_llama(tmp_path_factory)


def _logits(loaded, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    from prefixcache.attention import AttentionMetadata, PagedKVCache

    c, blocks = loaded.config, -(-len(ids) // 16)
    cache = PagedKVCache(c.num_hidden_layers, blocks, 16, c.num_key_value_heads, c.head_dim,
                         loaded.dtype)  # fmt: skip
    meta = AttentionMetadata.build([list(reversed(range(blocks)))], [0], [len(ids)], 16)
    meta.logits_indices = torch.arange(len(ids))
    with torch.no_grad():
        return loaded.model(torch.tensor(ids), meta.positions, cache, meta).float()


def test_bfloat16_weights_stay_closer_to_float32_than_bfloat16_compute(tiny_llama) -> None:
    path, theirs = tiny_llama
    ids = list(range(5, 60))
    with torch.no_grad():
        expected = theirs(torch.tensor([ids])).logits[0]
    errors = {}
    for dtype, weights in [("float32", "auto"), ("float32", "bfloat16"), ("bfloat16", "auto")]:
        loaded = load_model(str(path), dtype, weight_dtype=weights)
        errors[loaded.precision] = float((_logits(loaded, ids) - expected).abs().max())
    assert set(errors) == {"float32", "float32+bfloat16", "bfloat16"}
    assert errors["float32"] < 1e-4
    assert errors["float32+bfloat16"] < errors["bfloat16"] / 2
    bf16w = load_model(str(path), "float32", weight_dtype="bfloat16")
    assert bf16w.model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16  # half memory
    assert bf16w.identity != load_model(str(path)).identity  # its own cache namespace


def test_stored_weights_need_float32_activations_and_gguf_a_gguf_file(tiny_llama) -> None:
    path, _ = tiny_llama
    with pytest.raises(ModelLoadError, match="float32 activations"):
        load_model(str(path), "bfloat16", weight_dtype="q8_0")
    with pytest.raises(ModelLoadError, match="needs a GGUF model"):
        load_model(str(path), "float32", weight_dtype="gguf")
    with pytest.raises(ModelLoadError, match="unsupported weight dtype"):
        load_model(str(path), "float32", weight_dtype="int3")
    q8 = load_model(str(path), "float32", weight_dtype="q8_0")
    assert q8.precision == "float32+q8_0"
    assert isinstance(q8.model.lm_head.packed_copy, QuantWeight)


def _needs_candidates() -> None:
    if len(precision.candidates(False)) < 2:
        pytest.skip("--dtype auto has one candidate here: no bfloat16 kernel is vector code")


def test_dtype_auto_measures_once_per_machine_and_shape(tiny_llama, tmp_path, monkeypatch) -> None:
    _needs_candidates()
    path, _ = tiny_llama
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path))
    measured: list[list[str]] = []
    real = precision._measure

    def measure(config, options, form):  # noqa: ANN001, ANN202
        measured.append([p.label for p in options])
        return real(config, options, form)

    monkeypatch.setattr(precision, "_measure", measure)
    auto = load_model(str(path), "auto")
    assert measured and auto.choice is not None
    labels = measured[0]
    assert "float32" in labels and auto.precision in labels
    figures = auto.choice.figures
    # the fastest whose answers stay within the fidelity bounds (float32 needs none): those
    # faster were checked and failed, the slower ones need no check
    by_speed = sorted(labels, key=lambda label: figures[label]["score_s"])
    best = by_speed[[label == "float32" or figures[label].get("fidelity", {}).get("eligible")
                     for label in by_speed].index(True)]  # fmt: skip
    assert auto.precision == best
    for faster in by_speed[: by_speed.index(best)]:
        assert figures[faster]["fidelity"]["eligible"] is False
    assert all(figures[label]["prefill_tokens_per_s"] > 0 for label in labels)
    # each candidate's figures include its compute dtype's attention: float32's for float32
    # with narrower weights too (their KV cache and products are float32)
    attention = {label: figures[label]["attention_ms"] for label in labels}
    assert all(a["prefill"] > 0 and a["decode_step"] > 0 for a in attention.values())
    assert attention["float32"] == attention["float32+bfloat16"]
    assert auto.choice.cpu and "chose" in auto.choice.describe()
    timings = [p for p in (tmp_path / "calibration").glob("*.json")  # not the fidelity files
               if not p.name.startswith("fidelity-")]  # fmt: skip
    (kept,) = timings
    assert json.loads(kept.read_text())["chosen"] == min(
        labels, key=lambda label: figures[label]["score_s"])  # the fastest, as measured
    again = load_model(str(path), "auto")  # read back: not measured again
    assert len(measured) == 1 and again.precision == best
    forced = Precision.parse(best)
    same = load_model(str(path), forced.dtype, weight_dtype=forced.weights)
    assert same.identity == auto.identity  # the same cache namespace as the forced choice


def test_dtype_auto_takes_the_lowest_score_and_what_fits_in_memory(tiny_llama, monkeypatch) -> None:
    path, _ = tiny_llama
    from prefixcache.model.loader import open_checkpoint

    config = open_checkpoint(str(path)).config
    options = [Precision("float32", "float32"), Precision("float32", "bfloat16")]

    def fake(config, options, form):  # noqa: ANN001, ANN202
        score = {"float32": 2.0, "float32+bfloat16": 1.0}
        return {p.label: {"prefill_tokens_per_s": 1.0, "decode_step_ms": 1.0,
                          "score_s": score[p.label]} for p in options}  # fmt: skip

    monkeypatch.setattr(precision, "_measure", fake)
    # measured every time: nothing read from or written to the cache
    monkeypatch.setattr(precision.machine, "measured_once", lambda path, measure: (measure(), True))
    assert precision.choose(config, options).precision.label == "float32+bfloat16"
    float32_bytes = precision._weight_bytes(config, options[0])
    monkeypatch.setattr(precision, "_free_memory", lambda: float32_bytes - 1)
    choice = precision.choose(config, options)
    assert choice.precision.label == "float32+bfloat16" and "fits" in choice.reason


def test_dtype_auto_passes_over_a_faster_precision_that_changes_the_answers(
    tiny_llama, monkeypatch
) -> None:
    path, _ = tiny_llama
    from prefixcache.model.loader import open_checkpoint

    config = open_checkpoint(str(path)).config
    options = [Precision("float32", "float32"), Precision("bfloat16", "bfloat16"),
               Precision("float32", "bfloat16")]  # fmt: skip
    score = {"float32": 3.0, "bfloat16": 1.0, "float32+bfloat16": 2.0}

    def fake(config, options, form):  # noqa: ANN001, ANN202
        return {p.label: {"prefill_tokens_per_s": 1.0, "decode_step_ms": 1.0,
                          "score_s": score[p.label]} for p in options}  # fmt: skip

    asked: list[str] = []

    def fidelity(option: Precision) -> dict:
        asked.append(option.label)
        drift = option.label == "bfloat16"  # the fastest, but its answers drift
        return {"tokens": 200, "mean_kl": 0.2 if drift else 0.001, "p99_kl": 0.5,
                "max_kl": 1.0, "top1_agreement": 0.7 if drift else 0.99}  # fmt: skip

    monkeypatch.setattr(precision, "_measure", fake)
    monkeypatch.setattr(precision.machine, "measured_once", lambda path, measure: (measure(), True))
    choice = precision.choose(config, options, fidelity=fidelity)
    assert choice.precision.label == "float32+bfloat16"
    assert asked == ["bfloat16", "float32+bfloat16"]  # in order of speed, until one keeps them
    assert "bfloat16 faster but outside the fidelity bounds" in choice.reason
    assert choice.figures["bfloat16"]["fidelity"]["eligible"] is False
    assert "outside the bounds" in choice.describe()
    score["float32"] = 0.5  # float32 first: nothing to check
    asked.clear()
    assert precision.choose(config, options, fidelity=fidelity).precision.label == "float32"
    assert asked == []


def test_fidelity_is_stated_as_llama_cpp_states_a_quantization() -> None:
    gen = torch.Generator().manual_seed(0)
    reference = torch.randn(50, 300, generator=gen) * 4
    same = precision.fidelity_of(reference, reference.clone())
    assert same["mean_kl"] == 0 and same["top1_agreement"] == 1 and same["tokens"] == 50
    assert precision.within_bounds(same)
    noisy = precision.fidelity_of(reference, reference + torch.randn(50, 300, generator=gen))
    assert 0 < noisy["mean_kl"] <= noisy["p99_kl"] <= noisy["max_kl"]
    assert not precision.within_bounds(noisy)  # logits off by a whole unit: answers drift
    shuffled = precision.fidelity_of(reference, reference[torch.randperm(50, generator=gen)])
    assert shuffled["top1_agreement"] < 0.2 and not precision.within_bounds(shuffled)


def test_native_gguf_blocks_keep_the_builtin_models_perplexity() -> None:
    # llama.cpp's accuracy statement: perplexity on a fixed text. The built-in file is Q4_1
    # (layers) and Q8_0 (embedding / LM head); running its blocks natively differs from the
    # float32 model of the same weights only by the activations' 8-bit rounding; Q8_0 made
    # from those float32 weights rounds the weights once more.
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    full = load_model("smollm2")
    ids = full.tokenizer.encode(text)[:512]
    targets = torch.tensor(ids[1:])

    def perplexity(loaded) -> float:  # noqa: ANN001
        nll = torch.nn.functional.cross_entropy(_logits(loaded, ids)[:-1].double(), targets)
        return math.exp(float(nll))

    reference = perplexity(full)
    native = load_model("smollm2", "float32", weight_dtype="gguf")
    assert isinstance(native.model.lm_head.packed_copy, QuantWeight)
    assert native.model.lm_head.packed_copy.kind == "q8_0"
    assert native.model.model.layers[0].mlp.down_proj.packed_copy.kind == "q4_1"
    assert abs(perplexity(native) / reference - 1) < 0.01
    q8 = load_model("smollm2", "float32", weight_dtype="q8_0")
    assert abs(perplexity(q8) / reference - 1) < 0.01


def test_serve_shows_what_it_runs_in_on_v1_models() -> None:
    import httpx

    from server_harness import start_server

    running = start_server(["--model", "tiny", "--dtype", "auto"])
    try:
        (card,) = httpx.get(f"{running.base_url}/v1/models").json()["data"]
        shown = card["precision"]
        if len(precision.candidates(False)) < 2:  # nothing to measure: the reason says why
            assert "no bfloat16 or quantized kernel is vector code" in shown["dtype_auto"]["reason"]
        else:
            assert shown["precision"] in shown["dtype_auto"]["candidates"]
        assert shown["dtype_auto"]["chosen"] == shown["precision"]
        assert shown["dtype_auto"]["cpu"]
        kernels = shown["kernels"]  # which GEMM and attention path, and batch invariance
        assert kernels["gemm"] and kernels["attention"]
        vector = all(panel_gemm.vectorised(d) for d in (torch.float32, torch.bfloat16))
        if native_attention.available() and vector:  # the direct path and the panel GEMM
            assert kernels["batch_invariant"] is True
            assert kernels["attention"].startswith("direct")
        one = httpx.get(f"{running.base_url}/v1/models/tiny").json()
        assert one["precision"] == shown
    finally:
        running.stop()
