"""A KV block at rest: the record every lower tier stores, and the checks it must pass to be used.

One record holds one block's K and V and what proves it is the block asked for. Big-endian
throughout; ``docs/tiers.md`` gives the layout byte by byte::

    magic        4 bytes   b"PCKV"
    version      u16       1
    flags        u16       0
    identity_len u32       bytes of the identity JSON that follows
    identity     JSON      `TierIdentity.as_json()`: model identity, KV dtype, layout, block size,
                           hash algorithm, and for a quantized KV layout its name and row bytes
                           (sorted keys, no spaces, UTF-8)
    digest_len   u8
    digest       digest_len bytes   the block's chained digest (its key)
    parent       digest_len bytes   the previous block's digest, or the namespace root
    domain_tag   16 bytes  `domain_tag(isolation domain)`: who may purge it
    token_check  32 bytes  SHA-256(b"prefixcache.kv.tokens.v1" || parent || token bytes)
    payload_len  u64
    crc          u32       zlib.crc32 of every byte before it, then of the payload
    payload      payload_len bytes: per layer, K then V, each [block_size, kv_heads, head_dim]
                           in the KV dtype's little-endian bytes, or [block_size, kv_heads,
                           row_bytes] of a quantized layout's blocks (as the cache holds them)

A record holds KV and digests, never token ids or text: the token check is a keyed hash (the
parent digest roots it in the namespace, which carries the tenant's secret salt), so it cannot be
tested against guessed prompts. `decode` refuses anything that does not match what the caller
expects: another identity, digest, parent or token check, a wrong length or checksum.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "BadRecord",
    "BlockKey",
    "RecordHeader",
    "TierIdentity",
    "decode",
    "domain_tag",
    "encode",
    "read_header",
    "token_check",
]

MAGIC = b"PCKV"
FORMAT_VERSION = 1
_FIXED = struct.Struct(">4sHHI")  # magic, version, flags, identity_len
_LEN = struct.Struct(">Q")  # payload_len
_CRC = struct.Struct(">I")  # crc32 of the header before it and of the payload
DOMAIN_TAG_BYTES = 16
TOKEN_CHECK_BYTES = 32
_MAX_IDENTITY = 1 << 16
_TOKEN_CONTEXT = b"prefixcache.kv.tokens.v1"
_DOMAIN_CONTEXT = b"prefixcache.kv.domain.v1"


class BadRecord(ValueError):
    """A record that must not be used: truncated, corrupted, or another block's or model's."""


@dataclass(frozen=True, slots=True)
class TierIdentity:
    """Everything that makes two engines' blocks interchangeable. Equal identities and equal
    digests mean equal KV; anything else is a miss. ``model_id`` already covers the weights'
    content, the config, the dtype and the rope settings (`prefixcache.model.identity`); the
    rest is the KV's own shape and layout: a quantized layout (``kv_layout``, e.g.
    ``int8:q8_0/32``) stores ``row_bytes`` per token and kv head, its blocks as the cache holds
    them; the float layouts leave both empty, and their identity JSON without them."""

    model_id: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    hash_algo: str
    element_size: int
    kv_layout: str = ""
    row_bytes: int = 0

    def as_json(self) -> bytes:
        fields = {k: v for k, v in asdict(self).items()
                  if k not in ("kv_layout", "row_bytes") or v}  # fmt: skip
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @property
    def tag(self) -> str:
        """32 hex digits naming this identity (a directory name, a key prefix)."""
        return hashlib.sha256(self.as_json()).hexdigest()[:32]

    @property
    def payload_bytes(self) -> int:
        """Bytes of one block's K and V."""
        row = self.row_bytes or self.head_dim * self.element_size
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * row

    @classmethod
    def from_json(cls, data: bytes) -> TierIdentity:
        fields: dict[str, Any] = json.loads(data)
        return cls(**fields)


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What a reader knows of a block before it loads it: its digest, its parent's, the check
    of its tokens, and the isolation domain it belongs to. ``lora``: vLLM's ``(lora_id,
    lora_name)`` of the request it was keyed for (None: the base), for the tiers' KV events;
    neither stored nor compared (the adapter's identity is in the digest)."""

    digest: bytes
    parent: bytes
    token_check: bytes
    domain_tag: bytes
    lora: tuple[int, str] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """A record's header as read from storage (everything but the payload)."""

    identity: bytes  # the identity JSON, as stored
    digest: bytes
    parent: bytes
    domain_tag: bytes
    token_check: bytes
    payload_len: int
    crc: int
    header_len: int  # where the payload starts


def token_check(parent: bytes, token_bytes: bytes) -> bytes:
    """The keyed check of a block's tokens (``token_bytes``: its ids as u32be)."""
    return hashlib.sha256(_TOKEN_CONTEXT + parent + token_bytes).digest()


def domain_tag(domain: str) -> bytes:
    """The tag of an isolation domain (``tenant:acme``, ``group:x``, ``""``) in a record."""
    return hashlib.sha256(_DOMAIN_CONTEXT + domain.encode()).digest()[:DOMAIN_TAG_BYTES]


def encode(identity_json: bytes, key: BlockKey, payload: bytes | memoryview) -> bytes:
    """The record of one block."""
    if len(key.digest) != len(key.parent) or not 0 < len(key.digest) < 256:
        raise ValueError("digest and parent must be equal lengths of 1..255 bytes")
    head = b"".join((
        _FIXED.pack(MAGIC, FORMAT_VERSION, 0, len(identity_json)), identity_json,
        bytes((len(key.digest),)), key.digest, key.parent, key.domain_tag, key.token_check,
        _LEN.pack(len(payload)),
    ))  # fmt: skip
    return b"".join((head, _CRC.pack(zlib.crc32(payload, zlib.crc32(head))), payload))


def read_header(data: bytes | memoryview) -> RecordHeader:
    """The header at the start of ``data`` (at least the header's bytes; the payload may be
    missing). Raises `BadRecord` for anything that is not a record of this format."""
    view = memoryview(data)
    if len(view) < _FIXED.size:
        raise BadRecord("truncated header")
    magic, version, _flags, identity_len = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise BadRecord("not a prefixcache KV record (bad magic)")
    if version != FORMAT_VERSION:
        raise BadRecord(f"record format version {version}, this build reads {FORMAT_VERSION}")
    if identity_len > _MAX_IDENTITY:
        raise BadRecord("identity too long")
    pos = _FIXED.size
    identity = bytes(view[pos : pos + identity_len])
    pos += identity_len
    if len(view) < pos + 1:
        raise BadRecord("truncated header")
    digest_len = view[pos]
    pos += 1
    fixed_rest = 2 * digest_len + DOMAIN_TAG_BYTES + TOKEN_CHECK_BYTES + _LEN.size + _CRC.size
    if len(identity) != identity_len or len(view) < pos + fixed_rest:
        raise BadRecord("truncated header")
    digest = bytes(view[pos : pos + digest_len])
    parent = bytes(view[pos + digest_len : pos + 2 * digest_len])
    pos += 2 * digest_len
    tag = bytes(view[pos : pos + DOMAIN_TAG_BYTES])
    pos += DOMAIN_TAG_BYTES
    check = bytes(view[pos : pos + TOKEN_CHECK_BYTES])
    pos += TOKEN_CHECK_BYTES
    (payload_len,) = _LEN.unpack_from(view, pos)
    (crc,) = _CRC.unpack_from(view, pos + _LEN.size)
    pos += _LEN.size + _CRC.size
    return RecordHeader(identity, digest, parent, tag, check, payload_len, crc, pos)


def decode(data: bytes | memoryview, identity_json: bytes, key: BlockKey) -> memoryview:
    """The payload of ``data`` if it is the record of ``key``'s block under ``identity_json``,
    whole and intact; else `BadRecord` says what failed."""
    header = read_header(data)
    view = memoryview(data)
    payload = view[header.header_len :]
    if len(payload) != header.payload_len:
        raise BadRecord(f"payload of {len(payload)} bytes, the header says {header.payload_len}")
    if zlib.crc32(payload, zlib.crc32(view[: header.header_len - _CRC.size])) != header.crc:
        raise BadRecord("checksum mismatch")
    if header.identity != identity_json:
        raise BadRecord("record of another model identity, KV dtype or layout")
    if header.digest != key.digest:
        raise BadRecord("record of another block")
    if header.parent != key.parent:
        raise BadRecord("record with another parent block")
    if header.token_check != key.token_check:
        raise BadRecord("record of other tokens")
    return payload
