"""LoRA adapters against transformers + peft on the tiny model's own weights: logits and greedy
tokens alone and in steps that mix adapters and the base, cache on and off, in every dtype and
weight form; a row's bits whatever else is in its step; the adapter in every block's identity
(never the base's or another adapter's blocks, the same files under two names share, a changed
file does not, unloading evicts); bad adapters refused with nothing disturbed; ``max_loras``.
"""

from __future__ import annotations

import json
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_helpers import ALL_TARGETS, peft_adapter, peft_greedy, peft_logits
from prefixcache import LLM, LoRARequest, SamplingParams
from prefixcache.attention import AttentionMetadata
from prefixcache.cache import BlockRemoved
from prefixcache.model import load_model
from prefixcache.model.lora import LoraError, load_adapter
from prefixcache.model.lora_batch import LoraRun, LoraSlots, PackedLora

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 16
KV_BLOCKS = 160  # 2.5 MiB of the tiny model's KV: room for every test's batch
TOL = 1e-5  # of the logits' scale (the tiny model's reach 20): float32 summation orders
# name -> peft.LoraConfig fields: several ranks, targets, rsLoRA and per-module patterns
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all16": dict(r=16, lora_alpha=32, target_modules=ALL_TARGETS),
    "mlp_rs": dict(r=4, lora_alpha=8, use_rslora=True,
                   target_modules=["gate_proj", "up_proj", "down_proj"],
                   rank_pattern={"down_proj": 2}, alpha_pattern={"gate_proj": 3}),
}  # fmt: skip
PROMPTS = [[40 + (7 * i + 3 * j) % 200 for j in range(n)] for i, n in enumerate((37, 50, 23, 64))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base() -> Any:
    return load_model("tiny")


@pytest.fixture(scope="module")
def adapters(base: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """name -> (the peft model, the directory peft saved the adapter in)."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: (peft_adapter(base.path, root / name, seed=i + 1, **config), root / name)
            for i, (name, config) in enumerate(ADAPTERS.items())}  # fmt: skip


def tiny(**settings: Any) -> LLM:
    """The tiny model with LoRA on, a small KV pool, every cache invariant checked."""
    return LLM("tiny", **{"num_kv_blocks": KV_BLOCKS, "block_size": BS, "enable_lora": True,
                          "check_integrity": True, **settings})


def request(adapters: dict[str, tuple[Any, Path]], name: str, lora_id: int | None = None,
            alias: str | None = None) -> LoRARequest:  # fmt: skip
    return LoRARequest(alias or name, lora_id or list(ADAPTERS).index(name) + 1,
                       str(adapters[name][1]))


def step_logits(loaded: Any, slots: LoraSlots, seqs: list[tuple[list[int], int | None]]
                ) -> list[torch.Tensor]:  # fmt: skip
    """One step prefilling each (prompt, slot or None) from scratch: each last-token logits."""
    tables, first = [], 0
    for ids, _ in seqs:
        num = -(-len(ids) // BS)
        tables.append(list(range(first, first + num)))
        first += num
    kv = loaded.make_kv_cache(first, BS)
    meta = AttentionMetadata.build(tables, [0] * len(seqs), [len(i) for i, _ in seqs], BS)
    runs, row = [], 0
    for ids, slot in seqs:
        if slot is not None:
            runs.append(LoraRun(row, len(ids), slot))
        row += len(ids)
    flat = torch.tensor([t for ids, _ in seqs for t in ids])
    logits = loaded.model(flat, meta.positions, kv, meta, lora=slots.step(runs))
    return list(logits)


@pytest.fixture(scope="module")
def slots(base: Any, adapters: dict[str, tuple[Any, Path]]) -> LoraSlots:
    slots = LoraSlots(base.config, len(ADAPTERS))
    for slot, (_, path) in enumerate(adapters.values()):
        slots.install(slot, PackedLora.of(load_adapter(path, base.config), base.config))
    return slots


# ---- the model: logits against peft --------------------------------------------------------


@pytest.mark.usefixtures("native_kernels")
def test_logits_equal_peft_alone_and_in_a_step_mixing_adapters_and_the_base(
    base: Any, adapters: dict[str, tuple[Any, Path]], slots: LoraSlots, native_kernels: str
) -> None:
    # the compiled kernels: a row's bits are its own
    mixed = _logits_as_peft(base, adapters, slots, same_bits=native_kernels == "native")
    # the adapter changes the answer: the test is not comparing the base with itself
    base_row = step_logits(base, slots, [(PROMPTS[2], None)])[0]
    assert (mixed[2] - base_row).abs().max().item() > 0.1


def _logits_as_peft(base: Any, adapters: dict[str, tuple[Any, Path]], slots: LoraSlots,
                    same_bits: bool) -> list[torch.Tensor]:  # fmt: skip
    """A step's logits for a base row and a row of each adapter: each within TOL of peft's
    and, ``same_bits``, the bits of its row run alone. The step's logits."""
    models = [model for model, _ in adapters.values()]
    seqs = [(PROMPTS[0], None), (PROMPTS[1], 0), (PROMPTS[2], 1), (PROMPTS[3], 2)]
    mixed = step_logits(base, slots, seqs)
    for (ids, slot), ours in zip(seqs, mixed, strict=True):
        reference = peft_logits(models[slot or 0], ids, adapter=slot is not None)
        assert (ours - reference).abs().max().item() < TOL * reference.abs().max().item()
        if same_bits:
            assert torch.equal(step_logits(base, slots, [(ids, slot)])[0], ours)
    return mixed


@pytest.mark.parametrize("dtype, weights", [("bfloat16", "auto"), ("float32", "bfloat16"),
                                            ("float32", "q8_0")])  # fmt: skip
def test_every_dtype_and_weight_form_runs_the_adapter(
    adapters: dict[str, tuple[Any, Path]], dtype: str, weights: str
) -> None:
    """Beside a narrower base projection the update still runs: our adapted logits are as close
    to peft's float32 ones as our base logits are to transformers' (the form's own error), and
    a row's bits are the same alone and beside other adapters' rows."""
    loaded = load_model("tiny", dtype=dtype, weight_dtype=weights)
    slots = LoraSlots(loaded.config, 2)
    for slot, name in enumerate(("all16", "qv8")):  # bfloat16 A and B for a bfloat16 model
        adapter = load_adapter(adapters[name][1], loaded.config)
        slots.install(slot, PackedLora.of(adapter, loaded.config, loaded.dtype))
    model = adapters["all16"][0]
    seqs = [(PROMPTS[1], 0), (PROMPTS[0], None), (PROMPTS[3], 1)]
    mixed = step_logits(loaded, slots, seqs)
    ours_base = step_logits(loaded, slots, [(PROMPTS[1], None)])[0].float()
    form_error = (ours_base - peft_logits(model, PROMPTS[1], adapter=False)).abs().max().item()
    error = (mixed[0].float() - peft_logits(model, PROMPTS[1])).abs().max().item()
    effect = (peft_logits(model, PROMPTS[1]) - peft_logits(model, PROMPTS[1], False)).abs().max()
    assert error < 2 * form_error + 1e-3 < effect.item()
    for (ids, slot), row in zip(seqs, mixed, strict=True):
        assert torch.equal(step_logits(loaded, slots, [(ids, slot)])[0], row)


# the layers library (lora.h in it) as this CPU builds it, as a CPU with AVX2 and FMA but no
# AVX-512 builds it (8 lanes, tiles of 4 rows), and as one with neither (plain vectors, multiply
# and add rounded apart): PREFIXCACHE_NATIVE_CFLAGS, part of the build's key
KERNEL_FLAGS = {"this CPU": "", "AVX2": "-mno-avx512f", "plain": "-mno-avx"}


@pytest.fixture(params=list(KERNEL_FLAGS))
def lora_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from native_support import require_native_layers
    from prefixcache.model import native_layers, panel_gemm

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the instruction-set switches are x86's")
    require_native_layers()
    caches = [native_layers._library, native_layers.available, panel_gemm._library,
              panel_gemm.available]  # fmt: skip
    monkeypatch.setenv("PREFIXCACHE_NATIVE_CFLAGS", KERNEL_FLAGS[request.param])
    for cached in caches:
        cached.cache_clear()
    assert native_layers.available()  # built with these flags, and its probe passes
    isa = {"this CPU": "AVX-512F", "AVX2": "AVX2", "plain": "plain loops"}[request.param]
    assert panel_gemm.kernel_name(torch.float32) == isa  # the flags reach the compiler
    yield request.param
    monkeypatch.undo()
    for cached in caches:
        cached.cache_clear()


def _update(slots: LoraSlots, runs: list[LoraRun], x: torch.Tensor, projection: int,
            native: bool) -> torch.Tensor:  # fmt: skip
    """Layer 0's LoRA update of ``projection`` over the rows of ``x``, by the kernel or by
    torch (in float32, then added to the output's zeros)."""
    from prefixcache.model import native_layers

    config = slots.config
    width = (config.q_size + 2 * config.kv_size, config.hidden_size,
             2 * config.intermediate_size, config.hidden_size)[projection]  # fmt: skip
    out = torch.zeros(x.shape[0], width, dtype=x.dtype)
    step = slots.step(runs)
    assert step is not None
    native_layers.set_enabled(native)
    try:
        step.apply(0, projection, x, out)
    finally:
        native_layers.set_enabled(True)
    return out


def test_every_build_of_the_kernel_equals_torch_and_keeps_a_rows_bits_in_any_batch(
    base: Any, adapters: dict[str, tuple[Any, Path]], slots: LoraSlots, lora_kernel: str,
) -> None:
    """The LoRA kernel as this CPU, an AVX2 CPU and a CPU with neither AVX-512 nor AVX2 build
    it: each projection's update equals torch's within the AVX-512 build's tolerance (TOL of
    the update's scale), in a step that mixes three adapters and the base over runs that cut
    its tiles anywhere; a row's bits are the same alone, beside other rows or at another place
    in the step (float32 and bfloat16 rows); and the model's logits still equal peft's."""
    config = base.config
    gen = torch.Generator().manual_seed(7)
    runs = [LoraRun(0, 5, 1), LoraRun(7, 11, 0), LoraRun(18, 1, 2), LoraRun(19, 9, 1)]
    inputs = (config.hidden_size, config.q_size, config.hidden_size, config.intermediate_size)
    for projection, width in enumerate(inputs):
        x = torch.randn(28, width, generator=gen)
        ours, theirs = (_update(slots, runs, x, projection, native) for native in (True, False))
        assert (ours - theirs).abs().max().item() <= TOL * theirs.abs().max().item()
        assert not ours[5:7].any()  # rows under no adapter: untouched
        for dtype in (torch.float32, torch.bfloat16):
            rows = x.to(dtype)
            mixed = _update(slots, runs, rows, projection, True)
            alone = _update(slots, [LoraRun(0, 11, 0)], rows[7:18], projection, True)
            moved = _update(slots, [LoraRun(3, 11, 0)], rows[4:18], projection, True)[3:]
            assert torch.equal(alone, mixed[7:18]) and torch.equal(moved, mixed[7:18])
            for i in range(19, 28):  # each row of a run as its own one-row step
                one = _update(slots, [LoraRun(0, 1, 1)], rows[i : i + 1], projection, True)
                assert torch.equal(one[0], mixed[i])
    _logits_as_peft(base, adapters, slots, same_bits=True)


# ---- the engine: greedy tokens against peft --------------------------------------------------


@pytest.fixture(scope="module")
def expected(adapters: dict[str, tuple[Any, Path]]) -> dict[str | None, list[list[int]]]:
    """peft's greedy tokens per adapter (None: the base) for the first three prompts."""
    first = next(iter(adapters.values()))[0]
    out: dict[str | None, list[list[int]]] = {
        None: [peft_greedy(first, p, GREEDY.max_tokens, adapter=False) for p in PROMPTS[:3]]}
    for name, (model, _) in adapters.items():
        out[name] = [peft_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS[:3]]
    return out


@pytest.mark.parametrize("cache", ["hash", "radix", "off"])
def test_greedy_tokens_equal_peft_in_mixed_batches_cache_on_and_off(
    adapters: dict[str, tuple[Any, Path]], expected: dict[str | None, list[list[int]]],
    cache: str,
) -> None:  # fmt: skip
    llm = tiny(max_loras=3, prefix_cache="hash" if cache == "off" else cache,
               enable_prefix_caching=cache != "off")
    names: list[str | None] = [None, *ADAPTERS]
    batch = [(p, name) for name in names for p in range(3)]
    for _ in range(2):  # the second time over cached blocks (cache on)
        outs = llm.generate([PROMPTS[p] for p, _ in batch], GREEDY,
                            lora_request=[None if n is None else request(adapters, n)
                                          for _, n in batch])  # fmt: skip
        for (p, name), out in zip(batch, outs, strict=True):
            assert out.outputs[0].token_ids == expected[name][p], (name, p)
    assert (llm.stats()["hit_tokens"] > 0) == (cache != "off")


# ---- identity ------------------------------------------------------------------------------


def _cached(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> int:
    return llm.generate([prompt], GREEDY, lora_request=lora)[0].num_cached_tokens


def test_blocks_are_the_adapters_alone_and_shared_under_a_second_name(
    adapters: dict[str, tuple[Any, Path]],
) -> None:
    llm = tiny()
    prompt = PROMPTS[3]
    assert _cached(llm, prompt, None) == 0
    qv8 = request(adapters, "qv8")
    assert _cached(llm, prompt, qv8) == 0  # not the base's blocks
    assert _cached(llm, prompt, qv8) == 48
    assert _cached(llm, prompt, request(adapters, "all16")) == 0  # not another adapter's
    alias = request(adapters, "qv8", lora_id=9, alias="qv8-again")  # same files, new name
    assert _cached(llm, prompt, alias) == 48
    assert _cached(llm, prompt, None) == 48
    registry = llm.engine.loras
    assert registry is not None
    assert registry.identity_of("qv8") == registry.identity_of("qv8-again") != \
        registry.identity_of("all16")  # fmt: skip
    assert len(registry.loaded()) == 2  # one copy of qv8's weights for both names


def test_a_file_changed_under_the_same_name_is_another_adapter(
    adapters: dict[str, tuple[Any, Path]], tmp_path: Path,
) -> None:
    path = tmp_path / "changing"
    shutil.copytree(adapters["qv8"][1], path)
    lora = LoRARequest("changing", 1, str(path))
    llm = tiny()
    first = llm.generate([PROMPTS[3]], GREEDY, lora_request=lora)[0]
    assert _cached(llm, PROMPTS[3], lora) == 48
    weights = path / "adapter_model.safetensors"
    tensors = {k: v * 3 if "lora_B" in k else v for k, v in load_file(weights).items()}
    save_file(tensors, weights)
    second = llm.generate([PROMPTS[3]], GREEDY, lora_request=lora)[0]
    assert second.num_cached_tokens == 0
    assert second.outputs[0].token_ids != first.outputs[0].token_ids


def test_unloading_makes_its_blocks_unreachable_and_evicts_them(
    adapters: dict[str, tuple[Any, Path]],
) -> None:
    for cache in ("hash", "radix"):
        llm = tiny(prefix_cache=cache, kv_events=True)
        engine = llm.engine
        assert engine.loras is not None
        qv8, all16 = request(adapters, "qv8"), request(adapters, "all16")
        llm.generate([PROMPTS[3]], GREEDY, lora_request=all16)
        llm.generate([PROMPTS[3], PROMPTS[1]], GREEDY, lora_request=qv8)
        llm.generate([PROMPTS[3]], GREEDY)
        engine.take_kv_events()
        before = engine.cache.num_cached_blocks
        assert llm.remove_lora("qv8") and not llm.remove_lora("qv8")
        removed = [e for e in engine.take_kv_events() if isinstance(e, BlockRemoved)]
        num_removed = sum(len(e.block_hashes) for e in removed)
        assert num_removed == 4 + 3  # both prompts' full blocks: 64 and 50 + 10 tokens
        assert engine.cache.num_cached_blocks == before - num_removed
        assert llm.list_loras() == {2}
        assert _cached(llm, PROMPTS[3], all16) == 48  # the others' blocks stay
        assert _cached(llm, PROMPTS[3], None) == 48
        assert _cached(llm, PROMPTS[3], qv8) == 0  # loaded again: computed again


def test_unloading_evicts_blocks_its_pins_held_and_those_of_an_adapter_out_of_its_slot(
    adapters: dict[str, tuple[Any, Path]],
) -> None:
    llm = tiny(max_cpu_loras=1)  # one slot: all16 takes qv8's
    engine = llm.engine
    qv8, all16 = request(adapters, "qv8"), request(adapters, "all16")
    engine.add_request("pinned", prompt_token_ids=PROMPTS[3], sampling_params=GREEDY,
                       lora_request=qv8, pins=[(48, 3600.0)])  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pins.pins) == 1
    assert _cached(llm, PROMPTS[1], all16) == 0
    assert engine.loras is not None and list(engine.loras.loaded()) == [
        engine.loras.identity_of("all16")]  # qv8 is out of its slot, still registered
    assert _cached(llm, PROMPTS[3], qv8) == 48  # its slot filled again: its blocks hit
    assert _cached(llm, PROMPTS[1], all16) == 48  # qv8 out again
    assert llm.remove_lora("qv8")
    assert not engine.pins.pins  # its pin went with it
    assert _cached(llm, PROMPTS[3], qv8) == 0  # loaded again: computed again
    assert _cached(llm, PROMPTS[1], all16) == 48  # all16's blocks stay


# ---- bad adapters ----------------------------------------------------------------------------


def _broken(source: Path, out: Path, how: str) -> Path:
    shutil.copytree(source, out)
    weights, config = out / "adapter_model.safetensors", out / "adapter_config.json"
    data = json.loads(config.read_text())
    if how == "missing":
        shutil.rmtree(out)
    elif how == "no weights":
        weights.unlink()
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif how == "layer the model lacks":
        tensors = load_file(weights)
        save_file({k.replace("layers.0.", "layers.7."): v for k, v in tensors.items()}, weights)
    elif how == "lm_head":
        config.write_text(json.dumps({**data, "target_modules": ["q_proj", "lm_head"]}))
    elif how == "other model":
        tensors = load_file(weights)
        save_file({k: v[:, :128].contiguous() if "lora_A" in k else v
                   for k, v in tensors.items()}, weights)
    elif how == "dora":
        config.write_text(json.dumps({**data, "use_dora": True}))
    return out


@pytest.mark.parametrize("how, message", [
    ("missing", "does not exist"), ("no weights", "no adapter_model.safetensors"),
    ("truncated", "not a readable safetensors"), ("rank", "exceeds the maximum LoRA rank 8"),
    ("layer the model lacks", "layer 7, but the model has 4 layers"),
    ("lm_head", "lm_head: only the"), ("other model", "another base model"),
    ("dora", "DoRA"),
])  # fmt: skip
def test_a_bad_adapter_is_refused_and_disturbs_nothing(
    adapters: dict[str, tuple[Any, Path]], expected: dict[str | None, list[list[int]]],
    tmp_path: Path, how: str, message: str,
) -> None:  # fmt: skip
    llm = tiny(max_lora_rank=8)
    good = request(adapters, "qv8")
    assert llm.generate([PROMPTS[0]], GREEDY, lora_request=good)[0].outputs[0].token_ids == \
        expected["qv8"][0]  # fmt: skip
    source = adapters["all16" if how == "rank" else "qv8"][1]
    bad = LoRARequest("bad", 5, str(source if how == "rank" else _broken(source, tmp_path / "b",
                                                                        how)))
    with pytest.raises(LoraError, match=message):
        llm.add_lora(bad)
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=bad)
    assert llm.list_loras() == {1}
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], GREEDY, lora_request=[good, None])
    assert [o.outputs[0].token_ids for o in outs] == [expected["qv8"][0], expected[None][1]]


