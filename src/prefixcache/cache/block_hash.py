"""Block identity: canonical encoding and chained block digests.

A block's identity is ``digest_i = H(encode(parent_digest_{i-1}, token_ids_i, extras_i))`` with
``parent_digest_{-1} = root(namespace)``. The namespace carries everything that changes KV values
or who may see them (model identity, adapter, effective cache salt), so two namespaces share no
block. Only complete blocks have an identity.

The encoding is canonical, typed and length-prefixed: every field is ``tag:u8 ‖ length:u32be ‖
payload``; tokens are ``u32be`` each. The exact bytes, and golden vectors, are in
``docs/block-key.md``. Python's built-in ``hash()`` is never used: it is salted per process.

This module knows nothing about blocks in memory, tensors or requests.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "HASH_ALGOS",
    "BlockExtra",
    "BlockHasher",
    "Namespace",
    "encode_block",
    "encode_namespace",
    "get_hash_fn",
]

# Field tags. Bit 0x80 marks an absent optional field (length 0), so None != "".
TAG_MODEL = 0x01
TAG_ADAPTER = 0x02
TAG_SALT = 0x03
TAG_PARENT = 0x10
TAG_TOKENS = 0x11
TAG_EXTRAS = 0x12
TAG_EXTRA_ITEM = 0x13
TAG_KIND = 0x14
TAG_IDENTITY = 0x15
TAG_OFFSET = 0x16
ABSENT = 0x80

NAMESPACE_MAGIC = b"PCNS\x01"  # domain separation: a root can never equal a block digest
BLOCK_MAGIC = b"PCBK\x01"
MAX_TOKEN_ID = 2**32 - 1

HashFn = Callable[[bytes | bytearray], bytes]


def _sha256(data: bytes | bytearray) -> bytes:
    return hashlib.sha256(data).digest()


def _blake2b(data: bytes | bytearray) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def _xxh3_128() -> HashFn:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "hash_algo='xxh3_128' needs the optional 'xxhash' package: "
            "pip install 'prefixcache[fast]'"
        ) from exc
    warnings.warn(
        "hash_algo='xxh3_128' is fast but not collision-resistant: an adversary can craft "
        "colliding blocks (a collision costs a miss, since hits compare token ids, but it "
        "changes the privacy risk). Use sha256 across trust boundaries.",
        stacklevel=3,
    )
    fn: HashFn = xxhash.xxh3_128_digest
    return fn


HASH_ALGOS: dict[str, int] = {"sha256": 32, "blake2b": 32, "xxh3_128": 16}


def get_hash_fn(algo: str) -> HashFn:
    """The digest function for ``algo``: bytes -> fixed-width digest bytes."""
    if algo == "sha256":
        return _sha256
    if algo == "blake2b":
        return _blake2b
    if algo == "xxh3_128":
        return _xxh3_128()
    raise ValueError(f"unknown hash_algo {algo!r}; choose one of {sorted(HASH_ALGOS)}")


def _field(tag: int, payload: bytes | None) -> bytes:
    if payload is None:
        return struct.pack(">BI", tag | ABSENT, 0)
    return struct.pack(">BI", tag, len(payload)) + payload


def _text(value: str | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return value.encode("utf-8")


@dataclass(frozen=True, slots=True)
class BlockExtra:
    """A fact other than token ids that changes a block's KV: e.g. a multimodal input.

    ``kind`` names the input type ("image", "audio", ...), ``identity`` is its content digest, and
    ``offset`` is where its placeholder starts inside the block (token index within the block).
    """

    kind: str
    identity: bytes
    offset: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.offset <= MAX_TOKEN_ID:
            raise ValueError(f"BlockExtra.offset must fit in u32, got {self.offset}")

    def encode(self) -> bytes:
        return _field(
            TAG_EXTRA_ITEM,
            _field(TAG_KIND, self.kind.encode("utf-8"))
            + _field(TAG_IDENTITY, self.identity)
            + _field(TAG_OFFSET, struct.pack(">I", self.offset)),
        )


@dataclass(frozen=True, slots=True)
class Namespace:
    """Who and what a cached block belongs to. Different namespaces share no block.

    ``model`` is the model identity (checkpoint digest, revision, dtype, rope fingerprint...),
    ``adapter`` the LoRA adapter name, ``salt`` the *effective* cache salt (the server derives it
    from the authenticated tenant; a client cannot choose another tenant's).
    """

    model: str = ""
    adapter: str | None = None
    salt: str | bytes | None = None

    def encode(self) -> bytes:
        return (
            NAMESPACE_MAGIC
            + _field(TAG_MODEL, self.model.encode("utf-8"))
            + _field(TAG_ADAPTER, _text(self.adapter))
            + _field(TAG_SALT, _text(self.salt))
        )


def encode_namespace(namespace: Namespace) -> bytes:
    """The canonical bytes whose digest is the namespace root."""
    return namespace.encode()


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as big-endian u32, validated."""
    try:
        packed = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError("token ids must be integers in [0, 2**32)") from exc
    if packed.itemsize != 4:  # pragma: no cover - every mainstream platform has 4-byte "I"
        return struct.pack(f">{len(token_ids)}I", *token_ids)
    if _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


_LITTLE_ENDIAN = array("I", [1]).tobytes()[0] == 1


def encode_block(
    parent: bytes, token_ids: Sequence[int], extras: Sequence[BlockExtra] = ()
) -> bytes:
    """The canonical bytes whose digest is a block's identity."""
    return _block_prefix(parent) + _block_suffix(encode_tokens(token_ids), extras)


def _block_prefix(parent: bytes) -> bytes:
    return BLOCK_MAGIC + _field(TAG_PARENT, parent)


def _block_suffix(token_bytes: bytes, extras: Sequence[BlockExtra]) -> bytes:
    extras_payload = b"".join(e.encode() for e in extras) if extras else None
    return _field(TAG_TOKENS, token_bytes) + _field(TAG_EXTRAS, extras_payload)


class BlockHasher:
    """Computes namespace roots and chained block digests for one algorithm and block size.

    The hot path (`extend`) packs all new tokens once and then fills a preallocated buffer per
    block: the parent digest and the block's token bytes are the only bytes that change.
    """

    __slots__ = ("algo", "block_size", "digest_size", "_hash", "_buf", "_parent_at", "_tokens_at")

    def __init__(self, block_size: int, algo: str = "sha256") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.algo = algo
        self.block_size = block_size
        self._hash = get_hash_fn(algo)
        self.digest_size = HASH_ALGOS[algo]
        template = encode_block(bytes(self.digest_size), [0] * block_size)
        self._buf = bytearray(template)
        self._parent_at = len(BLOCK_MAGIC) + 5
        self._tokens_at = self._parent_at + self.digest_size + 5

    def root(self, namespace: Namespace) -> bytes:
        """The parent digest of a namespace's first block."""
        return self._hash(namespace.encode())

    def block(
        self, parent: bytes, token_ids: Sequence[int], extras: Sequence[BlockExtra] = ()
    ) -> bytes:
        """One block's digest (any length of token ids; the chain only uses full blocks)."""
        return self._hash(encode_block(parent, token_ids, extras))

    def extend(
        self,
        digests: list[bytes],
        root: bytes,
        token_ids: Sequence[int],
        extras: Callable[[int], Sequence[BlockExtra]] | None = None,
        chunks: list[bytes] | None = None,
    ) -> int:
        """Append digests for the complete blocks of ``token_ids`` not yet in ``digests``.

        ``extras(i)`` gives block ``i``'s extras (or is None). If ``chunks`` is given, each new
        block's encoded token bytes are appended to it too (a cache compares them on a hit).
        Returns how many were added. Never re-hashes a block already in ``digests``.
        """
        bs = self.block_size
        start = len(digests)
        end = len(token_ids) // bs
        if end <= start:
            return 0
        token_bytes = encode_tokens(token_ids[start * bs : end * bs])
        parent = digests[-1] if digests else root
        buf, h, p0, t0 = self._buf, self._hash, self._parent_at, self._tokens_at
        p1, width = p0 + self.digest_size, 4 * bs
        for i in range(end - start):
            chunk = token_bytes[i * width : (i + 1) * width]
            block_extras = extras(start + i) if extras is not None else ()
            if block_extras:
                parent = h(_block_prefix(parent) + _block_suffix(chunk, block_extras))
            else:
                buf[p0:p1] = parent
                buf[t0 : t0 + width] = chunk
                parent = h(buf)
            digests.append(parent)
            if chunks is not None:
                chunks.append(chunk)
        return end - start

    def chain(
        self,
        token_ids: Sequence[int],
        namespace: Namespace | None = None,
        extras: Callable[[int], Sequence[BlockExtra]] | None = None,
    ) -> list[bytes]:
        """Digests of every complete block of ``token_ids`` in ``namespace``."""
        digests: list[bytes] = []
        self.extend(digests, self.root(namespace or Namespace()), token_ids, extras)
        return digests
