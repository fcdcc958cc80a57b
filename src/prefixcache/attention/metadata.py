"""Per-step attention metadata for a flattened batch of sequences.

Sequence b contributes ``num_new[b]`` query tokens (a prefill, a prefill chunk or one decode
token) after ``num_computed[b]`` tokens whose K/V already sit in the paged cache, reachable through
its block table. Everything here is built once per step and shared by all layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = ["AttentionMetadata"]

_T = TypeVar("_T")


@dataclass(slots=True)
class AttentionMetadata:
    """Tensors the model needs for one step; T = total new tokens, B = sequences."""

    slot_mapping: torch.Tensor  # [T] int64: physical slot of each new token
    positions: torch.Tensor  # [T] int64: absolute position of each new token
    query_start_loc: torch.Tensor  # [B+1] int64: offsets of each sequence's tokens in T
    seq_lens: torch.Tensor  # [B] int64: num_computed + num_new
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    # [R] int64: the new tokens whose logits the model returns: each sequence's last, or all of
    # a sequence's new tokens where `build` was asked for every token (prompt logprobs)
    logits_indices: torch.Tensor
    block_size: int
    num_computed: list[int]
    num_new: list[int]
    query_starts: list[int]  # python copy of query_start_loc, for slicing without syncs
    # [B] row of each sequence's last new token in the returned logits (b when R == B)
    last_logits_rows: list[int]
    # Per prefill sequence with cached context: the slots of all its tokens [seq_len] and the
    # lower-right causal mask [num_new, seq_len]. None without cached context, and for a single
    # query token (decode attends through the block table: `decode_attention`).
    context_slots: list[torch.Tensor | None]
    causal_masks: list[torch.Tensor | None]
    # forms of causal_masks built on first use: additive, tiled for stacked heads (`stacked_mask`),
    # and the new tokens' part alone (`new_token_bias`)
    _stacked_masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(
        default_factory=dict, repr=False
    )
    # what attention paths derive from this metadata (e.g. the decode plan), see `derived`
    _derived: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)

    def derived(self, key: tuple[Any, ...], build: Callable[[], _T]) -> _T:
        """``build()`` the first time a step asks for ``key`` (the first layer), the same object
        for every later layer: per-step work that depends only on this metadata."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]  # type: ignore[no-any-return]

    def slot_range(self) -> tuple[int, int]:
        """(min, max) of the slot mapping, computed once per step: the compiled paths check
        their slots against the cache size with it instead of a pass per layer."""
        return self.derived(("slot_range",), lambda: min_max(self.slot_mapping))

    def compacted(self) -> tuple[torch.Tensor, AttentionMetadata]:
        """The blocks this step's sequences read ([U] int64, ascending) and this step's
        metadata over them renumbered 0 .. U - 1: for a path that attends a copy of the blocks
        it reads (the torch paths over a quantized cache) rather than the whole cache. Built
        once per step."""
        return self.derived(("compacted",), self._compact)

    def _compact(self) -> tuple[torch.Tensor, AttentionMetadata]:
        block_size = self.block_size
        counts = [-(-(c + n) // block_size) for c, n in zip(self.num_computed, self.num_new,
                                                             strict=True)]  # fmt: skip
        table = self.block_tables.cpu().numpy()
        read = np.concatenate([table[b, :count] for b, count in enumerate(counts)])
        used, local = np.unique(read, return_inverse=True)
        tables = [part.tolist() for part in np.split(local, np.cumsum(counts)[:-1])]
        device = self.block_tables.device
        step = AttentionMetadata.build(tables, self.num_computed, self.num_new, block_size, device)
        return torch.as_tensor(used, dtype=torch.int64, device=device), step

    def stacked_mask(self, b: int, repeats: int, dtype: torch.dtype) -> torch.Tensor:
        """Sequence b's causal mask as an additive ``dtype`` mask (0 / -inf), tiled ``repeats``
        times along the query axis: [repeats * num_new, seq_len], for query heads stacked into
        one block per kv head (GQA). Built once per step; every layer reuses it (a boolean mask
        would be converted to this by SDPA in every layer)."""
        key = (b, repeats, dtype)
        stacked = self._stacked_masks.get(key)
        if stacked is None:
            mask = self.causal_masks[b]
            if mask is None:
                raise ValueError(f"sequence {b} has no cached context, hence no mask")
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            additive.masked_fill_(~mask, float("-inf"))
            stacked = self._stacked_masks[key] = additive.repeat(repeats, 1)
        return stacked

    def new_token_bias(self, b: int, repeats: int, dtype: torch.dtype) -> torch.Tensor:
        """Sequence b's causal mask among its new tokens alone (the part of `causal_masks` that
        is not all True) as an additive ``dtype`` mask, tiled ``repeats`` times along the query
        axis: [repeats * num_new, num_new], 0 where query i may see new key j <= i, else -inf.
        Built once per step."""
        key = (b, -repeats, dtype)
        bias = self._stacked_masks.get(key)
        if bias is None:
            mask = self.causal_masks[b]
            if mask is None:
                raise ValueError(f"sequence {b} has no cached context, hence no mask")
            future = ~mask[:, self.num_computed[b] :]
            bias = torch.zeros(future.shape, dtype=dtype, device=future.device)
            bias.masked_fill_(future, float("-inf"))
            bias = self._stacked_masks[key] = bias.repeat(repeats, 1)
        return bias

    @property
    def num_seqs(self) -> int:
        return len(self.num_new)

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        num_computed: Sequence[int],
        num_new: Sequence[int],
        block_size: int,
        device: str | torch.device = "cpu",
        every_token: Sequence[bool] | None = None,
    ) -> AttentionMetadata:
        """Metadata from python lists; raises ValueError on inconsistent input. ``every_token[b]``:
        return logits for all of sequence b's new tokens, not only its last."""
        computed, new = list(map(int, num_computed)), list(map(int, num_new))
        _validate(block_tables, computed, new, block_size)
        table = _padded_table(block_tables)
        seq_idx = np.repeat(np.arange(len(new)), new)
        starts = np.concatenate(([0], np.cumsum(new)))
        positions = np.arange(starts[-1]) - starts[seq_idx] + np.asarray(computed)[seq_idx]
        slots = table[seq_idx, positions // block_size] * block_size + positions % block_size
        as_tensor = _tensor_maker(device)
        context_slots, masks = _context(table, computed, new, block_size, as_tensor)
        logits_indices = starts[1:] - 1
        last_rows = list(range(len(new)))
        if every_token is not None and any(every_token):
            logits_indices, last_rows = _logits_rows(starts, every_token)
        return cls(
            slot_mapping=as_tensor(slots),
            positions=as_tensor(positions),
            query_start_loc=as_tensor(starts),
            seq_lens=as_tensor(np.asarray(computed) + np.asarray(new)),
            block_tables=as_tensor(table),
            logits_indices=as_tensor(logits_indices),
            block_size=block_size,
            num_computed=computed,
            num_new=new,
            query_starts=starts.tolist(),
            last_logits_rows=last_rows,
            context_slots=context_slots,
            causal_masks=masks,
        )


def _logits_rows(starts: np.ndarray, every_token: Sequence[bool]) -> tuple[np.ndarray, list[int]]:
    """Token indices whose logits to return, and the row of each sequence's last one."""
    parts = []
    last_rows = []
    num_rows = 0
    for b, every in enumerate(every_token):
        start, end = int(starts[b]), int(starts[b + 1])
        rows = np.arange(start if every else end - 1, end)
        parts.append(rows)
        num_rows += len(rows)
        last_rows.append(num_rows - 1)
    return np.concatenate(parts), last_rows


def _tensor_maker(device: str | torch.device) -> Callable[[np.ndarray], torch.Tensor]:
    def as_tensor(array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array, dtype=np.int64), device=device)

    return as_tensor


