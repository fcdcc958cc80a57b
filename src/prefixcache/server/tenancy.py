"""Tenancy: API keys -> tenants, and the effective cache salt that scopes each tenant's reuse.

The server never trusts a client-supplied ``cache_salt`` to choose a namespace. With a tenants file
the effective salt is ``HMAC-SHA256(server_secret, encode(domain) || encode(client_salt))``, where
the domain is the tenant (mode ``tenant``) or its trusted group (mode ``group:<name>``): a client's
salt can only narrow sharing inside its own domain. Mode ``none`` neither reads nor writes the
cache. Without a tenants file the server is single-tenant and passes client salts through as given.
The operator's declared public prefixes (`public_prefixes.py`) are shared, block for block, with
the tenants each one names (`PublicAccess`); every block after one is the tenant's own again.

This module knows nothing about HTTP or the engine; it maps strings to `Tenant` and `CacheScope`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import sys
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixcache.cache.public import PublicPrefixes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

__all__ = [
    "SECRET_ENV",
    "CacheScope",
    "PublicAccess",
    "Tenant",
    "TenancyError",
    "TenantRegistry",
    "encode_salt_input",
    "load_secret",
    "load_tenants",
    "read_tenants_file",
]

SECRET_ENV = "PREFIXCACHE_SECRET"
MODES = ("tenant", "group", "none")
_TENANT_FIELDS = {"api_keys", "isolation", "admin", "max_running_seqs", "max_kv_blocks",
                  "max_pinned_blocks"}
# type tags of the salt encoding: a tenant named X never equals a group named X, and an absent
# client salt never equals an empty one
_TAG_TENANT, _TAG_GROUP, _TAG_SALT, _TAG_NO_SALT = b"T", b"G", b"S", b"N"
_SALT_CONTEXT = b"prefixcache.cache_salt.v1"


class TenancyError(ValueError):
    """A tenants file or server secret that cannot be used."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """An authenticated caller. ``isolation`` is ``tenant``, ``group:<name>`` or ``none``."""

    tenant_id: str
    isolation: str = "tenant"
    admin: bool = False
    max_running_seqs: int | None = None  # caps of its scheduling domain (tenants file)
    max_kv_blocks: int | None = None
    max_pinned_blocks: int | None = None  # the prefix pins of its scheduling domain (tenants file)

    @property
    def mode(self) -> str:
        return self.isolation.split(":", 1)[0]

    @property
    def isolation_domain(self) -> str:
        """Who owns a cache namespace, as metrics label it: ``tenant:<id>``, the trusted
        ``group:<name>``, or ``none`` (operator-configured)."""
        if self.mode == "group":
            return self.isolation
        if self.mode == "none":
            return "none"
        return f"tenant:{self.tenant_id}"

    @property
    def scheduling_domain(self) -> str:
        """Who shares a fair share and caps: the trusted group, else the tenant itself (also in
        mode ``none``: tenants that share no cache still get a share each)."""
        return self.isolation if self.mode == "group" else f"tenant:{self.tenant_id}"


@dataclass(frozen=True, slots=True)
class CacheScope:
    """What the engine gets: the effective salt and whether the request may use the cache."""

    salt: str | None
    use_cache: bool


def _field(tag: bytes, value: bytes) -> bytes:
    return tag + len(value).to_bytes(8, "big") + value


def encode_salt_input(tenant: Tenant, client_salt: str | None) -> bytes:
    """The HMAC message: context, then tagged, length-prefixed domain and client salt."""
    if tenant.mode == "group":
        domain = _field(_TAG_GROUP, tenant.isolation.split(":", 1)[1].encode())
    else:
        domain = _field(_TAG_TENANT, tenant.tenant_id.encode())
    if client_salt is None:
        salt = _field(_TAG_NO_SALT, b"")
    else:
        salt = _field(_TAG_SALT, client_salt.encode())
    return _field(b"C", _SALT_CONTEXT) + domain + salt


class PublicAccess:
    """Which declared public prefixes each tenant may use, and the prefixes as token ids. A
    tenant of isolation ``none`` uses none (it reads and writes no cache at all)."""

    def __init__(self, prefixes: PublicPrefixes | None = None,
                 permits: Mapping[str, SequenceABC[str]] | None = None) -> None:  # fmt: skip
        self.prefixes = prefixes or PublicPrefixes({})
        self.permits = {t: tuple(names) for t, names in (permits or {}).items() if names}

    def names_for(self, tenant: Tenant) -> tuple[str, ...]:
        """The public prefixes ``tenant`` may use."""
        return () if tenant.mode == "none" else self.permits.get(tenant.tenant_id, ())

    def num_public_blocks(self, tenant: Tenant, token_ids: SequenceABC[int],
                          block_size: int) -> int:  # fmt: skip
        """How many leading blocks of ``tenant``'s prompt ``token_ids`` are public."""
        names = self.names_for(tenant)
        return self.prefixes.num_public_blocks(token_ids, names, block_size) if names else 0


