"""The shared ground of the OpenAI endpoints: checks, tokenizing off the event loop, queueing a
request's prompts in the engine and finishing them, and the `Rendering` type each API's responses
implement (one JSON body, or a stream of server-sent events).

Each API is a module over this base (`completions.py`, `chat.py`, `responses.py`,
`tokenizer_api.py`); `serving.OpenAIServing` is all of them over one model. A client that goes
away aborts its requests. Prompt text and token ids never reach a log line; neither do the values
of ignored fields, only their (sanitised) names.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixcache.cache.pins import TTLS
from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.sampling_params import SamplingParams, StructuredOutputs
from prefixcache.errors import InvalidParam
from prefixcache.server import protocol
from prefixcache.server.async_engine import AsyncEngine, EngineFailure, EngineOverloaded
from prefixcache.server.errors import ApiError
from prefixcache.server.jobs import Choice, Job, PromptState, RenderOptions
from prefixcache.server.logprobs import TokenText, vllm_prompt_logprobs
from prefixcache.server.metrics import ServerMetrics
from prefixcache.server.protocol import ChatMessage, JSONObject, Lenient
from prefixcache.server.request_params import check_logprobs, render_chat
from prefixcache.server.tenancy import Tenant, TenantRegistry

__all__ = [
    "ChunkRendering", "Rendering", "ServingBase", "as_api_error", "sse", "text_bytes",
]  # fmt: skip

logger = logging.getLogger("prefixcache.server")

_DISCONNECT_POLL_S = 0.5
_FIELD_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
A = TypeVar("A")
T = TypeVar("T")



class StreamableBody(Protocol):
    """What `ServingBase._serve` reads of a request body (every API's has these)."""

    model: str
    cache_salt: str | None
    stream: bool


Body = TypeVar("Body", bound=StreamableBody, contravariant=True)


class Rendering(abc.ABC, Generic[Body]):
    """How one API answers a job: ``body`` once it is done, or ``stream`` as it runs (the
    stream releases the job when it ends). ``id_prefix`` starts the response ids."""

    id_prefix = ""

    def __init__(self, serving: ServingBase) -> None:
        self.serving = serving

    @abc.abstractmethod
    def body(self, job: Job, request: Body) -> JSONObject: ...

    @abc.abstractmethod
    def stream(self, job: Job, request: Body) -> AsyncIterator[str]: ...


class ChunkRendering(Rendering[Body]):
    """Completions and chat: one ``data:`` chunk per step that added something, usage when
    asked, then ``data: [DONE]``. ``usage_object`` names the usage chunk's ``object``."""

    usage_object = ""

    def opening(self, job: Job) -> list[JSONObject]:
        """Chunks sent before the first output (chat: each choice's role)."""
        return []

    @abc.abstractmethod
    def chunk(
        self, job: Job, output: RequestOutput, i: int, choice: Choice
    ) -> JSONObject | None:
        """The chunk for ``output`` (of prompt ``i``), or None when it adds nothing."""

    async def stream(self, job: Job, request: Body) -> AsyncIterator[str]:
        serving = self.serving
        try:
            for opening in self.opening(job):
                yield sse(opening)
            while not job.done:
                try:
                    output, i, choice = await serving._next(job)
                except ApiError as exc:
                    yield sse({"error": {"message": exc.message, "type": "server_error",
                                         "param": None, "code": None}})
                    break
                chunk = self.chunk(job, output, i, choice)
                if chunk is not None:
                    if job.options.continuous_usage:
                        chunk["usage"] = job.usage()
                    yield sse(chunk)
            if job.options.include_usage and job.done:
                yield sse(protocol.usage_chunk(job.public_id, self.usage_object, job.model,
                                               job.created, job.usage()))
            yield "data: [DONE]\n\n"
        finally:
            serving._finish(job)


class ServingBase:
    """What every endpoint shares over one model: the engine, tenancy, metrics and checks."""

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
        self.precision = dict(limits.precision)  # what the model runs in, for /v1/models
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

    # ---- request -> engine --------------------------------------------------------------

    async def _off_loop(self, fn: Callable[[A], T], arg: A) -> T:
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

    def _render_messages(
        self, arg: tuple[list[ChatMessage], str, bool, list[JSONObject] | None]
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
        with as_api_error():
            self.inputs.check_params(params)
        return params

    async def _serve(
        self, rendering: Rendering[Body], body: Body, prompts: list[tuple[list[int], str | None]],
        params: SamplingParams, options: RenderOptions, tenant: Tenant, http: Request,
    ) -> Response:
        """Queue one engine request per prompt, then answer with ``rendering``: one body, or a
        stream when the request asks for one."""
        start = time.monotonic()
        scope = self.tenants.scope(tenant, body.cache_salt)
        public_id = protocol.new_id(rendering.id_prefix)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        job = Job(public_id, body.model, protocol.now(), tenant, queue, [
            PromptState(public_id if len(prompts) == 1 else f"{public_id}-{i}", ids,
                    text if text is not None or not options.echo else self.tokenizer.decode(ids),
                    [Choice() for _ in range(params.num_choices)])
            for i, (ids, text) in enumerate(prompts)
        ], options, start)
        job.max_tokens = params.max_tokens
        retain = getattr(body, "prompt_cache_retention", None) == "24h"
        try:
            for prompt in job.prompts:
                pins = options.pins
                if retain:  # OpenAI's extended retention: the whole prompt, a day
                    pins = [*pins, (len(prompt.token_ids) - 1, TTLS["24h"])]
                await self.engine.add(prompt.request_id, prompt.token_ids, params, scope.salt,
                                      scope.use_cache, tenant.scheduling_domain, queue=queue,
                                      pins=pins)
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
        if body.stream:
            return StreamingResponse(rendering.stream(job, body), media_type="text/event-stream")
        await self._collect(job, http)
        return JSONResponse(rendering.body(job, body))

    # ---- engine -> response -------------------------------------------------------------

    async def _next(self, job: Job) -> tuple[RequestOutput, int, Choice]:
        had_first = job.first_token_time is not None
        output = await job.queue.get()
        if isinstance(output, EngineFailure):
            raise ApiError(500, str(output))
        if output.error is not None:  # this request alone failed inside a step
            raise ApiError(500, output.error)
        last_token_time = job.last_token_time
        i, choice = job.add(output)
        if not had_first and job.first_token_time is not None:
            self.metrics.observe_first_token(job.tenant.isolation_domain,
                                             job.first_token_time - job.start,
                                             job.prompts[i].num_cached)
        elif output.new_token_ids and last_token_time is not None and job.last_token_time:
            self.metrics.observe_tokens(job.last_token_time - last_token_time,
                                        len(output.new_token_ids))
        if output.finished:
            self.metrics.observe_choice(output, job.max_tokens)
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

    def _vllm_prompt_logprobs(self, prompt: PromptState) -> list[Any] | None:
        if prompt.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(prompt.prompt_logprobs, self.token_text)

    # ---- bookkeeping --------------------------------------------------------------------

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
        self.metrics.count_tokens(job.num_prompt_tokens, job.num_output_tokens,
                                  sum(p.num_cached for p in job.prompts[: job.num_added]))
        if job.done:
            self.metrics.observe_finished(job.tenant.isolation_domain, time.monotonic() - job.start,
                                          job.first_reason)


async def _wait_disconnect(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)


def sse(payload: JSONObject) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _safe_name(name: str) -> str:
    """A field name fit for a log line: short, plain characters; anything else is elided."""
    return name if _FIELD_NAME.fullmatch(name) else "<unprintable>"


def text_bytes(prompt: Any) -> int:
    """UTF-8 bytes of the text in a prompt (a string, or a list of strings); 0 for token ids."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8"))
    if isinstance(prompt, list):
        return sum(len(p.encode("utf-8")) for p in prompt if isinstance(p, str))
    return 0


@contextlib.contextmanager
def as_api_error() -> Iterator[None]:
    """An engine input check's `InvalidParam` as a 400 naming the field."""
    try:
        yield
    except InvalidParam as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


def _param_of(exc: ValueError) -> str | None:
    """The request field an engine/params error names (`InvalidParam`), for the error body."""
    return exc.param if isinstance(exc, InvalidParam) else None
