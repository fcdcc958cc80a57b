"""Synthetic workloads in trace form: shared system prompts, repeated prefixes, multi-turn chat,
few-shot, tree-of-thought, agentic loops, and a pinned system prompt beside a flooding tenant.

A generator describes each prompt as a list of *segments* (a content key and a token length);
`BlockIds` cuts the segment stream into blocks and names each complete block by its chain (parent
block and the pieces it contains), so two prompts share block ids exactly as far as their token
streams agree. Everything is seeded and deterministic. No caches, no files.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Hashable
from typing import Any

from prefixcache.sim.errors import TraceFormatError
from prefixcache.sim.trace import Trace, TraceRequest

Segment = tuple[Hashable, int]  # (content key, number of tokens)


class BlockIds:
    """Interns block chains to integer hash ids for one block size."""

    __slots__ = ("block_size", "_ids")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ids: dict[tuple[int, tuple[tuple[Hashable, int, int], ...]], int] = {}

    def hash_ids(self, segments: list[Segment]) -> list[int]:
        """Hash ids of the complete blocks of the concatenated segments."""
        bs, ids, out = self.block_size, self._ids, []
        parent, pieces, filled = -1, [], 0
        for key, length in segments:
            offset = 0
            while offset < length:
                take = min(length - offset, bs - filled)
                pieces.append((key, offset, offset + take))
                filled, offset = filled + take, offset + take
                if filled == bs:
                    parent = ids.setdefault((parent, tuple(pieces)), len(ids))
                    out.append(parent)
                    pieces, filled = [], 0
        return out


class _Builder:
    """Collects requests of one generated trace."""

    def __init__(self, name: str, block_size: int, seed: int) -> None:
        self.trace = Trace(name, block_size)
        self.block_ids = BlockIds(block_size)
        self.rng = random.Random(seed)

    def add(self, t: float, segments: list[Segment], output_length: int, group: str,
            tenant: str = "", pins: list[tuple[int, float]] | None = None) -> None:
        request_id = str(len(self.trace.requests))
        input_length = sum(length for _, length in segments)
        hash_ids = self.block_ids.hash_ids(segments)
        self.trace.requests.append(TraceRequest(request_id, t, input_length, output_length,
                                                hash_ids, group, tenant=tenant, pins=pins or []))

    def poisson_times(self, n: int, rate: float) -> list[float]:
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += self.rng.expovariate(rate)
        return out

    def done(self) -> Trace:
        self.trace.sort_by_arrival()
        return self.trace


def generated_shared_prefix(
    *,
    num_groups: int = 8,
    prompts_per_group: int = 32,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    rate: float = 8.0,
    block_size: int = 16,
    seed: int = 0,
) -> Trace:
    """SGLang's generated-shared-prefix: groups of questions behind one long system prompt each."""
    b = _Builder("generated-shared-prefix", block_size, seed)
    pairs = [(g, q) for g in range(num_groups) for q in range(prompts_per_group)]
    b.rng.shuffle(pairs)
    for t, (g, q) in zip(b.poisson_times(len(pairs), rate), pairs, strict=True):
        segments: list[Segment] = [(("sys", g), system_prompt_len), (("q", g, q), question_len)]
        b.add(t, segments, output_len, f"g{g}")
    return b.done()


def prefix_repetition(
    *,
    num_prefixes: int = 10,
    prefix_len: int = 1024,
    suffix_len: int = 256,
    num_requests: int = 320,
    output_len: int = 128,
    rate: float = 8.0,
    block_size: int = 16,
    seed: int = 0,
) -> Trace:
    """vLLM's prefix_repetition: a few prefixes repeated with random suffixes, shuffled."""
    b = _Builder("prefix-repetition", block_size, seed)
    for i, t in enumerate(b.poisson_times(num_requests, rate)):
        p = i % num_prefixes if i < num_prefixes else b.rng.randrange(num_prefixes)
        b.add(t, [(("prefix", p), prefix_len), (("suffix", i), suffix_len)], output_len, f"p{p}")
    return b.done()


def multi_turn(
    *,
    num_conversations: int = 32,
    turns: int = 6,
    system_len: int = 512,
    user_len: int = 128,
    output_len: int = 256,
    think_time_s: float = 10.0,
    rate: float = 1.0,
    block_size: int = 16,
    seed: int = 0,
) -> Trace:
    """Chat sessions: each turn's prompt is the whole history plus a new user message."""
    b = _Builder("multi-turn", block_size, seed)
    for c, start in enumerate(b.poisson_times(num_conversations, rate)):
        history: list[Segment] = [("system", system_len)]
        t = start
        for turn in range(turns):
            history.append((("user", c, turn), user_len))
            b.add(t, list(history), output_len, f"c{c}")
            history.append((("assistant", c, turn), output_len))
            t += think_time_s * (0.5 + b.rng.random())
    return b.done()


def few_shot(
    *,
    num_tasks: int = 4,
    shots: int = 8,
    instruction_len: int = 256,
    example_len: int = 192,
    question_len: int = 64,
    num_requests: int = 256,
    output_len: int = 64,
    rate: float = 8.0,
    block_size: int = 16,
    seed: int = 0,
) -> Trace:
    """Few-shot prompting: per task, a fixed instruction and example set, then a fresh question."""
    b = _Builder("few-shot", block_size, seed)
    for i, t in enumerate(b.poisson_times(num_requests, rate)):
        task = b.rng.randrange(num_tasks)
        segments: list[Segment] = [(("instruction", task), instruction_len)]
        segments += [(("example", task, k), example_len) for k in range(shots)]
        segments.append((("question", i), question_len))
        b.add(t, segments, output_len, f"task{task}")
    return b.done()