class TenantRegistry:
    """API key -> tenant lookup plus salt derivation; ``trusted`` when no tenants file is used."""

    def __init__(self, tenants_by_key: dict[str, Tenant] | None, secret: bytes) -> None:
        if len(secret) < 16:
            raise TenancyError("the server secret must be at least 16 bytes")
        self._secret = secret
        self.trusted = tenants_by_key is None
        # keyed by the key's SHA-256 so lookups do not compare raw keys byte by byte
        self._by_digest = {_key_digest(k): t for k, t in (tenants_by_key or {}).items()}
        self.default_tenant = Tenant("default", "tenant", admin=True)
        self.public = PublicAccess()  # the declared public prefixes (`declare_public_prefixes`)

    def tenants(self) -> list[Tenant]:
        """Every configured tenant (none in trusted mode)."""
        return list(dict.fromkeys(self._by_digest.values()))

    def authenticate(self, api_key: str | None) -> Tenant | None:
        """The key's tenant; the default tenant in trusted mode; None for a missing/unknown key."""
        if self.trusted:
            return self.default_tenant
        if not api_key:
            return None
        return self._by_digest.get(_key_digest(api_key))

    def derive_key(self, purpose: str) -> bytes:
        """A key for ``purpose`` (signing dashboard sessions, say) from the server secret: the
        same on every replica of a cluster, useless for deriving any salt."""
        return hmac.new(self._secret, b"prefixcache.key.v1:" + purpose.encode(),
                        hashlib.sha256).digest()

    def scope(self, tenant: Tenant, client_salt: str | None) -> CacheScope:
        """The effective cache salt for ``tenant`` sending ``client_salt``."""
        if self.trusted:
            return CacheScope(client_salt, use_cache=True)
        message = encode_salt_input(tenant, client_salt)
        salt = hmac.new(self._secret, message, hashlib.sha256).hexdigest()
        return CacheScope(salt, use_cache=tenant.mode != "none")

    @property
    def num_keys(self) -> int:
        return len(self._by_digest)


def _key_digest(api_key: str) -> bytes:
    return hashlib.sha256(api_key.encode()).digest()


def load_secret(secret_file: str | None) -> tuple[bytes, str]:
    """The server secret and where it came from: a file, $PREFIXCACHE_SECRET, or random."""
    if secret_file:
        try:
            data = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise TenancyError(f"cannot read secret file {secret_file}: {exc.strerror}") from None
        return _checked_secret(data, f"file {secret_file}"), "file"
    env = os.environ.get(SECRET_ENV)
    if env:
        return _checked_secret(env.encode(), f"${SECRET_ENV}"), "env"
    return secrets.token_bytes(32), "random"


def _checked_secret(data: bytes, where: str) -> bytes:
    if len(data) < 16:
        raise TenancyError(f"the server secret in {where} must be at least 16 bytes")
    return data


def read_tenants_file(path: str | Path) -> dict[str, Any]:
    """A tenants file's TOML tables: ``tenants`` and, optionally, ``public_prefixes``."""
    try:
        with open(path, "rb") as fh:
            data: dict[str, Any] = tomllib.load(fh)
    except OSError as exc:
        raise TenancyError(f"cannot read tenants file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise TenancyError(f"tenants file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise TenancyError(f"tenants file {path} is not UTF-8 text (byte {exc.start})") from None
    tenants = data.get("tenants")
    if set(data) - {"tenants", "public_prefixes"} or not isinstance(tenants, dict) or not tenants:
        raise TenancyError(f"tenants file {path} must hold one or more [tenants.<id>] tables "
                           "(and [public_prefixes.<name>] tables) only")
    return data


def load_tenants(path: str | Path) -> dict[str, Tenant]:
    """Parse a tenants TOML file into API key -> `Tenant` (see examples/tenants.toml)."""
    tenants = read_tenants_file(path)["tenants"]
    by_key: dict[str, Tenant] = {}
    for tenant_id, table in tenants.items():
        try:
            tenant, keys = _parse_tenant(tenant_id, table)
        except TenancyError as exc:  # the table and field named; the file too
            raise TenancyError(f"tenants file {path}: {exc}") from None
        for key in keys:
            if key in by_key:
                raise TenancyError(f"tenants file {path}: API key of tenant {tenant_id!r} is "
                                   "also used by another")
            by_key[key] = tenant
    return by_key


def _parse_tenant(tenant_id: str, table: object) -> tuple[Tenant, list[str]]:
    where = f"[tenants.{tenant_id}]"
    if not isinstance(table, dict):
        raise TenancyError(f"{where} must be a table")
    unknown = set(table) - _TENANT_FIELDS
    if unknown:
        allowed = sorted(_TENANT_FIELDS)
        raise TenancyError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {allowed}")
    keys = table.get("api_keys")
    if not isinstance(keys, list) or not keys or not all(_valid_key(k) for k in keys):
        raise TenancyError(f"{where}: api_keys must be a non-empty list of strings (>= 8 chars)")
    isolation = table.get("isolation", "tenant")
    admin = table.get("admin", False)
    if not isinstance(admin, bool):
        raise TenancyError(f"{where}: admin must be true or false")
    _check_isolation(where, isolation)
    caps = {name: table.get(name)
            for name in ("max_running_seqs", "max_kv_blocks", "max_pinned_blocks")}
    for name, value in caps.items():
        low = 0 if name == "max_pinned_blocks" else 1  # 0 pins: the tenant may pin nothing
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < low):
            raise TenancyError(f"{where}: {name} must be an integer >= {low}")
    return Tenant(tenant_id, isolation, admin, caps["max_running_seqs"],
                  caps["max_kv_blocks"], caps["max_pinned_blocks"]), keys


def _valid_key(key: object) -> bool:
    return isinstance(key, str) and len(key) >= 8 and key.strip() == key


def _check_isolation(where: str, isolation: object) -> None:
    if isolation in ("tenant", "none"):
        return
    if isinstance(isolation, str) and isolation.startswith("group:") and isolation[6:].strip():
        return
    raise TenancyError(
        f"{where}: isolation must be 'tenant', 'group:<name>' or 'none', got {isolation!r}"
    )
