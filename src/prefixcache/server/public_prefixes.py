"""Declared public prefixes: the ``[public_prefixes.<name>]`` tables of the tenants file, read,
checked against its tenants, and rendered to token ids the way requests are.

::

    [public_prefixes.support]
    system = "You are Acme's support assistant. ..."   # or system_file = "support.txt"
    tenants = ["acme", "globex"]                       # or ["*"]: every tenant that caches

    [public_prefixes.manual]
    prompt_file = "manual.txt"   # a /v1/completions prompt prefix, tokenized as prompts are
    tenants = ["*"]

    [public_prefixes.tools]
    token_ids = [1, 2, 3]
    tenants = ["acme"]

``system`` is a system message through the model's chat template (what a chat request that
starts with that system message renders first); ``prompt`` raw text as ``/v1/completions``
tokenizes it; ``token_ids`` the ids themselves. A file path is relative to the tenants file. A
tenant of isolation ``none`` caches nothing, so it may not be named, and ``*`` skips it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prefixcache.cache.public import PublicPrefixes
from prefixcache.server.errors import ApiError
from prefixcache.server.protocol import ChatMessage
from prefixcache.server.request_params import render_chat
from prefixcache.server.tenancy import PublicAccess, TenancyError, Tenant, read_tenants_file

if TYPE_CHECKING:
    from prefixcache.model.tokenizer import Tokenizer

__all__ = ["PublicPrefixSpec", "load_public_access", "read_public_prefixes", "render_public"]

_SOURCES = ("system", "system_file", "prompt", "prompt_file", "token_ids")
_FIELDS = {*_SOURCES, "tenants"}
MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True, slots=True)
class PublicPrefixSpec:
    """One declared prefix as the file gives it: ``kind`` is ``system``, ``prompt`` or
    ``token_ids``; ``text`` the text of the first two, ``token_ids`` the ids of the third;
    ``tenants`` the tenant ids that may use it."""

    name: str
    kind: str
    text: str | None
    token_ids: tuple[int, ...]
    tenants: tuple[str, ...]


def read_public_prefixes(path: str | Path, tenants: Iterable[Tenant]) -> list[PublicPrefixSpec]:
    """The tenants file's declared public prefixes (none: an empty list), checked."""
    table = read_tenants_file(path).get("public_prefixes", {})
    if not isinstance(table, dict):
        raise TenancyError(
            f"tenants file {path}: public_prefixes must be tables [public_prefixes.<name>]"
        )
    by_id = {t.tenant_id: t for t in tenants}
    try:
        return [_parse(name, body, Path(path).parent, by_id) for name, body in table.items()]
    except TenancyError as exc:
        raise TenancyError(f"tenants file {path}: {exc}") from None


def _parse(name: str, body: object, base: Path, by_id: dict[str, Tenant]) -> PublicPrefixSpec:
    where = f"[public_prefixes.{name}]"
    if not isinstance(body, dict):
        raise TenancyError(f"{where} must be a table")
    unknown = set(body) - _FIELDS
    if unknown:
        raise TenancyError(
            f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_FIELDS)}"
        )
    given = [f for f in _SOURCES if f in body]
    if len(given) != 1:
        raise TenancyError(f"{where}: give exactly one of {', '.join(_SOURCES)}")
    (source,) = given
    tenants = _tenants(where, body.get("tenants"), by_id)
    if source == "token_ids":
        return PublicPrefixSpec(name, "token_ids", None, _token_ids(where, body[source]), tenants)
    kind = source.removesuffix("_file")
    text = _read_text(where, base / str(body[source])) if source.endswith("_file") else body[source]
    if not isinstance(text, str) or not text:
        raise TenancyError(f"{where}: {source} must be a non-empty string")
    return PublicPrefixSpec(name, kind, text, (), tenants)


def _tenants(where: str, value: object, by_id: dict[str, Tenant]) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise TenancyError(f"{where}: tenants must be a non-empty list of tenant ids, or ['*']")
    if value == ["*"]:
        return tuple(t for t, tenant in by_id.items() if tenant.mode != "none")
    for tenant_id in value:
        tenant = by_id.get(tenant_id)
        if tenant is None:
            raise TenancyError(f"{where}: no tenant {tenant_id!r} in this file")
        if tenant.mode == "none":
            raise TenancyError(
                f"{where}: tenant {tenant_id!r} has isolation 'none': it reads "
                "and writes no cache, public prefixes included"
            )
    return tuple(dict.fromkeys(value))


def _token_ids(where: str, value: object) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or not value
        or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TOKEN_ID for v in value
        )
    ):
        raise TenancyError(f"{where}: token_ids must be a non-empty list of token ids")
    return tuple(value)


def _read_text(where: str, path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenancyError(f"{where}: cannot read {path}: {exc}") from None


def render_public(spec: PublicPrefixSpec, tokenizer: Tokenizer, vocab_size: int,
                  literal_content: bool = True) -> list[int]:  # fmt: skip
    """``spec``'s token ids, rendered as a request with it would be."""
    if spec.kind == "token_ids":
        ids = list(spec.token_ids)
    elif spec.kind == "prompt":
        ids = list(tokenizer.encode(spec.text or ""))
    else:
        message = ChatMessage.model_validate({"role": "system", "content": spec.text})
        try:
            ids = render_chat(tokenizer, [message], "system", False, None, literal_content)
        except ApiError as exc:
            raise TenancyError(f"[public_prefixes.{spec.name}]: {exc.message}") from None
    if any(i >= vocab_size for i in ids):
        raise TenancyError(
            f"[public_prefixes.{spec.name}]: a token id is not in this model's "
            f"vocabulary of {vocab_size}"
        )
    return ids


def load_public_access(path: str | Path, tenants: Iterable[Tenant], tokenizer: Tokenizer,
                       vocab_size: int, literal_content: bool = True) -> PublicAccess:  # fmt: skip
    """The tenants file's public prefixes, rendered, and who may use each."""
    specs = read_public_prefixes(path, tenants)
    prefixes = {s.name: render_public(s, tokenizer, vocab_size, literal_content) for s in specs}
    permits: dict[str, list[str]] = {}
    for spec in specs:
        for tenant_id in spec.tenants:
            permits.setdefault(tenant_id, []).append(spec.name)
    return PublicAccess(PublicPrefixes(prefixes), permits)
