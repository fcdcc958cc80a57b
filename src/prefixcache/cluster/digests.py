"""The ingress's view of a request: the block digests its prompt will have in a replica's cache.

A router that scores replicas by cached prefix must name the prompt's blocks exactly as the
replicas' caches do: the same token ids (the same tokenizer and chat template), the same cache
namespace (the tenant's derived salt, from the same server secret), the same model identity and
block hashing. `PromptDigester` does that from the request body alone, before any replica sees it;
a body it cannot read gets no digests (the router then balances by load) and the replica answers
it, with the same error it gives today. Prompt text never leaves this object: the router sees
digests only.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from prefixcache.cache.identity import CacheIdentity
from prefixcache.cache.sequence import Sequence

if TYPE_CHECKING:
    from prefixcache.model.tokenizer import Tokenizer
    from prefixcache.server.tenancy import TenantRegistry

__all__ = ["CacheIdentity", "PromptDigester"]

logger = logging.getLogger("prefixcache.cluster")


class PromptDigester:
    """Request body -> the digests of its first prompt's complete blocks (namespace-rooted)."""

    def __init__(
        self, tokenizer: Tokenizer, tenants: TenantRegistry, identity: CacheIdentity,
        literal_content: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.tenants = tenants
        self.identity = identity
        self.literal_content = literal_content

    def digests(self, path: str, api_key: str | None, body: bytes) -> list[bytes]:
        from pydantic import ValidationError

        from prefixcache.server.errors import ApiError
        from prefixcache.server.request_params import prompt_token_ids

        tenant = self.tenants.authenticate(api_key)
        if tenant is None:
            return []  # the replica answers 401
        try:
            found = prompt_token_ids(path, json.loads(body), self.tokenizer,
                                     self.literal_content)
        except (ValueError, TypeError, ApiError, ValidationError, RecursionError):
            return []  # the replica answers 400 (json.JSONDecodeError is a ValueError)
        if found is None:
            return []
        token_ids, client_salt = found
        scope = self.tenants.scope(tenant, client_salt)
        if not scope.use_cache:
            return []
        seq = Sequence("route", token_ids, scope.salt, copy=False)
        return list(self.identity.block_digests(seq))