def test_lora_off_refuses_an_adapter() -> None:
    llm = tiny(enable_lora=False)
    with pytest.raises(ValueError, match="LoRA is off"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("a", 1, "/nowhere"))


# ---- scheduling ---------------------------------------------------------------------------


def test_a_step_holds_at_most_max_loras_adapters(
    adapters: dict[str, tuple[Any, Path]], expected: dict[str | None, list[list[int]]],
) -> None:
    llm = tiny(max_loras=1)
    engine = llm.engine
    names = ["qv8", "all16", None, "qv8", "mlp_rs"]
    for i, name in enumerate(names):
        engine.add_request(f"r{i}", PROMPTS[i % 3], GREEDY,
                           lora_request=None if name is None else request(adapters, name))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        out = engine.last_scheduled
        assert out is not None
        assert len({c.request.seq.adapter for c in out.chunks} - {None}) <= 1
    for i, name in enumerate(names):
        assert tokens[f"r{i}"] == expected[name][i % 3]


def test_the_disk_tier_gives_an_adapters_blocks_to_that_adapter_alone(
    adapters: dict[str, tuple[Any, Path]], tmp_path: Path,
) -> None:
    def engine() -> LLM:
        return tiny(kv_disk=str(tmp_path))

    first = engine()
    want = first.generate([PROMPTS[3]], GREEDY, lora_request=request(adapters, "qv8"))[0]
    assert first.engine.flush_tiers(30)
    first.engine.close()
    second = engine()
    assert _cached(second, PROMPTS[3], None) == 0
    assert _cached(second, PROMPTS[3], request(adapters, "all16")) == 0
    renamed = request(adapters, "qv8", lora_id=7, alias="renamed")
    again = second.generate([PROMPTS[3]], GREEDY, lora_request=renamed)[0]
    assert again.num_cached_tokens == 48
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    assert second.stats()["tiers"]["engine"]["blocks_loaded_by_tier"].get("disk", 0) == 3
    second.engine.close()


