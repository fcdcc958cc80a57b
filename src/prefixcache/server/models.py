"""``GET /v1/models`` and ``GET /v1/models/{id}``: the model this server serves, with its
context length and what it runs in (precision, kernels), and its LoRA adapters (``parent``: the
base model, ``root``: the adapter's directory), as vLLM lists them."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, Request

from prefixcache.server import protocol
from prefixcache.server.errors import ApiError
from prefixcache.server.openapi import operation_id
from prefixcache.server.protocol import JSONObject
from prefixcache.server.serving_context import ServingContext
from prefixcache.server.tenancy import Tenant

__all__ = ["OpenAIServingModels", "models_router"]


class OpenAIServingModels:
    """The served model's card."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context

    def list_models(self) -> JSONObject:
        context, now = self.context, protocol.now()
        models = protocol.model_list(context.model_name, now, context.max_model_len,
                                     context.precision)
        models["data"] += context.loras.cards(now, context.max_model_len)
        return models

    def show_model(self, model_id: str) -> JSONObject:
        context = self.context
        adapters = {c["id"]: c for c in context.loras.cards(protocol.now(),
                                                            context.max_model_len)}
        if model_id in adapters and model_id != context.model_name:
            return adapters[model_id]
        if model_id != context.model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist", param="model",
                           code="model_not_found")
        return protocol.model_card(context.model_name, protocol.now(), context.max_model_len,
                                   context.precision)


def models_router(serving: OpenAIServingModels, auth: Callable[[Request], Tenant]) -> APIRouter:
    router = APIRouter(generate_unique_id_function=operation_id)

    @router.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(tenant: Tenant = Depends(auth)) -> JSONObject:
        return serving.list_models()

    @router.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str, tenant: Tenant = Depends(auth)) -> JSONObject:
        return serving.show_model(model_id)

    return router
