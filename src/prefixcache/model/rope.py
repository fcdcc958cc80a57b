"""Rotary position embeddings (default and llama3-scaled), computed per step from positions.

Matches transformers' Llama/Qwen rotary embedding: cos/sin of ``position * inv_freq`` in float32,
``rotate_half`` convention (the two halves of head_dim form the pairs).
"""

from __future__ import annotations

import math

import torch

from prefixcache.model.config import RopeConfig

__all__ = ["RotaryEmbedding", "apply_rotary"]


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """inv_freq [head_dim/2], float32, with llama3 frequency scaling when configured."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Holds inv_freq on the model's device; ``cos_sin(positions)`` once per step."""

    def __init__(self, head_dim: int, rope: RopeConfig, device: torch.device | str) -> None:
        self.inv_freq = inverse_frequencies(head_dim, rope).to(device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and *signed* sin, [T, 1, head_dim] in ``dtype`` (broadcast over heads).

        transformers computes ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) =
        [-x2, x1]``; the signed sin ``[-sin, sin]`` gives the same products from ``[x2, x1]``, a
        plain roll, so `apply_rotary` needs no negation pass.
        """
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        sin = freqs.sin()
        signed_sin = torch.cat((-sin, sin), dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), signed_sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated by position; cos, signed_sin from `RotaryEmbedding`."""
    half = x.shape[-1] // 2
    if x.dtype != torch.float32:  # each product rounded, then the sum, as transformers rounds
        return x * cos + x.roll(half, dims=-1) * signed_sin
    return torch.addcmul(x * cos, x.roll(half, dims=-1), signed_sin)
