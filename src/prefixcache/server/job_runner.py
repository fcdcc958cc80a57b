"""`JobRunner`: a prepared job through the engine and back — one engine request per prompt
queued in the caller's namespace, the outputs gathered (and timed for the metrics) as they
arrive, the answer rendered as one body or a stream, and the job's slots released (its
unfinished requests aborted) however it ends. A client that goes away aborts its requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixcache.engine.lora import LoraBusy, LoraNotFound
from prefixcache.server import protocol
from prefixcache.server.async_engine import AsyncEngine, EngineFailure, EngineOverloaded
from prefixcache.server.errors import ApiError
from prefixcache.server.jobs import Choice, Job, PreparedJob, PromptState, Step
from prefixcache.server.metrics import ServerMetrics
from prefixcache.server.rendering import Rendering
from prefixcache.server.serving_context import param_of
from prefixcache.server.tenancy import Tenant, TenantRegistry

if TYPE_CHECKING:
    from prefixcache.model.tokenizer import Tokenizer
    from prefixcache.server.async_engine import OutputQueue
    from prefixcache.server.lora import ServingLoras

__all__ = ["JobRunner", "StreamableBody"]

_DISCONNECT_POLL_S = 0.5


class StreamableBody(Protocol):
    """What the runner reads of a request body (every API's has these)."""

    @property
    def model(self) -> str: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def stream(self) -> bool: ...


class JobRunner:
    """Runs jobs on ``engine`` in their tenant's namespace, reporting to ``metrics``."""

    def __init__(
        self, engine: AsyncEngine, tenants: TenantRegistry, metrics: ServerMetrics,
        tokenizer: Tokenizer, loras: ServingLoras | None = None,
    ) -> None:
        self.engine = engine
        self.tenants = tenants
        self.metrics = metrics
        self.tokenizer = tokenizer  # echo of a prompt given as token ids
        self.loras = loras  # the adapter a job's model names

    async def serve(
        self, rendering: Rendering, body: StreamableBody, prepared: PreparedJob, tenant: Tenant,
        http: Request,
    ) -> Response:
        """Queue ``prepared``, then answer with ``rendering``: one body, or a stream when the
        request asks for one."""
        job = self._new_job(rendering.id_prefix, body.model, prepared, tenant)
        await self._add(job, prepared, body.cache_salt)
        if body.stream:
            return StreamingResponse(self._stream(rendering, job), media_type="text/event-stream")
        await self._collect(job, http)
        return JSONResponse(rendering.body(job))

    def _new_job(self, id_prefix: str, model: str, prepared: PreparedJob, tenant: Tenant) -> Job:
        start = time.monotonic()
        public_id = protocol.new_id(id_prefix)
        options, prompts = prepared.options, prepared.prompts
        queue: OutputQueue = asyncio.Queue()
        job = Job(public_id, model, protocol.now(), tenant, queue, [
            PromptState(public_id if len(prompts) == 1 else f"{public_id}-{i}", ids,
                        text if text is not None or not options.echo
                        else self.tokenizer.decode(ids),
                        [Choice() for _ in range(prepared.params.num_choices)])
            for i, (ids, text) in enumerate(prompts)
        ], options, start)
        job.max_tokens = prepared.params.max_tokens
        return job

    async def _add(self, job: Job, prepared: PreparedJob, cache_salt: str | None) -> None:
        """One engine request per prompt; on any refusal the job is released and the error
        answered (429 for a full queue, 400 naming the prompt otherwise)."""
        tenant = job.tenant
        scope = self.tenants.scope(tenant, cache_salt)
        bs = self.engine.limits.block_size
        lora = self.loras.adapter_name(job.model) if self.loras is not None else None
        try:
            for prompt in job.prompts:
                num_public = 0
                if scope.use_cache:
                    prompt.num_cacheable = len(prompt.token_ids) // bs * bs
                    num_public = self.tenants.public.num_public_blocks(tenant, prompt.token_ids,
                                                                       bs)
                    prompt.num_public = num_public * bs
                pins = job.options.pins
                if prepared.retention_s is not None:  # the whole prompt
                    pins = [*pins, (len(prompt.token_ids) - 1, prepared.retention_s)]
                await self.engine.add(prompt.request_id, prompt.token_ids, prepared.params,
                                      scope.salt, scope.use_cache, tenant.scheduling_domain,
                                      queue=job.queue, pins=pins, lora=lora,
                                      public_blocks=num_public)
                job.num_added += 1
        except (EngineOverloaded, LoraBusy) as exc:
            self.finish(job)
            raise ApiError(429, str(exc), code="queue_full") from None
        except LoraNotFound as exc:  # unloaded since the model was checked
            self.finish(job)
            raise ApiError(404, str(exc), param="model", code="model_not_found") from None
        except ValueError as exc:
            self.finish(job)
            where = "" if len(job.prompts) == 1 else f"prompt {job.num_added}: "
            raise ApiError(400, where + str(exc), param=param_of(exc)) from None
        except BaseException:
            self.finish(job)
            raise

    async def _stream(self, rendering: Rendering, job: Job) -> AsyncIterator[str]:
        try:
            async for event in rendering.stream(job, self.outputs(job)):
                yield event
        finally:
            self.finish(job)

    async def outputs(self, job: Job) -> AsyncIterator[Step]:
        """The job's outputs until it is done; a failed step raises `ApiError` (500)."""
        while not job.done:
            yield await self._next(job)

    async def _next(self, job: Job) -> Step:
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
        return Step(output, i, choice)

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
            self.finish(job)
        if not drain.done() or drain.cancelled():
            raise ApiError(499, "client disconnected")
        drain.result()

    def finish(self, job: Job) -> None:
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
        added = job.prompts[: job.num_added]
        num_cached = sum(p.num_cached for p in added)
        num_public = sum(p.num_public_cached for p in added)
        self.metrics.count_tokens(job.num_prompt_tokens, job.num_output_tokens, num_cached)
        self.metrics.count_hits(job.tenant.isolation_domain, num_cached - num_public, num_public)
        if job.done:
            self.metrics.observe_finished(job.tenant.isolation_domain, time.monotonic() - job.start,
                                          job.first_reason)


async def _wait_disconnect(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)