def test_smollm2_answers_as_peft_in_float32_and_runs_the_adapter_beside_its_gguf_blocks(
    tmp_path: Path,
) -> None:
    base = load_model("smollm2")
    model = peft_adapter(base.path, tmp_path / "a", seed=5, scale=0.05, r=16, lora_alpha=16,
                         target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])  # fmt: skip
    ids = base.tokenizer.encode("The capital of France is")
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(base, enable_lora=True, num_kv_blocks=KV_BLOCKS)
    assert llm.generate([ids], params, lora_request=lora)[0].outputs[0].token_ids == \
        peft_greedy(model, ids, 6)  # fmt: skip
    # Q4_1 blocks: logits off float32's by ~0.24 on average; the update still lands
    quantized = load_model("smollm2", weight_dtype="gguf")
    slots = LoraSlots(quantized.config, 1)
    slots.install(0, PackedLora.of(load_adapter(tmp_path / "a", quantized.config),
                                   quantized.config))  # fmt: skip
    adapted, plain = step_logits(quantized, slots, [(ids, 0), (ids, None)])
    theirs, their_base = peft_logits(model, ids), peft_logits(model, ids, adapter=False)
    form_error = (plain - their_base).abs().mean().item()
    error = (adapted - theirs).abs().mean().item()
    assert error < form_error and error < (plain - theirs).abs().mean().item() / 2
    assert torch.equal(step_logits(quantized, slots, [(ids, 0)])[0], adapted)


