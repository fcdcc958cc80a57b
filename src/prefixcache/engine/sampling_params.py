"""How to sample one request's continuation: validated, immutable plain data.

The sampler reads the sampling fields, the engine the stop fields. This module knows nothing about
tensors, caches or models.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

from prefixcache.errors import InvalidParam

__all__ = ["GREEDY_TEMPERATURE", "SamplingParams"]

# Below this temperature sampling is greedy (vLLM's rule): dividing logits by a tiny temperature
# overflows float32 (1e-300 gives inf scores, and softmax of infs picks token 0 every time).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping rules; bad values raise `InvalidParam` (a ValueError) naming the field.

    ``temperature < GREEDY_TEMPERATURE`` (0 included) is greedy (exact argmax); it must be
    finite. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. ``seed`` fixes the request's random stream (choice ``i`` of ``n`` gets its own stream
    derived from it); None draws a seed from the engine's seeded generator. ``stop`` strings end
    generation and are cut from the text; ``stop_token_ids`` and the tokenizer's EOS ids (unless
    ``ignore_eos``) end it too, and stay in ``token_ids``. ``logprobs`` asks for the sampled token's
    log-probability plus that many top alternatives per step.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_str_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_int_tuple(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("n", self.n, minimum=1)
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("temperature", self.temperature)
        _check_number("top_p", self.top_p)
        if self.temperature < 0 or not math.isfinite(self.temperature):
            raise InvalidParam(
                "temperature", f"temperature must be a finite number >= 0, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        if any(s == "" for s in self.stop):
            raise InvalidParam("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParam(
                "stop_token_ids", f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def max_stop_len(self) -> int:
        """Longest stop string: streamed text holds back this many characters minus one."""
        return max((len(s) for s in self.stop), default=0)


def _as_str_tuple(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    items = tuple(value) if isinstance(value, Iterable) else None
    if items is None or not all(isinstance(s, str) for s in items):
        raise InvalidParam("stop", f"stop must be a string or a list of strings, got {value!r}")
    return cast("tuple[str, ...]", items)


def _as_int_tuple(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    items = tuple(value) if isinstance(value, Iterable) else None
    if items is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        raise InvalidParam(
            "stop_token_ids", f"stop_token_ids must be a list of integers, got {value!r}"
        )
    return items


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidParam(name, f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidParam(name, f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise InvalidParam(name, f"{name} must be a number, got {value!r}")
