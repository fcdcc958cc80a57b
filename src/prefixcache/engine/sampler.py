"""Turn a step's logits into next tokens: greedy, temperature, min-p, top-k, top-p, seeded streams.

One row of logits per sampled sequence, already edited by the logits processors
(`logits_processors`). Greedy rows take the exact argmax (no temperature arithmetic, so a cache
hit cannot change them). Random rows draw from their own
``torch.Generator``: a sequence's tokens depend only on its seed and its logits, never on what else
is in the batch. Sampling uses the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``), which
equals a categorical draw and moves only when ``p`` changes by more than float noise near a tie.

Log-probabilities (for ``logprobs`` or a ``best_of`` ranking) are computed for all rows that want
them at once: of the model's own distribution (``raw_logprobs``, the default, as vLLM's) or of
the processed one after the logits processors and temperature (``processed_logprobs``; top-k,
top-p and min-p masks are not applied to it).

The sampler knows nothing about requests, caches or stop rules.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from prefixcache.engine.sampling_params import LOGPROBS_MODES, SamplingParams

__all__ = ["SampledToken", "Sampler", "derive_seed", "make_generator"]

_SEED_MASK = (1 << 63) - 1


def derive_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``; choice 0 keeps ``seed``,
    so ``n=1`` and the first of ``n=3`` agree. Other choices get independent streams."""
    if index == 0:
        return seed & _SEED_MASK
    digest = hashlib.sha256(f"prefixcache-choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & _SEED_MASK


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _SEED_MASK)
    return generator


@dataclass(slots=True)
class SampledToken:
    """One sampled token; ``logprob``/``top_logprobs`` are filled only when requested."""

    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] = field(default_factory=dict)


class Sampler:
    """Samples one token per logits row; rows are independent of each other."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}"
            )
        self.logprobs_mode = logprobs_mode

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        raw_logits: torch.Tensor | None = None,
    ) -> list[SampledToken]:
        """``logits``: [num_rows, vocab], processed; ``params[i]`` and ``generators[i]`` belong
        to row i (a generator may be None only for greedy rows). ``raw_logits``: the model's
        logits before the processors, for ``raw_logprobs`` (default: ``logits``)."""
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match {len(params)} params / "
                f"{len(generators)} generators"
            )
        greedy_ids = logits.argmax(dim=-1).tolist()
        out = [
            SampledToken(greedy_ids[row] if p.greedy else _sample_row(logits[row], p, gen))
            for row, (p, gen) in enumerate(zip(params, generators, strict=True))
        ]
        wanted = [row for row, p in enumerate(params) if p.logprobs is not None or p.ranks_choices]
        if wanted:
            source = logits if self.logprobs_mode == "processed_logprobs" else raw_logits
            self._add_logprobs(logits if source is None else source, params, out, wanted)
        return out

    def _add_logprobs(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], out: list[SampledToken],
        rows: list[int],
    ) -> None:
        """The sampled token's log-probability and the top alternatives, for ``rows`` at once."""
        scores = logits.index_select(0, torch.tensor(rows)).float()
        if self.logprobs_mode == "processed_logprobs":
            temps = [1.0 if params[r].greedy else params[r].temperature for r in rows]
            scores = scores / torch.tensor(temps).unsqueeze(1)
        logprobs = torch.log_softmax(scores, dim=-1)
        chosen = torch.tensor([out[r].token_id for r in rows]).unsqueeze(1)
        sampled = logprobs.gather(1, chosen).squeeze(1).tolist()
        num_top = min(max(params[r].logprobs or 0 for r in rows), logprobs.shape[1])
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if num_top:
            values, ids = torch.topk(logprobs, num_top, dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        for i, row in enumerate(rows):
            token = out[row]
            token.logprob = sampled[i]
            k = params[row].logprobs or 0
            if k:
                token.top_logprobs = dict(zip(top_ids[i][:k], top_values[i][:k], strict=True))


def _sample_row(
    row_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    if generator is None:
        raise ValueError("a random (temperature > 0) row needs a generator")
    scores = row_logits.float() / params.temperature
    if params.min_p > 0.0:
        scores = _min_p(scores, params.min_p)
    if 0 < params.top_k < scores.shape[0]:
        scores = _top_k(scores, params.top_k)
    if params.top_p < 1.0:
        scores = _top_p(scores, params.top_p)
    probs = torch.softmax(scores, dim=-1)
    # q ~ Exp(1): argmax(p / q) is a draw from Categorical(p)
    q = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / q).argmax().item())


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens less probable than ``min_p`` times the most probable one: in log space,
    ``p_i < min_p * p_max`` is ``s_i < s_max + log(min_p)`` (no softmax needed)."""
    return scores.masked_fill(scores < scores.max() + math.log(min_p), float("-inf"))


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    kth = torch.topk(scores, k).values[-1]
    return scores.masked_fill(scores < kth, float("-inf"))


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    # drop a token when the mass strictly before it already reaches top_p (the top one stays)
    drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
    drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))
