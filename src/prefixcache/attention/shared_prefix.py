"""Shared leading blocks between sequences, and the log-sum-exp merge of partial attentions.

Prefix caching makes sequences' block tables start with the same physical blocks. Attention over
those blocks can be computed once for all their queries and merged with each sequence's own part
(cascade attention); decode and prefill both group sequences here. Knows block ids, not requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["SharedPrefix", "find_shared_prefixes", "merge_by_lse"]


@dataclass(slots=True)
class SharedPrefix:
    """Leading blocks that several sequences hold in common (full in each of them)."""

    seq_indices: torch.Tensor  # [n] int64: rows of the batch, ascending, n >= 2
    block_ids: torch.Tensor  # [num_shared_blocks] int64, num_shared_blocks >= 1


def find_shared_prefixes(
    table: np.ndarray, num_shareable: np.ndarray, device: str | torch.device
) -> tuple[np.ndarray, list[SharedPrefix]]:
    """Shared leading blocks per sequence ([B]) and the groups; groups key on the first block.

    table: [B, max_blocks] int; num_shareable: [B] int, leading blocks each sequence may share.
    """
    shared_blocks = np.zeros(len(num_shareable), dtype=np.int64)
    groups: dict[int, list[int]] = {}
    for b in np.flatnonzero(num_shareable > 0).tolist():
        groups.setdefault(int(table[b, 0]), []).append(b)
    shared: list[SharedPrefix] = []
    for rows in groups.values():
        if len(rows) < 2:
            continue
        limit = int(num_shareable[rows].min())
        same = (table[rows, :limit] == table[rows[0], :limit]).all(axis=0)
        count = limit if same.all() else int(np.argmin(same))
        shared_blocks[rows] = count
        shared.append(
            SharedPrefix(
                seq_indices=torch.as_tensor(rows, dtype=torch.int64, device=device),
                block_ids=torch.as_tensor(table[rows[0], :count], dtype=torch.int64, device=device),
            )
        )
    return shared_blocks, shared


def merge_by_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets, from each set's output and lse.

    out_*: [..., head_dim]; lse_*: [...] (the same leading shape).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = (lse_a - lse).exp_().unsqueeze(-1)
    weight_b = (lse_b - lse).exp_().unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse
