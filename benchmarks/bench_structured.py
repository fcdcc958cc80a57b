"""Constrained decoding's cost: a decode step with JSON-Schema constraints vs without, side by side.

Question: on the real model's vocabulary (SmolLM2-135M, 49,152 tokens), how much does a
20-property JSON Schema constraint add to one decode step of 16 and of 64 sequences, and how long
does compiling that schema take, cold and warm (cached)? Target (issue: structured output):
<= 10% on a 64-sequence step; compile under 50 ms warm.

Each repeat runs both cases back to back (order alternating): ``--seqs`` requests with distinct
64-token prompts, prefilled untimed, then ``--steps`` decode steps timed one by one. The
constrained choices are mid-object throughout (the schema needs far more tokens than the steps).
``--libraries`` also times each grammar library that is installed (llguidance, xgrammar,
outlines-core) on its own: compile of the same schema, and the mask for one token along a random
valid path, on the tiny model's vocabulary and on SmolLM2's; the comparison behind the choice of
llguidance (docs/structured-output.md).

    .venv/bin/python benchmarks/bench_structured.py --repeats 5 [--libraries]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from typing import Any

import torch

from bench_sampling import decode_step_time  # same directory: the same timed step
from prefixcache.engine import LLMEngine, SamplingParams
from prefixcache.engine.sampling_params import StructuredOutputs


def schema20() -> dict[str, Any]:
    """20 properties: 16 scalars of four types, an enum, an array, a nested object, a bound."""
    kinds = ["string", "integer", "number", "boolean"]
    props: dict[str, Any] = {f"field_{i:02d}": {"type": kinds[i % 4]} for i in range(16)}
    props["status"] = {"enum": ["active", "inactive", "pending"]}
    props["tags"] = {"type": "array", "items": {"type": "string"}, "maxItems": 3}
    props["owner"] = {"type": "object", "additionalProperties": False,
                      "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                      "required": ["name", "age"]}
    props["score"] = {"type": "number", "minimum": 0}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def engine_cases(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    engine = LLMEngine(args.model, max_num_seqs=max(args.seqs), kv_cache_memory_bytes=1 << 30)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    spec = StructuredOutputs.of(json=schema20())
    t0 = time.perf_counter()
    engine.grammars.lltokenizer()
    tokenizer_ms = 1e3 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    engine.grammars.grammar(spec)
    cold_ms = 1e3 * (time.perf_counter() - t0)
    warm = []
    for _ in range(20):
        t0 = time.perf_counter()
        engine.grammars.matcher(spec)
        warm.append(1e3 * (time.perf_counter() - t0))
    free = SamplingParams(max_tokens=args.steps + 4, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.steps + 4, temperature=0.0, ignore_eos=True,
                                 structured_outputs=spec)
    rows = {}
    for num in args.seqs:
        prompts = [[rng.randrange(100, vocab - 100) for _ in range(64)] for _ in range(num)]
        decode_step_time(engine, prompts, free, 2)  # warm-up; caches the prompts
        samples: dict[str, list[float]] = {"off": [], "on": []}
        for repeat in range(args.repeats):
            pair = [("off", free), ("on", constrained)]
            for which, params in pair if repeat % 2 == 0 else pair[::-1]:
                samples[which].append(decode_step_time(engine, prompts, params, args.steps))
        off, on = statistics.median(samples["off"]), statistics.median(samples["on"])
        rows[f"{num} sequences"] = {"off_ms": 1e3 * off, "on_ms": 1e3 * on, "added": on / off - 1}
        print(f"{num} sequences done", file=sys.stderr)
    return {"tokenizer_build_ms": tokenizer_ms, "compile_cold_ms": cold_ms,
            "compile_warm_ms": statistics.median(warm), "steps": rows}


# ---- the libraries on their own ---------------------------------------------------------------


def _walk(mask_once: Any, consume: Any, allowed_of: Any, steps: int, seed: int) -> list[float]:
    """Time ``mask_once`` along a random valid path of ``steps`` tokens."""
    rng = random.Random(seed)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state = mask_once()
        times.append(time.perf_counter() - start)
        allowed = allowed_of(state)
        if not allowed or not consume(rng.choice(allowed)):
            break
    return times


def _bits(bitmask: torch.Tensor, vocab: int, eos: set[int]) -> list[int]:
    import numpy as np

    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab]
    ids = np.flatnonzero(bits).tolist()
    return [i for i in ids if i not in eos] or ids


def library_cases(model: str, steps: int) -> dict[str, Any]:
    from prefixcache.model.loader import load_model

    loaded = load_model(model)
    tok, vocab = loaded.tokenizer, loaded.config.vocab_size
    eos = set(tok.eos_token_ids)
    schema = json.dumps(schema20())
    out: dict[str, Any] = {}
    if importlib.util.find_spec("llguidance"):
        import llguidance

        t0 = time.perf_counter()
        lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab,
                                       eos_token=list(eos) or None)
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - t0
        mask = torch.empty((1, (vocab + 31) // 32), dtype=torch.int32)
        times = _walk(lambda: matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4),
                      matcher.consume_token, lambda _: _bits(mask[0], vocab, eos), steps, 0)
        out["llguidance"] = _summary(build, compile_s, times)
    if importlib.util.find_spec("xgrammar") and importlib.util.find_spec("transformers"):
        import transformers
        import xgrammar

        t0 = time.perf_counter()
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab,
                                                       stop_token_ids=list(eos))
        compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(schema)
        compile_s = time.perf_counter() - t0
        xm = xgrammar.GrammarMatcher(compiled)
        xmask = xgrammar.allocate_token_bitmask(1, vocab)
        times = _walk(lambda: xm.fill_next_token_bitmask(xmask), xm.accept_token,
                      lambda _: _bits(xmask[0], vocab, eos), steps, 0)
        out["xgrammar"] = _summary(build, compile_s, times)
    if importlib.util.find_spec("outlines_core"):
        from outlines_core import Guide, Index, Vocabulary, json_schema

        t0 = time.perf_counter()
        words: dict[str, list[int]] = {}
        for token_id in range(tok.vocab_size):
            if token_id not in eos:
                words.setdefault(tok.decode([token_id], skip_special_tokens=False),
                                 []).append(token_id)
        vocabulary = Vocabulary(min(eos), words)
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        guide = Guide(Index(json_schema.build_regex_from_schema(schema), vocabulary))
        compile_s = time.perf_counter() - t0
        times = _walk(guide.get_tokens, guide.advance,
                      lambda allowed: [t for t in allowed if t not in eos], steps, 0)
        out["outlines-core"] = _summary(build, compile_s, times)
    return out


def _summary(build_s: float, compile_s: float, times: list[float]) -> dict[str, float]:
    return {"tokenizer_ms": 1e3 * build_s, "compile_ms": 1e3 * compile_s,
            "mask_us_median": 1e6 * statistics.median(times), "tokens": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--libraries", action="store_true")
    args = parser.parse_args()
    result: dict[str, Any] = {"model": args.model, "threads": args.threads,
                              "repeats": args.repeats, "engine": engine_cases(args)}
    eng = result["engine"]
    print(f"\n{args.model}: 20-property JSON Schema; llguidance tokenizer "
          f"{eng['tokenizer_build_ms']:.0f} ms once, compile {eng['compile_cold_ms']:.1f} ms cold, "
          f"{eng['compile_warm_ms']:.2f} ms warm (cached grammar + new matcher)")
    print(f"{'decode step':16} {'free ms':>9} {'constrained ms':>15} {'added':>8}")
    for name, row in eng["steps"].items():
        print(f"{name:16} {row['off_ms']:9.1f} {row['on_ms']:15.1f} {100 * row['added']:7.1f}%")
    if args.libraries:
        result["libraries"] = {m: library_cases(m, 300) for m in ("tiny", args.model)}
        print(f"\n{'library':14} {'vocab':8} {'tokenizer ms':>13} {'compile ms':>11} "
              f"{'mask us/token':>14}")
        for model, libs in result["libraries"].items():
            for lib, row in libs.items():
                print(f"{lib:14} {model:8} {row['tokenizer_ms']:13.1f} {row['compile_ms']:11.2f} "
                      f"{row['mask_us_median']:14.1f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
