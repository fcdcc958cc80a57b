"""Many LoRA adapters in one batch: 4 adapters of rank 16 vs the same batch on the base alone.

Question: what does serving a batch whose requests run under 4 different adapters (rank 16,
every projection targeted: q, k, v, o, gate, up, down) cost next to the same batch on the base
model alone, for a decode step and for a prefill? Target (issue 54): at most 1.3x both, on
SmolLM2-135M and `bench_peers.py`'s shapes (``--shape synthetic``, ``qwen2`` or a JSON file:
random weights written once). The adapters run as the engine runs them: the base projection
once over every row, then each adapter's low-rank product over its own rows
(`prefixcache/native/lora.h`).

The adapters are written here as peft saves them (random A and B). Each repeat runs both cases
back to back, in alternating order: ``--seqs`` requests with ``--prompt-len``-token prompts (the
same prompts every time), prefilled untimed, then ``--steps`` decode steps timed one by one
(median step); and a prefill of ``--seqs`` prompts never seen before (whole steps of up to 2,048
tokens, timed to the last one). Medians over repeats; prints a table and one JSON line.

    .venv/bin/python benchmarks/bench_lora.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from prefixcache.engine import LLMEngine, LoRARequest, SamplingParams
from prefixcache.model.lora import TARGETS, target_shape

GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def write_adapter(engine: LLMEngine, path: Path, rank: int, seed: int) -> None:
    """An adapter of ``rank`` on every projection of every layer, as peft saves one."""
    config, gen = engine.model_config, torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name in TARGETS:
            in_features, out_features = target_shape(config, name)
            module = "self_attn" if name[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{module}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))


def prompts(vocab: int, num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(num)]


def add_all(engine: LLMEngine, batch: list[list[int]], params: SamplingParams, tag: str,
            loras: list[LoRARequest | None]) -> None:  # fmt: skip
    for i, p in enumerate(batch):
        engine.add_request(f"{tag}{i}", prompt_token_ids=p, sampling_params=params,
                           lora_request=loras[i % len(loras)])


def decode_step_time(engine: LLMEngine, batch: list[list[int]], loras: list[LoRARequest | None],
                     steps: int) -> float:  # fmt: skip
    """Median seconds of one decode step of ``len(batch)`` sequences, request i under
    ``loras[i % len(loras)]``."""
    add_all(engine, batch, SamplingParams(max_tokens=steps + 2, temperature=0.0,
                                          ignore_eos=True), "d", loras)  # fmt: skip

    def prefilling() -> bool:
        view = engine.inspect()
        return bool(view.waiting) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in view.running)

    while prefilling():
        engine.step()
    engine.step()  # every sequence has its first token: the next steps are pure decodes
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for i in range(len(batch)):
        engine.abort(f"d{i}")
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def prefill_time(engine: LLMEngine, batch: list[list[int]],
                 loras: list[LoRARequest | None]) -> float:  # fmt: skip
    start = time.perf_counter()
    add_all(engine, batch, GREEDY, "p", loras)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def model_of(args: argparse.Namespace) -> str:
    """``--model``, or the checkpoint of ``--shape`` (bench_peers.py's, written once)."""
    if args.shape is None:
        return str(args.model)
    import bench_peers
    from prefixcache.paths import cache_dir

    if args.shape.endswith(".json"):
        bench_peers.SHAPES[Path(args.shape).stem] = bench_peers._shape_config(Path(args.shape))
        args.shape = Path(args.shape).stem
    return bench_peers.checkpoint(args.shape, cache_dir() / "bench-models")


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    args.model = model_of(args)
    engine = LLMEngine(args.model, dtype=args.dtype, weight_dtype=args.weight_dtype,
                       enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                       max_num_seqs=args.seqs, max_num_batched_tokens=2048,
                       kv_cache_memory_bytes=1 << 30)  # fmt: skip
    loras: list[LoRARequest | None] = []
    for i in range(args.adapters):
        write_adapter(engine, root / f"a{i}", args.rank, seed=i)
        loras.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    cases: dict[str, list[LoRARequest | None]] = {"base": [None], "adapters": loras}
    vocab = engine.model_config.vocab_size
    batch = prompts(vocab, args.seqs, args.prompt_len, seed=0)
    for which in cases.values():  # warm-up: loads the adapters, builds the kernels
        decode_step_time(engine, batch, which, 2)
    decode: dict[str, list[float]] = {name: [] for name in cases}
    prefill: dict[str, list[float]] = {name: [] for name in cases}
    for repeat in range(args.repeats):
        order = list(cases) if repeat % 2 == 0 else list(reversed(cases))
        for name in order:
            decode[name].append(decode_step_time(engine, batch, cases[name], args.steps))
        for k, name in enumerate(order):
            fresh = prompts(vocab, args.seqs, args.prompt_len, seed=1000 + 2 * repeat + k)
            prefill[name].append(prefill_time(engine, fresh, cases[name]))
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    rows = {}
    for label, samples in (("decode step", decode), ("prefill", prefill)):
        base, adapted = statistics.median(samples["base"]), statistics.median(samples["adapters"])
        rows[label] = {"base_ms": 1e3 * base, "adapters_ms": 1e3 * adapted,
                       "ratio": adapted / base}  # fmt: skip
    return {"model": args.model, "dtype": args.dtype, "weight_dtype": args.weight_dtype,
            "threads": args.threads, "seqs": args.seqs, "prompt_len": args.prompt_len,
            "adapters": args.adapters, "rank": args.rank, "repeats": args.repeats,
            "steps": args.steps, "kernels": engine.kernels, "cases": rows}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--shape", default=None,
                        help="bench_peers.py's shape instead of --model: synthetic, qwen2, or "
                             "a JSON config file")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weight-dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        result = run(args, Path(root))
    print(f"\n{args.model} ({args.dtype}, weights {args.weight_dtype}), {args.seqs} sequences "
          f"spread over {args.adapters} adapters of rank {args.rank} vs the base alone, "
          f"{args.threads} threads, median of {args.repeats} repeats")
    print(f"{'':12} {'base ms':>10} {'adapters ms':>12} {'ratio':>7}")
    for name, row in result["cases"].items():
        print(f"{name:12} {row['base_ms']:10.1f} {row['adapters_ms']:12.1f} "
              f"{row['ratio']:6.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
