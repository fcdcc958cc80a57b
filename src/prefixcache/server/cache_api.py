"""The cache endpoints callers use: `POST /v1/cache/warm`, `GET /v1/cache/pins`,
`DELETE /v1/cache/pins/{id}`, and the admin's `POST /reset_prefix_cache` and `POST /cache/purge`.

Warming prefills a prompt (or chat messages) in the caller's own namespace — one output token,
discarded — so its blocks are committed, and pins them for ``ttl`` within the tenant's budget
(`cache/pins.py`). A tenant sees and releases only its own pins; a pin is described by its
id, token count, TTL, time left and last block's digest, never by tokens or text.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from prefixcache.cache.pins import ttl_seconds
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.server.errors import ApiError
from prefixcache.server.job_runner import JobRunner
from prefixcache.server.jobs import Job, PreparedJob, RenderOptions, Step
from prefixcache.server.openapi import operation_id
from prefixcache.server.protocol import JSONObject, PurgeRequest, WarmRequest
from prefixcache.server.rendering import Rendering
from prefixcache.server.serving_context import ServingContext, text_bytes
from prefixcache.server.tenancy import Tenant

__all__ = ["ServingCache", "cache_router"]

logger = logging.getLogger("prefixcache.server")


class ServingCache:
    """Warm-up, pins, and the admin's reset and purge of the cache."""

    def __init__(self, context: ServingContext, runner: JobRunner) -> None:
        self.context = context
        self.runner = runner
        self.engine = context.engine

    async def warm(self, body: WarmRequest, tenant: Tenant, http: Request) -> Response:
        self.context.check_model(body.model)
        if body.stream:
            raise ApiError(400, "a warm-up is not streamed", param="stream")
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give 'prompt' or 'messages', not both", param="prompt")
        token_ids = await self._prompt_ids(body)
        ttl_s = None if body.ttl is None else ttl_seconds(body.ttl)
        if body.ttl is not None and ttl_s is None:
            raise ApiError(400, "ttl must be '5m', '1h', '24h' or seconds in (0, 86400]",
                           param="ttl")
        options = RenderOptions(prefill_only=True)
        if ttl_s is not None:
            options.pins.append((len(token_ids) - 1, ttl_s))
        params = self.context.sampling_params(
            lambda: SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        prepared = PreparedJob([(token_ids, None)], params, options)
        return await self.runner.serve(WarmRendering(self.context.block_size), body, prepared,
                                       tenant, http)

    async def _prompt_ids(self, body: WarmRequest) -> list[int]:
        """The prompt's token ids, or the conversation's through the chat template."""
        context = self.context
        if body.messages is not None:
            context.check_prompt_bytes(sum(text_bytes(m.text()) for m in body.messages),
                                       "messages")
            # ending before a user turn (a system prompt): the prefix later conversations share,
            # without the assistant's generation prompt
            ask = bool(body.messages) and body.messages[-1].role == "user"
            return await context.render_messages(body.messages, "messages", ask)
        assert body.prompt is not None
        context.check_prompt_bytes(text_bytes(body.prompt), "prompt")
        return (await context.encode_prompts([body.prompt]))[0][0]

    async def list_pins(self, tenant: Tenant) -> JSONObject:
        return {"object": "list", "data": await self.engine.pins_of(tenant.scheduling_domain)}

    async def delete_pin(self, pin_id: str, tenant: Tenant) -> JSONObject:
        if not await self.engine.release_pin(tenant.scheduling_domain, pin_id):
            raise ApiError(404, "no such pin", param="id", code="pin_not_found")
        return {"id": pin_id, "deleted": True}

    async def reset_prefix_cache(self, tenant: Tenant) -> JSONResponse:
        if not tenant.admin:
            raise ApiError(403, "resetting the prefix cache needs an admin API key")
        done, num_pins = await self.engine.reset_prefix_cache_and_pins()
        if not done:
            raise ApiError(409, "the prefix cache was not reset: requests still hold KV blocks; "
                           "retry when the server is idle", code="cache_in_use")
        logger.info("prefix cache reset by an admin of %s (%d pins released)",
                    tenant.isolation_domain, num_pins)
        return JSONResponse({"reset": True, "pins_released": num_pins})

    async def purge(self, body: PurgeRequest, caller: Tenant) -> JSONResponse:
        """Remove one tenant's blocks from the lower tiers (admin only)."""
        if not caller.admin:
            raise ApiError(403, "purging a tenant's cache needs an admin API key")
        tenants = self.context.tenants
        if tenants.trusted:
            known = {tenants.default_tenant.tenant_id: tenants.default_tenant}
        else:
            known = {t.tenant_id: t for t in tenants.tenants()}
        target = known.get(body.tenant)
        if target is None:
            raise ApiError(404, "no such tenant", param="tenant", code="tenant_not_found")
        domain = target.scheduling_domain
        try:
            removed = await self.engine.purge_domain(domain)
        except ConnectionError as exc:
            raise ApiError(503, f"not every KV tier was purged: {exc}",
                           code="tier_unavailable") from None
        logger.info("KV tiers purged of %s by an admin of %s: %s", domain,
                    caller.isolation_domain, removed)
        return JSONResponse({"tenant": body.tenant, "domain": domain, "removed": removed})


def cache_router(serving: ServingCache, auth: Callable[[Request], Tenant]) -> APIRouter:
    router = APIRouter(generate_unique_id_function=operation_id)

    @router.post("/v1/cache/warm")
    async def warm(body: WarmRequest, request: Request,
                   tenant: Tenant = Depends(auth)) -> Response:
        return await serving.warm(body, tenant, request)

    @router.get("/v1/cache/pins")
    async def pins(tenant: Tenant = Depends(auth)) -> JSONObject:
        return await serving.list_pins(tenant)

    @router.delete("/v1/cache/pins/{pin_id}")
    async def delete_pin(pin_id: str, tenant: Tenant = Depends(auth)) -> JSONObject:
        return await serving.delete_pin(pin_id, tenant)

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(tenant: Tenant = Depends(auth)) -> JSONResponse:
        return await serving.reset_prefix_cache(tenant)

    @router.post("/cache/purge")
    async def purge_cache(body: PurgeRequest, tenant: Tenant = Depends(auth)) -> JSONResponse:
        return await serving.purge(body, tenant)

    return router


class WarmRendering(Rendering):
    """What a warm-up did: the prompt's tokens, those already cached, those it wrote to the
    cache, those pinned (in whole blocks of ``block_size``)."""

    id_prefix = "warm"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def body(self, job: Job) -> JSONObject:
        prompt = job.prompts[0]
        bs = self.block_size
        pinned = max((n // bs * bs for n, _ in job.options.pins), default=0)
        return {"object": "cache.warm", "prompt_tokens": len(prompt.token_ids),
                "cached_tokens": prompt.num_cached, "cache_write_tokens": prompt.num_written,
                "pinned_tokens": pinned,
                "ttl_s": max((t for _, t in job.options.pins), default=None)}

    async def stream(self, job: Job, outputs: AsyncIterator[Step]) -> AsyncIterator[str]:
        raise AssertionError("a warm-up is never streamed")  # refused before it is queued
        yield ""  # pragma: no cover