# ---- the adapter in KV events, explain, the simulator and the cluster's ingress ----------------


def test_kv_events_name_the_adapter_as_vllm_sends_it(
    adapters: dict[str, tuple[Any, Path]],
) -> None:
    import msgspec

    from prefixcache.cache import BlockStored
    from prefixcache.server.kv_events import decode_batch, encode_batch

    llm = tiny(kv_events=True)
    llm.generate([PROMPTS[3]], GREEDY, lora_request=request(adapters, "all16"))
    llm.generate([PROMPTS[1]], GREEDY)
    stored = [e for e in llm.engine.take_kv_events() if isinstance(e, BlockStored)]
    assert {(e.lora_id, e.lora_name) for e in stored} == {(2, "all16"), (None, None)}
    wire = encode_batch(stored, 1.0, with_tokens=False)
    raw = msgspec.msgpack.decode(wire)[1][0]  # vLLM's BlockStored fields
    assert (raw["lora_id"], raw["lora_name"]) == (2, "all16")
    assert decode_batch(wire)[1][0].lora_name == "all16"


def test_every_tier_announces_an_adapters_blocks_with_its_lora_id_and_name(
    adapters: dict[str, tuple[Any, Path]], tmp_path: Path,
) -> None:
    from prefixcache.cache import BlockStored
    from prefixcache.server.kv_events import decode_batch, encode_batch
    from tier_helpers import ValkeyProcess, flush, shared_url

    url, server = shared_url(), None
    if url is None:
        server = ValkeyProcess().start()
        url = server.url
    flush(url)
    try:
        def stored(llm: LLM, lora: LoRARequest | None) -> dict[str | None, set[Any]]:
            llm.generate([PROMPTS[3]], GREEDY, lora_request=lora)
            assert llm.engine.flush_tiers(30)
            events = [e for e in llm.engine.take_kv_events() if isinstance(e, BlockStored)]
            _, wire = decode_batch(encode_batch(events, 1.0, with_tokens=False))
            out: dict[str | None, set[Any]] = {}
            for event in wire:
                assert isinstance(event, BlockStored)
                out.setdefault(event.medium, set()).add((event.lora_id, event.lora_name))
            return out

        def engine(disk: Path) -> LLM:
            return tiny(kv_events=True, kv_disk=str(disk), kv_valkey=url)

        writer = engine(tmp_path / "one")  # computes, writes to its disk and to Valkey
        want = {None: {(2, "all16")}, "DISK": {(2, "all16")}, "VALKEY": {(2, "all16")}}
        assert stored(writer, request(adapters, "all16")) == want
        writer.engine.close()
        reader = engine(tmp_path / "two")  # loads from Valkey, copies to its disk
        renamed = request(adapters, "all16", lora_id=5, alias="again")
        assert stored(reader, renamed) == {m: {(5, "again")} for m in want}
        base = stored(reader, None)
        assert base and all(pairs == {(None, None)} for pairs in base.values())
        reader.engine.close()
    finally:
        if server is not None:
            server.stop()


