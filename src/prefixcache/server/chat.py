"""`POST /v1/chat/completions`: messages through the model's chat template -> choices.

Tools (forced calls through a grammar, calls parsed out of the answer, streamed as deltas),
logprobs (OpenAI's chat shape), prompt logprobs (vLLM's) and structured output, as one JSON body
or ``chat.completion.chunk`` deltas (`ChatRendering`).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from prefixcache.engine.outputs import RequestOutput
from prefixcache.server import protocol
from prefixcache.server.diagnostics import Diagnosis
from prefixcache.server.errors import ApiError
from prefixcache.server.job_runner import JobRunner
from prefixcache.server.jobs import Choice, Job, PreparedJob, RenderOptions, finish_reason_of
from prefixcache.server.logprobs import TokenText, chat_logprobs
from prefixcache.server.openapi import operation_id
from prefixcache.server.protocol import ChatCompletionRequest, JSONObject
from prefixcache.server.rendering import ChunkRendering
from prefixcache.server.request_params import (
    check_logprobs,
    continuous_usage,
    include_usage,
    retention_s,
    sampling_params_of,
    structured_of,
    tool_choice_of,
)  # fmt: skip
from prefixcache.server.responses import openai_diagnostics
from prefixcache.server.serving_context import ServingContext, text_bytes
from prefixcache.server.tenancy import Tenant
from prefixcache.server.tools import parse_tool_calls, tool_grammar

__all__ = ["ChatRendering", "OpenAIServingChat", "chat_router"]


class OpenAIServingChat:
    """The chat completions endpoint."""

    def __init__(self, context: ServingContext, runner: JobRunner) -> None:
        self.context = context
        self.runner = runner

    async def create_chat_completion(
        self, body: ChatCompletionRequest, tenant: Tenant, http: Request
    ) -> Response:
        prepared = await self.prepare(body)
        options = body.prompt_cache_options
        prepared.retention_s = retention_s(body.prompt_cache_retention, options)
        diagnosis = self.context.diagnosis(
            tenant, body.cache_salt, prepared.prompts[0][0], _segments(body),
            [m.model_dump(exclude_none=True) for m in body.messages],
            options.comparison_response_id if options is not None else None)
        return await self.runner.serve(ChatRendering(self.context.token_text, diagnosis), body,
                                       prepared, tenant, http)

    async def prepare(self, body: ChatCompletionRequest) -> PreparedJob:
        """A chat body's prompt, sampling parameters and rendering options, every check done
        (the Messages API builds its jobs through here too)."""
        context = self.context
        context.check_model(body.model)
        context.check_ignored(body)
        if body.prompt_logprobs is not None:
            check_logprobs(body.prompt_logprobs, "prompt_logprobs")
        tools, choice = tool_choice_of(body)
        if body.top_logprobs is not None:
            check_logprobs(body.top_logprobs, "top_logprobs")
            if not body.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        context.check_prompt_bytes(sum(text_bytes(m.text()) for m in body.messages), "messages")
        token_ids = await context.render_messages(body.messages, "messages",
                                                  body.add_generation_prompt,
                                                  tools if choice != "none" else None)
        max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        if max_tokens is None:
            max_tokens = context.default_max_tokens(len(token_ids))
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        structured, param = structured_of(body)
        if choice not in ("none", "auto"):  # a forced call: the tool's arguments' grammar
            if structured is not None:
                raise ApiError(400, "a required or named tool_choice already constrains the "
                               "output: drop response_format", param="tool_choice")
            structured = tool_grammar(tools, choice, body.parallel_tool_calls)
            param = "tools"
        params = context.sampling_params(lambda: sampling_params_of(
            body, max_tokens, logprobs=num_top, prompt_logprobs=body.prompt_logprobs,
            structured=structured))
        await context.compile(params, param)
        options = RenderOptions(n=body.n, logprobs=num_top,
                                prompt_logprobs=body.prompt_logprobs is not None,
                                include_usage=include_usage(body),
                                continuous_usage=continuous_usage(body), tools=choice != "none")
        return PreparedJob([(token_ids, None)], params, options)


def chat_router(
    serving: OpenAIServingChat, auth: Callable[[Request], Tenant]
) -> APIRouter:
    router = APIRouter(generate_unique_id_function=operation_id)

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request,
                   tenant: Tenant = Depends(auth)) -> Response:
        return await serving.create_chat_completion(body, tenant, request)

    return router


def _segments(body: ChatCompletionRequest) -> list[tuple[str, object]]:
    """What OpenAI's diagnostics compare before the messages, each its own reason."""
    fmt = body.response_format
    return [("model", body.model), ("prompt_cache_key", body.prompt_cache_key),
            ("tools", [t.model_dump(exclude_none=True) for t in body.tools or []]),
            ("text_format", fmt.model_dump(exclude_none=True) if fmt is not None else None)]