def _validate(
    block_tables: Sequence[Sequence[int]], computed: list[int], new: list[int], block_size: int
) -> None:
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not (len(block_tables) == len(computed) == len(new)) or not new:
        raise ValueError(
            "block_tables, num_computed and num_new must be non-empty and of equal length, got "
            f"{len(block_tables)}, {len(computed)}, {len(new)}"
        )
    for b, (table, n_computed, n_new) in enumerate(zip(block_tables, computed, new, strict=True)):
        if n_computed < 0 or n_new < 1:
            raise ValueError(f"sequence {b}: num_computed={n_computed}, num_new={n_new} invalid")
        needed = -(-(n_computed + n_new) // block_size)
        if len(table) < needed:
            raise ValueError(
                f"sequence {b}: block table has {len(table)} blocks, "
                f"{n_computed + n_new} tokens need {needed}"
            )
        if any(block_id < 0 for block_id in table[:needed]):
            raise ValueError(f"sequence {b}: negative block id in block table")


def _padded_table(block_tables: Sequence[Sequence[int]]) -> np.ndarray:
    width = max(1, max(len(t) for t in block_tables))
    table = np.zeros((len(block_tables), width), dtype=np.int64)
    for b, row in enumerate(block_tables):
        table[b, : len(row)] = row
    return table


def _context(
    table: np.ndarray,
    computed: list[int],
    new: list[int],
    block_size: int,
    as_tensor: Callable[[np.ndarray], torch.Tensor],
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Slots of every token of prefill sequences that have cached context, and their masks."""
    slots: list[torch.Tensor | None] = []
    masks: list[torch.Tensor | None] = []
    for b, (n_computed, n_new) in enumerate(zip(computed, new, strict=True)):
        if n_computed == 0 or n_new == 1:
            slots.append(None)
            masks.append(None)
            continue
        pos = np.arange(n_computed + n_new)
        seq_slots = as_tensor(table[b, pos // block_size] * block_size + pos % block_size)
        slots.append(seq_slots)
        masks.append(_lower_right_mask(n_computed, n_new, seq_slots))
    return slots, masks


def _lower_right_mask(n_computed: int, n_new: int, like: torch.Tensor) -> torch.Tensor:
    # mask[i, j]: new token i (absolute position n_computed + i) may attend key j <= that position
    query_pos = torch.arange(n_new, device=like.device).unsqueeze(1) + n_computed
    key_pos = torch.arange(n_computed + n_new, device=like.device).unsqueeze(0)
    return key_pos <= query_pos


def min_max(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor, in one pass."""
    low, high = t.aminmax()
    return int(low), int(high)
