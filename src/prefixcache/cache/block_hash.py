"""Block identity: canonical encoding and chained block digests.

A block's identity is ``digest_i = H(encode(token_ids_i, extras_i, parent_digest_{i-1}))`` with
``parent_digest_{-1} = root(namespace)``. The namespace carries everything that changes KV values
or who may see them (model identity, adapter, effective cache salt, and the KV layout where it is
not the model's own dtype), so two namespaces share no block. Only complete blocks have an
identity.

The encoding is canonical, typed and length-prefixed: every field is ``tag:u8 ‖ length:u32be ‖
payload``; tokens are ``u32be`` each. The exact bytes, and golden vectors, are in
``docs/block-key.md``. Python's built-in ``hash()`` is never used: it is salted per process.

This module knows nothing about blocks in memory, tensors or requests.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
import warnings
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
TAG_KV_LAYOUT = 0x04
TAG_PUBLIC = 0x05
TAG_FOLLOWS = 0x06
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
# hashlib constructors whose .digest() is the algorithm's digest (the hot path continues them)
_HASHLIB_NEW: dict[str, Callable[[bytes | bytearray], Any]] = {
    "sha256": hashlib.sha256,
    "blake2b": functools.partial(hashlib.blake2b, digest_size=32),
}


def get_hash_fn(algo: str) -> HashFn:
    """The digest function for ``algo``: bytes -> fixed-width digest bytes."""
    if algo == "xxh3_128":
        return _xxh3_128()
    if algo not in _HASHLIB_NEW:
        raise ValueError(f"unknown hash_algo {algo!r}; choose one of {sorted(HASH_ALGOS)}")
    new = _HASHLIB_NEW[algo]
    return lambda data: bytes(new(data).digest())


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
    from the authenticated tenant; a client cannot choose another tenant's), ``kv_layout`` how
    the KV is stored where that is not the model's dtype (``int8:q8_0/32``: quantized blocks,
    never mixed with another layout's). A namespace without a layout encodes without that field,
    so the keys of caches in the model's own dtype are what they always were.

    ``public`` marks the one namespace of the operator's declared public prefixes (no salt: no
    client salt can name it); ``follows`` is the last public block's digest where a salted chain
    continues a public one. Both fields are written only when set.
    """

    model: str = ""
    adapter: str | None = None
    salt: str | bytes | None = None
    kv_layout: str | None = None
    public: bool = False
    follows: bytes | None = None

    def encode(self) -> bytes:
        layout = b"" if self.kv_layout is None else _field(TAG_KV_LAYOUT, _text(self.kv_layout))
        public = _field(TAG_PUBLIC, b"") if self.public else b""
        follows = b"" if self.follows is None else _field(TAG_FOLLOWS, self.follows)
        return (
            NAMESPACE_MAGIC
            + _field(TAG_MODEL, self.model.encode("utf-8"))
            + _field(TAG_ADAPTER, _text(self.adapter))
            + _field(TAG_SALT, _text(self.salt))
            + layout
            + public
            + follows
        )


def encode_namespace(namespace: Namespace) -> bytes:
    """The canonical bytes whose digest is the namespace root."""
    return namespace.encode()


def _pack_big_endian(token_ids: Sequence[int]) -> array[int]:
    """Token ids as u32 in big-endian byte order (validated): one conversion, one in-place swap."""
    try:
        if type(token_ids) is list:
            # the fastest conversion from Python ints (faster than array("I", ids))
            packed = array("I")
            packed.fromlist(token_ids)
        else:
            packed = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError("token ids must be integers in [0, 2**32)") from exc
    if sys.byteorder == "little":
        packed.byteswap()
    return packed


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as big-endian u32, validated."""
    return _pack_big_endian(token_ids).tobytes()


if array("I").itemsize != 4:  # pragma: no cover - every platform CPython supports has 4 bytes
    raise ImportError("prefixcache needs a C unsigned int of 4 bytes")


def encode_block(
    parent: bytes, token_ids: Sequence[int], extras: Sequence[BlockExtra] = ()
) -> bytes:
    """The canonical bytes whose digest is a block's identity.

    ``BLOCK_MAGIC ‖ field(TOKENS) ‖ [field(EXTRAS)] ‖ field(PARENT)``: the parent comes last so the
    chain can hash ``body_i + parent`` with a single concatenation per block.
    """
    return _block_body(encode_tokens(token_ids), extras) + _parent_header(len(parent)) + parent


def _block_body(token_bytes: bytes, extras: Sequence[BlockExtra] = ()) -> bytes:
    """Everything of a block's encoding but the parent digest itself (its field header included)."""
    body = BLOCK_MAGIC + _field(TAG_TOKENS, token_bytes)
    if extras:
        body += _field(TAG_EXTRAS, b"".join(e.encode() for e in extras))
    return body


