"""The quantized KV cache (``--kv-cache-dtype``): the layouts' bytes, the kernel reading them as
stored, the engine keeping them (capacity, identity, tiers), and bad input refused clearly.

Batch invariance in the int8 and int4 layouts is in tests/test_batch_invariance.py (its forms);
here the same answer alone, batched, chunked, warm and from a tier for the other layouts and the
bfloat16 model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from native_support import require_native_attention
from prefixcache import LLM, SamplingParams
from prefixcache.attention import KVLayout, native_attention
from prefixcache.attention.kv_format import FORMATS, KVFormat, hadamard, kv_format
from prefixcache.cache import CacheIdentity, Sequence
from prefixcache.cache.block_hash import BlockHasher, Namespace
from prefixcache.cli import main
from prefixcache.engine.config import EngineConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUANTIZED = ["int8", "int4", "fp8_e4m3", "fp8_e5m2"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
PROMPTS = [list(range(40, 130)) + [200 + 3 * i + j for j in range(5 + 4 * i)] for i in range(3)]


def _rows(kernel_rows: torch.Tensor, layout: KVFormat, dim: int) -> torch.Tensor:
    """The values the kernel reads back from stored rows [n, bytes] (rotated back)."""
    kernel = native_attention._kernel()
    assert kernel is not None
    out = torch.empty(kernel_rows.shape[0], dim)
    for i in range(kernel_rows.shape[0]):
        kernel.kv_read(out.data_ptr() + 4 * dim * i, kernel_rows.data_ptr(), i, dim, layout.code)
    if layout.rotated:
        kernel.hadamard_rows(out.data_ptr(), out.shape[0], dim)
    return out


# ---- the layouts' bytes --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_writes_the_torch_reference_bytes(name: str, dim: int, dtype) -> None:
    require_native_attention()
    layout = FORMATS[name]
    gen = torch.Generator().manual_seed(dim)
    qkv = (torch.randn(37, 7, dim, generator=gen) * 3).to(dtype)  # k, v: strided views
    qkv[0, 3, :4] = 0  # a block with zeros, and a whole zero row
    qkv[1, 4] = 0
    k, v = qkv[:, 3:5], qkv[:, 5:7]
    slots = torch.randperm(50, generator=gen)[:37]
    k_rows, v_rows = (torch.zeros(50, 2, layout.row_width(dim), dtype=torch.uint8)
                      for _ in range(2))  # fmt: skip
    assert native_attention.kv_write(k, v, k_rows, v_rows, slots, layout.code)
    assert torch.equal(k_rows[slots], layout.quantize(k))
    assert torch.equal(v_rows[slots], layout.quantize(v))
    assert torch.equal(_rows(k_rows[slots].reshape(-1, k_rows.shape[-1]), layout, dim),
                       layout.dequantize(k_rows[slots]).reshape(-1, dim))  # fmt: skip


@pytest.mark.parametrize("name", QUANTIZED)
def test_each_layout_keeps_its_values_within_its_precision(name: str) -> None:
    layout = kv_format(name)
    x = torch.randn(64, 2, 64, generator=torch.Generator().manual_seed(1)) * 2
    back = layout.dequantize(layout.quantize(x))
    relative = float((back - x).norm() / x.norm())
    bound = {"int8": 0.006, "int4": 0.12, "fp8_e4m3": 0.04, "fp8_e5m2": 0.08}[name]
    assert relative < bound
    if native_attention.available():
        stored = layout.quantize(x).reshape(-1, layout.row_width(64)).contiguous()
        assert torch.equal(_rows(stored, layout, 64), back.reshape(-1, 64))


def test_bytes_per_value_and_the_hadamard_transform() -> None:
    bytes_per_value = {name: FORMATS[name].row_bytes(64) / 64 for name in FORMATS}
    assert bytes_per_value == {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1.0625,
                               "int4": 0.5625, "fp8_e4m3": 1.0625, "fp8_e5m2": 1.0625}
    x = torch.randn(5, 64)
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-6)  # its own inverse
    assert torch.allclose(hadamard(x).norm(dim=-1), x.norm(dim=-1))  # a rotation
    if native_attention.available():
        kernel = native_attention._kernel()
        assert kernel is not None
        y = x.clone()
        kernel.hadamard_rows(y.data_ptr(), 5, 64)
        assert torch.equal(y, hadamard(x))


def test_bad_layouts_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int3'"):
        kv_format("int3")
    assert kv_format("fp8") == FORMATS["fp8_e4m3"]  # vLLM's spelling
    with pytest.raises(ValueError, match="not a multiple of 32"):
        KVLayout(2, 2, 48, torch.float32, FORMATS["int8"])
    with pytest.raises(ValueError, match="power-of-two head_dim, not 96"):
        KVLayout(2, 2, 96, torch.float32, FORMATS["int4"])
    KVLayout(2, 2, 96, torch.float32, FORMATS["int8"])  # 3 blocks of 32: fine
    import prefixcache.attention.kv_format as formats

    with monkeypatch.context() as patch:  # a torch without 8-bit floats on the CPU
        patch.setattr(formats, "_fp8_supported", lambda dtype: False)
        with pytest.raises(ValueError, match="cannot convert to torch.float8_e4m3fn"):
            kv_format("fp8")
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        EngineConfig.from_kwargs("tiny", kv_cache_dtype="q4_0")
    with pytest.raises(ValueError, match="bfloat16 under float32"):
        LLM(model="tiny", dtype="bfloat16", kv_cache_dtype="float32")


def test_a_model_whose_head_the_layout_cannot_take_is_refused_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a checkpoint with 96-value heads: int8 keeps them (3 blocks of 32), int4's rotation
    # needs a power of two, refused by LLM(...) and by the command line with the reason
    import transformers

    from prefixcache.model.byte_tokenizer import write_byte_tokenizer

    config = transformers.LlamaConfig(hidden_size=192, intermediate_size=128, head_dim=96,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=300)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    write_byte_tokenizer(tmp_path)
    int8 = LLM(model=str(tmp_path), kv_cache_dtype="int8")
    assert int8.engine.runner.kv_cache.head_dim == 96
    assert len(int8.generate(["hello"], GREEDY)[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="needs a power-of-two head_dim, not 96"):
        LLM(model=str(tmp_path), kv_cache_dtype="int4")
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model", str(tmp_path), "--kv-cache-dtype", "int4", "hello"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "power-of-two head_dim, not 96" in err
    assert "Traceback" not in err


# ---- the kernel reads the blocks as stored -------------------------------------------------


def _reference(q, keys, values, context: int) -> torch.Tensor:
    new, heads, dim = q.shape
    group = heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * dim**-0.5
    visible = torch.arange(keys.shape[0]) <= (torch.arange(new) + context).unsqueeze(1)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v)


@pytest.mark.parametrize(("name", "dim"), [(name, dim) for name in QUANTIZED
                                           for dim in (64, 128, 96) if (name, dim) != ("int4", 96)])
def test_prefill_and_decode_attend_the_stored_values(name: str, dim: int) -> None:
    require_native_attention()  # (int4 rotates a power-of-two head_dim only)
    layout = kv_format(name)
    gen = torch.Generator().manual_seed(dim)
    heads, kv_heads, slots_n, context, new = 6, 2, 400, 300, 40  # past one 256-key segment
    k, v = torch.randn(slots_n, kv_heads, dim, generator=gen), torch.randn(slots_n, kv_heads, dim,
                                                                          generator=gen)
    k_rows, v_rows = layout.quantize(k).contiguous(), layout.quantize(v).contiguous()
    keys, values = layout.dequantize(k_rows), layout.dequantize(v_rows)
    slots = torch.randperm(slots_n, generator=gen)[: context + new]
    q = torch.randn(new, heads, dim, generator=gen)
    out = torch.empty_like(q)
    native_attention.attend(q, k_rows, v_rows, slots, dim**-0.5, out, kv_code=layout.code)
    ref = _reference(q, keys[slots], values[slots], context)
    assert torch.allclose(out.double(), ref, atol=2e-5, rtol=1e-4)
    # decode: 3 sequences sharing the first 200 keys, each with its own tail
    shared = slots[:200]
    tails = torch.stack([slots[200 + 30 * b: 230 + 30 * b] for b in range(3)])
    lens = torch.tensor([30, 17, 1], dtype=torch.int32)
    q1 = torch.randn(3, heads, dim, generator=gen)
    out1 = torch.empty_like(q1)
    native_attention.decode(q1, k_rows, v_rows, shared, tails, lens, dim**-0.5, out1,
                            kv_code=layout.code)
    for b in range(3):
        seq = torch.cat((shared, tails[b, : int(lens[b])]))
        ref1 = _reference(q1[b : b + 1], keys[seq], values[seq], len(seq) - 1)
        assert torch.allclose(out1[b : b + 1].double(), ref1, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["int8", "int4", "fp8_e5m2", "bfloat16"])
def test_the_torch_paths_dequantize_only_the_blocks_a_step_reads(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # without the kernel, each sequence's path (decode, a cascade over shared cached blocks,
    # a prefill over its own context, a fresh prefill) attends the values its blocks hold,
    # and the layer copies those blocks only, never the whole cache
    from prefixcache.attention import AttentionMetadata, PagedKVCache
    from prefixcache.attention import plan as plans
    from prefixcache.attention.paged_attention import paged_attention, write_kv

    monkeypatch.setattr(native_attention, "available", lambda: False)
    layout, dim, bs, kv_heads, heads = kv_format(name), 64, 4, 2, 6
    cache = PagedKVCache(1, 64, bs, kv_heads, dim, kv_format=layout)
    k_cache, v_cache = cache.layer(0)
    shared = [40, 7, 21]  # three cached blocks read by sequences 1 and 2
    tables = [[3, 9], shared + [11, 12], shared + [13, 14], [50, 51, 52], [60, 61]]
    computed, new = [6, 12, 12, 5, 0], [1, 5, 6, 7, 6]
    gen = torch.Generator().manual_seed(3)
    full = [(torch.randn(c + n, kv_heads, dim, generator=gen),
             torch.randn(c + n, kv_heads, dim, generator=gen))
            for c, n in zip(computed, new, strict=True)]  # fmt: skip
    for b, c in enumerate(computed):  # earlier steps wrote the context (the shared blocks once)
        if c and b != 2:
            prior = AttentionMetadata.build([tables[b]], [0], [c], bs)
            write_kv(full[b][0][:c], full[b][1][:c], k_cache, v_cache, prior.slot_mapping, layout)
    meta = AttentionMetadata.build(tables, computed, new, bs)
    k = torch.cat([fk[c:] for (fk, _), c in zip(full, computed, strict=True)])
    v = torch.cat([fv[c:] for (_, fv), c in zip(full, computed, strict=True)])
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping, layout)
    plan = plans.build_plan(meta, k_cache, v_cache, heads, torch.float32, torch.device("cpu"),
                            layout)
    assert not plan.native and plan.groups  # the torch paths, a cascade among them
    read_rows = []
    dequantize = type(layout).dequantize

    def counted(self: KVFormat, rows: torch.Tensor, dtype: torch.dtype = torch.float32):
        read_rows.append(rows.shape[0])
        return dequantize(self, rows, dtype)

    monkeypatch.setattr(type(layout), "dequantize", counted)
    q = torch.randn(sum(new), heads, dim, generator=gen)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, dim**-0.5, plan)
    blocks_read = len({block for table in tables for block in table})
    assert read_rows == [blocks_read, blocks_read]  # K and V: 14 of the cache's 64 blocks
    flat_k = dequantize(layout, k_cache).view(-1, kv_heads, dim)
    flat_v = dequantize(layout, v_cache).view(-1, kv_heads, dim)
    for b in range(len(new)):
        s, e = meta.query_starts[b], meta.query_starts[b + 1]
        seq = AttentionMetadata.build([tables[b]], [0], [computed[b] + new[b]], bs).slot_mapping
        ref = _reference(q[s:e], flat_k[seq], flat_v[seq], computed[b])
        assert torch.allclose(out[s:e].double(), ref, atol=2e-5, rtol=1e-4), b


# ---- the engine: same answers, capacity, identity, tiers -------------------------------------


def _answers(outs) -> list[list[tuple[int, float]]]:
    return [[(d["token_id"], d["logprob"]) for d in o.outputs[0].logprobs] for o in outs]


@pytest.mark.parametrize(("dtype", "kv"), [("bfloat16", "int8"), ("float32", "bfloat16"),
                                           ("float32", "fp8_e4m3"), ("float32", "fp8_e5m2"),
                                           ("bfloat16", "int4")])
def test_same_answer_alone_batched_chunked_warm_and_from_a_tier(
    dtype: str, kv: str, tmp_path: Path
) -> None:
    def llm(**settings) -> LLM:
        return LLM(model="tiny", dtype=dtype, kv_cache_dtype=kv, check_integrity=True,
                   **settings)

    alone = [_answers(llm(enable_prefix_caching=False).generate([p], GREEDY))[0]
             for p in PROMPTS]  # fmt: skip
    on = llm(max_num_batched_tokens=32, kv_disk=str(tmp_path))
    assert _answers(on.generate(PROMPTS, GREEDY)) == alone  # batched, chunked, cold
    assert _answers(on.generate(PROMPTS, GREEDY)) == alone  # warm: every prefix a hit
    assert on.stats()["hit_tokens"] > 0
    assert on.engine.flush_tiers(30)
    on.engine.close()
    restored = llm(kv_disk=str(tmp_path))  # its prefixes read back from the disk tier
    assert _answers(restored.generate(PROMPTS, GREEDY)) == alone
    assert restored.stats()["tiers"]["engine"]["blocks_loaded_by_tier"].get("disk", 0) > 0


def test_auto_picks_a_smaller_layout_only_within_the_precision_gate() -> None:
    # under --dtype auto, auto checks int4 then int8 against --dtype auto's own gate: on the
    # tiny model int4 misses it (its top-1 agreement), int8 passes and is kept; under a
    # given --dtype, auto keeps the activations' dtype, as vLLM's does
    from prefixcache.model import precision

    measured = LLM(model="tiny", dtype="auto")
    kv = measured.engine.limits.precision["kv_cache"]
    checked = kv["kv_auto"]["fidelity"]
    assert list(checked) == ["int4", "int8"]  # smallest first
    for figures in checked.values():
        assert figures["eligible"] == precision.within_bounds(figures)
    assert not checked["int4"]["eligible"] and checked["int8"]["eligible"]
    assert kv["dtype"] == kv["kv_auto"]["chosen"] == "int8"
    assert measured.engine.runner.kv_cache.kv_format == FORMATS["int8"]
    given = LLM(model="tiny", dtype="float32", kv_cache_dtype="auto")
    assert given.engine.runner.kv_cache.kv_format == FORMATS["float32"]


def test_a_fixed_memory_holds_about_four_and_seven_times_the_blocks() -> None:
    blocks = {}
    for kv in ("float32", "bfloat16", "int8", "int4"):
        llm = LLM(model="tiny", kv_cache_dtype=kv, kv_cache_memory_bytes=64 << 20,
                  max_num_seqs=256)
        blocks[kv] = llm.engine.cache.num_blocks
        assert llm.engine.runner.kv_cache.num_bytes <= 64 << 20
    assert blocks["int8"] / blocks["float32"] >= 3.7 and blocks["int8"] / blocks["bfloat16"] >= 1.85
    assert blocks["int4"] / blocks["float32"] >= 7.0 and blocks["int4"] / blocks["bfloat16"] >= 3.5


def test_the_layout_is_in_the_namespace_and_the_default_keys_are_unchanged() -> None:
    hasher = BlockHasher(4)
    tokens = list(range(12))
    plain = hasher.chain(tokens, Namespace("m"))
    assert plain == hasher.chain(tokens, Namespace("m", kv_layout=None))
    int8 = hasher.chain(tokens, Namespace("m", kv_layout=FORMATS["int8"].layout))
    int4 = hasher.chain(tokens, Namespace("m", kv_layout=FORMATS["int4"].layout))
    assert len({plain[0], int8[0], int4[0]}) == 3  # no block shared between layouts
    seq = Sequence("s", tokens)
    assert CacheIdentity("m", 4, kv_layout="int8:q8_0/32").block_digests(seq) == int8
    assert CacheIdentity("m", 4).block_digests(seq) == plain  # the chain is rebuilt
    identity = CacheIdentity("m", 4, kv_layout="int8:q8_0/32")
    assert CacheIdentity.from_dict(identity.as_dict()) == identity
    float32 = LLM(model="tiny").engine.cache_identity
    int8_engine = LLM(model="tiny", kv_cache_dtype="int8").engine.cache_identity
    assert float32.kv_layout is None and int8_engine.kv_layout == "int8:q8_0/32"
    assert float32.model_id == int8_engine.model_id  # the same model, another layout


@pytest.fixture(params=["disk", "valkey"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A fresh disk directory or valkey-server, as an engine's tier flags."""
    if request.param == "disk":
        yield {"kv_disk": str(tmp_path)}
        return
    from tier_helpers import ValkeyProcess

    server = ValkeyProcess().start()
    try:
        yield {"kv_valkey": server.url}
    finally:
        server.stop()


