"""The OpenAI endpoints' logic: request model -> token ids + sampling params -> engine -> response.

`OpenAIServing` tokenizes (chat through the model's template), builds `SamplingParams`, asks the
tenancy registry for the cache scope, submits one engine request per prompt to the `AsyncEngine`
(a batched completions ``prompt`` is several; their outputs share one queue) and turns the
incremental outputs into one JSON response or an SSE stream: completions and chat end in
``data: [DONE]``, the Responses API sends typed events. A client that goes away aborts its
requests. Prompt text and token ids never reach a log line; neither do the values of ignored
fields, only their (sanitised) names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.sampling_params import SamplingParams, StructuredOutputs
from prefixcache.errors import InvalidParam
from prefixcache.server import protocol
from prefixcache.server.async_engine import AsyncEngine, EngineFailure, EngineOverloaded
from prefixcache.server.errors import ApiError
from prefixcache.server.jobs import Choice, Job, PromptState, RenderOptions, finish_reason_of
from prefixcache.server.logprobs import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    vllm_prompt_logprobs,
)
from prefixcache.server.metrics import ServerMetrics
from prefixcache.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    Lenient,
    ResponsesRequest,
    TokenizeRequest,
)
from prefixcache.server.request_params import (
    as_prompts,
    check_logprobs,
    continuous_usage,
    include_usage,
    render_chat,
    response_messages,
    response_status,
    structured_of,
    tool_choice_of,
)
from prefixcache.server.tenancy import Tenant, TenantRegistry
from prefixcache.server.tools import parse_tool_calls, tool_grammar

__all__ = ["OpenAIServing"]

logger = logging.getLogger("prefixcache.server")

_DISCONNECT_POLL_S = 0.5
_FIELD_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class OpenAIServing:
    """Completions, chat completions, responses and the tokenizer endpoints over one model."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        model_name: str,
        tenants: TenantRegistry,
        metrics: ServerMetrics,
        default_max_tokens: int,
        trust_content_markers: bool = False,
        strict_api: bool = False,
    ) -> None:
        self.engine = engine
        self.inputs = engine.inputs
        limits = engine.limits
        self.tokenizer = engine.tokenizer
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size
        self.model_name = model_name
        self.tenants = tenants
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        # False: marker strings in message content are text, never control tokens
        self.trust_content_markers = trust_content_markers
        self.strict_api = strict_api
        self.token_text = TokenText(self.tokenizer)
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")

    # ---- endpoints ----------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, tenant: Tenant, http: Request) -> Any:
        self._check_common(body)
        if body.suffix:
            raise ApiError(400, "'suffix' (insertion) is not supported", param="suffix")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        options = RenderOptions(n=body.n, echo=body.echo, echo_only=body.echo and max_tokens == 0,
                           logprobs=body.logprobs,
                           prompt_logprobs=body.prompt_logprobs is not None)
        if max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens must be >= 1 (0 only with echo)", param="max_tokens")
        check_logprobs(body.logprobs, "logprobs")
        prompts = as_prompts(body.prompt)
        limit = self.engine.max_pending_per_domain
        if len(prompts) > limit:
            raise ApiError(400, f"{len(prompts)} prompts in one request: at most {limit}",
                           param="prompt")
        for prompt in prompts:
            self._check_prompt_bytes(_text_bytes(prompt), "prompt")
        encoded = await self._off_loop(self._completion_prompts, prompts)
        # echo with logprobs rates the prompt tokens: prompt logprobs of the same width
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
        structured, param = structured_of(body)
        params = self._params(body, max(1, max_tokens), logprobs=body.logprobs,
                              prompt_logprobs=prompt_logprobs, best_of=body.best_of,
                              structured=structured)
        await self._compile(params, param)
        options.include_usage = include_usage(body)
        options.continuous_usage = continuous_usage(body)
        if body.stream and params.ranks_choices:
            raise ApiError(400, "best_of > n cannot be streamed", param="best_of")
        return await self._serve("completion", body, encoded, params, options, tenant, http)

    async def chat(self, body: ChatCompletionRequest, tenant: Tenant, http: Request) -> Any:
        self._check_common(body)
        tools, choice = tool_choice_of(body)
        if body.top_logprobs is not None:
            check_logprobs(body.top_logprobs, "top_logprobs")
            if not body.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        self._check_prompt_bytes(sum(_text_bytes(m.text()) for m in body.messages), "messages")
        rendered_tools = tools if choice != "none" else None
        token_ids = await self._off_loop(
            self._render_messages, (body.messages, "messages", body.add_generation_prompt,
                                    rendered_tools))
        max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(self.default_max_tokens, self.max_model_len - len(token_ids)))
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        forced = choice not in ("none", "auto")
        structured, param = structured_of(body)
        if forced:
            if structured is not None:
                raise ApiError(400, "a required or named tool_choice already constrains the "
                               "output: drop response_format", param="tool_choice")
            structured = tool_grammar(tools, choice, body.parallel_tool_calls)
            param = "tools"
        params = self._params(body, max_tokens, logprobs=num_top,
                              prompt_logprobs=body.prompt_logprobs, structured=structured)
        await self._compile(params, param)
        options = RenderOptions(n=body.n, logprobs=num_top,
                           prompt_logprobs=body.prompt_logprobs is not None,
                           include_usage=include_usage(body),
                           continuous_usage=continuous_usage(body), tools=choice != "none")
        prompts: list[tuple[list[int], str | None]] = [(token_ids, None)]
        return await self._serve("chat", body, prompts, params, options, tenant, http)

    async def responses(self, body: ResponsesRequest, tenant: Tenant, http: Request) -> Any:
        self._check_model(body.model)
        self._check_ignored(body)
        if body.previous_response_id is not None:
            raise ApiError(400, "previous_response_id needs stored responses, which this server "
                           "does not keep: send the whole conversation in 'input'",
                           param="previous_response_id")
        if body.tools:
            raise ApiError(400, "tools (built-in or function) are not supported on "
                           "/v1/responses", param="tools")
        messages = response_messages(body)
        self._check_prompt_bytes(sum(_text_bytes(m.text()) for m in messages), "input")
        token_ids = await self._off_loop(self._render_messages, (messages, "input", True, None))
        max_tokens = body.max_output_tokens
        if max_tokens is None:
            max_tokens = max(1, min(self.default_max_tokens, self.max_model_len - len(token_ids)))
        fmt = body.text.format if body.text is not None else None
        structured = None
        try:
            if fmt is not None and fmt.type == "json_object":
                structured = StructuredOutputs.of(json_object=True)
            elif fmt is not None and fmt.type == "json_schema":
                structured = StructuredOutputs.of(json=fmt.schema_)
        except InvalidParam as exc:
            raise ApiError(400, str(exc), param="text.format") from None
        params = self._sampling_params(
            param_names={"max_tokens": "max_output_tokens"},
            max_tokens=max_tokens, temperature=float(body.temperature), top_p=float(body.top_p),
            structured_outputs=structured,
        )
        await self._compile(params, "text.format")
        prompts: list[tuple[list[int], str | None]] = [(token_ids, None)]
        return await self._serve("response", body, prompts, params, RenderOptions(), tenant, http)

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self._check_ignored(body)
        if body.model is not None:
            self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            ids = await self._off_loop(
                self._render_messages,
                (body.messages, "messages", body.add_generation_prompt, None))
        else:
            assert body.prompt is not None
            self._check_prompt_bytes(_text_bytes(body.prompt), "prompt")
            ids = await self._off_loop(
                lambda text: list(self.tokenizer.encode(text, body.add_special_tokens)),
                body.prompt)
        strs = [self.token_text(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check_ignored(body)
        if body.model is not None:
            self._check_model(body.model)
        with _as_api_error():
            self.inputs.check_token_ids(body.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def tokenizer_info(self) -> dict[str, Any]:
        """What a remote-tokenizer client (lm-eval) needs: special tokens and the template."""
        special = self.tokenizer.special_tokens
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": special.get("eos_token"),
            "bos_token": special.get("bos_token"),
            "pad_token": special.get("pad_token"),
            "unk_token": special.get("unk_token"),
            "chat_template": self.tokenizer.chat_template,
            "model_max_length": self.max_model_len,
            "vocab_size": self.vocab_size,
        }

    # ---- request -> engine ----------------------------------------------------------------------

    async def _off_loop(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        """Tokenize (and render chat templates) on worker threads: a long prompt must not stall
        every other connection's event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, arg)

    def _check_prompt_bytes(self, num_bytes: int, param: str) -> None:
        """Refuse, before tokenizing, a text that must hold more tokens than the context."""
        limit = self.max_model_len * self.tokenizer.max_token_bytes
        if num_bytes > limit:
            raise ApiError(400, f"the prompt is {num_bytes} bytes: more tokens than this "
                           f"model's context of {self.max_model_len} can hold", param=param)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(400, f"model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    def _check_ignored(self, body: Lenient) -> None:
        """Unknown top-level fields: 400 under --strict-api, else one log line naming them."""
        names = body.ignored_fields()
        if not names:
            return
        if self.strict_api:
            raise ApiError(400, f"unknown parameter {_safe_name(names[0])!r}",
                           param=_safe_name(names[0]))
        shown = ", ".join(_safe_name(n) for n in names[:16])
        more = f" (+{len(names) - 16} more)" if len(names) > 16 else ""
        logger.warning("ignoring unknown request field(s): %s%s", shown, more)

    def _check_common(self, body: protocol._SamplingFields) -> None:
        self._check_model(body.model)
        self._check_ignored(body)
        if body.prompt_logprobs is not None:
            check_logprobs(body.prompt_logprobs, "prompt_logprobs")

    def _completion_prompts(
        self, prompts: list[str | list[int]]
    ) -> list[tuple[list[int], str | None]]:
        out: list[tuple[list[int], str | None]] = []
        for i, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt {i}"
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            with _as_api_error():
                out.append((self.inputs.prompt_ids(text, ids, where), text))
        return out

    def _render_messages(
        self, arg: tuple[list[ChatMessage], str, bool, list[dict[str, Any]] | None]
    ) -> list[int]:
        messages, param, add_generation_prompt, tools = arg
        return render_chat(self.tokenizer, messages, param, add_generation_prompt, tools,
                           literal_content=not self.trust_content_markers)

    def _params(
        self, body: protocol._SamplingFields, max_tokens: int, *, logprobs: int | None,
        prompt_logprobs: int | None, best_of: int | None = None,
        structured: StructuredOutputs | None = None,
    ) -> SamplingParams:
        return self._sampling_params(
            max_tokens=max_tokens, temperature=float(body.temperature),
            top_p=float(body.top_p), top_k=body.top_k, min_p=float(body.min_p), seed=body.seed,
            stop=tuple([body.stop] if isinstance(body.stop, str) else body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            n=body.n, best_of=best_of, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=float(body.presence_penalty),
            frequency_penalty=float(body.frequency_penalty),
            repetition_penalty=float(body.repetition_penalty),
            min_tokens=body.min_tokens, logit_bias=body.logit_bias,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            structured_outputs=structured,
        )

    async def _compile(self, params: SamplingParams, param: str) -> None:
        """Compile (and cache) the request's output grammar off the event loop, so a bad one is
        a 400 naming ``param``, the field it came from, and the engine thread finds it compiled."""
        spec = params.structured_outputs
        if spec is None:
            return
        grammars = self.engine.grammars
        try:
            await self._off_loop(lambda s: grammars.grammar(s, param), spec)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=_param_of(exc) or param) from None

    def _sampling_params(
        self, *, param_names: dict[str, str] | None = None, **fields: Any
    ) -> SamplingParams:
        try:
            params = SamplingParams(**fields)
        except ValueError as exc:
            param = _param_of(exc)
            raise ApiError(400, str(exc),
                           param=(param_names or {}).get(param or "", param)) from None
        with _as_api_error():
            self.inputs.check_params(params)
        return params

    async def _serve(
        self, kind: str, body: Any, prompts: list[tuple[list[int], str | None]],
        params: SamplingParams, options: RenderOptions, tenant: Tenant, http: Request,
    ) -> Any:
        start = time.monotonic()
        scope = self.tenants.scope(tenant, body.cache_salt)
        public_id = protocol.new_id({"completion": "cmpl", "chat": "chatcmpl",
                                     "response": "resp"}[kind])
        queue: asyncio.Queue[Any] = asyncio.Queue()
        job = Job(kind, public_id, body.model, protocol.now(), tenant, queue, [
            PromptState(public_id if len(prompts) == 1 else f"{public_id}-{i}", ids,
                    text if text is not None or not options.echo else self.tokenizer.decode(ids),
                    [Choice() for _ in range(params.num_choices)])
            for i, (ids, text) in enumerate(prompts)
        ], options, start)
        try:
            for prompt in job.prompts:
                await self.engine.add(prompt.request_id, prompt.token_ids, params, scope.salt,
                                      scope.use_cache, tenant.scheduling_domain, queue=queue)
                job.num_added += 1
        except EngineOverloaded as exc:
            self._finish(job)
            raise ApiError(429, str(exc), code="queue_full") from None
        except ValueError as exc:
            self._finish(job)
            where = "" if len(prompts) == 1 else f"prompt {job.num_added}: "
            raise ApiError(400, where + str(exc), param=_param_of(exc)) from None
        except BaseException:
            self._finish(job)
            raise
        if getattr(body, "stream", False):
            stream = self._stream_response(job, body) if kind == "response" else self._stream(job)
            return StreamingResponse(stream, media_type="text/event-stream")
        await self._collect(job, http)
        if kind == "response":
            return JSONResponse(self._response_body(job, body))
        return JSONResponse(self._final_body(job))

    # ---- engine -> response ---------------------------------------------------------------------

    async def _next(self, job: Job) -> tuple[Any, int, Choice]:
        had_first = job.first_token_time is not None
        output = await job.queue.get()
        if isinstance(output, EngineFailure):
            raise ApiError(500, str(output))
        if output.error is not None:  # this request alone failed inside a step
            raise ApiError(500, output.error)
        i, choice = job.add(output)
        if not had_first and job.first_token_time is not None:
            self.metrics.observe_first_token(job.tenant.domain, job.first_token_time - job.start,
                                             job.prompts[i].num_cached)
        return output, i, choice

    async def _drain(self, job: Job) -> None:
        while not job.done:
            await self._next(job)

    async def _collect(self, job: Job, http: Request) -> None:
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

    def _final_body(self, job: Job) -> dict[str, Any]:
        choices = []
        for i, prompt in enumerate(job.prompts):
            for j, choice in enumerate(job.ranked(prompt)):
                index = i * job.options.n + j
                if job.kind == "completion":
                    text, logprobs = self._completion_text(job, prompt, choice, first=True)
                    item = protocol.completion_choice(index, text, choice.reason, logprobs)
                else:
                    content: str | None = choice.text
                    calls: list[dict[str, Any]] = []
                    if job.options.tools:
                        content, calls = parse_tool_calls(choice.text)
                    reason = "tool_calls" if calls else choice.reason
                    item = protocol.chat_choice(index, content, reason,
                                                self._chat_logprobs(job, choice.logprobs), calls)
                if choice.stop_reason is not None:
                    item["stop_reason"] = choice.stop_reason
                if job.options.prompt_logprobs and job.kind == "completion":
                    item["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt)
                choices.append(item)
        if job.kind == "completion":
            return protocol.completion_response(job.public_id, job.model, job.created, choices,
                                                job.usage())
        body = protocol.chat_response(job.public_id, job.model, job.created, choices, job.usage())
        if job.options.prompt_logprobs:  # vLLM puts a chat's prompt logprobs beside its choices
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(job.prompts[0])
        return body

    def _completion_text(
        self, job: Job, prompt: PromptState, choice: Choice, *, first: bool,
        new_text: str | None = None, new_logprobs: list[dict[str, Any]] | None = None,
    ) -> tuple[str, dict[str, Any] | None]:
        """A completions choice's text and logprobs: the whole choice, or (``new_*``) one
        stream delta; ``first`` adds the echoed prompt."""
        options = job.options
        text = choice.text if new_text is None else new_text
        entries: list[dict[str, Any] | None] = list(
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

    def _chat_logprobs(
        self, job: Job, entries: list[dict[str, Any]]
    ) -> dict[str, Any] | None:
        if job.options.logprobs is None:
            return None
        return chat_logprobs(entries, job.options.logprobs, self.token_text)

    def _vllm_prompt_logprobs(self, prompt: PromptState) -> list[Any] | None:
        if prompt.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(prompt.prompt_logprobs, self.token_text)

    async def _stream(self, job: Job) -> AsyncIterator[str]:
        try:
            if job.kind == "chat":
                for j in range(job.options.n):
                    yield _sse(protocol.chat_chunk(job.public_id, job.model, job.created, j,
                                                   {"role": "assistant", "content": ""}, None))
            while not job.done:
                try:
                    output, i, choice = await self._next(job)
                except ApiError as exc:
                    yield _sse({"error": {"message": exc.message, "type": "server_error",
                                          "param": None, "code": None}})
                    break
                chunk = self._chunk(job, output, i, choice)
                if chunk is not None:
                    if job.options.continuous_usage:
                        chunk["usage"] = job.usage()
                    yield _sse(chunk)
            if job.options.include_usage and job.done:
                obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
                yield _sse(protocol.usage_chunk(job.public_id, obj, job.model, job.created,
                                                job.usage()))
            yield "data: [DONE]\n\n"
        finally:
            self._finish(job)

    def _chunk(
        self, job: Job, output: RequestOutput, i: int, choice: Choice
    ) -> dict[str, Any] | None:
        reason = finish_reason_of(output.finish_reason) if output.finished else None
        first = not choice.started
        if not (output.text or output.new_token_ids or reason or (first and job.options.echo)):
            return None  # nothing new: no token, no text, no finish
        choice.started = True
        index = i * job.options.n + output.index
        prompt = job.prompts[i]
        if job.kind == "completion":
            text, logprobs = self._completion_text(job, prompt, choice, first=first,
                                                   new_text=output.text,
                                                   new_logprobs=output.new_logprobs)
            chunk = protocol.completion_chunk(job.public_id, job.model, job.created, index,
                                              text, reason, logprobs)
        else:
            delta: dict[str, Any] = {"content": output.text}
            if job.options.tools:
                text, calls = choice.tool_stream.feed(output.text, final=output.finished)
                delta = {"content": text} if text else {}
                if calls:
                    delta["tool_calls"] = calls
                if reason is not None and choice.tool_stream.num_calls:
                    reason = "tool_calls"
                if not (delta or reason or output.new_logprobs):
                    return None
            chunk = protocol.chat_chunk(job.public_id, job.model, job.created, index, delta,
                                        reason, self._chat_logprobs(job, output.new_logprobs))
        if first and job.options.prompt_logprobs:
            chunk["choices"][0]["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt)
        if reason is not None and choice.stop_reason is not None:
            chunk["choices"][0]["stop_reason"] = choice.stop_reason
        return chunk

    # ---- the Responses API ----------------------------------------------------------------------

    def _response_body(self, job: Job, body: ResponsesRequest) -> dict[str, Any]:
        choice = job.prompts[0].choices[0]
        status, incomplete = response_status(choice.reason)
        message = protocol.response_message(f"msg_{job.public_id[5:]}", choice.text, "completed")
        use = protocol.response_usage(job.num_prompt_tokens, job.num_output_tokens,
                                      job.prompts[0].num_cached)
        return protocol.response_object(job.public_id, body, job.created, status=status,
                                        output=[message], use=use, incomplete_reason=incomplete)

    async def _stream_response(self, job: Job, body: ResponsesRequest) -> AsyncIterator[str]:
        """The event sequence of a streamed response, each event with its ``sequence_number``."""
        sequence = 0
        item_id = f"msg_{job.public_id[5:]}"

        def event(kind: str, **payload: Any) -> str:
            nonlocal sequence
            data = {"type": kind, "sequence_number": sequence, **payload}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

        def snapshot(status: str, use: dict[str, Any] | None = None,
                     output: list[dict[str, Any]] | None = None,
                     incomplete: str | None = None) -> dict[str, Any]:
            return protocol.response_object(job.public_id, body, job.created, status=status,
                                            output=output or [], use=use,
                                            incomplete_reason=incomplete)

        part = {"item_id": item_id, "output_index": 0, "content_index": 0}
        try:
            yield event("response.created", response=snapshot("in_progress"))
            yield event("response.in_progress", response=snapshot("in_progress"))
            yield event("response.output_item.added", output_index=0,
                        item=protocol.response_message(item_id, "", "in_progress"))
            yield event("response.content_part.added", **part, part=protocol.output_text(""))
            choice = job.prompts[0].choices[0]
            while not job.done:
                try:
                    output, _, choice = await self._next(job)
                except ApiError as exc:
                    yield event("error", code="server_error", message=exc.message, param=None)
                    return
                if output.text:
                    yield event("response.output_text.delta", **part, delta=output.text,
                                logprobs=[])
            yield event("response.output_text.done", **part, text=choice.text, logprobs=[])
            yield event("response.content_part.done", **part,
                        part=protocol.output_text(choice.text))
            message = protocol.response_message(item_id, choice.text, "completed")
            yield event("response.output_item.done", output_index=0, item=message)
            status, incomplete = response_status(choice.reason)
            use = protocol.response_usage(job.num_prompt_tokens, job.num_output_tokens,
                                          job.prompts[0].num_cached)
            # "response.completed" even when cut at max_output_tokens (as vLLM): clients wait
            # for it; the response's status says "incomplete"
            yield event("response.completed", response=snapshot(status, use, [message],
                                                                incomplete))
        finally:
            self._finish(job)

    # ---- bookkeeping ----------------------------------------------------------------------------

    def _finish(self, job: Job) -> None:
        """Release the job's slots; abort in the engine what the client left unfinished."""
        if job.released:
            return
        job.released = True
        for prompt in job.prompts[: job.num_added]:
            self.engine.release(job.tenant.scheduling_domain)
            if not prompt.done:
                self.engine.abort(prompt.request_id)
        if not job.num_added:
            return
        self.metrics.prompt_tokens.inc(job.num_prompt_tokens)
        self.metrics.generation_tokens.inc(job.num_output_tokens)
        if job.done:
            self.metrics.observe_finished(job.tenant.domain, time.monotonic() - job.start,
                                          job.first_reason)


async def _wait_disconnect(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _safe_name(name: str) -> str:
    """A field name fit for a log line: short, plain characters; anything else is elided."""
    return name if _FIELD_NAME.fullmatch(name) else "<unprintable>"


def _text_bytes(prompt: Any) -> int:
    """UTF-8 bytes of the text in a prompt (a string, or a list of strings); 0 for token ids."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8"))
    if isinstance(prompt, list):
        return sum(len(p.encode("utf-8")) for p in prompt if isinstance(p, str))
    return 0


@contextlib.contextmanager
def _as_api_error() -> Iterator[None]:
    """An engine input check's `InvalidParam` as a 400 naming the field."""
    try:
        yield
    except InvalidParam as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


def _param_of(exc: ValueError) -> str | None:
    """The request field an engine/params error names (`InvalidParam`), for the error body."""
    return exc.param if isinstance(exc, InvalidParam) else None