class ChatRendering(ChunkRendering):
    """A chat job as ``chat.completion`` objects (tool calls parsed out of the text); with a
    ``diagnosis``, ``prompt_cache_diagnostics`` as on /v1/responses (our extension: in the
    body, or in the usage chunk of a stream)."""

    id_prefix = "chatcmpl"
    usage_object = "chat.completion.chunk"

    def __init__(self, token_text: TokenText, diagnosis: Diagnosis | None = None) -> None:
        super().__init__(token_text)
        self.diagnosis = diagnosis

    def diagnostics(self, job: Job) -> JSONObject | None:
        if self.diagnosis is None:
            return None
        return openai_diagnostics(self.diagnosis.outcome(job.public_id, job.prompts[0].num_cached))

    def opening(self, job: Job) -> list[JSONObject]:
        return [protocol.chat_chunk(job.public_id, job.model, job.created, j,
                                    {"role": "assistant", "content": ""}, None)
                for j in range(job.options.n)]

    def body(self, job: Job) -> JSONObject:
        choices = []
        for i, prompt in enumerate(job.prompts):
            for j, choice in enumerate(job.ranked(prompt)):
                content: str | None = choice.text
                calls: list[JSONObject] = []
                if job.options.tools:
                    content, calls = parse_tool_calls(choice.text)
                reason = "tool_calls" if calls else choice.reason
                item = protocol.chat_choice(i * job.options.n + j, content, reason,
                                            self._logprobs(job, choice.logprobs), calls)
                if choice.stop_reason is not None:
                    item["stop_reason"] = choice.stop_reason
                choices.append(item)
        body = protocol.chat_response(job.public_id, job.model, job.created, choices, job.usage())
        if job.options.prompt_logprobs:  # vLLM puts a chat's prompt logprobs beside its choices
            body["prompt_logprobs"] = self.prompt_logprobs(job.prompts[0])
        diagnostics = self.diagnostics(job)
        if diagnostics is not None:
            body["prompt_cache_diagnostics"] = diagnostics
        return body

    def chunk(
        self, job: Job, output: RequestOutput, i: int, choice: Choice
    ) -> JSONObject | None:
        reason = finish_reason_of(output.finish_reason) if output.finished else None
        first = not choice.started
        if not (output.text or output.new_token_ids or reason):
            return None  # nothing new: no token, no text, no finish
        choice.started = True
        delta: JSONObject = {"content": output.text}
        if job.options.tools:
            text, calls = choice.tool_stream.feed(output.text, final=output.finished)
            delta = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = calls
            if reason is not None and choice.tool_stream.num_calls:
                reason = "tool_calls"
            if not (delta or reason or output.new_logprobs):
                return None
        chunk = protocol.chat_chunk(job.public_id, job.model, job.created,
                                    i * job.options.n + output.index, delta, reason,
                                    self._logprobs(job, output.new_logprobs))
        if first and job.options.prompt_logprobs:
            prompt = job.prompts[i]
            chunk["choices"][0]["prompt_logprobs"] = self.prompt_logprobs(prompt)
        if reason is not None and choice.stop_reason is not None:
            chunk["choices"][0]["stop_reason"] = choice.stop_reason
        return chunk

    def _logprobs(
        self, job: Job, entries: list[JSONObject]
    ) -> JSONObject | None:
        if job.options.logprobs is None:
            return None
        return chat_logprobs(entries, job.options.logprobs, self.token_text)