def _stored_record_bytes(tier: dict[str, str]) -> dict[str, list[int]]:
    """Each identity tag's stored records' sizes, as the tier holds them."""
    sizes: dict[str, list[int]] = {}
    if "kv_disk" in tier:
        for path in Path(tier["kv_disk"]).rglob("*.kv"):
            sizes.setdefault(path.parent.parent.name, []).append(path.stat().st_size)
        return sizes
    from prefixcache.tiers.valkey import connect

    client = connect(tier["kv_valkey"])
    for key in client.scan_iter(match="prefixcache:v1:*", count=1000):
        parts = key.decode().split(":")
        if len(parts) == 4:  # a record, not a domain's set
            sizes.setdefault(parts[2], []).append(int(client.strlen(key)))
    return sizes


def test_tier_records_keep_the_layout_and_another_layout_misses(tier: dict[str, str]) -> None:
    # each layout's records are stored as its cache holds them, under its own identity: an
    # engine of another layout reads none of them (a miss) and removes none (both kept), and
    # the next engine of the first layout loads its own with the same answers
    tags, answers = {}, {}
    for kv in ("int8", "float32", "int4", "bfloat16", "int8"):
        llm = LLM(model="tiny", kv_cache_dtype=kv, block_size=16, **tier)
        answers.setdefault(kv, []).append(_answers(llm.generate(PROMPTS, GREEDY)))
        assert llm.engine.flush_tiers(30)
        loaded = llm.stats()["tiers"]["engine"]["blocks_loaded_by_tier"]
        tags[kv] = llm.engine.tiers.offload.store.identity.tag
        if len(answers[kv]) == 2:  # the second int8 engine: the first's blocks, loaded
            assert sum(loaded.values()) > 0
            assert answers[kv][0] == answers[kv][1]
        else:  # nothing of another layout is read
            assert sum(loaded.values()) == 0
        llm.engine.close()
    stored = _stored_record_bytes(tier)
    assert sorted(stored) == sorted(tags.values())  # 4 identities, every record kept
    size = {kv: sum(stored[tag]) / len(stored[tag]) for kv, tag in tags.items()}  # headers too
    assert len({len(stored[tag]) for tag in stored}) == 1  # the same blocks in each layout
    assert 3.5 <= size["float32"] / size["int8"] and 1.8 <= size["bfloat16"] / size["int8"]
    assert 6.0 <= size["float32"] / size["int4"] and 3.0 <= size["bfloat16"] / size["int4"]


