"""A request as the engine tracks it: state, tokens, cache sequence, sampling stream, timing.

One `Request` is one sequence of tokens. A request with ``n > 1`` is one `Request` until its prompt
is computed; then the scheduler forks ``n - 1`` children (``index`` 1..n-1) that share its blocks.
The cache sees only ``request.seq``; tensors never appear here.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixcache.cache import Sequence
from prefixcache.engine.sampling_params import SamplingParams

__all__ = ["FINISH_REASONS", "Request", "RequestStatus", "RequestTiming"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # this request failed inside a step; the others went on

    @property
    def finished(self) -> bool:
        return self in FINISH_REASONS


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class RequestTiming:
    """Wall-clock instants (``time.monotonic()`` seconds); None until they happen."""

    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated. ``seq.token_ids`` = prompt + generated tokens."""

    request_id: str
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
    index: int = 0
    base_seed: int = 0  # choice i samples from derive_seed(base_seed, i)
    parent: Request | None = None
    forked: bool = False  # n > 1: children were forked after the prompt
    children: list[Request] = field(default_factory=list)  # choices 1..n-1, once forked
    domain: str = ""  # isolation domain (tenant or group) for fair sharing; "" single-tenant
    arrival_index: int = 0  # admission order key (FCFS); children inherit their parent's
    arrival_step: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = -1  # prompt tokens served from the cache at first admission
    num_preemptions: int = 0
    timing: RequestTiming = field(default_factory=RequestTiming)
    detokenizer: Any = None  # IncrementalDetokenizer, set by the engine
    text: str = ""
    num_text_emitted: int = 0  # characters of `text` already streamed
    num_tokens_emitted: int = 0  # output tokens already streamed
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def seq_id(self) -> str:
        return self.seq.seq_id

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.seq.num_tokens - self.seq.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.token_ids[: self.seq.num_prompt_tokens]

    @property
    def choices(self) -> list[Request]:
        """This request and its forked children, by index (call on the parent)."""
        return [self, *self.children]

    @property
    def all_finished(self) -> bool:
        """Every choice is finished (a parent not yet forked counts its future children)."""
        if self.params.n > 1 and not self.forked and not self.is_finished:
            return False
        return all(r.is_finished for r in self.choices)

    def append_output(self, token_id: int) -> None:
        self.seq.append(token_id)
        self.output_token_ids.append(token_id)
