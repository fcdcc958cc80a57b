"""Paged KV storage: per layer, K and V of shape [num_blocks, block_size, num_kv_heads, row],
a row being one token's head in the cache's layout (`kv_format`: head_dim values of the
activations' dtype, or a quantized layout's bytes).

The storage knows block ids and slots (``block_id * block_size + offset``), never hashes or
requests. Writes go through a slot mapping; copy-on-write and zero-on-reuse act on whole blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from prefixcache.attention.kv_format import KVFormat, format_of_dtype

__all__ = ["KVLayout", "PagedKVCache", "bytes_per_block"]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of a model's KV per token: every KV size (bytes per block, blocks in a budget,
    the tensors to allocate) is computed from this one place. ``dtype``: the activations'
    (the queries'); ``kv_format``: how the cache keeps K and V (None: as ``dtype``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    kv_format: KVFormat | None = None

    def __post_init__(self) -> None:
        self.format.check_head_dim(self.head_dim)

    @classmethod
    def of(
        cls, config: ModelShape, dtype: torch.dtype, kv_format: KVFormat | None = None
    ) -> KVLayout:
        """The layout of a model config (anything with the Hugging Face field names)."""
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype,
                   kv_format)  # fmt: skip

    @property
    def format(self) -> KVFormat:
        """The cache's layout (`kv_format`), resolved."""
        return self.kv_format or format_of_dtype(self.dtype)

    @property
    def namespace_layout(self) -> str | None:
        """What the cache namespace names of the layout: None where it keeps the activations'
        dtype (the model identity names that), else the layout's name (`KVFormat.layout`)."""
        found = self.format
        return None if found == format_of_dtype(self.dtype) else found.layout

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of K and V, over all layers, that one block of ``block_size`` tokens holds."""
        row = self.format.row_bytes(self.head_dim)
        return 2 * self.num_layers * block_size * self.num_kv_heads * row

    def blocks_in(self, memory_bytes: int, block_size: int) -> int:
        """How many blocks fit in ``memory_bytes`` (at least one, else a clear error)."""
        per_block = self.bytes_per_block(block_size)
        num_blocks = int(memory_bytes // per_block)
        if num_blocks < 1:
            raise ValueError(
                f"a KV memory budget of {memory_bytes} bytes holds no block "
                f"({per_block} bytes per block of {block_size} tokens)"
            )
        return num_blocks

    def allocate(
        self, num_blocks: int, block_size: int, device: str | torch.device = "cpu"
    ) -> PagedKVCache:
        """Paged K/V tensors of this layout."""
        return PagedKVCache(self.num_layers, num_blocks, block_size, self.num_kv_heads,
                            self.head_dim, self.dtype, device, self.kv_format)


class ModelShape(Protocol):
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of K and V, over all layers, that one block holds (`KVLayout.bytes_per_block`)."""
    return KVLayout(num_layers, num_kv_heads, head_dim, dtype).bytes_per_block(block_size)


class PagedKVCache:
    """K and V tensors for every layer, addressed by physical block id. ``dtype``: the
    activations'; ``kv_format``: the cache's layout (None: rows of ``dtype`` values)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_format: KVFormat | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {value!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_format = kv_format or format_of_dtype(dtype)
        self.kv_format.check_head_dim(head_dim)
        self.storage_dtype = storage = self.kv_format.storage
        shape = (num_blocks, block_size, num_kv_heads, self.kv_format.row_width(head_dim))
        # k_caches[i], v_caches[i]: [num_blocks, block_size, num_kv_heads, row width]
        self.k_caches = [torch.zeros(shape, dtype=storage, device=device)
                         for _ in range(num_layers)]  # fmt: skip
        self.v_caches = [torch.zeros(shape, dtype=storage, device=device)
                         for _ in range(num_layers)]  # fmt: skip

    @classmethod
    def from_memory_budget(
        cls,
        memory_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_format: KVFormat | None = None,
    ) -> PagedKVCache:
        """As many blocks as fit in ``memory_bytes`` (at least one, else a clear error)."""
        layout = KVLayout(num_layers, num_kv_heads, head_dim, dtype, kv_format)
        return layout.allocate(layout.blocks_in(memory_bytes, block_size), block_size, device)

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                        self.kv_format)  # fmt: skip

    @property
    def row_width(self) -> int:
        """The tensors' last dimension: head_dim values, or a quantized row's bytes."""
        return self.kv_format.row_width(self.head_dim)

    @property
    def num_bytes(self) -> int:
        """Total bytes of K and V storage."""
        return self.num_blocks * self.layout.bytes_per_block(self.block_size)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each [num_blocks, block_size, num_kv_heads, `row_width`]."""
        return self.k_caches[index], self.v_caches[index]

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy every layer's K/V of block ``src`` into block ``dst`` (copy-on-write)."""
        if not pairs:
            return
        src, dst = self._block_index(pairs)
        if len(set(dst.tolist())) != len(pairs):
            raise ValueError("copy_blocks: a destination block appears twice")
        for cache in (*self.k_caches, *self.v_caches):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Wipe every layer's K/V of the given blocks (zero-on-reuse across namespaces)."""
        if not block_ids:
            return
        index = self._check_ids(list(block_ids))
        for cache in (*self.k_caches, *self.v_caches):
            cache.index_fill_(0, index, 0)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the given blocks' K and V as stored: [len(block_ids), 2 * num_layers,
        block_size, num_kv_heads, `row_width`], per block layer 0's K, layer 0's V, layer 1's
        K, ... (the payload order of a tier record, in the cache's layout)."""
        index = self._check_ids(list(block_ids))
        parts: list[torch.Tensor] = []
        for k, v in zip(self.k_caches, self.v_caches, strict=True):
            parts += (k.index_select(0, index), v.index_select(0, index))
        return torch.stack(parts, dim=1)

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite the given blocks' K and V with ``data`` (as `read_blocks` returns it)."""
        index = self._check_ids(list(block_ids))
        shape = (len(index), 2 * self.num_layers, self.block_size, self.num_kv_heads,
                 self.row_width)
        if tuple(data.shape) != shape or data.dtype != self.storage_dtype:
            raise ValueError(f"write_blocks: expected {shape} {self.storage_dtype}, got "
                             f"{tuple(data.shape)} {data.dtype}")
        for layer, (k, v) in enumerate(zip(self.k_caches, self.v_caches, strict=True)):
            k.index_copy_(0, index, data[:, 2 * layer].to(k.device))
            v.index_copy_(0, index, data[:, 2 * layer + 1].to(v.device))

    def _block_index(self, pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        src = self._check_ids([int(p[0]) for p in pairs])
        dst = self._check_ids([int(p[1]) for p in pairs])
        return src, dst

    def _check_ids(self, block_ids: list[int]) -> torch.Tensor:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)
