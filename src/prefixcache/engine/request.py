"""A request as the engine tracks it: the scheduler's state plus sampling, text and timing.

`Request` extends the scheduler's `SchedRequest` (queues, sequence, choices) with what only the
engine needs: sampling parameters and the choice's random stream, generated ids, the
detokenizer's text, log probabilities and wall-clock timing. The scheduler forks ``n - 1``
children through `spawn`, which gives each its own stream. Tensors never appear here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixcache.cache import Sequence
from prefixcache.engine.sampler import derive_seed, make_generator
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.sched.request import SchedRequest

__all__ = ["Request", "RequestTiming"]


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
class Request(SchedRequest):
    """One choice being generated. ``seq.token_ids`` = prompt + generated tokens."""

    params: SamplingParams
    generator: torch.Generator | None
    base_seed: int = field(default=0, kw_only=True)  # choice i samples from derive_seed(.., i)
    output_token_ids: list[int] = field(default_factory=list, kw_only=True)
    timing: RequestTiming = field(default_factory=RequestTiming, kw_only=True)
    detokenizer: Any = field(default=None, kw_only=True)  # IncrementalDetokenizer
    text: str = field(default="", kw_only=True)
    num_text_emitted: int = field(default=0, kw_only=True)  # characters of `text` streamed
    num_tokens_emitted: int = field(default=0, kw_only=True)  # output tokens streamed
    logprobs: list[dict[str, Any]] = field(default_factory=list, kw_only=True)
    cumulative_logprob: float = field(default=0.0, kw_only=True)  # of the sampled tokens
    # prompt logprobs by position (None for position 0), filled as prefill chunks run
    prompt_logprobs: list[dict[str, Any] | None] | None = field(default=None, kw_only=True)
    _unique_prompt: torch.Tensor | None = field(default=None, kw_only=True, repr=False)
    matcher: Any = field(default=None, kw_only=True, repr=False)  # the output grammar's state
    stop_reason: str | None = field(default=None, kw_only=True)  # why it stopped, if not EOS/stop
    # prompt tokens whose KV a lower tier (disk, Valkey) supplied, part of num_cached_tokens;
    # None: the engine has no lower tier
    num_external_cached_tokens: int | None = field(default=None, kw_only=True)
    # (num_tokens, ttl_s): prompt prefixes to pin when the request is done (cache breakpoints)
    pin_requests: list[tuple[int, float]] = field(default_factory=list, kw_only=True)

    @classmethod
    def new(
        cls, request_id: str, token_ids: list[int], params: SamplingParams, base_seed: int,
        arrival_index: int, *, cache_salt: str | bytes | None = None, use_cache: bool = True,
        domain: str = "", external: bool = False, adapter: str | None = None,
        lora: tuple[int, str] | None = None, public_blocks: int = 0,
    ) -> Request:  # fmt: skip
        """A request's first choice. A request asking for prompt logprobs needs logits at every
        prompt position: it computes them all (no cache read), still caching the blocks for
        others. ``external``: the engine has lower tiers (their share of the hit is counted).
        ``adapter``: the identity of the LoRA adapter it runs under (its blocks' namespace),
        ``lora`` its id and name (the KV events')."""
        seq = Sequence(request_id, token_ids, cache_salt, use_cache=use_cache, domain=domain,
                       read_cache=params.prompt_logprobs is None, adapter=adapter, lora=lora,
                       public_blocks=public_blocks)
        generator = None if params.greedy else make_generator(derive_seed(base_seed, 0))
        request = cls(request_id=request_id, seq=seq, params=params, generator=generator,
                      base_seed=base_seed, arrival_index=arrival_index, domain=domain)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(token_ids)
        if external:
            request.num_external_cached_tokens = 0
        return request

    def __post_init__(self) -> None:
        self.n = self.params.num_choices
        self.prompt_logits = self.params.prompt_logprobs is not None

    def unique_prompt_ids(self) -> torch.Tensor:
        """The prompt's distinct token ids, for the repetition penalty (built once)."""
        if self._unique_prompt is None:
            parent = self.parent
            if isinstance(parent, Request):
                self._unique_prompt = parent.unique_prompt_ids()
            else:
                ids = torch.tensor(self.prompt_token_ids, dtype=torch.long)
                self._unique_prompt = torch.unique(ids)
        return self._unique_prompt

    def spawn(self, index: int, seq: Sequence) -> Request:
        """Choice ``index``: same parameters, its own random stream, the parent's timing."""
        seed = derive_seed(self.base_seed, index)
        child = Request(
            self.request_id,
            seq,
            self.params,
            None if self.params.greedy else make_generator(seed),
            base_seed=self.base_seed,
            **SchedRequest.child_fields(self, index),
        )
        if self.matcher is not None:  # forked before any token: the same fresh grammar state
            child.matcher = self.matcher.deep_copy()
        child.timing.arrival_time = self.timing.arrival_time
        child.timing.first_scheduled_time = self.timing.first_scheduled_time
        return child

    @property
    def choices(self) -> list[Request]:  # type: ignore[override]
        """This request and its forked children, by index (call on the parent)."""
        return [self, *self.children]  # type: ignore[list-item]

    def append_output(self, token_id: int) -> None:
        self.seq.append(token_id)
        self.output_token_ids.append(token_id)
