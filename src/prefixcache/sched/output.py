"""What one scheduler step decided: the chunks to compute, in batch order, and the block work
(copies, zeroing) the runner does before it."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.sched.request import SchedRequest

__all__ = ["ScheduledChunk", "SchedulerOutput"]


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
