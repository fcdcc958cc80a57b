"""The ingress's view of a request: the block digests its prompt will have in a replica's cache.

A router that scores replicas by cached prefix must name the prompt's blocks exactly as the
replicas' caches do: the same token ids (the same tokenizer and chat template), the same cache
namespace (the tenant's derived salt, from the same server secret), the same model identity and
block hashing. `PromptDigester` does that from the request body alone, before any replica sees it;
a body it cannot read gets no digests (the router then balances by load) and the replica answers
it, with the same error it gives today. A body whose ``model`` names a LoRA adapter the replicas
serve (``adapters``: name -> identity, as they report it) is named in that adapter's namespace,
as the replica's cache names it, and a declared public prefix's whole blocks in the public
namespace (the tenants file's, read by the ingress too), as the replicas name them. A body's
``prompt_cache_key`` becomes the request's affinity key, scoped to its namespace (a keyed
digest: two tenants' equal keys differ) and never part of any block's identity. Prompt text never
leaves this object: the router sees digests only.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixcache.cache.identity import CacheIdentity
from prefixcache.cache.sequence import Sequence

if TYPE_CHECKING:
    from prefixcache.model.tokenizer import Tokenizer
    from prefixcache.server.tenancy import TenantRegistry

__all__ = ["CacheIdentity", "PromptDigester", "Route"]

logger = logging.getLogger("prefixcache.cluster")


@dataclass(slots=True)
class Route:
    """What the router gets for one request."""

    block_digests: list[bytes] = field(default_factory=list)
    affinity_key: bytes | None = None  # from prompt_cache_key, scoped to the namespace


class PromptDigester:
    """Request body -> the digests of its first prompt's complete blocks (namespace-rooted)."""

    def __init__(
        self, tokenizer: Tokenizer, tenants: TenantRegistry, identity: CacheIdentity,
        literal_content: bool = True, adapters: Mapping[str, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tenants = tenants
        self.identity = identity
        self.literal_content = literal_content
        self.adapters = dict(adapters or {})  # LoRA adapter name -> identity

    def digests(self, path: str, api_key: str | None, body: bytes) -> list[bytes]:
        return self.route(path, api_key, body).block_digests

    def route(self, path: str, api_key: str | None, body: bytes) -> Route:
        from pydantic import ValidationError

        from prefixcache.server.errors import ApiError
        from prefixcache.server.request_params import prompt_cache_key, prompt_token_ids

        tenant = self.tenants.authenticate(api_key)
        if tenant is None:
            return Route()  # the replica answers 401
        try:
            parsed = json.loads(body)
            found = prompt_token_ids(path, parsed, self.tokenizer, self.literal_content)
        except (ValueError, TypeError, ApiError, ValidationError, RecursionError):
            return Route()  # the replica answers 400 (json.JSONDecodeError is a ValueError)
        if found is None:
            return Route()
        token_ids, client_salt = found
        scope = self.tenants.scope(tenant, client_salt)
        key = prompt_cache_key(parsed)
        affinity = None if key is None else hashlib.blake2b(
            key.encode(), digest_size=16, person=b"prompt_cache_key",
            key=(scope.salt or "").encode()[:64]).digest()
        if not scope.use_cache:
            return Route(affinity_key=affinity)
        model = parsed.get("model") if isinstance(parsed, dict) else None
        adapter = self.adapters.get(model) if isinstance(model, str) else None
        public = self.tenants.public.num_public_blocks(tenant, token_ids, self.identity.block_size)
        seq = Sequence("route", token_ids, scope.salt, copy=False, adapter=adapter,
                       public_blocks=public)  # a declared public prefix's blocks: as replicas
        return Route(list(self.identity.block_digests(seq)), affinity)
