"""The scheduler's data: a request as it sees it (its sequence, its place in the queues, its n
choices), and what one step decided (the chunks to compute, in batch order, and the block work,
copies and zeroing, the runner does before it).

One `SchedRequest` is one sequence of tokens. A request with ``n > 1`` is one request until its
prompt is computed; then the scheduler forks ``n - 1`` children (``index`` 1..n-1) that share its
blocks, each made by `spawn`, which a driver's own request type overrides (the engine's adds its
sampling state, the simulator's its trace record). Nothing here knows tensors or sampling.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from prefixcache.cache import Sequence

__all__ = ["FINISH_REASONS", "RequestStatus", "SchedRequest", "ScheduledChunk", "SchedulerOutput"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # a lower tier is reading its blocks
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


@dataclass(slots=True, eq=False)
class SchedRequest:
    """Scheduling state of one sequence. ``seq.token_ids`` = prompt + generated tokens.

    ``domain`` is its domain (a tenant or trusted group) for fair sharing ("" single-tenant);
    ``arrival_index`` orders admission (FCFS; children inherit their parent's);
    ``num_cached_tokens`` is the prompt prefix served from the cache at first admission.
    ``prompt_logits``: the driver needs the logits at every prompt position (prompt logprobs),
    so each prefill chunk of this request returns a row per token, not only its last.
    """

    request_id: str
    seq: Sequence
    n: int = field(default=1, kw_only=True)
    domain: str = field(default="", kw_only=True)
    arrival_index: int = field(default=0, kw_only=True)
    arrival_step: int = field(default=0, kw_only=True)
    status: RequestStatus = field(default=RequestStatus.WAITING, kw_only=True)
    num_cached_tokens: int = field(default=-1, kw_only=True)
    num_preemptions: int = field(default=0, kw_only=True)
    index: int = field(default=0, kw_only=True)
    forked: bool = field(default=False, kw_only=True)  # n > 1: children were forked
    parent: SchedRequest | None = field(default=None, kw_only=True)
    children: list[SchedRequest] = field(default_factory=list, kw_only=True)
    prompt_logits: bool = field(default=False, kw_only=True)

    def spawn(self, index: int, seq: Sequence) -> SchedRequest:
        """Choice ``index`` of this request, on ``seq`` (forked from this one's)."""
        return SchedRequest(self.request_id, seq, **self.child_fields(index))

    def child_fields(self, index: int) -> dict[str, Any]:
        """What a forked child inherits (for `spawn` overrides)."""
        return dict(
            n=self.n, domain=self.domain, arrival_index=self.arrival_index, index=index,
            arrival_step=self.arrival_step, status=RequestStatus.RUNNING, forked=True,
            num_cached_tokens=self.num_cached_tokens, parent=self,
        )  # fmt: skip

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
    def reserved_seqs(self) -> int:
        """Sequences this request will occupy: with n > 1, room for its children too."""
        return 1 if self.forked else self.n

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
    def choices(self) -> list[SchedRequest]:
        """This request and its forked children, by index (call on the parent)."""
        return [self, *self.children]

    @property
    def all_finished(self) -> bool:
        """Every choice is finished (a parent not yet forked counts its future children)."""
        if self.n > 1 and not self.forked and not self.is_finished:
            return False
        return all(r.is_finished for r in self.choices)


@dataclass(slots=True)
class ScheduledChunk:
    """``num_new_tokens`` tokens of ``request`` after its ``num_computed_tokens`` computed ones."""

    request: SchedRequest
    num_computed_tokens: int
    num_new_tokens: int
    block_table: list[int]
    # the chunk reaches the end of the sequence: its last logits give the next token
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        end = self.num_computed_tokens + self.num_new_tokens
        self.samples = end == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.request.seq.token_ids[start : start + self.num_new_tokens]

    @property
    def is_prefill(self) -> bool:
        """Computes prompt tokens (else one decode token)."""
        return self.num_computed_tokens < self.request.num_prompt_tokens

    @property
    def logits_every_token(self) -> bool:
        """The runner returns a logits row for each of this chunk's tokens (prompt logprobs)."""
        return self.request.prompt_logits and self.is_prefill


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: chunks in batch order, plus block copies/zeroing to do before it.

    ``admission_blocked``: requests were waiting and none could start this step (no room).
    """

    step: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_zero: list[int] = field(default_factory=list)
    preempted: list[SchedRequest] = field(default_factory=list)
    num_deferred: int = 0  # waiting requests held back by in-batch dedup
    num_admitted: int = 0
    admission_blocked: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