def test_explain_names_a_tier_written_in_another_layout(
    tier: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "A system prompt that every request of this tenant starts with, word for word. " * 3
    llm = LLM(model="tiny", kv_cache_dtype="int8", **tier)
    llm.generate([prompt], SamplingParams(max_tokens=1))
    assert llm.engine.flush_tiers(30)
    llm.engine.close()
    [(flag, location)] = tier.items()

    def explain(*flags: str) -> str:
        with pytest.raises(SystemExit):
            main(["explain", prompt, prompt, "--model", "tiny", "--dtype", "float32",
                  "--" + flag.replace("_", "-"), location, *flags])
        return capsys.readouterr().out

    assert "KV layout differs (a miss)" in explain()  # a float32 engine reads none of them
    assert "in the int8 KV layout" in explain()
    same = explain("--kv-cache-dtype", "int8")
    assert "KV layout differs" not in same and "holds 0 of" not in same
    split = explain("--kv-cache-dtype-b", "int4")  # A's RAM blocks are float32, B's int4
    assert "why: the namespace differs: KV layout" in split


def test_models_metrics_dashboard_and_events_name_the_layout() -> None:
    import httpx
    import msgspec
    import zmq

    from prefixcache.cache import BlockStored
    from prefixcache.server.kv_events import decode_batch
    from server_harness import start_server
    from tier_helpers import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    events = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
              f'"endpoint": "{endpoint}", "topic": "kv"}}')
    running = start_server(["--model", "tiny", "--kv-cache-dtype", "int8", "--num-kv-blocks",
                            "64", "--kv-events-config", events])  # fmt: skip
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.connect(endpoint)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        card = httpx.get(running.base_url + "/v1/models").json()["data"][0]
        kv = card["precision"]["kv_cache"]
        assert kv["dtype"] == "int8" and kv["layout"] == "int8:q8_0/32"
        assert kv["bytes_per_token"] == 4 * 2 * 2 * (64 + 4)  # layers x K,V x kv heads x row
        assert kv["fidelity"]["top1_agreement"] > 0.9 and "mean_kl" in kv["fidelity"]
        metrics = httpx.get(running.base_url + "/metrics").text
        assert 'cache_dtype="int8"' in metrics and 'kv_layout="int8:q8_0/32"' in metrics
        dashboard = httpx.get(running.base_url + "/dashboard/data").json()
        assert dashboard["kv_cache_dtype"] == "int8"  # the page's model line: "tiny · KV int8"
        stored = []
        for attempt in range(50):  # until the subscription has joined: a request's blocks
            httpx.post(running.base_url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": f"{attempt} " + "a shared prefix " * 8,
                "max_tokens": 1})  # fmt: skip
            if subscriber.poll(200):
                _, _, payload = subscriber.recv_multipart()
                stored = [e for e in msgspec.msgpack.decode(payload)[1]
                          if e.get("type") == "BlockStored"]  # fmt: skip
                if stored:
                    break
        assert stored and all(e["kv_cache_dtype"] == "int8" for e in stored)
        assert isinstance(decode_batch(payload)[1][0], BlockStored)  # readers that skip it
    finally:
        subscriber.close(0)
        running.stop()


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_the_compiled_layer_calls_write_the_same_bytes(
    kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # int8 and int4 rows are quantized by the kernel's writer inside the compiled calls, as
    # the layers' separate steps write them: the same answers either way
    from native_support import require_native_layers
    from prefixcache.model import fused_layers

    require_native_layers()
    llm = LLM(model="tiny", kv_cache_dtype=kv)
    assert llm.engine.kernels["layers"] == "compiled"
    compiled = _answers(llm.generate(PROMPTS, GREEDY))
    monkeypatch.setattr(fused_layers, "_kv_writer", lambda kv_cache: None)  # separate steps
    separate = _answers(LLM(model="tiny", kv_cache_dtype=kv).generate(PROMPTS, GREEDY))
    assert compiled == separate
    assert LLM(model="tiny", kv_cache_dtype="fp8").engine.kernels["layers"].startswith("torch")


def test_the_simulators_table_is_the_layouts_row_sizes() -> None:
    from prefixcache.attention.kv_format import ALIASES
    from prefixcache.sim.config import KV_BYTES_SCALE

    for name, scale in KV_BYTES_SCALE.items():  # against bfloat16's row
        assert kv_format(ALIASES.get(name, name)).row_bytes(64) / 128 == scale
