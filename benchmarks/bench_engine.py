"""Shared-prefix serving: the engine with the prefix cache on vs off, vs transformers `generate`.

Question: on the `small` preset, 16 requests share a 1,920-token prefix and each adds a distinct
128-token suffix, 16 output tokens each, all arriving at once. How much faster is the whole batch
(and its mean TTFT) with the prefix cache on than off, next to the ideal speedup — the ratio of
model FLOPs computed without and with reuse (bench_model.py's cost model: per token 2P linear FLOPs
plus 4*L*d*position attention FLOPs, summed over every computed token, decode included) — and how
does it compare with Hugging Face transformers' `generate`, one request at a time?

Each repeat runs cache-on, cache-off and transformers back to back (cache reset first, so every
cache-on run computes the prefix once); a short warm-up run comes first; medians are reported.
Prints a table and a final JSON line. Usage: python benchmarks/bench_engine.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from prefixcache.engine import LLMEngine, SamplingParams
from prefixcache.model.host_memory import retain_freed_memory
from prefixcache.model.loader import LoadedModel, load_model


@dataclass(slots=True)
class RunResult:
    total_s: float
    mean_ttft_s: float
    outputs: list[list[int]]


def make_prompts(vocab: int, num: int, prefix_len: int, suffix_len: int) -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab - 16) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, vocab - 16) for _ in range(suffix_len)] for _ in range(num)]


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> RunResult:
    if not engine.reset_prefix_cache():
        raise RuntimeError("the engine still holds requests")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.monotonic()
    requests = [
        engine.add_request(f"b{i}", prompt_token_ids=p, sampling_params=params, arrival_time=start)
        for i, p in enumerate(prompts)
    ]
    while engine.has_unfinished():
        engine.step()
    total = time.monotonic() - start
    ttfts = [r.timing.ttft for r in requests]
    return RunResult(total, statistics.mean(ttfts), [r.output_token_ids for r in requests])


class HFReference:
    """transformers `generate`, one request at a time, greedy, exactly ``max_tokens`` tokens."""

    def __init__(self, loaded: LoadedModel) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(loaded.path), dtype=torch.float32
        )
        self.model.eval()

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_tokens: int) -> RunResult:
        start = time.monotonic()
        ttfts, outputs = [], []
        for prompt in prompts:
            clock = _FirstTokenClock()
            ids = torch.tensor([prompt])
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                streamer=clock,
                pad_token_id=0,
            )
            ttfts.append(clock.first_token_time - start)
            outputs.append(out[0, len(prompt) :].tolist())
        return RunResult(time.monotonic() - start, statistics.mean(ttfts), outputs)


class _FirstTokenClock:
    """A generate() streamer that notes when the first new token appears (the prompt comes
    first, as one put)."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_time = float("nan")

    def put(self, value: torch.Tensor) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_token_time = time.monotonic()

    def end(self) -> None:
        pass


def workload_flops(
    loaded: LoadedModel, num: int, prompt_len: int, cached: int, max_tokens: int
) -> float:
    """FLOPs of the batch when ``cached`` prompt tokens of all but the first request are reused."""
    c = loaded.config
    linear = sum(
        p.numel()
        for name, p in loaded.model.named_parameters()
        if p.dim() == 2 and "embed" not in name and "lm_head" not in name
    )
    attn = c.num_hidden_layers * c.num_attention_heads * c.head_dim

    def span(a: int, b: int) -> float:  # tokens at positions a..b-1
        return 2 * linear * (b - a) + 2 * attn * (b * b - a * a)

    end = prompt_len + max_tokens - 1  # the last sampled token is never fed back
    first = span(0, end)
    others = span(cached, end)
    return first + (num - 1) * others


