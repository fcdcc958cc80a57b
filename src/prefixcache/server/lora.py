"""LoRA adapters over HTTP, as vLLM serves them: ``--lora-modules name=path`` (or vLLM's JSON
form ``{"name": ..., "path": ..., "base_model_name": ...}``) loaded at start; a request picks
one with ``model: <name>``; ``GET /v1/models`` lists each beside the base with ``parent`` set to
it; and, where runtime updating is allowed (``--allow-runtime-lora-updating`` or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``), an admin tenant's ``POST /v1/load_lora_adapter``
(``{"lora_name", "lora_path"}``) and ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``).

A bad adapter (no such directory or file, a rank above ``--max-lora-rank``, a target the model
lacks, a truncated weight file, ...) is a 400 naming what is wrong, or a one-line error at
start; nothing loaded before is disturbed. The adapters themselves live in the engine's
`LoraRegistry` (`prefixcache.engine.lora`): its files are read off the engine's thread, then
installed between two steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from prefixcache.engine.lora import LoraBusy, LoraError, LoRARequest
from prefixcache.errors import CliError
from prefixcache.server import protocol
from prefixcache.server.errors import ApiError
from prefixcache.server.openapi import operation_id
from prefixcache.server.protocol import JSONObject
from prefixcache.server.tenancy import Tenant

if TYPE_CHECKING:
    from prefixcache.engine.llm_engine import LLMEngine
    from prefixcache.engine.lora import LoraRegistry
    from prefixcache.model.lora_batch import PackedLora
    from prefixcache.server.async_engine import AsyncEngine

__all__ = ["RUNTIME_UPDATING_ENV", "ServingLoras", "lora_router", "parse_lora_modules",
           "runtime_updating", "start_lora_modules"]  # fmt: skip

logger = logging.getLogger("prefixcache.server")

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating(args: argparse.Namespace) -> bool:
    """Whether the load and unload endpoints are served."""
    flag = os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true", "yes")
    return flag or bool(getattr(args, "allow_runtime_lora_updating", False))


def parse_lora_modules(values: list[str] | None) -> list[LoRARequest]:
    """``--lora-modules``' values as requests with ids 1, 2, ... (a `CliError` for a bad
    one)."""
    out: list[LoRARequest] = []
    for value in values or []:
        try:
            if value.lstrip().startswith("{"):
                data = json.loads(value)
                name, path = data["name"], data["path"]
                base = data.get("base_model_name")
            else:
                name, sep, path = value.partition("=")
                if not sep:
                    raise ValueError("expected name=path")
                base = None
            out.append(LoRARequest(name, len(out) + 1, path, base))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CliError(f"--lora-modules {value!r}: {exc}") from None
    names = [r.lora_name for r in out]
    if len(set(names)) != len(names):
        raise CliError("--lora-modules: a name is given twice")
    return out


def start_lora_modules(engine: LLMEngine, args: argparse.Namespace) -> None:
    """Load ``--lora-modules`` into the engine before it serves (a `CliError` for a bad one)."""
    modules = parse_lora_modules(getattr(args, "lora_modules", None))
    if engine.loras is None:
        if modules or getattr(args, "allow_runtime_lora_updating", False):
            raise CliError("--lora-modules and runtime LoRA updating need --enable-lora")
        return
    for request in modules:
        try:
            engine.loras.add(request)
        except LoraError as exc:
            raise CliError(f"cannot load LoRA adapter {request.lora_name!r}: {exc}") from None
        logger.info("LoRA adapter %s loaded from %s", request.lora_name, request.lora_path)


class ServingLoras:
    """The adapters behind the model names requests send (``base_model``: the served name)."""

    def __init__(self, engine: AsyncEngine, base_model: str) -> None:
        self.engine = engine
        self.base_model = base_model
        self.registry: LoraRegistry | None = engine.loras

    def adapter_name(self, model: str) -> str | None:
        """The name of the adapter a request for ``model`` runs under (None: the base); the
        engine takes the adapter registered under it when it takes the request (a 404 if it
        was unloaded since)."""
        if self.registry is None or model == self.base_model:
            return None
        return model

    def identity_of(self, model: str) -> str | None:
        """The identity (content digest) of the adapter named ``model``; None for the base."""
        if self.registry is None or model == self.base_model:
            return None
        return self.registry.identity_of(model)

    def cards(self, created: int, max_model_len: int) -> list[JSONObject]:
        """A model card per adapter, its ``parent`` the base (vLLM's fields)."""
        if self.registry is None:
            return []
        cards = []
        for request in self.registry.requests():
            card = protocol.model_card(request.lora_name, created, max_model_len)
            card.update(root=request.lora_path,
                        parent=request.base_model_name or self.base_model)
            cards.append(card)
        return cards

    async def load(self, body: JSONObject, tenant: Tenant) -> str:
        registry = self._admin_registry(tenant)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ApiError(400, "both 'lora_name' and 'lora_path' must be given",
                           param="lora_name" if not name else "lora_path")
        inplace = bool(body.get("load_inplace")) and name != self.base_model
        _check_free(registry, name, inplace, self.base_model)  # before reading the files
        try:  # read off the engine thread, then checked again and installed on it at once
            read = await asyncio.to_thread(registry.read, LoRARequest(name, 1, path))
            await self.engine.call(
                lambda: _install(registry, LoRARequest(name, 1, path), read, inplace))
        except LoraBusy as exc:
            raise ApiError(429, str(exc)) from None
        except LoraError as exc:
            raise ApiError(400, f"cannot load LoRA adapter {name!r}: {exc}",
                           param="lora_path") from None
        logger.info("LoRA adapter %s loaded by an admin of %s", name, tenant.tenant_id)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: JSONObject, tenant: Tenant) -> str:
        registry = self._admin_registry(tenant)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'lora_name' must be given", param="lora_name")
        if not await self.engine.call(lambda: registry.remove(name)):
            raise ApiError(404, f"the LoRA adapter {name!r} cannot be found",
                           param="lora_name", code="model_not_found")
        logger.info("LoRA adapter %s unloaded by an admin of %s", name, tenant.tenant_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _admin_registry(self, tenant: Tenant) -> LoraRegistry:
        if not tenant.admin:
            raise ApiError(403, "loading and unloading LoRA adapters needs an admin API key")
        if self.registry is None:
            raise ApiError(400, "LoRA is off on this server (--enable-lora)")
        return self.registry


def _check_free(registry: LoraRegistry, name: str, inplace: bool, base: str = "") -> None:
    if name == base or (registry.identity_of(name) is not None and not inplace):
        raise ApiError(400, f"the LoRA adapter {name!r} has already been loaded",
                       param="lora_name")


def _install(registry: LoraRegistry, request: LoRARequest,
             read: tuple[PackedLora, tuple[int, ...]], inplace: bool) -> None:  # fmt: skip
    """Register ``request``'s name for its path (``read``: its files, read) under the next
    free id, unless the name is registered and not ``inplace``: on the engine's thread, so
    that no other load or unload of the name comes between the check and the registration."""
    name = request.lora_name
    _check_free(registry, name, inplace)
    ids = [r.lora_int_id for r in registry.requests() if r.lora_name != name]
    registry.add(replace(request, lora_int_id=max([0, *ids]) + 1), read)


def lora_router(serving: ServingLoras, auth: Callable[[Request], Tenant]) -> APIRouter:
    router = APIRouter(generate_unique_id_function=operation_id)

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load(body: dict[str, object], tenant: Tenant = Depends(auth)) -> str:
        return await serving.load(body, tenant)

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload(body: dict[str, object], tenant: Tenant = Depends(auth)) -> str:
        return await serving.unload(body, tenant)

    return router
