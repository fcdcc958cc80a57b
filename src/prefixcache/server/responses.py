"""`POST /v1/responses` (OpenAI's Responses API): ``input`` (text or messages) -> one message.

Text formats (``json_object``, ``json_schema``) through the output grammars; a whole
``response`` object, or its typed event sequence, each event with a ``sequence_number``
(`ResponsesRendering`). Stored responses (``previous_response_id``) and tools are refused.
``prompt_cache_options``: ``comparison_response_id`` adds ``prompt_cache_diagnostics`` (why the
cache missed, against that response; every response leaves its fingerprint for a later one),
``prewarm`` computes and caches the prompt and generates nothing. Usage reports the tokens read
from the cache (``cached_tokens``) and written to it (``cache_write_tokens``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from prefixcache.engine.sampling_params import SamplingParams, StructuredOutputs
from prefixcache.errors import InvalidParam
from prefixcache.server import protocol
from prefixcache.server.diagnostics import (
    ENGINE_REASONS,
    NOT_FOUND,
    Diagnosis,
    Outcome,
    Verdict,
)
from prefixcache.server.errors import ApiError
from prefixcache.server.job_runner import JobRunner
from prefixcache.server.jobs import Job, PreparedJob, RenderOptions, Step
from prefixcache.server.openapi import operation_id
from prefixcache.server.protocol import JSONObject, ResponsesRequest
from prefixcache.server.rendering import Rendering
from prefixcache.server.request_params import response_messages, response_status, retention_s
from prefixcache.server.serving_context import ServingContext, text_bytes
from prefixcache.server.tenancy import Tenant

__all__ = ["OpenAIServingResponses", "ResponsesRendering", "responses_router"]


class OpenAIServingResponses:
    """The Responses endpoint."""

    def __init__(self, context: ServingContext, runner: JobRunner) -> None:
        self.context = context
        self.runner = runner

    async def create_response(
        self, body: ResponsesRequest, tenant: Tenant, http: Request
    ) -> Response:
        prepared = await self.prepare(body)
        options = body.prompt_cache_options
        diagnosis = self.context.diagnosis(
            tenant, body.cache_salt, prepared.prompts[0][0], _segments(body),
            [body.instructions, *(m.model_dump(exclude_none=True)
                                  for m in response_messages(body))],
            options.comparison_response_id if options is not None else None)
        return await self.runner.serve(ResponsesRendering(body, diagnosis), body, prepared,
                                       tenant, http)

    async def prepare(self, body: ResponsesRequest) -> PreparedJob:
        context = self.context
        context.check_model(body.model)
        context.check_ignored(body)
        if body.previous_response_id is not None:
            raise ApiError(400, "previous_response_id needs stored responses, which this server "
                           "does not keep: send the whole conversation in 'input'",
                           param="previous_response_id")
        if body.tools:
            raise ApiError(400, "tools (built-in or function) are not supported on "
                           "/v1/responses", param="tools")
        messages = response_messages(body)
        context.check_prompt_bytes(sum(text_bytes(m.text()) for m in messages), "input")
        token_ids = await context.render_messages(messages, "input", True)
        max_tokens = body.max_output_tokens
        if max_tokens is None:
            max_tokens = context.default_max_tokens(len(token_ids))
        structured = _text_format(body)
        prewarm = body.prompt_cache_options is not None and body.prompt_cache_options.prewarm
        if prewarm:  # the prompt's prefill alone: its first token is computed, never shown
            max_tokens, structured = 1, None
        params = context.sampling_params(
            lambda: SamplingParams(max_tokens=max_tokens, temperature=float(body.temperature),
                                   top_p=float(body.top_p), structured_outputs=structured),
            param_names={"max_tokens": "max_output_tokens"})
        await context.compile(params, "text.format")
        return PreparedJob([(token_ids, None)], params, RenderOptions(prefill_only=prewarm),
                           retention_s=retention_s(body.prompt_cache_retention,
                                                   body.prompt_cache_options))


def _segments(body: ResponsesRequest) -> list[tuple[str, object]]:
    """What OpenAI's diagnostics compare before the input, each its own reason."""
    fmt = body.text.format if body.text is not None else None
    return [("model", body.model), ("prompt_cache_key", body.prompt_cache_key),
            ("tools", body.tools),
            ("text_format", fmt.model_dump(exclude_none=True) if fmt is not None else None)]


def openai_diagnostics(outcome: Outcome) -> JSONObject | None:
    """OpenAI's ``prompt_cache_diagnostics`` (None: not asked for). The engine's own reasons
    (`ENGINE_REASONS`) where the request changed nothing and the cache still served less, with
    their detail beside the counts."""
    if outcome is None:
        return None
    if outcome == NOT_FOUND:
        return {"type": "comparison_response_not_found"}
    assert isinstance(outcome, Verdict)
    if outcome.reason is None:
        return {"type": "cache_hit", **outcome.public_part()}
    reason = {"messages": "input_changed"}.get(outcome.reason, outcome.reason)
    if reason not in ENGINE_REASONS:
        reason = reason if reason.endswith("_changed") else f"{reason}_changed"
    return {"type": "cache_miss", "reason": reason, "cache_missed_tokens": outcome.missed_tokens,
            "comparison_reusable_tokens": outcome.reusable_tokens, **(outcome.detail or {}),
            **outcome.public_part()}