def warm_up(engines: list[LLMEngine], hf: HFReference | None, vocab: int) -> None:
    prompts = make_prompts(vocab, 2, 64, 16)
    for engine in engines:
        run_engine(engine, prompts, 4)
    if hf is not None:
        hf.run(prompts[:1], 4)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # as `prefixcache serve` does
    loaded = load_model(args.model)
    prompts = make_prompts(loaded.config.vocab_size, args.requests, args.prefix, args.suffix)
    prompt_len = args.prefix + args.suffix
    num_blocks = args.requests * -(-(prompt_len + args.max_tokens) // args.block_size) + 8
    engines = {
        name: LLMEngine(
            loaded,
            block_size=args.block_size,
            num_kv_blocks=num_blocks,
            enable_prefix_caching=on,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        for name, on in (("on", True), ("off", False))
    }
    hf = None if args.skip_hf else HFReference(loaded)
    warm_up(list(engines.values()), hf, loaded.config.vocab_size)
    results: dict[str, list[RunResult]] = {"on": [], "off": [], "hf": []}
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            results[name].append(run_engine(engine, prompts, args.max_tokens))
            _progress(repeat, name, results[name][-1])
        if hf is not None:
            results["hf"].append(hf.run(prompts, args.max_tokens))
            _progress(repeat, "hf", results["hf"][-1])
    cached = args.prefix // args.block_size * args.block_size
    ideal = workload_flops(loaded, args.requests, prompt_len, 0, args.max_tokens) / workload_flops(
        loaded, args.requests, prompt_len, cached, args.max_tokens
    )
    return summarise(args, results, ideal, engines["on"].stats())


def _progress(repeat: int, name: str, result: RunResult) -> None:
    print(f"repeat {repeat} {name}: {result.total_s:.2f} s", file=sys.stderr, flush=True)


def _median(runs: list[RunResult], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in runs) if runs else float("nan")


def summarise(args: argparse.Namespace, results: dict, ideal: float, on_stats: dict) -> dict:
    total = {k: _median(v, "total_s") for k, v in results.items()}
    ttft = {k: _median(v, "mean_ttft_s") for k, v in results.items()}
    speedup = total["off"] / total["on"]
    same = results["on"][-1].outputs == results["off"][-1].outputs
    hf_same = (
        sum(
            a == b
            for a, b in zip(results["on"][-1].outputs, results["hf"][-1].outputs, strict=True)
        )
        if results["hf"]
        else None
    )
    return {
        "bench": "engine_shared_prefix",
        "model": args.model,
        "threads": args.threads,
        "requests": args.requests,
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "total_s": {k: round(v, 3) for k, v in total.items()},
        "mean_ttft_s": {k: round(v, 3) for k, v in ttft.items()},
        "speedup_on_vs_off": round(speedup, 2),
        "speedup_ideal": round(ideal, 2),
        "fraction_of_ideal": round(speedup / ideal, 3),
        "speedup_on_vs_hf": round(total["hf"] / total["on"], 2) if results["hf"] else None,
        "outputs_on_equal_off": same,
        "outputs_equal_hf": hf_same,
        "hit_tokens_last_run": on_stats["hit_tokens"],
        "deferred_by_dedup": on_stats["deferred_by_dedup"],
    }


def print_table(s: dict) -> None:
    print(
        f"{s['requests']} requests, {s['prefix_tokens']}-token shared prefix + "
        f"{s['suffix_tokens']}-token suffixes, {s['max_tokens']} output tokens, "
        f"model={s['model']}, threads={s['threads']}, median of {s['repeats']}"
    )
    print(f"{'run':<28}{'total s':>10}{'mean TTFT s':>14}")
    names = {"on": "engine, prefix cache on", "off": "engine, prefix cache off"}
    names["hf"] = "transformers generate (1x1)"
    for key, label in names.items():
        print(f"{label:<28}{s['total_s'][key]:>10.2f}{s['mean_ttft_s'][key]:>14.2f}")
    print(
        f"speedup on/off {s['speedup_on_vs_off']:.2f}x vs ideal {s['speedup_ideal']:.2f}x "
        f"-> {100 * s['fraction_of_ideal']:.0f}% of ideal; on vs transformers "
        f"{s['speedup_on_vs_hf']}x; outputs on == off: {s['outputs_on_equal_off']}, "
        f"== transformers: {s['outputs_equal_hf']}/{s['requests']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=1920)
    parser.add_argument("--suffix", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    summary = run(args)
    print_table(summary)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