def tree_of_thought(
    *,
    num_problems: int = 8,
    branching: int = 3,
    depth: int = 3,
    problem_len: int = 512,
    thought_len: int = 128,
    output_len: int = 128,
    step_s: float = 2.0,
    rate: float = 0.5,
    block_size: int = 16,
    seed: int = 0,
) -> Trace:
    """Tree-of-thought search: every node extends its parent's prompt with one more thought."""
    b = _Builder("tree-of-thought", block_size, seed)
    for p, start in enumerate(b.poisson_times(num_problems, rate)):
        frontier: list[tuple[Segment, ...]] = [((("problem", p), problem_len),)]
        for level in range(depth + 1):
            for path in frontier:
                b.add(start + level * step_s, list(path), output_len, f"p{p}")
            if level < depth:
                frontier = [
                    path + ((("thought", p, level, i, k), thought_len),)
                    for i, path in enumerate(frontier)
                    for k in range(branching)
                ]
    return b.done()


def agentic(
    *,
    num_sessions: int = 16,
    steps: int = 12,
    system_len: int = 4096,
    task_len: int = 256,
    tool_result_len: int = 512,
    output_len: int = 128,
    step_interval_s: float = 5.0,
    rate: float = 0.5,
    block_size: int = 16,
    seed: int = 0,
) -> Trace:
    """Agent loops: a shared system+tools prompt, then a growing log of actions and tool results."""
    b = _Builder("agentic", block_size, seed)
    for s, start in enumerate(b.poisson_times(num_sessions, rate)):
        context: list[Segment] = [("system+tools", system_len), (("task", s), task_len)]
        t = start
        for step in range(steps):
            b.add(t, list(context), output_len, f"s{s}")
            context.append((("action", s, step), output_len))
            tool_len = b.rng.randint(tool_result_len // 2, tool_result_len)
            context.append((("tool", s, step), tool_len))
            t += step_interval_s * (0.5 + b.rng.random())
    return b.done()


def pinned_prompt(
    *,
    system_len: int = 2048,
    question_len: int = 64,
    num_questions: int = 30,
    interval_s: float = 20.0,
    ttl_s: float = 300.0,
    flood_len: int = 512,
    flood_rate: float = 1.0,
    own_rate: float = 1.0,
    output_len: int = 64,
    block_size: int = 16,
    seed: int = 0,
) -> Trace:
    """Tenant ``app`` asks a question behind its long system prompt every ``interval_s`` seconds,
    with a ``cache_control`` breakpoint after the system prompt (``ttl_s``), and meanwhile sends
    one-off ``flood_len``-token prompts of its own at ``own_rate``/s; tenant ``flood`` sends
    distinct ``flood_len``-token prompts at ``flood_rate``/s. Replay it with ``--pins on,off``
    at a capacity the two floods overrun between questions to see the pin hold (the other
    tenant's flood alone does not evict it: each tenant keeps its fair share)."""
    b = _Builder("pinned-prompt", block_size, seed)
    for q in range(num_questions):
        t = q * interval_s
        b.add(t, [("system", system_len), (("q", q), question_len)], output_len, "app",
              tenant="app", pins=[(system_len, ttl_s)])
    span = num_questions * interval_s
    for tenant, rate in (("app", own_rate), ("flood", flood_rate)):
        if rate > 0:
            for i, t in enumerate(b.poisson_times(int(span * rate), rate)):
                b.add(t, [((tenant, i), flood_len)], output_len, tenant, tenant=tenant)
    return b.done()


GENERATORS: dict[str, Callable[..., Trace]] = {
    "generated-shared-prefix": generated_shared_prefix,
    "prefix-repetition": prefix_repetition,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "tree-of-thought": tree_of_thought,
    "agentic": agentic,
    "pinned-prompt": pinned_prompt,
}


def generate(name: str, params: str = "", block_size: int | None = None) -> Trace:
    """Build a named workload; ``params`` is ``"key=value,key=value"`` over its keywords."""
    fn = GENERATORS.get(name)
    if fn is None:
        raise TraceFormatError(
            f"unknown synthetic workload {name!r}; choose one of {', '.join(GENERATORS)}"
        )
    kwargs = parse_params(fn, params)
    if block_size is not None:
        kwargs["block_size"] = block_size
    try:
        return fn(**kwargs)
    except ValueError as exc:
        raise TraceFormatError(f"synthetic:{name}: {exc}") from exc


def parse_params(fn: Callable[..., Trace], params: str) -> dict[str, Any]:
    """``"turns=8,rate=2.5"`` -> typed keyword arguments of ``fn`` (types from its defaults)."""
    defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()}
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in params.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in defaults:
            raise TraceFormatError(f"bad workload parameter {item!r}; known: {', '.join(defaults)}")
        try:
            out[key] = type(defaults[key])(value)
        except ValueError as exc:
            raise TraceFormatError(f"bad value for {key}: {value!r}") from exc
    return out
