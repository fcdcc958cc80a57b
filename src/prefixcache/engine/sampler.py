"""Turn a step's logits into next tokens: greedy, temperature, top-k, top-p, seeded streams.

One row of logits per sampled sequence. Greedy rows take the exact argmax of the raw logits (no
temperature arithmetic, so a cache hit cannot change them). Random rows draw from their own
``torch.Generator``: a sequence's tokens depend only on its seed and its logits, never on what else
is in the batch. Sampling uses the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``), which
equals a categorical draw and moves only when ``p`` changes by more than float noise near a tie.

The sampler knows nothing about requests, caches or stop rules.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from prefixcache.engine.sampling_params import SamplingParams

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

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[SampledToken]:
        """``logits``: [num_rows, vocab]; ``params[i]`` and ``generators[i]`` belong to row i
        (a generator may be None only for greedy rows)."""
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match {len(params)} params / "
                f"{len(generators)} generators"
            )
        greedy_ids = logits.argmax(dim=-1).tolist()
        out: list[SampledToken] = []
        for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
            token_id = greedy_ids[row] if p.greedy else _sample_row(logits[row], p, gen)
            out.append(_with_logprobs(logits[row], token_id, p.logprobs))
        return out


def _sample_row(
    row_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    if generator is None:
        raise ValueError("a random (temperature > 0) row needs a generator")
    scores = row_logits.float() / params.temperature
    if 0 < params.top_k < scores.shape[0]:
        scores = _top_k(scores, params.top_k)
    if params.top_p < 1.0:
        scores = _top_p(scores, params.top_p)
    probs = torch.softmax(scores, dim=-1)
    # q ~ Exp(1): argmax(p / q) is a draw from Categorical(p)
    q = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / q).argmax().item())


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


def _with_logprobs(row_logits: torch.Tensor, token_id: int, num_top: int | None) -> SampledToken:
    if num_top is None:
        return SampledToken(token_id)
    logprobs = torch.log_softmax(row_logits.float(), dim=-1)
    top: dict[int, float] = {}
    if num_top > 0:
        values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[0]))
        top = dict(zip(ids.tolist(), values.tolist(), strict=True))
    return SampledToken(token_id, float(logprobs[token_id].item()), top)