def test_explain_names_an_adapter_by_its_files(
    adapters: dict[str, tuple[Any, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    from prefixcache.cli import main

    copy = tmp_path / "copy"
    shutil.copytree(adapters["qv8"][1], copy)
    prompt = "x" * 80

    def diff(a: str, b: str) -> list[str]:
        with pytest.raises(SystemExit):
            main(["explain", prompt, prompt, "--adapter-a", a, "--adapter-b", b, "--json"])
        result: list[str] = json.loads(capsys.readouterr().out)["namespace_diff"]
        return result

    assert diff(str(adapters["qv8"][1]), str(copy)) == []  # the same files elsewhere
    assert diff(str(adapters["qv8"][1]), str(adapters["all16"][1])) == ["adapter"]


def test_the_simulator_keeps_each_adapters_blocks_apart() -> None:
    from prefixcache.sim.config import RunSpec
    from prefixcache.sim.sequential import replay_sequential
    from prefixcache.sim.trace import Trace, TraceRequest

    def hit_ratio(adapters: list[str]) -> float:
        requests = [TraceRequest(f"r{i}", float(i), 64, 4, [1, 2, 3, 4], adapter=a)
                    for i, a in enumerate(adapters)]  # fmt: skip
        (result,) = replay_sequential(Trace("lora", BS, requests), [RunSpec("hash", "lru", None)])
        return result.hit_ratio

    assert hit_ratio(["", ""]) > 0 and hit_ratio(["x", "x"]) > 0
    assert hit_ratio(["", "x"]) == hit_ratio(["x", "y"]) == 0.0


def test_the_ingress_names_an_adapter_requests_blocks_as_its_replica(
    adapters: dict[str, tuple[Any, Path]],
) -> None:
    from prefixcache.cluster.digests import PromptDigester
    from prefixcache.server.tenancy import TenantRegistry

    llm = tiny()
    engine, text = llm.engine, "route me " * 12
    request_id = engine.add_request("r", text, GREEDY, lora_request=request(adapters, "qv8"))
    replica = engine.prompt_block_digests(request_id)
    registry = engine.loras
    assert registry is not None
    digester = PromptDigester(engine.tokenizer, TenantRegistry(None, b"s" * 32),
                              engine.cache_identity, adapters={"qv8": registry.identity_of("qv8")})
    body = json.dumps({"model": "qv8", "prompt": text}).encode()
    assert digester.digests("/v1/completions", None, body) == replica
    base = json.dumps({"model": "tiny", "prompt": text}).encode()
    assert digester.digests("/v1/completions", None, base)[0] != replica[0]


def test_qwen3_layers_run_the_update_before_their_q_k_norm(tmp_path: Path) -> None:
    """Qwen3's layers run as PyTorch modules (q/k norm): the update lands on q and k before
    their norm, as peft's does, with qkv bias off and head_dim 32 != hidden / heads."""
    import transformers

    from prefixcache.model.byte_tokenizer import write_byte_tokenizer

    config = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=300, max_position_embeddings=1024,
        tie_word_embeddings=False)  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    model.save_pretrained(tmp_path / "base")
    write_byte_tokenizer(tmp_path / "base")
    peft_model = peft_adapter(tmp_path / "base", tmp_path / "a", seed=4, scale=0.2, r=8,
                              lora_alpha=8, target_modules=ALL_TARGETS)  # fmt: skip
    loaded = load_model(str(tmp_path / "base"))
    slots = LoraSlots(loaded.config, 1)
    slots.install(0, PackedLora.of(load_adapter(tmp_path / "a", loaded.config), loaded.config))
    ids = PROMPTS[1]
    adapted, plain = step_logits(loaded, slots, [(ids, 0), (ids, None)])
    theirs = peft_logits(peft_model, ids)
    assert (adapted - theirs).abs().max().item() < TOL * theirs.abs().max().item()
    assert (plain - theirs).abs().max().item() > 0.01


@pytest.mark.parametrize("dtype, weights", [(torch.float32, torch.float32),
                                            (torch.bfloat16, torch.float32),
                                            (torch.bfloat16, torch.bfloat16)])  # fmt: skip
def test_the_kernel_gives_a_row_the_same_bits_in_any_tile(
    base: Any, adapters: dict[str, tuple[Any, Path]], dtype: torch.dtype, weights: torch.dtype
) -> None:
    """The update of a row does not depend on where its run starts, how the runs are cut or
    what runs beside it (tiles of 8 rows: every row count 1-8 and a cut inside one), and it is
    peft's product (float64 reference), with A and B in float32 or bfloat16."""
    from native_support import require_native_layers

    require_native_layers()
    slots = LoraSlots(base.config, 2)
    for slot, name in enumerate(("qv8", "all16")):
        adapter = load_adapter(adapters[name][1], base.config)
        slots.install(slot, PackedLora.of(adapter, base.config, weights))
    gen = torch.Generator().manual_seed(0)
    hidden, width = base.config.hidden_size, base.config.q_size + 2 * base.config.kv_size
    x = torch.randn(37, hidden, generator=gen).to(dtype)

    def update(runs: list[LoraRun]) -> torch.Tensor:
        out = torch.zeros(37, width, dtype=dtype)
        step = slots.step(runs)
        assert step is not None
        step.apply(1, 0, x, out)
        return out

    whole = update([LoraRun(0, 37, 1)])
    for cuts in ([LoraRun(0, 5, 1), LoraRun(5, 32, 1)], [LoraRun(0, 3, 0), LoraRun(3, 34, 1)],
                 [LoraRun(i, 1, 1) for i in range(37)]):  # fmt: skip
        mine = [r for r in cuts if r.slot == 1]
        rows = slice(mine[0].row0, 37)
        assert torch.equal(update(cuts)[rows], whole[rows])
    (q, k, v) = slots.pieces(1, 0, 1)
    expected = torch.cat([(x.double() @ p.a_t[:, : p.rank].double())
                          @ p.b_t[:, : p.n].double() * p.scale for p in (q, k, v)], dim=1)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (whole.double() - expected).abs().max().item() < tolerance * expected.abs().max()


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_evicting_a_namespace_takes_its_free_blocks_alone(kind: str) -> None:
    """The cache's side of an unload: every free cached block under the roots goes (counted,
    announced), blocks a live sequence holds stay, the other namespaces keep theirs, and every
    invariant holds after."""
    import random

    from prefixcache.cache import Sequence, make_prefix_cache

    rng = random.Random(7)
    cache = make_prefix_cache(kind, num_blocks=96, block_size=4, enable_kv_events=True)
    shared = [rng.randrange(100) for _ in range(12)]
    seqs = []
    for i in range(9):
        adapter = ("lora:a", "lora:b", None)[i % 3]
        ids = shared + [rng.randrange(100) for _ in range(rng.randrange(1, 9))]
        seq = Sequence(f"s{i}", ids, adapter=adapter)
        assert cache.allocate(seq, len(ids), cache.match(seq)) is not None
        cache.commit(seq, len(ids))
        seqs.append(seq)
    for seq in seqs[1:]:  # s0 (adapter a) stays live
        cache.free(seq)
    cache.check_integrity()
    roots = {cache.identity.root(s) for s in seqs if s.adapter == "lora:a"}
    before, evicted = cache.num_cached_blocks, len(cache.evict_namespaces(roots))
    cache.check_integrity()
    assert evicted and cache.num_cached_blocks == before - evicted
    again = Sequence("again", seqs[3].token_ids, adapter="lora:a")  # s3: adapter a, freed
    assert cache.match(again).num_tokens == 12  # the shared blocks live s0 still holds
    for seq in seqs[1:]:
        if seq.adapter != "lora:a":
            probe = Sequence("p", seq.token_ids, adapter=seq.adapter)
            assert cache.match(probe).num_tokens == (len(seq.token_ids) - 1) // 4 * 4
    removed = [e for e in cache.take_events() if isinstance(e, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removed) == evicted
