"""Logits processors: what edits a step's logits before the sampler, as batched tensor operations.

`apply_logits_processors` takes the step's sampled rows and their requests and edits, in place,
only the rows whose request asks for a control: ``logit_bias``, ``min_tokens``,
``repetition_penalty``, ``frequency_penalty`` and ``presence_penalty`` (vLLM's semantics, in
that order; `SamplingParams` documents each). Every control is one scatter or gather over the
flat logits of all rows that use it, indexed by ``row * vocab + token``: the work grows with the
tokens a row has seen, never with the vocabulary times a Python loop. Rows with every control
neutral are not touched, so their logits (and a greedy argmax over them) stay bit-identical.

Knows a choice only through `ProcessorState` (its parameters and the tokens it has seen).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import torch

from prefixcache.engine.sampling_params import SamplingParams

__all__ = ["ProcessorState", "apply_logits_processors"]


class ProcessorState(Protocol):
    """What the processors read of one choice (the engine's `Request` is one)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...

    def unique_prompt_ids(self) -> torch.Tensor:
        """The prompt's distinct token ids (int64), built once per request."""
        ...


def apply_logits_processors(
    logits: torch.Tensor, states: Sequence[ProcessorState], eos_token_ids: Collection[int]
) -> torch.Tensor:
    """Edit ``logits`` [rows, vocab] (float, contiguous, owned by the caller) in place for the
    rows whose parameters ask for a control; returns it."""
    rows = [i for i, s in enumerate(states) if s.params.processes_logits]
    if not rows:
        return logits
    vocab = logits.shape[1]
    flat = logits.view(-1)
    _logit_bias(flat, vocab, [(i, states[i]) for i in rows if states[i].params.logit_bias])
    _min_tokens(flat, vocab, [(i, states[i]) for i in rows if _below_min_tokens(states[i])],
                eos_token_ids)
    _repetition(flat, vocab, [(i, states[i]) for i in rows
                              if states[i].params.repetition_penalty != 1.0])
    _frequency_presence(flat, vocab, [(i, states[i]) for i in rows
                                      if states[i].params.frequency_penalty
                                      or states[i].params.presence_penalty])
    return logits


def _below_min_tokens(state: ProcessorState) -> bool:
    return len(state.output_token_ids) < state.params.min_tokens


def _logit_bias(flat: torch.Tensor, vocab: int, rows: list[tuple[int, ProcessorState]]) -> None:
    if not rows:
        return
    index: list[int] = []
    bias: list[float] = []
    for row, state in rows:
        assert state.params.logit_bias is not None
        for token_id, value in state.params.logit_bias.items():
            index.append(row * vocab + token_id)
            bias.append(value)
    flat.index_add_(0, torch.tensor(index), torch.tensor(bias, dtype=flat.dtype))


def _min_tokens(
    flat: torch.Tensor, vocab: int, rows: list[tuple[int, ProcessorState]],
    eos_token_ids: Collection[int],
) -> None:
    """Mask every token that would stop the choice before its ``min_tokens``."""
    if not rows:
        return
    index = [
        row * vocab + token_id
        for row, state in rows
        for token_id in {*(() if state.params.ignore_eos else eos_token_ids),
                         *state.params.stop_token_ids}
        if token_id < vocab
    ]
    if index:
        flat.index_fill_(0, torch.tensor(index), float("-inf"))


def _repetition(flat: torch.Tensor, vocab: int, rows: list[tuple[int, ProcessorState]]) -> None:
    """A token seen in the prompt or output: positive logit / penalty, negative * penalty."""
    if not rows:
        return
    parts = []
    penalties = []
    for row, state in rows:
        seen = torch.cat((state.unique_prompt_ids(),
                          torch.tensor(list(state.output_token_ids), dtype=torch.long)))
        parts.append(torch.unique(seen) + row * vocab)
        penalties.append(torch.full((parts[-1].numel(),), state.params.repetition_penalty,
                                    dtype=flat.dtype))
    index = torch.cat(parts)
    penalty = torch.cat(penalties)
    values = flat.index_select(0, index)
    flat.index_copy_(0, index, torch.where(values > 0, values / penalty, values * penalty))


def _frequency_presence(
    flat: torch.Tensor, vocab: int, rows: list[tuple[int, ProcessorState]]
) -> None:
    """Subtract ``count * frequency_penalty + presence_penalty`` for each generated token."""
    flat_ids: list[int] = []
    freq: list[float] = []
    pres: list[float] = []
    for row, state in rows:
        offset = row * vocab
        flat_ids.extend(offset + t for t in state.output_token_ids)
        freq.append(state.params.frequency_penalty)
        pres.append(state.params.presence_penalty)
    if not flat_ids:
        return
    index, counts = torch.unique(torch.tensor(flat_ids), return_counts=True)
    position = torch.zeros(rows[-1][0] + 1, dtype=torch.long)  # row -> its place in `rows`
    position[torch.tensor([row for row, _ in rows])] = torch.arange(len(rows))
    which = position[index // vocab]
    penalty = (counts.to(flat.dtype) * torch.tensor(freq, dtype=flat.dtype)[which]
               + torch.tensor(pres, dtype=flat.dtype)[which])
    flat.index_add_(0, index, -penalty)