def _parent_header(digest_size: int) -> bytes:
    return struct.pack(">BI", TAG_PARENT, digest_size)


class BlockHasher:
    """Computes namespace roots and chained block digests for one algorithm and block size.

    The hot path (`extend`) packs all new tokens once as big-endian u32 and cuts the bytes into
    blocks; each block's digest then continues a hash state that has already consumed the
    constant ``BLOCK_MAGIC ‖ tokens header`` (hashlib's ``copy``), with the block's token bytes
    and ``parent header ‖ parent``: no body is assembled.
    """

    __slots__ = ("algo", "block_size", "digest_size", "_hash", "_state", "_prefix", "_suffix")

    def __init__(self, block_size: int, algo: str = "sha256") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.algo = algo
        self.block_size = block_size
        self._hash = get_hash_fn(algo)
        self.digest_size = HASH_ALGOS[algo]
        # encoding without extras = _prefix ‖ token bytes ‖ _suffix ‖ parent
        self._prefix = BLOCK_MAGIC + struct.pack(">BI", TAG_TOKENS, 4 * block_size)
        self._suffix = _parent_header(self.digest_size)
        new = _HASHLIB_NEW.get(algo)
        self._state: Any = None if new is None else new(self._prefix)  # copied per block

    def __reduce__(self) -> tuple[type[BlockHasher], tuple[int, str]]:
        # pickle / deepcopy rebuild from the parameters (the per-thread scratch is not state)
        return (BlockHasher, (self.block_size, self.algo))

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
        base: int = 0,
    ) -> int:
        """Append digests for the complete blocks of ``token_ids`` not yet in ``digests``.

        ``extras(i)`` gives block ``i``'s extras (or is None). If ``chunks`` is given, each new
        block's encoded token bytes are appended to it too (a cache compares them on a hit).
        ``base`` is the index of the block that chains from ``root`` (the blocks before it chain
        from another root: a public prefix). Returns how many were added. Never re-hashes a
        block already in ``digests``.
        """
        bs = self.block_size
        start = len(digests)
        num_new = len(token_ids) // bs - start
        if num_new <= 0:
            return 0
        parent = digests[-1] if start > base else root
        width = 4 * bs
        if extras is not None and any(extras(start + i) for i in range(num_new)):
            token_bytes = encode_tokens(token_ids[start * bs : (start + num_new) * bs])
            blocks = [token_bytes[i * width : (i + 1) * width] for i in range(num_new)]
            if chunks is not None:
                chunks.extend(blocks)
            self._extend_each(digests, parent, blocks, start, extras)
            return num_new
        # Validate and pack every new token once (a copy of the list costs more than the tail).
        packed = _pack_big_endian(token_ids if start == 0 else token_ids[start * bs :])
        data = packed.tobytes()
        blocks = [data[i * width : (i + 1) * width] for i in range(num_new)]
        if chunks is not None:
            chunks.extend(blocks)
        suffix, state = self._suffix, self._state
        if state is not None:  # sha256 / blake2b: continue the prefix's state
            for block in blocks:
                h = state.copy()
                h.update(block)
                h.update(suffix + parent)
                parent = h.digest()
                digests.append(parent)
        else:
            prefix, hash_fn = self._prefix, self._hash
            digests.extend(
                [parent := hash_fn(prefix + block + suffix + parent) for block in blocks]
            )
        return num_new

    def _extend_each(
        self,
        digests: list[bytes],
        parent: bytes,
        blocks: list[bytes],
        start: int,
        extras: Callable[[int], Sequence[BlockExtra]] | None,
    ) -> None:
        """Block by block: few blocks, or blocks with extras."""
        for i, token_bytes in enumerate(blocks):
            body = _block_body(token_bytes, extras(start + i) if extras is not None else ())
            parent = self._hash(body + self._suffix + parent)
            digests.append(parent)

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
