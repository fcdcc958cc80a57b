"""``serve --warm FILE``: prefill (and pin) tenants' prompts at start-up, before the port opens.

Each line of the JSONL file is one prompt::

    {"tenant": "acme", "messages": [{"role": "system", "content": "..."}], "ttl": "1h"}
    {"tenant": "globex", "prompt": "a long shared document ...", "cache_salt": "team-7"}

``tenant`` names a tenant of the tenants file (omitted, or ``default``, without one); ``prompt``
is text or token ids, ``messages`` a chat conversation rendered by the model's template; the
blocks go into that tenant's own namespace (its HMAC salt, narrowed by ``cache_salt``; the
whole blocks of a declared public prefix it may use into the public one) and,
with ``ttl`` (``5m``, ``1h``, ``24h`` or seconds up to a day), are pinned (`cache/pins.py`). A
line that cannot be used stops the start with its line number and the reason.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from prefixcache.cache.pins import ttl_seconds
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.errors import CliError
from prefixcache.server.protocol import ChatMessage, JSONObject
from prefixcache.server.request_params import render_chat
from prefixcache.server.tenancy import Tenant, TenantRegistry

if TYPE_CHECKING:
    from prefixcache.engine.llm_engine import LLMEngine

__all__ = ["warm_from_file"]

logger = logging.getLogger("prefixcache.server")

_FIELDS = {"tenant", "prompt", "messages", "ttl", "cache_salt"}


def warm_from_file(engine: LLMEngine, tenants: TenantRegistry, path: str,
                   literal_content: bool = True) -> int:
    """Prefill every prompt of ``path`` on ``engine`` (its thread not started yet); returns how
    many. Raises `CliError` naming the line of a prompt that cannot be used."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read --warm {path}: {exc}") from None
    by_id = ({tenants.default_tenant.tenant_id: tenants.default_tenant} if tenants.trusted
             else {t.tenant_id: t for t in tenants.tenants()})
    count = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--warm {path}:{number}"
        try:
            item = json.loads(line)
        except ValueError:
            raise CliError(f"{where}: not a JSON object") from None
        if not isinstance(item, dict):
            raise CliError(f"{where}: not a JSON object")
        unknown = sorted(set(item) - _FIELDS)
        if unknown:
            raise CliError(f"{where}: unknown field(s) {', '.join(unknown)}")
        tenant = by_id.get(item.get("tenant", tenants.default_tenant.tenant_id))
        if tenant is None:
            raise CliError(f"{where}: no such tenant")
        token_ids = _tokens(engine, item, where, literal_content)
        pins = [(len(token_ids) - 1, _ttl(item.get("ttl"), where))] if "ttl" in item else []
        salt = item.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise CliError(f"{where}: cache_salt must be a string")
        _prefill(engine, f"warm-{number}", token_ids, tenants, tenant, salt, pins, where)
        count += 1
    if count:
        logger.info("warmed %d prompts from %s (%d blocks pinned)", count, path,
                    engine.snapshot().num_pinned_blocks)
    return count


def _tokens(engine: LLMEngine, item: JSONObject, where: str, literal: bool) -> list[int]:
    if ("prompt" in item) == ("messages" in item):
        raise CliError(f"{where}: give 'prompt' or 'messages'")
    try:
        if "messages" in item:
            messages = [ChatMessage.model_validate(m) for m in item["messages"]]
            # a conversation that ends before a user turn (a system prompt) is warmed as the
            # prefix later conversations share: without the assistant's generation prompt
            ask = bool(messages) and messages[-1].role == "user"
            return render_chat(engine.tokenizer, messages, "messages", ask, None,
                               literal_content=literal)
        prompt = item["prompt"]
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        return engine.inputs.prompt_ids(text, ids, "prompt")
    except (ValueError, TypeError) as exc:
        raise CliError(f"{where}: {type(exc).__name__}: {exc}"[:300]) from None


def _ttl(value: object, where: str) -> float:
    seconds = ttl_seconds(value)
    if seconds is None:
        raise CliError(f"{where}: ttl must be '5m', '1h', '24h' or seconds in (0, 86400]")
    return seconds


def _prefill(engine: LLMEngine, rid: str, token_ids: list[int], tenants: TenantRegistry,
             tenant: Tenant, salt: str | None, pins: list[tuple[int, float]], where: str) -> None:
    scope = tenants.scope(tenant, salt)
    if not scope.use_cache:
        raise CliError(f"{where}: this tenant's isolation is 'none': it caches nothing")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    num_public = tenants.public.num_public_blocks(tenant, token_ids, engine.block_size)
    try:
        engine.add_request(rid, prompt_token_ids=token_ids, sampling_params=params,
                           cache_salt=scope.salt, domain=tenant.scheduling_domain, pins=pins,
                           public_blocks=num_public)
    except ValueError as exc:
        raise CliError(f"{where}: {exc}") from None
    while engine.has_unfinished():
        engine.step()
