"""Sampling for one step: logits in, a token (or a reason there is none) per row out.

`StepSampler` applies, over a copy of the step's rows, the output grammars' masks and the
batched logits processors (penalties, ``logit_bias``, ``min_tokens``), then the `Sampler` (greedy,
temperature, top-k/p, min-p, log-probabilities) in one batch; if anything raises, it retries row
by row from the step's untouched logits, so only the failing rows fail. `record_prompt_logprobs`
is the tensor maths of prompt log-probabilities. Nothing here finishes a request or knows the
scheduler: the engine acts on what comes back.
"""

from __future__ import annotations

from typing import cast

import torch

from prefixcache.engine.logits_processors import apply_logits_processors
from prefixcache.engine.request import Request
from prefixcache.engine.runner import StepLogits
from prefixcache.engine.sampler import SampledToken, Sampler
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.structured import mask_logits
from prefixcache.sched import SchedulerOutput

__all__ = ["NoTokenAllowed", "RowResult", "StepSampler", "record_prompt_logprobs"]


class NoTokenAllowed(Exception):
    """A row whose output grammar allows no token: its choice stops (not an error)."""


RowResult = SampledToken | NoTokenAllowed | Exception  # what one row of a step gives


class StepSampler:
    """The step's rows through grammar masks, logits processors and ``sampler``."""

    def __init__(self, sampler: Sampler, eos_token_ids: tuple[int, ...]) -> None:
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids

    def sample(
        self, step_logits: torch.Tensor, rows: torch.Tensor, requests: list[Request]
    ) -> list[RowResult]:
        """One result per row of ``rows`` (``requests[i]`` owns row ``rows[i]``)."""
        try:
            return self._sample(step_logits, rows, requests)
        except Exception:  # noqa: BLE001 - retried per row below
            pass
        out: list[RowResult] = []
        for i in range(len(requests)):
            try:
                out += self._sample(step_logits, rows[i : i + 1], requests[i : i + 1])
            except Exception as exc:  # noqa: BLE001 - this row's failure, reported in it
                out.append(exc)
        return out

    def _sample(
        self, step_logits: torch.Tensor, rows: torch.Tensor, requests: list[Request]
    ) -> list[RowResult]:
        params = [r.params for r in requests]
        logits = step_logits.index_select(0, rows)
        raw = _raw_copy(logits, params)
        dead = _mask_grammars(logits, requests)
        if len(dead) == len(requests):  # no row left to sample
            return [NoTokenAllowed() for _ in requests]
        processed = apply_logits_processors(logits, requests, self.eos_token_ids)
        generators = [r.generator for r in requests]
        out: list[RowResult] = list(self.sampler.sample(processed, params, generators, raw))
        for index in dead:
            out[index] = NoTokenAllowed()
        return out


def record_prompt_logprobs(out: SchedulerOutput, logits: StepLogits) -> None:
    """Each prompt position's logits rate the next prompt token: keep its logprob (and the top
    alternatives) by position in the request's table; a recomputed chunk (after preemption)
    rewrites them."""
    for i, rows in logits.every_token.items():
        chunk = out.chunks[i]
        request = cast(Request, chunk.request)  # the engine's scheduler holds its requests
        table = request.prompt_logprobs
        if table is None or request.params.prompt_logprobs is None:
            continue
        start = chunk.num_computed_tokens
        num = min(chunk.num_new_tokens, request.num_prompt_tokens - 1 - start)
        if num <= 0:
            continue
        logprobs = torch.log_softmax(rows[:num].float(), dim=-1)
        next_ids = request.seq.token_ids[start + 1 : start + 1 + num]
        chosen_t = logprobs.gather(1, torch.tensor(next_ids).unsqueeze(1))
        # int32: summing a bool tensor into int64 is much slower on CPU
        ranks = ((logprobs > chosen_t).sum(dim=1, dtype=torch.int32) + 1).tolist()
        chosen = chosen_t.squeeze(1).tolist()
        k = min(request.params.prompt_logprobs, logprobs.shape[1])
        tops: list[dict[int, float]] = [{} for _ in range(num)]
        if k:
            values, ids = torch.topk(logprobs, k, dim=-1)
            tops = [dict(zip(i_row, v_row, strict=True))
                    for i_row, v_row in zip(ids.tolist(), values.tolist(), strict=True)]
        for j in range(num):
            table[start + 1 + j] = {"token_id": next_ids[j], "logprob": chosen[j],
                                    "rank": ranks[j], "top": tops[j]}


def _mask_grammars(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Mask the constrained rows to their grammars' tokens; the rows left with none."""
    rows = [i for i, r in enumerate(requests) if r.matcher is not None]
    return mask_logits(logits, rows, [requests[i].matcher for i in rows]) if rows else []


def _raw_copy(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """The rows before the logits processors edit them, where raw logprobs are reported."""
    wants = any(p.logprobs is not None or p.ranks_choices for p in params)
    if wants and any(p.processes_logits for p in params):
        return logits.clone()
    return None
