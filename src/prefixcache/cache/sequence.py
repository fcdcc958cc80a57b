"""A token sequence as the cache sees it: ids, namespace parts, and its digest chain."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC

from prefixcache.cache.block_hash import BlockExtra, BlockHasher, Namespace

__all__ = ["Sequence"]


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

    ``num_computed_tokens`` belongs to the cache that holds the sequence: `allocate` sets it to
    the hit, `commit` advances it, `free` zeroes it. Everyone else only reads it.
    """

    __slots__ = (
        "seq_id", "token_ids", "num_prompt_tokens", "salt", "adapter", "lora", "block_extras",
        "reads_cache", "writes_cache", "domain", "num_computed_tokens", "block_digests",
        "block_token_bytes",
        "_digest_key", "_root", "_hasher", "_model", "_kv_layout",
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
    ) -> None:
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
        self.num_computed_tokens = 0
        self.block_digests: list[bytes] = []
        # block i's token ids as u32be bytes, kept with its digest: hits compare them cheaply
        self.block_token_bytes: list[bytes] = []
        self._digest_key: tuple[object, ...] | None = None
        self._root = b""
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
        return Namespace(model=model, adapter=self.adapter, salt=self.salt, kv_layout=kv_layout)

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
                self._root = hasher.root(self.namespace(model, kv_layout))
                self.block_digests = []
                self.block_token_bytes = []
        if len(self.token_ids) >= (len(self.block_digests) + 1) * hasher.block_size:
            get = self.block_extras.get
            extras = (lambda i: get(i) or ()) if self.block_extras else None
            hasher.extend(
                self.block_digests, self._root, self.token_ids, extras, self.block_token_bytes
            )
        return self.block_digests

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
