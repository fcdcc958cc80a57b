"""The OpenAI endpoints' logic: request model -> token ids + sampling params -> engine -> response.

`OpenAIServing` tokenizes (chat through the model's template), builds `SamplingParams`, asks the
tenancy registry for the cache scope, submits to the `AsyncEngine` and turns its incremental
outputs into one JSON response or an SSE stream ending in ``data: [DONE]``. A client that goes
away aborts its request. Prompt text and token ids never reach a log line.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.errors import InvalidParam
from prefixcache.server import protocol
from prefixcache.server.async_engine import AsyncEngine, EngineFailure, EngineOverloaded
from prefixcache.server.errors import ApiError
from prefixcache.server.metrics import ServerMetrics
from prefixcache.server.protocol import ChatCompletionRequest, CompletionRequest
from prefixcache.server.tenancy import Tenant, TenantRegistry

__all__ = ["OpenAIServing"]

_DISCONNECT_POLL_S = 0.5


@dataclass(slots=True)
class _Tally:
    """What a request has produced so far, per choice."""

    n: int
    start: float
    texts: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    num_outputs: list[int] = field(default_factory=list)
    num_prompt: int = 0
    num_cached: int = 0
    first_token_time: float | None = None
    done: bool = False

    def __post_init__(self) -> None:
        self.texts = [""] * self.n
        self.reasons = [None] * self.n
        self.num_outputs = [0] * self.n

    def add(self, output: Any) -> None:
        i = output.index
        self.texts[i] += output.text
        self.num_outputs[i] = output.num_output_tokens
        self.num_prompt = output.num_prompt_tokens
        if i == 0:
            self.num_cached = output.num_cached_tokens
        if output.finished:
            self.reasons[i] = _finish_reason(output.finish_reason)
        if self.first_token_time is None and output.new_token_ids:
            self.first_token_time = time.monotonic()
        self.done = output.request_finished

    def usage(self) -> dict[str, Any]:
        return protocol.usage(self.num_prompt, sum(self.num_outputs), self.num_cached)


def _finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


@dataclass(slots=True)
class _Job:
    """One accepted request on its way through the engine."""

    request_id: str
    kind: str  # "completion" | "chat"
    model: str
    created: int
    tenant: Tenant
    queue: asyncio.Queue[Any]
    tally: _Tally


class OpenAIServing:
    """Completions and chat completions over one model."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        model_name: str,
        tenants: TenantRegistry,
        metrics: ServerMetrics,
        default_max_tokens: int,
        trust_content_markers: bool = False,
    ) -> None:
        self.engine = engine
        limits = engine.engine.limits
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size
        self.max_n = limits.max_num_seqs
        self.model_name = model_name
        self.tenants = tenants
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        # False: marker strings in message content are text, never control tokens
        self.trust_content_markers = trust_content_markers
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")

    # ---- endpoints ----------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, tenant: Tenant, http: Request) -> Any:
        self._check_common(body)
        self._check_prompt_bytes(_text_bytes(body.prompt), "prompt")
        token_ids = await self._off_loop(self._completion_prompt, body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        return await self._serve("completion", body, token_ids, max_tokens, tenant, http)

    async def chat(self, body: ChatCompletionRequest, tenant: Tenant, http: Request) -> Any:
        self._check_common(body)
        self._check_prompt_bytes(sum(_text_bytes(m.text()) for m in body.messages), "messages")
        token_ids = await self._off_loop(self._chat_prompt, body)
        max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(self.default_max_tokens, self.max_model_len - len(token_ids)))
        return await self._serve("chat", body, token_ids, max_tokens, tenant, http)

    # ---- request -> engine ----------------------------------------------------------------------

    async def _off_loop(self, fn: Callable[[Any], list[int]], arg: Any) -> list[int]:
        """Tokenize (and render chat templates) on worker threads: a long prompt must not stall
        every other connection's event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, arg)

    def _check_prompt_bytes(self, num_bytes: int, param: str) -> None:
        """Refuse, before tokenizing, a text that must hold more tokens than the context."""
        limit = self.max_model_len * self.tokenizer.max_token_bytes
        if num_bytes > limit:
            raise ApiError(400, f"the prompt is {num_bytes} bytes: more tokens than this "
                           f"model's context of {self.max_model_len} can hold", param=param)

    def _check_common(self, body: protocol._SamplingFields) -> None:
        if body.model != self.model_name:
            raise ApiError(400, f"model {body.model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")
        unsupported = body.unsupported_fields()
        if unsupported:
            raise ApiError(400, f"{unsupported[0]!r} is not supported by this server",
                           param=unsupported[0])
        if not 1 <= body.n <= self.max_n:
            raise ApiError(400, f"n must be between 1 and {self.max_n}, got {body.n}", param="n")

    def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "batched prompts are not supported: send one prompt per "
                               "request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "the prompt is empty", param="prompt")
            return list(self.tokenizer.encode(prompt))
        if not prompt:
            raise ApiError(400, "the prompt is empty (no token ids)", param="prompt")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"prompt token id {bad} is outside the vocabulary "
                           f"[0, {self.vocab_size})", param="prompt")
        return list(prompt)

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if not any(m["content"] for m in messages):
            raise ApiError(400, "the messages are empty", param="messages")
        try:
            ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True,
                                             literal_content=not self.trust_content_markers)
        except ValueError as exc:
            raise ApiError(400, f"cannot apply the chat template: {exc}",
                           param="messages") from None
        return list(ids)

    def _params(self, body: protocol._SamplingFields, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=float(body.temperature),
                top_p=float(body.top_p), top_k=body.top_k, seed=body.seed,
                stop=tuple([body.stop] if isinstance(body.stop, str) else body.stop or ()),
                stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                n=body.n,
            )
        except ValueError as exc:
            raise ApiError(400, str(exc), param=_param_of(exc)) from None

    async def _serve(
        self, kind: str, body: Any, token_ids: list[int], max_tokens: int, tenant: Tenant,
        http: Request,
    ) -> Any:
        start = time.monotonic()
        params = self._params(body, max_tokens)
        scope = self.tenants.scope(tenant, body.cache_salt)
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        request_id = protocol.new_id(prefix)
        try:
            queue = await self.engine.add(request_id, token_ids, params, scope.salt,
                                          scope.use_cache, tenant.scheduling_domain)
        except EngineOverloaded as exc:
            raise ApiError(429, str(exc), code="queue_full") from None
        except ValueError as exc:
            raise ApiError(400, str(exc), param=_param_of(exc)) from None
        job = _Job(request_id, kind, body.model, protocol.now(), tenant, queue,
                   _Tally(body.n, start))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(job, include_usage),
                                     media_type="text/event-stream")
        return await self._collect(job, http)

    # ---- engine -> response ---------------------------------------------------------------------

    async def _next(self, job: _Job) -> Any:
        output = await job.queue.get()
        if isinstance(output, EngineFailure):
            raise ApiError(500, str(output))
        if output.error is not None:  # this request alone failed inside a step
            raise ApiError(500, output.error)
        job.tally.add(output)
        return output

    async def _drain(self, job: _Job) -> None:
        while not job.tally.done:
            await self._next_observed(job)

    async def _collect(self, job: _Job, http: Request) -> JSONResponse:
        drain = asyncio.ensure_future(self._drain(job))
        watch = asyncio.ensure_future(_wait_disconnect(http))
        try:
            await asyncio.wait({drain, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not drain.done():
                drain.cancel()
            self._finish(job)
        if not drain.done() or drain.cancelled():
            raise ApiError(499, "client disconnected")
        drain.result()
        choices = list(zip(job.tally.texts, job.tally.reasons, strict=True))
        build = protocol.completion_response if job.kind == "completion" else (
            protocol.chat_response)
        return JSONResponse(build(job.request_id, job.model, job.created, choices,
                                  job.tally.usage()))

    async def _next_observed(self, job: _Job) -> Any:
        had_first = job.tally.first_token_time is not None
        output = await self._next(job)
        if not had_first and job.tally.first_token_time is not None:
            self.metrics.observe_first_token(job.tenant.domain,
                                             job.tally.first_token_time - job.tally.start,
                                             job.tally.num_cached)
        return output

    async def _stream(self, job: _Job, include_usage: bool) -> AsyncIterator[str]:
        try:
            if job.kind == "chat":
                for i in range(job.tally.n):
                    yield _sse(protocol.chat_chunk(job.request_id, job.model, job.created, i,
                                                   {"role": "assistant", "content": ""}, None))
            while not job.tally.done:
                try:
                    output = await self._next_observed(job)
                except ApiError as exc:
                    yield _sse({"error": {"message": exc.message, "type": "server_error",
                                          "param": None, "code": None}})
                    break
                chunk = self._chunk(job, output)
                if chunk is not None:
                    yield _sse(chunk)
            if include_usage and job.tally.done:
                obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
                yield _sse(protocol.usage_chunk(job.request_id, obj, job.model, job.created,
                                                job.tally.usage()))
            yield "data: [DONE]\n\n"
        finally:
            self._finish(job)

    def _chunk(self, job: _Job, output: Any) -> dict[str, Any] | None:
        reason = _finish_reason(output.finish_reason) if output.finished else None
        if not (output.text or output.new_token_ids or reason):
            return None  # nothing new: no token, no text, no finish
        if job.kind == "completion":
            return protocol.completion_chunk(job.request_id, job.model, job.created,
                                             output.index, output.text, reason)
        delta = {"content": output.text}
        return protocol.chat_chunk(job.request_id, job.model, job.created, output.index,
                                   delta, reason)

    def _finish(self, job: _Job) -> None:
        """Release the request's slot; abort it in the engine if the client left early."""
        self.engine.release(job.tenant.scheduling_domain)
        self.metrics.prompt_tokens.inc(job.tally.num_prompt)
        self.metrics.generation_tokens.inc(sum(job.tally.num_outputs))
        if not job.tally.done:
            self.engine.abort(job.request_id)
            return
        self.metrics.observe_finished(job.tenant.domain, time.monotonic() - job.tally.start,
                                      job.tally.reasons[0])


async def _wait_disconnect(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _text_bytes(prompt: Any) -> int:
    """UTF-8 bytes of the text in a prompt (a string, or a list of strings); 0 for token ids."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8"))
    if isinstance(prompt, list):
        return sum(len(p.encode("utf-8")) for p in prompt if isinstance(p, str))
    return 0


def _param_of(exc: ValueError) -> str | None:
    """The request field an engine/params error names (`InvalidParam`), for the error body."""
    return exc.param if isinstance(exc, InvalidParam) else None
