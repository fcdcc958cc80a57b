"""The cache endpoints callers use: `POST /v1/cache/warm`, `GET /v1/cache/pins`,
`DELETE /v1/cache/pins/{id}`.

Warming prefills a prompt (or chat messages) in the caller's own namespace — one output token,
discarded — so its blocks are committed, and pins them for ``ttl`` within the tenant's budget
(`cache/pins.py`). A tenant sees and releases only its own pins; a pin is described by its
id, token count, TTL, time left and last block's digest, never by tokens or text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from prefixcache.cache.pins import ttl_seconds
from prefixcache.server.completions import CompletionsAPI
from prefixcache.server.errors import ApiError
from prefixcache.server.jobs import Job, RenderOptions
from prefixcache.server.protocol import JSONObject, WarmRequest
from prefixcache.server.serving_base import Rendering, text_bytes
from prefixcache.server.tenancy import Tenant

__all__ = ["CacheAPI"]



class CacheAPI(CompletionsAPI):
    """Warm-up and pins (a prompt is tokenized as the completions endpoint does)."""

    async def warm(self, body: WarmRequest, tenant: Tenant, http: Request) -> Response:
        self._check_model(body.model)
        if body.stream:
            raise ApiError(400, "a warm-up is not streamed", param="stream")
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give 'prompt' or 'messages', not both", param="prompt")
        if body.messages is not None:
            self._check_prompt_bytes(sum(text_bytes(m.text()) for m in body.messages),
                                     "messages")
            # ending before a user turn (a system prompt): the prefix later conversations share,
            # without the assistant's generation prompt
            ask = bool(body.messages) and body.messages[-1].role == "user"
            token_ids = await self._off_loop(self._render_messages,
                                             (body.messages, "messages", ask, None))
        else:
            assert body.prompt is not None
            self._check_prompt_bytes(text_bytes(body.prompt), "prompt")
            token_ids = (await self._off_loop(self._completion_prompts, [body.prompt]))[0][0]
        ttl_s = None if body.ttl is None else ttl_seconds(body.ttl)
        if body.ttl is not None and ttl_s is None:
            raise ApiError(400, "ttl must be '5m', '1h', '24h' or seconds in (0, 86400]",
                           param="ttl")
        options = RenderOptions()
        if ttl_s is not None:
            options.pins.append((len(token_ids) - 1, ttl_s))
        params = self._sampling_params(max_tokens=1, temperature=0.0, ignore_eos=True)
        return await self._serve(WarmRendering(self), body, [(token_ids, None)], params,
                                 options, tenant, http)

    async def list_pins(self, tenant: Tenant) -> JSONObject:
        return {"object": "list", "data": await self.engine.pins_of(tenant.scheduling_domain)}

    async def delete_pin(self, pin_id: str, tenant: Tenant) -> JSONObject:
        if not await self.engine.release_pin(tenant.scheduling_domain, pin_id):
            raise ApiError(404, "no such pin", param="id", code="pin_not_found")
        return {"id": pin_id, "deleted": True}


class WarmRendering(Rendering[WarmRequest]):
    """What a warm-up did: the prompt's tokens, those already cached, those pinned."""

    id_prefix = "warm"

    def body(self, job: Job, request: WarmRequest) -> JSONObject:
        prompt = job.prompts[0]
        bs = self.serving.engine.limits.block_size
        pinned = max((n // bs * bs for n, _ in job.options.pins), default=0)
        return {"object": "cache.warm", "prompt_tokens": len(prompt.token_ids),
                "cached_tokens": prompt.num_cached, "pinned_tokens": pinned,
                "ttl_s": max((t for _, t in job.options.pins), default=None)}

    async def stream(self, job: Job, request: WarmRequest) -> AsyncIterator[str]:
        raise AssertionError("a warm-up is never streamed")  # refused before it is queued
        yield ""  # pragma: no cover