def _text_format(body: ResponsesRequest) -> StructuredOutputs | None:
    """The output constraint of ``text.format`` (None: plain text)."""
    fmt = body.text.format if body.text is not None else None
    try:
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputs.of(json_object=True)
        if fmt is not None and fmt.type == "json_schema":
            return StructuredOutputs.of(json=fmt.schema_)
    except InvalidParam as exc:
        raise ApiError(400, str(exc), param="text.format") from None
    return None


def responses_router(
    serving: OpenAIServingResponses, auth: Callable[[Request], Tenant]
) -> APIRouter:
    router = APIRouter(generate_unique_id_function=operation_id)

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request,
                        tenant: Tenant = Depends(auth)) -> Response:
        return await serving.create_response(body, tenant, request)

    return router


class ResponsesRendering(Rendering):
    """A job as one ``response`` object or the Responses API's event stream (``request``: the
    body, which the ``response`` object repeats)."""

    id_prefix = "resp"

    def __init__(self, request: ResponsesRequest, diagnosis: Diagnosis | None = None) -> None:
        self.request = request
        self.diagnosis = diagnosis

    def body(self, job: Job) -> JSONObject:
        choice = job.prompts[0].choices[0]
        status, incomplete = response_status(choice.reason)
        if job.options.prefill_only:  # a prewarm: complete, nothing output
            return self._snapshot(job, "completed", _usage(job), [], None, final=True)
        message = protocol.response_message(f"msg_{job.public_id[5:]}", choice.text, "completed")
        return self._snapshot(job, status, _usage(job), [message], incomplete, final=True)

    def _snapshot(self, job: Job, status: str, use: JSONObject | None = None,
                  output: list[JSONObject] | None = None,
                  incomplete: str | None = None, *, final: bool = False) -> JSONObject:
        """The ``response`` object; ``final``: with its cache diagnostics, if asked for."""
        response = protocol.response_object(job.public_id, self.request, job.created,
                                            status=status, output=output or [], use=use,
                                            incomplete_reason=incomplete)
        options = self.request.prompt_cache_options
        if options is not None:
            response["prompt_cache_options"] = {
                "mode": options.mode, "ttl": options.ttl,
                "comparison_response_id": options.comparison_response_id}
        if final and self.diagnosis is not None:
            diagnostics = openai_diagnostics(self.diagnosis.outcome(
                job.public_id, job.prompts[0].num_cached))
            if diagnostics is not None:
                response["prompt_cache_diagnostics"] = diagnostics
        return response

    async def stream(self, job: Job, outputs: AsyncIterator[Step]) -> AsyncIterator[str]:
        """The event sequence of a streamed response, each event with its ``sequence_number``."""
        events = _Events()
        item_id = f"msg_{job.public_id[5:]}"
        part = {"item_id": item_id, "output_index": 0, "content_index": 0}
        yield events("response.created", response=self._snapshot(job, "in_progress"))
        yield events("response.in_progress", response=self._snapshot(job, "in_progress"))
        if job.options.prefill_only:  # a prewarm: no output item, then completed
            try:
                async for _ in outputs:
                    pass
            except ApiError as exc:
                yield events("error", code="server_error", message=exc.message, param=None)
                return
            yield events("response.completed", response=self.body(job))
            return
        yield events("response.output_item.added", output_index=0,
                     item=protocol.response_message(item_id, "", "in_progress"))
        yield events("response.content_part.added", **part, part=protocol.output_text(""))
        choice = job.prompts[0].choices[0]  # a response has one
        try:
            async for output, _, _ in outputs:
                if output.text:
                    yield events("response.output_text.delta", **part, delta=output.text,
                                 logprobs=[])
        except ApiError as exc:
            yield events("error", code="server_error", message=exc.message, param=None)
            return
        yield events("response.output_text.done", **part, text=choice.text, logprobs=[])
        yield events("response.content_part.done", **part,
                     part=protocol.output_text(choice.text))
        message = protocol.response_message(item_id, choice.text, "completed")
        yield events("response.output_item.done", output_index=0, item=message)
        status, incomplete = response_status(choice.reason)
        # "response.completed" even when cut at max_output_tokens (as vLLM): clients wait
        # for it; the response's status says "incomplete"
        yield events("response.completed", response=self._snapshot(
            job, status, _usage(job), [message], incomplete, final=True))


class _Events:
    """The stream's events, numbered in order (``sequence_number``)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **payload: object) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _usage(job: Job) -> JSONObject:
    return protocol.response_usage(job.num_prompt_tokens, job.num_output_tokens,
                                   job.prompts[0].num_cached, job.num_written,
                                   job.num_public_cached)
