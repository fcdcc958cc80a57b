"""`POST /v1/completions`: prompts (text, token ids, or a batch of either) -> choices.

Echo, logprobs (OpenAI's legacy shape), prompt logprobs (vLLM's), ``best_of`` ranking and
structured output, as one JSON body or ``data:`` chunks (`CompletionRendering`).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from prefixcache.engine.outputs import RequestOutput
from prefixcache.server import protocol
from prefixcache.server.errors import ApiError
from prefixcache.server.job_runner import JobRunner
from prefixcache.server.jobs import (
    Choice,
    Job,
    PreparedJob,
    Prompts,
    PromptState,
    RenderOptions,
    finish_reason_of,
)  # fmt: skip
from prefixcache.server.logprobs import completion_logprobs
from prefixcache.server.openapi import operation_id
from prefixcache.server.protocol import CompletionRequest, JSONObject
from prefixcache.server.rendering import ChunkRendering
from prefixcache.server.request_params import (
    as_prompts,
    check_logprobs,
    continuous_usage,
    include_usage,
    retention_s,
    sampling_params_of,
    structured_of,
)  # fmt: skip
from prefixcache.server.serving_context import ServingContext, text_bytes
from prefixcache.server.tenancy import Tenant

__all__ = ["CompletionRendering", "OpenAIServingCompletion", "completion_router"]


class OpenAIServingCompletion:
    """The completions endpoint."""

    def __init__(self, context: ServingContext, runner: JobRunner) -> None:
        self.context = context
        self.runner = runner

    async def create_completion(
        self, body: CompletionRequest, tenant: Tenant, http: Request
    ) -> Response:
        prepared = await self.prepare(body)
        return await self.runner.serve(CompletionRendering(self.context.token_text), body,
                                       prepared, tenant, http)

    async def prepare(self, body: CompletionRequest) -> PreparedJob:
        """A completions body's prompts, sampling parameters and rendering options, every
        check done."""
        context = self.context
        context.check_model(body.model)
        context.check_ignored(body)
        if body.prompt_logprobs is not None:
            check_logprobs(body.prompt_logprobs, "prompt_logprobs")
        if body.suffix:
            raise ApiError(400, "'suffix' (insertion) is not supported", param="suffix")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        options = RenderOptions(n=body.n, echo=body.echo, echo_only=body.echo and max_tokens == 0,
                                logprobs=body.logprobs,
                                prompt_logprobs=body.prompt_logprobs is not None)
        if max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens must be >= 1 (0 only with echo)", param="max_tokens")
        check_logprobs(body.logprobs, "logprobs")
        prompts = await self._encode(body.prompt)
        # echo with logprobs rates the prompt tokens: prompt logprobs of the same width
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
        structured, param = structured_of(body)
        params = context.sampling_params(lambda: sampling_params_of(
            body, max(1, max_tokens), logprobs=body.logprobs, prompt_logprobs=prompt_logprobs,
            best_of=body.best_of, structured=structured))
        await context.compile(params, param)
        options.include_usage = include_usage(body)
        options.continuous_usage = continuous_usage(body)
        if body.stream and params.ranks_choices:
            raise ApiError(400, "best_of > n cannot be streamed", param="best_of")
        return PreparedJob(prompts, params, options, retention_s(body.prompt_cache_retention))

    async def _encode(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> Prompts:
        """The body's prompts as token ids, each checked (at most a domain's share of the
        queue in one request)."""
        prompts = as_prompts(prompt)
        limit = self.context.engine.max_pending_per_domain
        if len(prompts) > limit:
            raise ApiError(400, f"{len(prompts)} prompts in one request: at most {limit}",
                           param="prompt")
        for one in prompts:
            self.context.check_prompt_bytes(text_bytes(one), "prompt")
        return await self.context.encode_prompts(prompts)


def completion_router(
    serving: OpenAIServingCompletion, auth: Callable[[Request], Tenant]
) -> APIRouter:
    router = APIRouter(generate_unique_id_function=operation_id)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request,
                          tenant: Tenant = Depends(auth)) -> Response:
        return await serving.create_completion(body, tenant, request)

    return router


class CompletionRendering(ChunkRendering):
    """A completions job as ``text_completion`` objects."""

    id_prefix = "cmpl"
    usage_object = "text_completion"

    def body(self, job: Job) -> JSONObject:
        choices = []
        for i, prompt in enumerate(job.prompts):
            for j, choice in enumerate(job.ranked(prompt)):
                text, logprobs = self._text(job, prompt, choice, first=True)
                item = protocol.completion_choice(i * job.options.n + j, text, choice.reason,
                                                  logprobs)
                if choice.stop_reason is not None:
                    item["stop_reason"] = choice.stop_reason
                if job.options.prompt_logprobs:
                    item["prompt_logprobs"] = self.prompt_logprobs(prompt)
                choices.append(item)
        return protocol.completion_response(job.public_id, job.model, job.created, choices,
                                            job.usage())

    def chunk(
        self, job: Job, output: RequestOutput, i: int, choice: Choice
    ) -> JSONObject | None:
        reason = finish_reason_of(output.finish_reason) if output.finished else None
        first = not choice.started
        if not (output.text or output.new_token_ids or reason or (first and job.options.echo)):
            return None  # nothing new: no token, no text, no finish
        choice.started = True
        prompt = job.prompts[i]
        text, logprobs = self._text(job, prompt, choice, first=first, new_text=output.text,
                                    new_logprobs=output.new_logprobs)
        chunk = protocol.completion_chunk(job.public_id, job.model, job.created,
                                          i * job.options.n + output.index, text, reason,
                                          logprobs)
        if first and job.options.prompt_logprobs:
            chunk["choices"][0]["prompt_logprobs"] = self.prompt_logprobs(prompt)
        if reason is not None and choice.stop_reason is not None:
            chunk["choices"][0]["stop_reason"] = choice.stop_reason
        return chunk

    def _text(
        self, job: Job, prompt: PromptState, choice: Choice, *, first: bool,
        new_text: str | None = None, new_logprobs: list[JSONObject] | None = None,
    ) -> tuple[str, JSONObject | None]:
        """A completions choice's text and logprobs: the whole choice, or (``new_*``) one
        stream delta; ``first`` adds the echoed prompt."""
        options = job.options
        text = choice.text if new_text is None else new_text
        entries: list[JSONObject | None] = list(
            choice.logprobs if new_logprobs is None else new_logprobs)
        if options.echo_only:
            text, entries = "", []
        if first and options.echo:
            text = (prompt.text or "") + text
            if options.logprobs is not None:
                prompt_entries = prompt.prompt_logprobs or [None] * len(prompt.token_ids)
                entries = list(prompt_entries) + entries
        if options.logprobs is None:
            return text, None
        logprobs, choice.text_offset = completion_logprobs(
            entries, prompt.token_ids[0], self.token_text, choice.text_offset)
        return text, logprobs
