"""The engine's request groups: a request's ``n`` choices under its first (the parent), from
admission to retirement; each step's update of the choices it touched (sample, detokenize, stop
rules, `RequestOutput`), a failing choice ending its whole group, and aborts."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from prefixcache.engine.output_processor import OutputProcessor
from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.request import Request
from prefixcache.engine.step_sampling import NoTokenAllowed, StepSampler
from prefixcache.errors import describe_exception
from prefixcache.sched import Scheduler
from prefixcache.sched.request import RequestStatus

__all__ = ["RequestGroups"]

logger = logging.getLogger("prefixcache.engine.llm_engine")


class RequestGroups:
    """Request id -> its parent choice, and the outputs of aborts due with the next step."""

    def __init__(self, scheduler: Scheduler[Request], step_sampler: StepSampler,
                 output_processor: OutputProcessor,
                 on_retired: Callable[[Request], None]) -> None:  # fmt: skip
        self.scheduler = scheduler
        self.step_sampler = step_sampler
        self.output_processor = output_processor
        self.on_retired = on_retired
        self.groups: dict[str, Request] = {}
        self.pending: list[RequestOutput] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def add(self, request: Request) -> None:
        self.groups[request.request_id] = request

    def choices(self, request_id: str) -> list[Request]:
        """The live choices of a request (empty once it finished)."""
        parent = self.groups.get(request_id)
        return parent.choices if parent is not None else []

    def take_pending(self) -> list[RequestOutput]:
        pending, self.pending = self.pending, []
        return pending

    def abort(self, request_id: str) -> bool:
        """End every unfinished choice of ``request_id`` (their outputs come with the next
        step); False for an unknown or finished request."""
        parent = self.groups.get(request_id)
        if parent is None:
            return False
        now = time.monotonic()
        for request in parent.choices:
            if not request.is_finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
                request.timing.finish_time = now
                self.pending.append(self.output(request, [], []))
        self.retire_if_done(request_id)
        return True

    def update(
        self, logits: torch.Tensor, targets: list[tuple[Request, int]]
    ) -> list[RequestOutput]:
        """Sample, detokenize and apply stop rules per target row. A failure in any of these
        ends that row's request (finish reason ``error``); the step's other requests go on."""
        if not targets:
            return []
        rows = torch.tensor([row for _, row in targets], dtype=torch.long)
        sampled = self.step_sampler.sample(logits, rows, [r for r, _ in targets])
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for (request, _), token in zip(targets, sampled, strict=True):
            if request.is_finished:  # another choice of its request failed earlier this step
                continue
            try:
                if isinstance(token, NoTokenAllowed):
                    stopped = self.output_processor.stopped_by_grammar(request)
                    outputs.append(self._finish_output(request, stopped, [], [], now))
                    continue
                if isinstance(token, Exception):
                    raise token
                status, new_logprobs = self.output_processor.add_token(request, token, now)
                outputs.append(
                    self._finish_output(request, status, [token.token_id], new_logprobs, now)
                )
            except Exception as exc:  # noqa: BLE001 - isolated to this request, reported in it
                outputs.extend(self.fail(request, exc, now))
        return outputs

    def _finish_output(
        self,
        request: Request,
        status: RequestStatus | None,
        new_token_ids: list[int],
        new_logprobs: list[dict[str, Any]],
        now: float,
    ) -> RequestOutput:
        """The step's output for ``request``, ending it first where ``status`` says so."""
        if status is not None:
            self.scheduler.finish(request, status)
            request.timing.finish_time = now
        output = self.output(request, new_token_ids, new_logprobs)
        if status is not None:
            output.request_finished = self.retire_if_done(request.request_id)
        return output

    def fail(self, request: Request, exc: Exception, now: float) -> list[RequestOutput]:
        """End every unfinished choice of ``request``'s group with finish reason ``error``."""
        # the type and code location only: an exception's message may quote prompt text
        message = f"the request failed inside the engine: {describe_exception(exc)}"
        logger.error("request %s failed: %s", request.request_id, describe_exception(exc))
        parent = self.groups.get(request.request_id)
        outputs = []
        for choice in parent.choices if parent is not None else [request]:
            if choice.is_finished:
                continue
            self.scheduler.finish(choice, RequestStatus.FINISHED_ERROR)
            choice.timing.finish_time = now
            output = self.output(choice, [], [])
            output.error = message
            outputs.append(output)
        if outputs:
            outputs[-1].request_finished = self.retire_if_done(request.request_id)
        return outputs

    def output(
        self, request: Request, new_token_ids: list[int], new_logprobs: list[dict[str, Any]]
    ) -> RequestOutput:
        done = self.done(request.request_id)
        return self.output_processor.output(request, new_token_ids, new_logprobs, done)

    def done(self, request_id: str) -> bool:
        parent = self.groups.get(request_id)
        return parent is None or parent.all_finished

    def retire_if_done(self, request_id: str) -> bool:
        """Forget ``request_id``'s group once every choice finished (recorded, then handed to
        ``on_retired``); whether it is done."""
        if not self.done(request_id):
            return False
        parent = self.groups.pop(request_id, None)
        if parent is not None:
            self.output_processor.record(parent)
            self.on_retired(parent)
        return True
