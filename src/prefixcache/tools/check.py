"""`prefixcache check`: the same greedy workload with the cache off and on, token for token.

Step 1 of debugging a serving incident: reproduce with the cache disabled. The workload runs once
with prefix caching disabled (the reference) and once per cache implementation (``hash``,
``radix``), in waves so that later requests hit what earlier ones cached, with every cache
invariant checked after each step. The first request and token position where an output differs
from the reference is reported, and the exit status is 1.

`run_check` takes an observer: ``step_hook`` (made once per cache-enabled run) is called with the
engine after every step; its tests use it to corrupt a cached block and see the check catch it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixcache.catalog import model_help
from prefixcache.errors import CliError

__all__ = [
    "BUILTIN_WORKLOAD",
    "CheckResult",
    "Divergence",
    "WorkItem",
    "compare",
    "load_workload",
    "run_check",
]

DEFAULT_MAX_TOKENS = 12
# small enough that integrity checks after every step stay cheap, large enough for the builtin
DEFAULT_NUM_KV_BLOCKS = 64

_SYSTEM = (
    "You are a support assistant for a storage company. Be concise and cite the policy section. "
    "Policy 1: refunds within 30 days. Policy 2: data is kept for 90 days after closure. "
)
_QUESTIONS = (
    "How long is my data kept?",
    "Can I get a refund after two weeks?",
    "What happens when I close my account?",
    "Do you keep backups of deleted files?",
    "How long is my data kept?",  # an exact repeat: a full-prefix hit
    "Is there a fee for early closure?",
)


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request of a workload."""

    prompt: str | list[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    cache_salt: str | None = None


def _builtin() -> list[WorkItem]:
    items = [WorkItem(_SYSTEM + "User: " + q + "\nAssistant:") for q in _QUESTIONS]
    turn = _SYSTEM + "User: " + _QUESTIONS[0] + "\nAssistant: 90 days.\nUser: "
    items += [WorkItem(turn + "And backups?"), WorkItem(turn + "And logs?\nAssistant:")]
    items += [WorkItem(_SYSTEM + "User: hello", cache_salt="tenant-b")] * 2
    return items


BUILTIN_WORKLOAD: list[WorkItem] = _builtin()


@dataclass(slots=True)
class Divergence:
    """Where one run's output first differs from the cache-disabled reference."""

    run: str
    request_index: int
    token_position: int
    expected_token: int | None
    actual_token: int | None
    num_cached_tokens: int


@dataclass(slots=True)
class RunOutput:
    """Per request: generated token ids and how many prompt tokens came from the cache."""

    name: str
    token_ids: list[list[int]]
    num_cached_tokens: list[int]
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class CheckResult:
    """All runs and the divergences found (empty: the cache is invisible in the outputs)."""

    runs: list[RunOutput]
    divergences: list[Divergence]

    @property
    def ok(self) -> bool:
        return not self.divergences


# ---- workload ---------------------------------------------------------------------------------


def load_workload(source: str) -> list[WorkItem]:
    """``builtin``, or a JSON list / JSONL file of prompts (text, token ids, or objects with
    ``prompt``, ``max_tokens``, ``cache_salt``)."""
    if source == "builtin":
        return list(BUILTIN_WORKLOAD)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read workload {source}: {exc}") from None
    raw = _parse(text, source)
    if not raw:
        raise CliError(f"workload {source} is empty")
    return [_item(entry, i, source) for i, entry in enumerate(raw)]


def _parse(text: str, source: str) -> list[Any]:
    try:
        value = json.loads(text)
        return value if isinstance(value, list) else [value]
    except json.JSONDecodeError:
        pass
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise CliError(f"workload {source} is neither JSON nor JSONL: {exc}") from None


def _item(entry: Any, index: int, source: str) -> WorkItem:
    if not isinstance(entry, dict):
        entry = {"prompt": entry}
    prompt, max_tokens = entry.get("prompt"), entry.get("max_tokens", DEFAULT_MAX_TOKENS)
    salt = entry.get("cache_salt")
    ok_prompt = isinstance(prompt, str) and prompt or _is_ids(prompt)
    if not ok_prompt or not isinstance(max_tokens, int) or max_tokens < 1:
        raise CliError(f"workload {source} item {index}: need a non-empty prompt, max_tokens >= 1")
    if salt is not None and not isinstance(salt, str):
        raise CliError(f"workload {source} item {index}: cache_salt must be a string")
    return WorkItem(prompt, max_tokens, salt)


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


# ---- runs -------------------------------------------------------------------------------------


if TYPE_CHECKING:  # torch: imported when a check runs, not for `--help`
    from prefixcache.engine.llm_engine import LLMEngine
    from prefixcache.model.loader import LoadedModel

StepHook = Callable[["LLMEngine"], None]


def run_workload(
    loaded: LoadedModel,
    items: list[WorkItem],
    name: str,
    prefix_cache: str | None,
    num_kv_blocks: int | None,
    wave_size: int = 4,
    hook: StepHook | None = None,
) -> RunOutput:
    """Run ``items`` greedy in waves of ``wave_size``; ``prefix_cache=None`` disables caching.
    ``hook`` sees the engine after every step (its KV events are kept for it)."""
    from prefixcache.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        loaded,
        num_kv_blocks=num_kv_blocks,
        enable_prefix_caching=prefix_cache is not None,
        prefix_cache=prefix_cache or "hash",
        check_integrity=True,
        kv_events=hook is not None,
    )
    out = RunOutput(name, [[] for _ in items], [0] * len(items))
    for start in range(0, len(items), wave_size):
        _run_wave(engine, items, range(start, min(start + wave_size, len(items))), out, hook)
    out.stats = {k: v for k, v in engine.stats().items() if isinstance(v, int | float)}
    return out


