"""The FastAPI application: routes, authentication and lifecycle around one `LLMEngine`.

``create_app(engine, ...)`` wires the engine thread (`AsyncEngine`), tenancy, metrics and the
OpenAI endpoints; starting the app starts the engine thread, stopping it stops the thread. The
endpoint logic itself lives in `serving`, the wire format in `protocol`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixcache.server import protocol
from prefixcache.server.async_engine import AsyncEngine
from prefixcache.server.errors import ApiError, install_error_handlers
from prefixcache.server.limits import BodyLimit
from prefixcache.server.metrics import CONTENT_TYPE, ServerMetrics
from prefixcache.server.openapi import install_openapi, operation_id
from prefixcache.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    JSONObject,
    MessagesCountRequest,
    MessagesRequest,
    PurgeRequest,
    ResponsesRequest,
    TokenizeRequest,
    WarmRequest,
)
from prefixcache.server.serving import OpenAIServing
from prefixcache.server.tenancy import Tenant, TenantRegistry

if TYPE_CHECKING:
    from prefixcache.engine.llm_engine import LLMEngine

__all__ = ["create_app", "metrics_authorization"]

logger = logging.getLogger("prefixcache.server")


def create_app(
    engine: LLMEngine,
    *,
    model_name: str,
    tenants: TenantRegistry,
    max_queue_len: int = 256,
    default_max_tokens: int = 256,
    log_interval_s: float = 10.0,
    max_request_bytes: int = 8 * 1024 * 1024,
    trust_content_markers: bool = False,
    metrics_key: str | None = None,
    metrics_domain_labels: str = "name",
    strict_api: bool = False,
    vllm_metric_names: bool = True,
    dashboard: bool = True,
) -> FastAPI:
    """An OpenAI-compatible app over ``engine`` (an `LLMEngine`, driven from its own thread).

    With a tenants file, ``/metrics`` answers only an admin tenant's key or ``metrics_key``.
    ``strict_api``: unknown request fields get 400 instead of being ignored.
    ``vllm_metric_names``: export vLLM's names beside ours (`server/vllm_metrics.py`).
    ``dashboard``: serve ``GET /dashboard`` (`server/dashboard`).
    """
    metrics = ServerMetrics(model_name, engine.block_bytes, metrics_domain_labels,
                            vllm_max_model_len=engine.max_model_len if vllm_metric_names else None)
    offload = engine.offload
    if offload is not None:
        metrics.add_tiers(offload.stats_dict)
    max_pending = engine.limits.max_num_seqs + max_queue_len
    # with tenants, one domain may hold at most half of the queue
    per_domain = None if tenants.trusted else max(1, max_pending // 2)
    async_engine = AsyncEngine(engine, max_pending=max_pending, metrics=metrics,
                               log_interval_s=log_interval_s, max_pending_per_domain=per_domain)
    serving = OpenAIServing(async_engine, model_name=model_name, tenants=tenants,
                            metrics=metrics, default_max_tokens=default_max_tokens,
                            trust_content_markers=trust_content_markers, strict_api=strict_api)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()
            engine.flush_tiers()  # what the write-behind queued reaches the tiers

    app = FastAPI(title="prefixcache", lifespan=lifespan, generate_unique_id_function=operation_id)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    install_error_handlers(app)
    _add_routes(app, serving, tenants, metrics_key)
    install_openapi(app, model_name)
    if dashboard:
        from prefixcache.server.dashboard import CacheView, install_dashboard

        view = CacheView(engine.cache_identity, metrics.domain_label)
        engine.cache.add_observer(view)  # before the engine's thread starts
        install_dashboard(app, async_engine, metrics, view, model_name,
                          metrics_key_check(tenants, metrics_key), api_key_of,
                          offload.stats_dict if offload is not None else None,
                          tenants.derive_key("dashboard-session"))
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    return app


def api_key_of(request: Request) -> str | None:
    """The API key: ``Authorization: Bearer <key>``, or Anthropic's ``x-api-key: <key>``."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = request.headers.get("x-api-key", "").strip()
    return key or None


