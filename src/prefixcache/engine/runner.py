"""Execute one scheduled step on the model: block copies, zeroing, one flattened forward pass.

The runner owns the paged KV tensors. It sees block ids (tables, copies, blocks to zero), never
hashes or cache policy: copy-on-write and zero-on-reuse instructions come from the cache through
the `SchedulerOutput` and are executed *before* the step's KV writes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from prefixcache.attention import AttentionMetadata, PagedKVCache
from prefixcache.sched import SchedulerOutput

if TYPE_CHECKING:
    from prefixcache.engine.lora import LoraRegistry

__all__ = ["ModelRunner", "PrefillSpeed", "StepLogits"]


@dataclass(slots=True)
class StepLogits:
    """One step's logits: ``last`` [num_chunks, vocab] at each chunk's last token, and
    ``every_token[i]`` [num_new_tokens, vocab] for chunk i where it asked for every token."""

    last: torch.Tensor
    every_token: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class PrefillSpeed:
    """Seconds per prompt token computed, measured over the steps that computed any: a step's
    whole time over its prompt tokens, so the decode tokens riding along make a busy engine's
    prefill slower, as a new request there finds it. Sums decay by ``decay`` per step, so the
    figure follows the recent steps; the first step (kernels warming up) is left out."""

    decay: float = 0.98
    seconds: float = 0.0
    tokens: float = 0.0
    num_steps: int = 0

    def add(self, seconds: float, num_tokens: int) -> None:
        self.num_steps += 1
        if self.num_steps > 1:
            self.seconds = self.seconds * self.decay + seconds
            self.tokens = self.tokens * self.decay + num_tokens

    @property
    def s_per_token(self) -> float:
        """0.0 until measured."""
        return self.seconds / self.tokens if self.tokens else 0.0


class ModelRunner:
    """Runs the model over a step's chunks, all tokens flattened into one batch; measures its
    prefill speed (`PrefillSpeed`)."""

    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache) -> None:
        self.model = model
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        self.kv_cache = kv_cache
        self.prefill_speed = PrefillSpeed()
        self.loras: LoraRegistry | None = None  # the LoRA adapters the rows run under

    def execute_step(self, out: SchedulerOutput) -> StepLogits:
        """The step's logits: at each chunk's last token, and at every token of the chunks
        whose request needs prompt logprobs (`ScheduledChunk.logits_every_token`)."""
        started = time.perf_counter()
        logits = self._execute(out)
        num_prompt_tokens = sum(c.num_new_tokens for c in out.chunks if c.is_prefill)
        if num_prompt_tokens:
            self.prefill_speed.add(time.perf_counter() - started, num_prompt_tokens)
        return logits

    def _execute(self, out: SchedulerOutput) -> StepLogits:
        # zero first: a freshly reused block may also be a copy-on-write destination
        self.kv_cache.zero_blocks(out.blocks_to_zero)
        self.kv_cache.copy_blocks(out.block_copies)
        if out.is_empty:
            return StepLogits(torch.empty((0, 0)))
        token_ids: list[int] = []
        for chunk in out.chunks:
            token_ids.extend(chunk.token_ids)
        every = [c.logits_every_token for c in out.chunks]
        metadata = AttentionMetadata.build(
            [c.block_table for c in out.chunks],
            [c.num_computed_tokens for c in out.chunks],
            [c.num_new_tokens for c in out.chunks],
            self.block_size,
            device=self.device,
            every_token=every,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        lora = self.loras.step(out.chunks) if self.loras is not None else None
        logits: torch.Tensor = self.model(input_ids, metadata.positions, self.kv_cache, metadata,
                                          lora=lora)
        if not any(every):
            return StepLogits(logits)
        rows = metadata.last_logits_rows
        step = StepLogits(logits.index_select(0, torch.tensor(rows, device=logits.device)))
        for i, chunk in enumerate(out.chunks):
            if every[i]:
                step.every_token[i] = logits[rows[i] - chunk.num_new_tokens + 1 : rows[i] + 1]
        return step