def _run_wave(
    engine: LLMEngine, items: list[WorkItem], indices: range, out: RunOutput, hook: StepHook | None
) -> None:
    from prefixcache.engine.sampling_params import SamplingParams

    for i in indices:
        item = items[i]
        params = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)
        ids = item.prompt if isinstance(item.prompt, list) else None
        prompt = item.prompt if isinstance(item.prompt, str) else None
        try:
            engine.add_request(
                str(i), prompt, params, cache_salt=item.cache_salt, prompt_token_ids=ids
            )
        except ValueError as exc:
            raise CliError(f"workload item {i}: {exc}") from None
    while engine.has_unfinished():
        for output in engine.step():
            index = int(output.request_id)
            out.token_ids[index].extend(output.new_token_ids)
            out.num_cached_tokens[index] = output.num_cached_tokens
        if hook is not None:
            hook(engine)


def compare(reference: RunOutput, run: RunOutput) -> Divergence | None:
    """The first request (in workload order) whose tokens differ, and where."""
    pairs = zip(reference.token_ids, run.token_ids, strict=True)
    for index, (expected, actual) in enumerate(pairs):
        if expected == actual:
            continue
        pos = next(
            (p for p, (x, y) in enumerate(zip(expected, actual, strict=False)) if x != y), None
        )
        pos = min(len(expected), len(actual)) if pos is None else pos
        return Divergence(
            run.name,
            index,
            pos,
            expected[pos] if pos < len(expected) else None,
            actual[pos] if pos < len(actual) else None,
            run.num_cached_tokens[index],
        )
    return None


def run_check(
    model: str | LoadedModel,
    items: list[WorkItem],
    num_kv_blocks: int | None = DEFAULT_NUM_KV_BLOCKS,
    implementations: tuple[str, ...] = ("hash", "radix"),
    step_hook: Callable[[], StepHook] | None = None,
) -> CheckResult:
    """Reference run with caching off, then one run per implementation, compared;
    ``step_hook()`` makes each cache-enabled run's observer."""
    from prefixcache.model.loader import load_model

    loaded = load_model(model) if isinstance(model, str) else model
    reference = run_workload(loaded, items, "cache off", None, num_kv_blocks)
    runs, divergences = [reference], []
    for impl in implementations:
        hook = step_hook() if step_hook is not None else None
        run = run_workload(loaded, items, f"{impl} cache", impl, num_kv_blocks, hook=hook)
        runs.append(run)
        divergence = compare(reference, run)
        if divergence is not None:
            divergences.append(divergence)
    return CheckResult(runs, divergences)


# ---- command ----------------------------------------------------------------------------------


def format_result(result: CheckResult, num_items: int) -> list[str]:
    lines = [f"check: {num_items} requests, greedy, cache off vs on"]
    for run in result.runs:
        hit = sum(run.num_cached_tokens)
        lines.append(
            f"  {run.name:<12} tokens {sum(map(len, run.token_ids)):>5}  cached prompt tokens "
            f"{hit:>5}  evictions {run.stats.get('evictions', 0)}  "
            f"preemptions {run.stats.get('preemptions', 0)}"
        )
    for d in result.divergences:
        lines.append(
            f"DIVERGENCE in {d.run}: request {d.request_index}, output token {d.token_position} "
            f"(expected {d.expected_token}, got {d.actual_token}; the request hit "
            f"{d.num_cached_tokens} cached prompt tokens)"
        )
    if result.ok:
        lines.append("OK: outputs are identical with the cache on and off")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help=model_help("tiny"))
    parser.add_argument("--workload", default="builtin", help="builtin, or a JSON/JSONL file")
    parser.add_argument(
        "--num-kv-blocks", type=int, default=DEFAULT_NUM_KV_BLOCKS, help="KV pool size (64)"
    )
    parser.add_argument(
        "--prefix-cache", default="hash,radix", help="implementations to check (hash,radix)"
    )


def run(args: argparse.Namespace) -> int:
    items = load_workload(args.workload)
    impls = tuple(s.strip() for s in args.prefix_cache.split(",") if s.strip())
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        raise CliError(f"--num-kv-blocks must be >= 1, got {args.num_kv_blocks}")
    try:
        result = run_check(args.model, items, args.num_kv_blocks, impls)
    except ValueError as exc:  # unknown model or implementation, a pool too small, ...
        raise CliError(str(exc)) from None
    for line in format_result(result, len(items)):
        print(line)
    return 0 if result.ok else 1
