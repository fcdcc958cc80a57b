"""What one HTTP request has produced so far: per prompt (one engine request each) and per choice.

`Job` gathers the engine's incremental outputs for one API call (several prompts of a batched
completions request share it), ranks ``best_of`` choices, sums usage, and carries the render
options (echo, logprobs, tools). Plain data; `job_runner.JobRunner` fills it, each API's
`Rendering` renders it. `PreparedJob` is what an API makes of a request body before it is queued.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from prefixcache.engine.outputs import RequestOutput, best_of
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.server import protocol
from prefixcache.server.protocol import JSONObject
from prefixcache.server.tenancy import Tenant
from prefixcache.server.tools import ToolCallStream

if TYPE_CHECKING:
    from prefixcache.server.async_engine import OutputQueue

__all__ = [
    "Choice", "Job", "PreparedJob", "Prompts", "PromptState", "RenderOptions", "Step",
    "finish_reason_of",
]  # fmt: skip


@dataclass(slots=True)
class Choice:
    """What one choice has produced so far."""

    text: str = ""
    reason: str | None = None
    num_output: int = 0
    logprobs: list[JSONObject] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    started: bool = False  # its first stream chunk (role, echoed prompt) went out
    text_offset: int = 0  # completions logprobs: where its next token starts in the text
    tool_stream: ToolCallStream = field(default_factory=ToolCallStream)
    stop_reason: str | None = None  # vLLM's field: why it stopped, beyond finish_reason


@dataclass(slots=True)
class PromptState:
    """One engine request: a prompt and its choices (``best_of`` of them, if given)."""

    request_id: str
    token_ids: list[int]
    text: str | None  # the prompt's text, for echo (decoded from ids where given as ids)
    choices: list[Choice]
    num_cached: int = 0
    num_external_cached: int | None = None  # of num_cached, from a lower tier (None: no tier)
    prompt_logprobs: list[JSONObject | None] | None = None
    done: bool = False
    num_cacheable: int = 0  # its full blocks' tokens, where its namespace caches (else 0)
    num_public: int = 0  # its leading tokens in public blocks (a declared public prefix's)

    @property
    def num_written(self) -> int:
        """Prompt tokens this request wrote to the cache: its full blocks past the hit."""
        return max(0, self.num_cacheable - self.num_cached)

    @property
    def num_public_cached(self) -> int:
        """Of the cached tokens, those read from public blocks."""
        return min(self.num_cached, self.num_public)


@dataclass(slots=True)
class RenderOptions:
    """How outputs are rendered: echo, logprobs, usage, choice count."""

    n: int = 1
    echo: bool = False
    echo_only: bool = False  # max_tokens 0 with echo: the prompt (and its logprobs) alone
    prefill_only: bool = False  # a prewarm: the prompt is computed and cached, nothing output
    logprobs: int | None = None  # completions: top-N per token; chat: top_logprobs
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage in every chunk
    tools: bool = False  # chat: the answer may hold tool calls, parsed out of its text
    # (num_tokens, ttl_s): cache breakpoints, pinned once the request is done (messages)
    pins: list[tuple[int, float]] = field(default_factory=list)


Prompts = list[tuple[list[int], str | None]]  # per prompt: its token ids, and its text if given


@dataclass(slots=True)
class PreparedJob:
    """A request body as the engine takes it: its prompts (token ids, and the text where one
    was given), sampling parameters and render options; ``retention_s``: pin each whole prompt
    for this long once it is done (OpenAI's ``prompt_cache_retention``)."""

    prompts: Prompts
    params: SamplingParams
    options: RenderOptions = field(default_factory=RenderOptions)
    retention_s: float | None = None


class Step(NamedTuple):
    """One engine output as a job took it in: of prompt ``prompt_index``, for ``choice``."""

    output: RequestOutput
    prompt_index: int
    choice: Choice


@dataclass(slots=True)
class Job:
    """One accepted HTTP request on its way through the engine."""

    public_id: str
    model: str
    created: int
    tenant: Tenant
    queue: OutputQueue
    prompts: list[PromptState]
    options: RenderOptions
    start: float
    by_id: dict[str, int] = field(default_factory=dict)
    first_token_time: float | None = None
    last_token_time: float | None = None  # when the latest output with tokens arrived
    max_tokens: int | None = None  # the request's output limit (for vLLM's histograms)
    num_added: int = 0  # engine requests accepted (each released once, by `JobRunner.finish`)
    released: bool = False

    def __post_init__(self) -> None:
        self.by_id = {p.request_id: i for i, p in enumerate(self.prompts)}

    @property
    def done(self) -> bool:
        return all(p.done for p in self.prompts[: self.num_added])

    def add(self, output: RequestOutput) -> tuple[int, Choice]:
        i = self.by_id[output.request_id]
        prompt = self.prompts[i]
        choice = prompt.choices[output.index]
        choice.text += output.text
        choice.num_output = output.num_output_tokens
        choice.logprobs.extend(output.new_logprobs)
        if output.cumulative_logprob is not None:
            choice.cumulative_logprob = output.cumulative_logprob
        if output.prompt_logprobs is not None:
            prompt.prompt_logprobs = output.prompt_logprobs
        if output.index == 0:
            prompt.num_cached = output.num_cached_tokens
            prompt.num_external_cached = output.num_external_cached_tokens
        if output.finished:
            choice.reason = finish_reason_of(output.finish_reason)
            choice.stop_reason = output.stop_reason
        if output.new_token_ids:
            self.last_token_time = time.monotonic()
            if self.first_token_time is None:
                self.first_token_time = self.last_token_time
        if output.request_finished:
            prompt.done = True
        return i, choice

    def ranked(self, prompt: PromptState) -> list[Choice]:
        """The choices to return: all, or the n best of ``best_of``."""
        if len(prompt.choices) == self.options.n:
            return prompt.choices
        order = best_of([c.cumulative_logprob for c in prompt.choices], self.options.n)
        return [prompt.choices[i] for i in order]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        if self.options.echo_only or self.options.prefill_only:
            return 0
        return sum(c.num_output for p in self.prompts for c in p.choices)

    @property
    def num_written(self) -> int:
        """Prompt tokens the job wrote to the cache (OpenAI's ``cache_write_tokens``)."""
        return sum(p.num_written for p in self.prompts)

    def usage(self) -> JSONObject:
        cached = sum(p.num_cached for p in self.prompts)
        return protocol.usage(self.num_prompt_tokens, self.num_output_tokens, cached,
                              self.num_external_cached, self.num_written, self.num_public_cached)

    @property
    def num_public_cached(self) -> int | None:
        """Cached prompt tokens read from public blocks (None: no prompt starts with any)."""
        if not any(p.num_public for p in self.prompts):
            return None
        return sum(p.num_public_cached for p in self.prompts)

    @property
    def num_external_cached(self) -> int | None:
        """Cached prompt tokens a lower tier supplied (None: the engine has no lower tier)."""
        parts = [p.num_external_cached for p in self.prompts]
        return None if all(p is None for p in parts) else sum(p or 0 for p in parts)

    @property
    def first_reason(self) -> str | None:
        return self.prompts[0].choices[0].reason


def finish_reason_of(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason
