"""What the engine hands back: per-step increments (`RequestOutput`) and, for the offline `LLM`,
whole results (`GenerationOutput` of `CompletionOutput` choices). Plain data, no tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixcache.attention.kv_cache import PagedKVCache
    from prefixcache.cache import PrefixCache
    from prefixcache.engine.request import Request
    from prefixcache.sched import SchedulerOutput

__all__ = [
    "CompletionOutput",
    "best_of",
    "EngineLimits",
    "EngineSnapshot",
    "GenerationOutput",
    "RequestOutput",
]


@dataclass(slots=True)
class RequestOutput:
    """What one step added to one choice of a request (``index`` among its ``n``).

    ``text`` is the new text only (stop strings cut, a possible stop-string prefix held back
    until it is decided). ``request_finished`` is True on the last output of the whole request.
    ``error`` says why a request ended with finish reason ``"error"`` (a failure inside the step
    that touched this request alone; no prompt text in it). ``new_logprobs``: per new token,
    ``{"token_id", "logprob", "top": {id: logprob}}`` when logprobs were asked for;
    ``prompt_logprobs`` (on a choice's first output, when asked for): per prompt position, None
    for the first, else the same shape for that prompt token; ``cumulative_logprob``: of the
    choice's tokens so far, when logprobs or a ``best_of`` ranking need it.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    request_finished: bool = False
    new_logprobs: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | None = None  # a stop not by EOS, stop string or token: the grammar's
    # of num_cached_tokens, those a lower tier (disk, Valkey) supplied; None: no lower tier
    num_external_cached_tokens: int | None = None
    # on a choice's finished output: (arrival, first scheduled, first token, finish) instants,
    # time.monotonic() seconds (None where it did not happen)
    timing: tuple[float, float | None, float | None, float | None] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One finished choice."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict[str, Any]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | None = None


@dataclass(slots=True)
class GenerationOutput:
    """A finished request; ``token_ids``/``text``/``finish_reason`` are the first choice's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    ttft: float | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def best_of(cumulative_logprobs: list[float], n: int) -> list[int]:
    """The indices of the ``n`` choices with the highest cumulative log-probability, best first
    (ties: the lower index), as ``best_of`` returns them."""
    order = sorted(range(len(cumulative_logprobs)), key=lambda i: (-cumulative_logprobs[i], i))
    return order[:n]


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What an engine accepts: a server validates requests against these. ``precision``: what
    the model runs in (``dtype``, ``weights``, ``precision`` and, where ``--dtype auto`` chose
    it, ``dtype_auto``: the candidates' figures), for ``/v1/models``."""

    max_num_seqs: int
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    precision: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineView:
    """A read-only look inside an engine between steps (`LLMEngine.inspect`), for tools and
    benchmarks: the choices running and waiting now (copies of the queues), the latest step's
    batch, and the KV pool's levels. ``kv_cache`` is the paged KV storage itself and ``cache``
    the prefix cache over it (debugging tools read them; nothing outside the engine writes them
    but tests)."""

    running: tuple[Request, ...]
    waiting: tuple[Request, ...]
    last_batch: SchedulerOutput | None
    num_steps: int
    kv_cache_usage: float
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache: PagedKVCache
    cache: PrefixCache


@dataclass(slots=True)
class EngineSnapshot:
    """Engine figures after one step: cumulative counters and current levels."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    min_free_blocks: int = 0
    num_blocks: int = 0  # the KV pool's size
    num_cached_free_blocks: int = 0  # free blocks that still hold a cached prefix
    num_cached_blocks: int = 0  # hittable blocks (held or free)
    num_pinned_blocks: int = 0  # blocks pins hold
    num_steps: int = 0  # engine steps so far
    last_step_tokens: int = 0  # tokens the last step scheduled (prefill and decode)
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    preemptions: int = 0
    duplicate_blocks: int = 0
    # the step time per prompt token computed, recent steps (`PrefillSpeed`; 0.0: not yet)
    prefill_s_per_token: float = 0.0
    queued_prefill_tokens: int = 0  # prompt tokens running, waiting or loading, not computed

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
