"""A token sequence as the cache sees it: ids, namespace parts, and its digest chain."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceABC

from prefixcache.cache.block_hash import BlockExtra, BlockHasher, Namespace

__all__ = ["PUBLIC_DOMAIN", "Sequence"]

PUBLIC_DOMAIN = "public"  # the domain of public blocks (never a tenant's: those are kind:name)


class Sequence:
    """``salt`` is the *effective* cache salt (namespace part), ``adapter`` the LoRA adapter's
    identity (its content digest: namespace part; ``lora``, its id and name as the request gave
    them, go into KV events only), and
    ``block_extras`` maps a block index to the extras (multimodal inputs) that change its KV.
    ``use_cache=False`` is isolation mode ``none``: the sequence neither reads nor writes the
    cache. ``read_cache=False`` computes every token (no hit is looked up) but still caches what
    it computes: a request that needs prompt logprobs. Both are settled once, as
    ``reads_cache`` and ``writes_cache`` (a cache with prefix caching off does neither).
    ``domain`` is the scheduling domain it belongs to (a tenant or a trusted group: the server's
    ``Tenant.scheduling_domain``): its fair share, its caps and pins, and the blocks it caches,
    evicted in that domain's turn. The token ids are copied, unless ``copy=False`` and they are
    a list built for this sequence alone (a simulator's fresh prompt: a copy touches every int
    object).

    ``public_blocks``: how many leading blocks are whole blocks of a public prefix the operator
    declared and this sequence's tenant may use (the server decides, `public.py`). Those blocks
    chain from the one public namespace (no salt) and belong to `PUBLIC_DOMAIN`; the blocks after
    them chain from the last public block under the sequence's own salt.

    ``num_computed_tokens`` belongs to the cache that holds the sequence: `allocate` sets it to
    the hit, `commit` advances it, `free` zeroes it. Everyone else only reads it.
    """

    __slots__ = (
        "seq_id", "token_ids", "num_prompt_tokens", "salt", "adapter", "lora", "block_extras",
        "reads_cache", "writes_cache", "domain", "num_computed_tokens", "block_digests",
        "block_token_bytes", "public_blocks",
        "_digest_key", "_root", "_tail_root", "_hasher", "_model", "_kv_layout",
    )  # fmt: skip

    def __init__(
        self,
        seq_id: str,
        token_ids: Iterable[int],
        salt: str | bytes | None = None,
        *,
        adapter: str | None = None,
        block_extras: dict[int, SequenceABC[BlockExtra]] | None = None,
        use_cache: bool = True,
        copy: bool = True,
        domain: str = "",
        read_cache: bool = True,
        lora: tuple[int, str] | None = None,
        public_blocks: int = 0,
    ) -> None:
        if public_blocks < 0:
            raise ValueError(f"public_blocks must be >= 0, got {public_blocks}")
        self.seq_id = seq_id
        # copy=False: a list built for this sequence alone becomes its own (it is appended to)
        self.token_ids: list[int] = (
            token_ids if not copy and isinstance(token_ids, list) else list(token_ids)
        )
        self.num_prompt_tokens = len(self.token_ids)
        self.salt = salt
        self.adapter = adapter
        self.lora = lora
        self.block_extras = block_extras or {}
        self.writes_cache = use_cache
        self.reads_cache = use_cache and read_cache
        self.domain = domain
        self.public_blocks = public_blocks if use_cache else 0
        self.num_computed_tokens = 0
        self.block_digests: list[bytes] = []
        # block i's token ids as u32be bytes, kept with its digest: hits compare them cheaply
        self.block_token_bytes: list[bytes] = []
        self._digest_key: tuple[object, ...] | None = None
        self._root = b""
        self._tail_root = b""  # the root of the blocks after the public ones (the salted chain)
        self._hasher: BlockHasher | None = None  # the last caller's, for a cheap same-key check
        self._model = ""
        self._kv_layout: str | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, num_tokens={len(self.token_ids)}, "
            f"num_computed={self.num_computed_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append(self, token_id: int) -> None:
        """Add one generated token (its KV is computed by the next step)."""
        self.token_ids.append(token_id)

    def namespace(self, model: str, kv_layout: str | None = None) -> Namespace:
        """The namespace of the sequence's own (salted) blocks, with no public prefix."""
        return Namespace(model=model, adapter=self.adapter, salt=self.salt, kv_layout=kv_layout)

    def block_domain(self, index: int) -> str:
        """The domain block ``index`` is cached in: `PUBLIC_DOMAIN` or the sequence's own."""
        return PUBLIC_DOMAIN if index < self.public_blocks else self.domain

    def digests(
        self, hasher: BlockHasher, model: str, kv_layout: str | None = None
    ) -> list[bytes]:
        """Digests of every complete block, extended incrementally (never re-hashed).

        A sequence used by a cache with a different hasher, model or KV layout gets a fresh
        chain.
        """
        if hasher is not self._hasher or model != self._model or kv_layout != self._kv_layout:
            self._hasher, self._model, self._kv_layout = hasher, model, kv_layout
            key = (hasher.algo, hasher.block_size, model, kv_layout)
            if key != self._digest_key:
                self._digest_key = key
                ns = (Namespace(model, self.adapter, None, kv_layout, public=True)
                      if self.public_blocks else self.namespace(model, kv_layout))
                self._root = self._tail_root = hasher.root(ns)
                self.block_digests = []
                self.block_token_bytes = []
        if len(self.token_ids) >= (len(self.block_digests) + 1) * hasher.block_size:
            get = self.block_extras.get
            extras = (lambda i: get(i) or ()) if self.block_extras else None
            if self.public_blocks:
                self._extend_split(hasher, model, kv_layout, extras)
            else:
                hasher.extend(
                    self.block_digests, self._root, self.token_ids, extras, self.block_token_bytes
                )
        return self.block_digests

    def _extend_split(
        self, hasher: BlockHasher, model: str, kv_layout: str | None,
        extras: Callable[[int], SequenceABC[BlockExtra]] | None,
    ) -> None:
        """The public blocks from the public root, then the rest from the salted root that
        follows the last public block."""
        num_public, digests = self.public_blocks, self.block_digests
        if len(digests) < num_public:
            if num_public * hasher.block_size > self.num_prompt_tokens:
                raise ValueError(f"public_blocks {num_public} is more than the prompt's "
                                 f"{self.num_prompt_tokens // hasher.block_size} whole blocks")
            public_ids = self.token_ids[: num_public * hasher.block_size]
            hasher.extend(digests, self._root, public_ids, extras, self.block_token_bytes)
            self._tail_root = hasher.root(Namespace(
                model, self.adapter, self.salt, kv_layout, follows=digests[-1]))
        hasher.extend(digests, self._tail_root, self.token_ids, extras, self.block_token_bytes,
                      base=num_public)

    def tail_root(self, hasher: BlockHasher, model: str, kv_layout: str | None = None) -> bytes:
        """The root the sequence's own blocks chain from: its namespace root, or, after a
        public prefix, the salted root that follows it."""
        self.digests(hasher, model, kv_layout)
        return self._tail_root

    def root_digest(self, hasher: BlockHasher, model: str, kv_layout: str | None = None) -> bytes:
        """The namespace root: the parent of the first block."""
        self.digests(hasher, model, kv_layout)
        return self._root

    def fork(self, child_id: str) -> Sequence:
        """A copy with the same tokens, namespace and computed state (for n > 1)."""
        child = copy.copy(self)  # every slot; the lists the child appends to are its own
        child.seq_id = child_id
        child.token_ids = list(self.token_ids)
        child.block_digests = list(self.block_digests)
        child.block_token_bytes = list(self.block_token_bytes)
        return child
