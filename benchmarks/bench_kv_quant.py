"""The quantized KV cache (``--kv-cache-dtype``): what each layout costs and buys, side by side.

Parts (``--parts``, default all):

- ``attention``: the attention kernel alone over SmolLM2's shapes (9 query heads, 3 kv heads,
  head_dim 64), K and V from memory (``--layers`` layers' caches in turn, times per layer):
  decode of ``--seqs`` sequences over 8,192 keys each, a 128-token prefill after a 2,048-token
  hit, and a fresh 512-token prefill; float32 queries over float32, bfloat16 and the quantized
  caches, and a bfloat16 model's over bfloat16 and int8. The float cases run on any tree (run
  it with ``PYTHONPATH`` at another checkout to compare builds).
- ``fidelity``: SmolLM2 (float32 weights) with each layout against float32 KV, as llama.cpp's
  ``perplexity --kl-divergence`` states it: mean, 99th percentile and largest KL divergence of
  the next-token distributions and the top-1 agreement, over the README's first 512 tokens and
  over `precision.FIDELITY_TEXT` (what ``auto``'s gate reads).
- ``llamacpp``: the same in llama.cpp's ``perplexity --kl-divergence`` protocol (the README in
  chunks of 512 tokens, each chunk's second half scored), and with ``--llama-perplexity BIN``
  llama.cpp's own q8_0 and q4_0 KV (rotated, its default, and not) on the same GGUF file.
- ``capacity``: SmolLM2 with a fixed ``--kv-cache-memory-bytes``: 2,000-token prefixes sent one
  after another until the first is evicted; how many stay cached whole, and the time to first
  token of a miss and of a hit.
- ``restore``: a 2,048-token prefix loaded back from a disk tier and a Valkey tier (a real
  ``valkey-server`` on loopback), time to first token against a RAM hit, per block, and the
  record's bytes.
- ``traces``: the Mooncake conversation trace and the WEKA agentic traces through the
  simulator (``--kv-cache-gib`` of an 8B Llama's KV per layout), and two agentic
  conversations interleaved through the engine (each hash id one token, SmolLM2, a fixed
  memory): hit rate and time to first token.
- ``mooncake``: the Mooncake conversation trace's first ``--mooncake-requests`` through the
  engine (each hash id a block of ``--mooncake-block`` tokens of its own, SmolLM2,
  ``--mooncake-memory`` of KV): hit rate and time to first token per layout.

    .venv/bin/python benchmarks/bench_kv_quant.py [--parts attention,fidelity] [--repeats 5]

Cases alternate inside each repeat; medians. Prints tables and a final JSON line; the CPU and the
load average are in the header.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tier_helpers: a valkey-server on a free port
TRACES = ROOT.parent / "shared" / "traces"
LAYOUTS = ("float32", "bfloat16", "int8", "int4")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def median_ms(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


# -- attention ---------------------------------------------------------------------------------


def _caches(layout: str, slots: int, layers: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Per layer (K rows, V rows, the kernel's layout code) of ``slots`` tokens."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        k, v = torch.randn(slots, 3, 64, generator=gen), torch.randn(slots, 3, 64, generator=gen)
        if layout in ("float32", "bfloat16"):
            out.append((k.to(getattr(torch, layout)), v.to(getattr(torch, layout)), 0))
            continue
        from prefixcache.attention.kv_format import kv_format

        found = kv_format(layout)
        out.append((found.quantize(k).contiguous(), found.quantize(v).contiguous(), found.code))
    return out


def bench_attention(args: argparse.Namespace) -> dict[str, Any]:
    from prefixcache.attention import native_attention as na

    cases = [("float32", torch.float32), ("bfloat16", torch.float32),
             ("bfloat16", torch.bfloat16)]  # fmt: skip
    try:
        from prefixcache.attention import kv_format  # noqa: F401  # the quantized layouts
        cases += [("int8", torch.float32), ("int4", torch.float32), ("fp8_e4m3", torch.float32),
                  ("int8", torch.bfloat16)]  # fmt: skip
    except ImportError:
        pass
    seqs, context, layers = args.seqs, 8192, args.layers
    slots = seqs * context
    # each sequence's keys in 16-token blocks scattered over the cache, as a block table has them
    blocks = torch.randperm(slots // 16, generator=torch.Generator().manual_seed(1))
    table = (blocks.view(-1, 1) * 16 + torch.arange(16)).view(seqs, context)
    prepared: dict[str, list[Callable[[], None]]] = {}
    for layout, qdtype in cases:
        name = f"{layout} KV, {str(qdtype).removeprefix('torch.')} queries"
        calls = []
        for k, v, code in _caches(layout, slots, layers):
            extra = {"kv_code": code} if code else {}
            q = torch.randn(seqs, 9, 64).to(qdtype)
            out = torch.empty_like(q)
            decode = na.PreparedDecode(q, k, v, torch.empty(0, dtype=torch.long), table,
                                       torch.full((seqs,), context, dtype=torch.int32), out,
                                       **extra)  # fmt: skip
            q2 = torch.randn(128, 9, 64).to(qdtype)
            out2 = torch.empty_like(q2)
            prefill = na.PreparedAttend(q2, k, v, table[0, :2048 + 128].contiguous(), out2,
                                        **extra)  # fmt: skip
            q3 = torch.randn(512, 9, 64).to(qdtype)
            out3 = torch.empty_like(q3)
            fresh = na.PreparedAttend(q3, k, v, table[1, :512].contiguous(), out3, **extra)
            calls.append((lambda d=decode, q=q, k=k, v=v, o=out: d(q, k, v, 0.125, o),
                          lambda p=prefill, q=q2, k=k, v=v, o=out2: p(q, k, v, 0.125, o),
                          lambda p=fresh, q=q3, k=k, v=v, o=out3: p(q, k, v, 0.125, o)))
        for part, label in enumerate(("decode 8k", "prefill 128 after 2048", "prefill 512")):
            fns = [c[part] for c in calls]
            prepared[f"{name}|{label}"] = [lambda fns=fns: [f() for f in fns]]  # type: ignore[misc]
    for fn in prepared.values():
        fn[0]()  # warm-up
    samples: dict[str, list[float]] = {key: [] for key in prepared}
    for _ in range(args.repeats):  # cases alternate inside each repeat
        for key, fn in prepared.items():
            samples[key].append(median_ms(fn[0], 1) / layers)
    result = {key: statistics.median(v) for key, v in samples.items()}
    print(f"\nattention, SmolLM2 shapes, {seqs} sequences, ms per layer (median of "
          f"{args.repeats}, {layers} layers' caches in turn)")
    for key, ms in result.items():
        print(f"  {key:<60} {ms:8.3f}")
    return result


# -- fidelity ----------------------------------------------------------------------------------


def bench_fidelity(args: argparse.Namespace) -> dict[str, Any]:
    from prefixcache.attention.kv_format import kv_format
    from prefixcache.model import precision
    from prefixcache.model.loader import load_model

    loaded = load_model("smollm2", dtype="float32")
    texts = {"README 512": loaded.tokenizer.encode((ROOT / "README.md").read_text())[:512],
             "FIDELITY_TEXT": loaded.tokenizer.encode(precision.FIDELITY_TEXT)}  # fmt: skip
    out: dict[str, Any] = {}
    print("\nfidelity against float32 KV, SmolLM2 float32 weights")
    print(f"  {'text':<14} {'layout':<10} {'tokens':>6} {'mean KL':>9} {'p99 KL':>8} "
          f"{'max KL':>8} {'top-1':>7}")
    for text, ids in texts.items():
        ref = precision.all_logits(loaded.model, loaded.config, ids, torch.float32)
        for name in ("bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "int4"):
            logits = precision.all_logits(loaded.model, loaded.config, ids, torch.float32,
                                          kv_format(name))  # fmt: skip
            fig = precision.fidelity_of(ref, logits)
            out[f"{text}|{name}"] = fig
            print(f"  {text:<14} {name:<10} {fig['tokens']:>6} {fig['mean_kl']:>9.5f} "
                  f"{fig['p99_kl']:>8.4f} {fig['max_kl']:>8.4f} "
                  f"{100 * fig['top1_agreement']:>6.1f}%")
    return out


def bench_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    """llama.cpp's protocol on both sides: the README in chunks of 512 tokens, the KL divergence
    of each chunk's second half against the same model's own wide KV (ours float32, llama.cpp's
    f16), per layout; llama.cpp's own run where ``--llama-perplexity`` names its binary (its
    q4_0 with and without the rotation it applies by default, LLAMA_ATTN_ROT_DISABLE)."""
    import re
    import subprocess

    from prefixcache.attention.kv_format import kv_format
    from prefixcache.model import precision
    from prefixcache.model.builtin import locate_packaged
    from prefixcache.model.loader import load_model

    loaded = load_model("smollm2", dtype="float32")
    ids = loaded.tokenizer.encode((ROOT / "README.md").read_text())
    chunks = [ids[i : i + 512] for i in range(0, len(ids) - 511, 512)]
    out: dict[str, Any] = {}
    print(f"\nllama.cpp's protocol: the README, {len(chunks)} chunks of 512, second halves scored")
    for name in ("int8", "fp8_e4m3", "int4"):
        figs = []
        for chunk in chunks:
            ref = precision.all_logits(loaded.model, loaded.config, chunk, torch.float32)
            got = precision.all_logits(loaded.model, loaded.config, chunk, torch.float32,
                                       kv_format(name))  # fmt: skip
            figs.append(precision.fidelity_of(ref[256:], got[256:]))
        row = {k: statistics.mean(f[k] for f in figs) for k in ("mean_kl", "top1_agreement")}
        out[f"ours|{name}"] = row
        print(f"  ours       {name:<18} mean KL {row['mean_kl']:.5f}  top-1 "
              f"{100 * row['top1_agreement']:.1f}%")
    if not args.llama_perplexity:
        return out
    gguf, text = locate_packaged("smollm2"), str(ROOT / "README.md")
    with tempfile.TemporaryDirectory() as tmp:
        base = str(Path(tmp) / "base.kld")
        common = [args.llama_perplexity, "-m", str(gguf), "-f", text, "-c", "512", "-b", "512",
                  "-t", str(args.threads), "-fa", "on"]  # fmt: skip
        subprocess.run([*common, "-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", base],
                       capture_output=True, check=True)  # fmt: skip
        for label, kv, rotation in (("q8_0", "q8_0", "0"), ("q4_0 rotated", "q4_0", "0"),
                                    ("q4_0 unrotated", "q4_0", "1")):  # fmt: skip
            run = subprocess.run([*common, "-ctk", kv, "-ctv", kv, "--kl-divergence-base", base,
                                  "--kl-divergence"], capture_output=True, text=True,
                                 env={**os.environ, "LLAMA_ATTN_ROT_DISABLE": rotation},
                                 check=True)  # fmt: skip
            log = run.stdout + run.stderr
            kl = float(re.search(r"Mean +KLD: +([0-9.]+)", log).group(1))  # type: ignore[union-attr]
            top = float(re.search(r"Same top p: +([0-9.]+)", log).group(1))  # type: ignore[union-attr]
            out[f"llama.cpp|{label}"] = {"mean_kl": kl, "top1_agreement": top / 100}
            print(f"  llama.cpp  {label:<18} mean KL {kl:.5f}  top-1 {top:.1f}%")
    return out


# -- capacity ----------------------------------------------------------------------------------


def _one(engine: Any, rid: str, prompt: list[int]) -> tuple[float, int]:
    from prefixcache.engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, prompt_token_ids=prompt, sampling_params=params)
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            last = out
    assert last is not None
    return time.perf_counter() - start, last.num_cached_tokens


def _held(engine: Any, prompt: list[int]) -> bool:
    """Whether every full block of ``prompt`` is in the cache (a pure lookup)."""
    from prefixcache.cache import Sequence

    hit = engine.cache.match(Sequence("probe", list(prompt)))
    return hit.num_tokens >= (len(prompt) - 1) // engine.block_size * engine.block_size


def bench_capacity(args: argparse.Namespace) -> dict[str, Any]:
    from prefixcache.engine import LLMEngine

    out: dict[str, Any] = {}
    print(f"\ncapacity: 2,000-token prefixes in {args.memory >> 20} MiB of KV, SmolLM2 float32")
    print(f"  {'layout':<10} {'blocks':>7} {'prefixes held':>14} {'miss TTFT':>10} "
          f"{'hit TTFT':>9}")
    for layout in LAYOUTS:
        engine = LLMEngine("smollm2", dtype="float32", kv_cache_dtype=layout, block_size=16,
                           kv_cache_memory_bytes=args.memory, max_num_seqs=64)
        rng = random.Random(0)
        vocab = engine.model_config.vocab_size
        prompts: list[list[int]] = []
        misses, hits = [], []
        while not prompts or _held(engine, prompts[0]):
            prompts.append([rng.randrange(3, vocab - 16) for _ in range(2000)])
            misses.append(_one(engine, f"p{len(prompts)}", prompts[-1])[0])
        held = sum(_held(engine, p) for p in prompts)
        for i in range(3):  # hits on the newest (never the ones being counted)
            seconds, cached = _one(engine, f"h{i}", prompts[-1])
            assert cached >= 1984, cached
            hits.append(seconds)
        row = {"blocks": engine.cache.num_blocks, "prefixes_held": held,
               "miss_ttft_s": statistics.median(misses), "hit_ttft_s": statistics.median(hits)}
        out[layout] = row
        print(f"  {layout:<10} {row['blocks']:>7} {held:>14} {row['miss_ttft_s']:>9.3f}s "
              f"{row['hit_ttft_s']:>8.3f}s")
        engine.close()
    for layout in ("int8", "int4"):
        for base in ("float32", "bfloat16"):
            out[f"{layout}/{base}"] = out[layout]["prefixes_held"] / out[base]["prefixes_held"]
    print("  held ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in out.items() if "/" in k))
    return out


# -- restore from the tiers --------------------------------------------------------------------


def bench_restore(args: argparse.Namespace) -> dict[str, Any]:
    from prefixcache.engine import LLMEngine
    from tier_helpers import ValkeyProcess

    valkey = ValkeyProcess().start()
    out: dict[str, Any] = {}
    print("\nrestore: a 2,048-token prefix (128 blocks) from a tier, SmolLM2 float32")
    print(f"  {'layout':<10} {'record':>9} {'ram TTFT':>9} {'disk TTFT':>10} {'per block':>10} "
          f"{'valkey TTFT':>12} {'per block':>10}")
    try:
        for layout in LAYOUTS:
            disk = tempfile.mkdtemp(prefix="bench-kvq-")
            engines = {"disk": LLMEngine("smollm2", dtype="float32", kv_cache_dtype=layout,
                                         block_size=16, kv_disk=disk),
                       "valkey": LLMEngine("smollm2", dtype="float32", kv_cache_dtype=layout,
                                           block_size=16, kv_valkey=valkey.url)}  # fmt: skip
            rng = random.Random(1)
            vocab = engines["disk"].model_config.vocab_size
            times: dict[str, list[float]] = {"ram": [], "disk": [], "valkey": []}
            for r in range(args.repeats):
                for name, engine in engines.items():
                    prompt = [rng.randrange(3, vocab - 16) for _ in range(2048 + 16)]
                    _one(engine, f"c{r}", prompt)
                    assert engine.flush_tiers(120)
                    if name == "disk":
                        times["ram"].append(_one(engine, f"r{r}", prompt)[0])
                    assert engine.reset_prefix_cache()
                    seconds, cached = _one(engine, f"t{r}", prompt)
                    assert cached == 2048, (layout, name, cached)
                    times[name].append(seconds)
            med = {k: statistics.median(v) for k, v in times.items()}
            record = engines["disk"].tiers.offload.store.identity.payload_bytes
            row = {"record_bytes": record, **{f"{k}_ttft_s": v for k, v in med.items()},
                   **{f"{k}_per_block_ms": 1000 * (med[k] - med["ram"]) / 128
                      for k in ("disk", "valkey")}}  # fmt: skip
            out[layout] = row
            print(f"  {layout:<10} {record:>8,}B {med['ram']:>8.3f}s {med['disk']:>9.3f}s "
                  f"{row['disk_per_block_ms']:>8.3f}ms {med['valkey']:>11.3f}s "
                  f"{row['valkey_per_block_ms']:>8.3f}ms")
            for engine in engines.values():
                engine.close()
    finally:
        valkey.stop()
    return out


# -- traces ------------------------------------------------------------------------------------


def _simulate(trace: str, extra: list[str]) -> list[dict[str, Any]]:
    from prefixcache.sim import cli as sim_cli

    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    with tempfile.TemporaryDirectory() as out:
        args = parser.parse_args([trace, "--prefix-cache", "hash", "--no-plots",
                                  "--no-progress", "--out", out, *extra])  # fmt: skip
        with open(os.devnull, "w") as quiet:
            stdout, sys.stdout = sys.stdout, quiet
            try:
                sim_cli.run(args)
            finally:
                sys.stdout = stdout
        rows: list[dict[str, Any]] = json.loads(Path(out, "results.json").read_text())["results"]
    return rows


def _replay(engine: Any, prompts: list[list[int]]) -> dict[str, float]:
    """Each request's prompt (its hash ids as tokens: equal id prefixes, equal token prefixes)
    and one token more, one request at a time: the hit rate and times to first token."""
    ttft, cached, total = [], 0, 0
    for i, ids in enumerate(prompts):
        prompt = ids + [7]
        seconds, hit = _one(engine, f"t{i}", prompt)
        ttft.append(seconds)
        cached, total = cached + hit, total + len(prompt)
    ttft.sort()
    return {"hit_rate": cached / total, "ttft_p50_s": ttft[len(ttft) // 2],
            "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], "requests": len(ttft)}


def bench_traces(args: argparse.Namespace) -> dict[str, Any]:
    from prefixcache.engine import LLMEngine
    from prefixcache.sim.loader import load_trace

    out: dict[str, Any] = {}
    traces = {"mooncake conversation": str(TRACES / "mooncake" / "conversation_trace.jsonl"),
              "agentic (WEKA)": str(TRACES / "weka-kv-cache-tester")}  # fmt: skip
    print(f"\ntraces through the simulator: {args.sim_gib:g} GiB of KV (agentic: "
          f"{args.agentic_gib:g}), an 8B Llama's 131,072 bytes per token in bfloat16, hash, LRU, "
          "sequential")
    for name, path in traces.items():
        gib = args.sim_gib if name.startswith("mooncake") else args.agentic_gib
        rows = _simulate(path, ["--kv-cache-dtype", ",".join(LAYOUTS),
                                "--kv-cache-gib", str(gib)])  # fmt: skip
        for row in rows:
            key = f"sim|{name}|{row['capacity_label']}"
            out[key] = {k: row.get(k) for k in ("hit_ratio", "ttft_p50_s", "ttft_p99_s")}
            print(f"  {name:<24} {row['capacity_label']:<16} hit {row['hit_ratio']:.3f}  "
                  f"TTFT p50 {1000 * row['ttft_p50_s']:7.1f} ms  p99 "
                  f"{1000 * row['ttft_p99_s']:8.1f} ms")
    # two agentic conversations interleaved, each hash id one token: their latest prompts
    # (about 3,100 tokens) fit the pool in bfloat16 and below, not in float32
    agentic = [load_trace(str(TRACES / "weka-kv-cache-tester" / f"trace_000{i}.json")).requests
               for i in (1, 2)]  # fmt: skip
    requests = [r for pair in zip(*agentic, strict=False) for r in pair]
    print(f"\nagentic traces 0001 and 0002 through the engine, interleaved ({len(requests)} "
          f"requests; SmolLM2 float32, {args.trace_memory >> 20} MiB of KV, each hash id one "
          "token, prompts cut at 2,048)")
    for layout in LAYOUTS:
        engine = LLMEngine("smollm2", dtype="float32", kv_cache_dtype=layout, block_size=16,
                           kv_cache_memory_bytes=args.trace_memory, max_num_seqs=64)
        row = _replay(engine, [[3 + h % 40000 for h in r.hash_ids][:2048] for r in requests])
        out[f"engine|agentic|{layout}"] = row
        print(f"  {layout:<10} {engine.cache.num_blocks:>5} blocks  hit {row['hit_rate']:.3f}  "
              f"TTFT p50 {1000 * row['ttft_p50_s']:7.1f} ms  p99 "
              f"{1000 * row['ttft_p99_s']:8.1f} ms")
        engine.close()
    return out


def _block_tokens(hash_id: int, block_size: int, vocab: int) -> list[int]:
    """The tokens of one Mooncake hash id: a block of its own (the trace's ids name blocks;
    equal ids, equal tokens, and no two ids alike)."""
    rng = random.Random(hash_id)
    return [rng.randrange(3, vocab) for _ in range(block_size)]


def bench_mooncake_engine(args: argparse.Namespace) -> dict[str, Any]:
    from prefixcache.engine import LLMEngine
    from prefixcache.sim.loader import load_trace

    trace = load_trace(str(TRACES / "mooncake" / "conversation_trace.jsonl"))
    requests = trace.requests[: args.mooncake_requests]
    size = args.mooncake_block
    print(f"\nthe Mooncake conversation trace's first {len(requests)} requests through the engine "
          f"(SmolLM2 float32, {args.mooncake_memory >> 20} MiB of KV, each hash id one "
          f"{size}-token block of its own, one request at a time)")
    out: dict[str, Any] = {}
    prompts: list[list[int]] = []
    for layout in LAYOUTS:
        engine = LLMEngine("smollm2", dtype="float32", kv_cache_dtype=layout, block_size=size,
                           kv_cache_memory_bytes=args.mooncake_memory, max_num_seqs=64)
        vocab = engine.model_config.vocab_size
        prompts = prompts or [[t for h in r.hash_ids for t in _block_tokens(h, size, vocab)]
                              for r in requests]  # fmt: skip
        row = _replay(engine, prompts)
        out[f"engine|mooncake|{layout}"] = row
        print(f"  {layout:<10} {engine.cache.num_blocks:>5} blocks  hit {row['hit_rate']:.3f}  "
              f"TTFT p50 {1000 * row['ttft_p50_s']:7.1f} ms  p99 "
              f"{1000 * row['ttft_p99_s']:8.1f} ms")
        engine.close()
    return out


PARTS = {"attention": bench_attention, "fidelity": bench_fidelity, "llamacpp": bench_llamacpp,
         "capacity": bench_capacity, "restore": bench_restore, "traces": bench_traces,
         "mooncake": bench_mooncake_engine}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seqs", type=int, default=4, help="attention: decode sequences")
    parser.add_argument("--layers", type=int, default=4, help="attention: layers' caches")
    parser.add_argument("--memory", type=int, default=512 << 20, help="KV bytes (capacity)")
    parser.add_argument("--sim-gib", type=float, default=640.0, help="traces: simulated KV GiB")
    parser.add_argument("--llama-perplexity", default=None, metavar="BIN",
                        help="llamacpp: llama.cpp's llama-perplexity, to run its side too")
    parser.add_argument("--trace-memory", type=int, default=96 << 20,
                        help="traces: the engine's KV bytes")
    parser.add_argument("--agentic-gib", type=float, default=64.0,
                        help="traces: simulated KV GiB for the agentic traces")
    parser.add_argument("--mooncake-requests", type=int, default=1000,
                        help="mooncake: the trace's first N requests through the engine")
    parser.add_argument("--mooncake-memory", type=int, default=512 << 20,
                        help="mooncake: the engine's KV bytes")
    parser.add_argument("--mooncake-block", type=int, default=4,
                        help="mooncake: tokens per hash id (the engine's block size)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"bench_kv_quant on {cpu_name()}, {args.threads} threads, load average "
          f"{os.getloadavg()[0]:.2f}, torch {torch.__version__}")
    results = {name: PARTS[name](args) for name in args.parts.split(",")}
    print(json.dumps({"cpu": cpu_name(), "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
