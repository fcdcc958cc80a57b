"""Execute one scheduled step on the model: block copies, zeroing, one flattened forward pass.

The runner owns the paged KV tensors. It sees block ids (tables, copies, blocks to zero), never
hashes or cache policy: copy-on-write and zero-on-reuse instructions come from the cache through
the `SchedulerOutput` and are executed *before* the step's KV writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixcache.attention import AttentionMetadata, PagedKVCache
from prefixcache.sched import SchedulerOutput

__all__ = ["ModelRunner", "StepLogits"]


@dataclass(slots=True)
class StepLogits:
    """One step's logits: ``last`` [num_chunks, vocab] at each chunk's last token, and
    ``every_token[i]`` [num_new_tokens, vocab] for chunk i where it asked for every token."""

    last: torch.Tensor
    every_token: dict[int, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    """Runs the model over a step's chunks, all tokens flattened into one batch."""

    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache) -> None:
        self.model = model
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        self.kv_cache = kv_cache

    def execute_step(self, out: SchedulerOutput) -> StepLogits:
        """The step's logits: at each chunk's last token, and at every token of the chunks
        whose request needs prompt logprobs (`ScheduledChunk.logits_every_token`)."""
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
        logits: torch.Tensor = self.model(input_ids, metadata.positions, self.kv_cache, metadata)
        if not any(every):
            return StepLogits(logits)
        rows = metadata.last_logits_rows
        step = StepLogits(logits.index_select(0, torch.tensor(rows, device=logits.device)))
        for i, chunk in enumerate(out.chunks):
            if every[i]:
                step.every_token[i] = logits[rows[i] - chunk.num_new_tokens + 1 : rows[i] + 1]
        return step
