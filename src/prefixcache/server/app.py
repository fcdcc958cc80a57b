"""The FastAPI application: routes, authentication and lifecycle around one `LLMEngine`.

``create_app(engine, ...)`` wires the engine thread (`AsyncEngine`), tenancy, metrics and one
serving object per API over a shared `ServingContext`, each with its own router
(`completions`, `chat`, `responses`, `models`, `tokenizer_api`, `messages`, `cache_api`);
starting the app starts the engine thread, stopping it stops the thread. The wire format is
`protocol`'s.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixcache.server.async_engine import AsyncEngine
from prefixcache.server.cache_api import ServingCache, cache_router
from prefixcache.server.chat import OpenAIServingChat, chat_router
from prefixcache.server.completions import OpenAIServingCompletion, completion_router
from prefixcache.server.diagnostics import DEFAULT_MAX_ENTRIES
from prefixcache.server.diagnostics_store import open_store
from prefixcache.server.errors import ApiError, install_error_handlers
from prefixcache.server.job_runner import JobRunner
from prefixcache.server.limits import BodyLimit
from prefixcache.server.lora import lora_router
from prefixcache.server.messages import AnthropicServingMessages, messages_router
from prefixcache.server.metrics import CONTENT_TYPE, ServerMetrics
from prefixcache.server.models import OpenAIServingModels, models_router
from prefixcache.server.openapi import install_openapi, operation_id
from prefixcache.server.responses import OpenAIServingResponses, responses_router
from prefixcache.server.serving_context import ServingContext, ServingOptions
from prefixcache.server.tenancy import Tenant, TenantRegistry
from prefixcache.server.tokenizer_api import ServingTokenization, tokenization_router

if TYPE_CHECKING:
    from prefixcache.engine.llm_engine import LLMEngine

__all__ = ["create_app", "metrics_authorization"]


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
    lora_updating: bool = False,
) -> FastAPI:
    """An OpenAI-compatible app over ``engine`` (an `LLMEngine`, driven from its own thread).

    With a tenants file, ``/metrics`` answers only an admin tenant's key or ``metrics_key``.
    ``strict_api``: unknown request fields get 400 instead of being ignored.
    ``vllm_metric_names``: export vLLM's names beside ours (`server/vllm_metrics.py`).
    ``dashboard``: serve ``GET /dashboard`` (`server/dashboard`). ``lora_updating``: serve
    the admins' ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
    """
    metrics = _metrics(engine, model_name, metrics_domain_labels, vllm_metric_names)
    max_pending = engine.limits.max_num_seqs + max_queue_len
    # with tenants, one domain may hold at most half of the queue
    per_domain = None if tenants.trusted else max(1, max_pending // 2)
    async_engine = AsyncEngine(engine, max_pending=max_pending, metrics=metrics,
                               log_interval_s=log_interval_s, max_pending_per_domain=per_domain)
    store = open_store(engine.engine_config.tiers, DEFAULT_MAX_ENTRIES)
    context = ServingContext(async_engine, tenants, metrics, ServingOptions(
        model_name, default_max_tokens, trust_content_markers, strict_api), store)
    app = FastAPI(title="prefixcache", lifespan=_lifespan(engine, async_engine, context),
                  generate_unique_id_function=operation_id)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.tier_stats = engine.tier_stats  # thread safe: a cluster replica's routing costs
    install_error_handlers(app)
    _add_routes(app, context, metrics_key)
    if lora_updating:
        app.include_router(lora_router(context.loras, _auth_dependency(tenants)))
    install_openapi(app, model_name)
    if dashboard:
        _add_dashboard(app, engine, context, metrics_key)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    return app


def _metrics(
    engine: LLMEngine, model_name: str, domain_labels: str, vllm_names: bool
) -> ServerMetrics:
    """The server's metrics, the lower tiers' counters among them where the engine has tiers."""
    kv = engine.limits.precision.get("kv_cache", {})
    cache_config = {"cache_dtype": str(kv.get("dtype", "")), "kv_layout": str(kv.get("layout", "")),
                    "block_size": str(engine.block_size),
                    "num_blocks": str(engine.limits.num_kv_blocks),
                    "block_bytes": str(engine.block_bytes)}  # fmt: skip
    metrics = ServerMetrics(model_name, engine.block_bytes, domain_labels,
                            vllm_max_model_len=engine.max_model_len if vllm_names else None,
                            cache_config=cache_config)
    if engine.tier_stats() is not None:
        metrics.add_tiers(engine.tier_stats)
    return metrics


def _lifespan(
    engine: LLMEngine, async_engine: AsyncEngine, context: ServingContext
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Starting the app starts the engine thread; stopping it stops the thread and flushes what
    the write-behind queued to the tiers, and the diagnostics' fingerprints to their store."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()
            engine.flush_tiers()
            context.diagnoser.close()

    return lifespan


def _add_dashboard(
    app: FastAPI, engine: LLMEngine, context: ServingContext, metrics_key: str | None
) -> None:
    from prefixcache.server.dashboard import CacheView, DashboardSources, install_dashboard

    tenants, metrics = context.tenants, context.metrics
    view = CacheView(engine.cache_identity, metrics.domain_label)
    engine.add_cache_observer(view)  # before the engine's thread starts
    tier_stats = engine.tier_stats if engine.tier_stats() is not None else None
    sources = DashboardSources(context.engine, metrics, view, context.model_name, tier_stats)
    install_dashboard(app, sources, metrics_key_check(tenants, metrics_key), api_key_of,
                      tenants.derive_key("dashboard-session"))


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


def _add_routes(app: FastAPI, context: ServingContext, metrics_key: str | None) -> None:
    """Each API's router over its serving object, in the order the description lists them."""
    tenants = context.tenants
    auth = _auth_dependency(tenants)
    runner = JobRunner(context.engine, tenants, context.metrics, context.tokenizer,
                       context.loras)
    chat = OpenAIServingChat(context, runner)
    app.include_router(completion_router(OpenAIServingCompletion(context, runner), auth))
    app.include_router(chat_router(chat, auth))
    app.include_router(responses_router(OpenAIServingResponses(context, runner), auth))
    app.include_router(models_router(OpenAIServingModels(context), auth))
    app.include_router(tokenization_router(ServingTokenization(context), auth))
    app.include_router(_health_router(context, metrics_authorization(tenants, metrics_key)))
    app.include_router(messages_router(AnthropicServingMessages(context, runner, chat), auth))
    app.include_router(cache_router(ServingCache(context, runner), auth))


def _health_router(context: ServingContext, metrics_auth: Callable[[Request], None]) -> APIRouter:
    router = APIRouter(generate_unique_id_function=operation_id)
    async_engine = context.engine

    @router.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not async_engine.is_alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.api_route("/metrics", methods=["GET", "HEAD"], dependencies=[Depends(metrics_auth)])
    async def metrics() -> Response:
        return Response(context.metrics.render(), media_type=CONTENT_TYPE)

    return router
