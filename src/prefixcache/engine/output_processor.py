"""Output processing: what a sampled token means to the user who asked for it.

`OutputProcessor` appends a choice's token, keeps its log-probabilities, detokenizes it
incrementally, applies the stop rules (EOS, stop ids and strings, ``max_tokens``) and its output
grammar's end, and builds each step's `RequestOutput`; it keeps the timing of finished requests
that `LLMEngine.stats` reports. It decides *whether* a choice ends (a `RequestStatus`), never
frees anything: the engine's core loop tells the scheduler.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.request import Request
from prefixcache.engine.sampler import SampledToken
from prefixcache.engine.stop import check_stop, emittable_text
from prefixcache.model.tokenizer import Tokenizer
from prefixcache.sched.request import RequestStatus

__all__ = ["MAX_HISTORY", "OutputProcessor"]

MAX_HISTORY = 10_000  # finished requests whose timing `LLMEngine.stats()` still reports


class OutputProcessor:
    """Tokens -> text, stop decisions and `RequestOutput` for one engine's tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.history: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def add_token(
        self, request: Request, token: SampledToken, now: float
    ) -> tuple[RequestStatus | None, list[dict[str, Any]]]:
        """Take ``token`` into ``request``: whether that ends the choice, and the log-probability
        entries it adds (empty unless asked for)."""
        token_id = token.token_id
        request.append_output(token_id)
        if request.timing.first_token_time is None:
            request.timing.first_token_time = now
        if request.detokenizer is None:
            request.detokenizer = self._detokenizer(request.params.skip_special_tokens)
        new_logprobs: list[dict[str, Any]] = []
        if token.logprob is not None:
            request.cumulative_logprob += token.logprob
            if request.params.logprobs is not None:
                entry = {"token_id": token_id, "logprob": token.logprob,
                         "top": token.top_logprobs}
                request.logprobs.append(entry)
                new_logprobs.append(entry)
        status = check_stop(request, token_id, self.tokenizer.eos_token_ids)
        if request.matcher is not None:
            status = self._advance_grammar(request, token_id, status)
        return status, new_logprobs

    def _advance_grammar(
        self, request: Request, token_id: int, status: RequestStatus | None
    ) -> RequestStatus | None:
        """Accept the token into the choice's grammar; a complete grammar ends the choice."""
        matcher = request.matcher
        if not matcher.consume_token(token_id):
            request.stop_reason = "the output constraint rejected the token"
            return RequestStatus.FINISHED_STOPPED
        if status is None and matcher.is_stopped():
            request.text += request.detokenizer.flush()
            return RequestStatus.FINISHED_STOPPED
        return status

    def stopped_by_grammar(self, request: Request) -> RequestStatus:
        """The choice's grammar allows no next token: it ends with the text it has."""
        request.stop_reason = "the output constraint allows no further token"
        if request.detokenizer is not None:
            request.text += request.detokenizer.flush()
        return RequestStatus.FINISHED_STOPPED

    def _detokenizer(self, skip_special_tokens: bool) -> Any:
        from prefixcache.model.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens)

    def output(
        self,
        request: Request,
        new_token_ids: list[int],
        new_logprobs: list[dict[str, Any]],
        request_finished: bool,
    ) -> RequestOutput:
        """What ``request`` gained this step (``request_finished``: every choice is done)."""
        params = request.params
        prompt_logprobs = None
        if params.prompt_logprobs is not None and len(request.output_token_ids) <= 1:
            root = request.parent if isinstance(request.parent, Request) else request
            prompt_logprobs = root.prompt_logprobs
        tracks = params.logprobs is not None or params.ranks_choices
        return RequestOutput(
            request_id=request.request_id,
            index=request.index,
            new_token_ids=new_token_ids,
            text=emittable_text(request),
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            request_finished=request_finished,
            new_logprobs=new_logprobs,
            prompt_logprobs=prompt_logprobs,
            cumulative_logprob=request.cumulative_logprob if tracks else None,
            stop_reason=request.stop_reason,
            num_external_cached_tokens=_external(request),
            timing=_timing(request) if request.is_finished else None,
        )

    def record(self, request: Request) -> None:
        """``request`` (its first choice) finished: keep its timing, the newest `MAX_HISTORY`."""
        timing = request.timing
        self.history[request.request_id] = {
            "ttft": timing.ttft,
            "queue_time": timing.queue_time,
            "num_cached_tokens": max(request.num_cached_tokens, 0),
            "num_prompt_tokens": request.num_prompt_tokens,
        }
        while len(self.history) > MAX_HISTORY:
            self.history.popitem(last=False)


def _external(request: Request) -> int | None:
    """The tier-supplied part of the request's cached prompt tokens (None: no lower tier)."""
    parent = request.parent if isinstance(request.parent, Request) else request
    external = parent.num_external_cached_tokens
    if external is None:
        return None
    return min(external, max(request.num_cached_tokens, 0))


def _timing(request: Request) -> tuple[float, float | None, float | None, float | None]:
    t = request.timing
    return (t.arrival_time, t.first_scheduled_time, t.first_token_time,
            t.finish_time if t.finish_time is not None else time.monotonic())