def _auth_dependency(tenants: TenantRegistry) -> Callable[[Request], Tenant]:
    def authenticate(request: Request) -> Tenant:
        tenant = tenants.authenticate(api_key_of(request))
        if tenant is None:
            reason = "missing" if api_key_of(request) is None else "invalid"
            raise ApiError(401, f"{reason} API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        return tenant

    return authenticate


def metrics_authorization(
    tenants: TenantRegistry, metrics_key: str | None
) -> Callable[[Request], None]:
    """/metrics names tenants and their traffic: behind an admin or metrics key when tenanted."""
    check = metrics_key_check(tenants, metrics_key)

    def authorize(request: Request) -> None:
        check(api_key_of(request))

    return authorize


def metrics_key_check(
    tenants: TenantRegistry, metrics_key: str | None
) -> Callable[[str | None], None]:
    """Raises `ApiError` (401, 403) unless ``token`` may read the metrics (and the dashboard)."""
    key_digest = hashlib.sha256(metrics_key.encode()).digest() if metrics_key else None

    def check(token: str | None) -> None:
        if tenants.trusted:
            return
        if token and key_digest is not None and hmac.compare_digest(
            hashlib.sha256(token.encode()).digest(), key_digest
        ):
            return
        tenant = tenants.authenticate(token)
        if tenant is None:
            raise ApiError(401, "/metrics needs an admin or metrics API key: send "
                           "'Authorization: Bearer <key>'", code="invalid_api_key")
        if not tenant.admin:
            raise ApiError(403, "/metrics needs an admin or metrics API key")

    return check


def _add_routes(
    app: FastAPI, serving: OpenAIServing, tenants: TenantRegistry, metrics_key: str | None
) -> None:
    auth = _auth_dependency(tenants)
    metrics_auth = metrics_authorization(tenants, metrics_key)
    async_engine = serving.engine

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request,
                          tenant: Tenant = Depends(auth)) -> Response:
        return await serving.completions(body, tenant, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request,
                   tenant: Tenant = Depends(auth)) -> Response:
        return await serving.chat(body, tenant, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request,
                        tenant: Tenant = Depends(auth)) -> Response:
        return await serving.responses(body, tenant, request)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(tenant: Tenant = Depends(auth)) -> JSONObject:
        return protocol.model_list(serving.model_name, protocol.now(), serving.max_model_len,
                                   serving.precision)

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str, tenant: Tenant = Depends(auth)) -> JSONObject:
        if model_id != serving.model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist", param="model",
                           code="model_not_found")
        return protocol.model_card(serving.model_name, protocol.now(), serving.max_model_len,
                                   serving.precision)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, tenant: Tenant = Depends(auth)) -> JSONObject:
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, tenant: Tenant = Depends(auth)) -> JSONObject:
        return await serving.detokenize(body)

    @app.api_route("/tokenizer_info", methods=["GET", "HEAD"])
    async def tokenizer_info(tenant: Tenant = Depends(auth)) -> JSONObject:
        return serving.tokenizer_info()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not async_engine.is_alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.api_route("/metrics", methods=["GET", "HEAD"], dependencies=[Depends(metrics_auth)])
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request,
                       tenant: Tenant = Depends(auth)) -> Response:
        return await serving.messages(body, tenant, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesCountRequest,
                           tenant: Tenant = Depends(auth)) -> JSONObject:
        return await serving.count_tokens(body)

    @app.post("/v1/cache/warm")
    async def warm(body: WarmRequest, request: Request,
                   tenant: Tenant = Depends(auth)) -> Response:
        return await serving.warm(body, tenant, request)

    @app.get("/v1/cache/pins")
    async def pins(tenant: Tenant = Depends(auth)) -> JSONObject:
        return await serving.list_pins(tenant)

    @app.delete("/v1/cache/pins/{pin_id}")
    async def delete_pin(pin_id: str, tenant: Tenant = Depends(auth)) -> JSONObject:
        return await serving.delete_pin(pin_id, tenant)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(tenant: Tenant = Depends(auth)) -> JSONResponse:
        return await _reset(async_engine, tenant)

    @app.post("/cache/purge")
    async def purge_cache(body: PurgeRequest, tenant: Tenant = Depends(auth)) -> JSONResponse:
        return await _purge(async_engine, tenants, tenant, body)


async def _purge(
    async_engine: AsyncEngine, tenants: TenantRegistry, caller: Tenant, body: PurgeRequest
) -> JSONResponse:
    """Remove one tenant's blocks from the lower tiers (admin only)."""
    if not caller.admin:
        raise ApiError(403, "purging a tenant's cache needs an admin API key")
    if tenants.trusted:
        known = {tenants.default_tenant.tenant_id: tenants.default_tenant}
    else:
        known = {t.tenant_id: t for t in tenants.tenants()}
    target = known.get(body.tenant)
    if target is None:
        raise ApiError(404, "no such tenant", param="tenant", code="tenant_not_found")
    domain = target.scheduling_domain
    try:
        removed = await async_engine.purge_domain(domain)
    except ConnectionError as exc:
        raise ApiError(503, f"not every KV tier was purged: {exc}",
                       code="tier_unavailable") from None
    logger.info("KV tiers purged of %s by an admin of %s: %s", domain, caller.isolation_domain,
                removed)
    return JSONResponse({"tenant": body.tenant, "domain": domain, "removed": removed})


async def _reset(async_engine: AsyncEngine, tenant: Tenant) -> JSONResponse:
    if not tenant.admin:
        raise ApiError(403, "resetting the prefix cache needs an admin API key")
    done, num_pins = await async_engine.reset_prefix_cache_and_pins()
    if not done:
        raise ApiError(409, "the prefix cache was not reset: requests still hold KV blocks; "
                       "retry when the server is idle", code="cache_in_use")
    logger.info("prefix cache reset by an admin of %s (%d pins released)",
                tenant.isolation_domain, num_pins)
    return JSONResponse({"reset": True, "pins_released": num_pins})
