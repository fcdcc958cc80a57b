"""How to sample one request's continuation: validated, immutable plain data.

The sampler reads the sampling fields, the engine the stop fields. This module knows nothing about
tensors, caches or models.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import cast

from prefixcache.errors import InvalidParam

__all__ = [
    "GREEDY_TEMPERATURE",
    "LOGPROBS_MODES",
    "MAX_LOGPROBS",
    "SamplingParams",
    "StructuredOutputs",
]

# Most alternatives one token may report (vLLM's default ``max_logprobs``; OpenAI allows 20).
MAX_LOGPROBS = 20
# What reported log-probabilities are of (vLLM's ``logprobs_mode`` names): the model's own
# distribution, or the one after the logits processors (penalties, bias, min_tokens) and
# temperature.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")

# Below this temperature sampling is greedy (vLLM's rule): dividing logits by a tiny temperature
# overflows float32 (1e-300 gives inf scores, and softmax of infs picks token 0 every time).
GREEDY_TEMPERATURE = 1e-5


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """One output constraint, as vLLM's ``structured_outputs`` names them: ``json`` (a JSON
    Schema, as a dict or its JSON text), ``json_object`` (any JSON object), ``regex``, ``choice``
    (one of these strings) or ``grammar`` (Lark). Exactly one. Hashable: compiled grammars are
    cached by it (`prefixcache.engine.structured`)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidParam("structured_outputs", f"unknown constraint {self.kind!r}; one of "
                               f"{', '.join(STRUCTURED_KINDS)}")
        if not isinstance(self.value, str):
            raise InvalidParam("structured_outputs", "the constraint must be given as text")

    @classmethod
    def of(
        cls,
        *,
        json: object = None,
        json_object: bool = False,
        regex: str | None = None,
        choice: Iterable[str] | None = None,
        grammar: str | None = None,
    ) -> StructuredOutputs:
        """vLLM's keyword form: ``StructuredOutputs.of(json=schema)``, ``of(choice=[...])``..."""
        import json as _json

        given = [name for name, v in (("json", json), ("regex", regex), ("choice", choice),
                                      ("grammar", grammar)) if v is not None]
        given += ["json_object"] if json_object else []
        if len(given) != 1:
            raise InvalidParam("structured_outputs", "give exactly one of json, json_object, "
                               f"regex, choice and grammar (got {', '.join(given) or 'none'})")
        kind = given[0]
        if kind == "json":
            text = json if isinstance(json, str) else _json.dumps(json)  # property order kept
            return cls("json", text)
        if kind == "choice":
            items = list(choice or ())
            if not items or not all(isinstance(c, str) and c for c in items):
                raise InvalidParam("structured_outputs",
                                   "choice must be a non-empty list of non-empty strings")
            return cls("choice", _json.dumps(items))
        if kind == "json_object":
            return cls("json_object")
        source = regex if kind == "regex" else grammar
        if not isinstance(source, str) or not source:
            raise InvalidParam("structured_outputs", f"{kind} must be a non-empty string")
        return cls(kind, source)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping rules; bad values raise `InvalidParam` (a ValueError) naming the field.

    ``temperature < GREEDY_TEMPERATURE`` (0 included) is greedy (exact argmax); it must be
    finite. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. ``seed`` fixes the request's random stream (choice ``i`` of ``n`` gets its own stream
    derived from it); None draws a seed from the engine's seeded generator. ``stop`` strings end
    generation and are cut from the text (kept with ``include_stop_str_in_output``);
    ``stop_token_ids`` and the tokenizer's EOS ids (unless ``ignore_eos``) end it too, and stay in
    ``token_ids``. ``logprobs`` asks for the sampled token's log-probability plus that many top
    alternatives per step; ``prompt_logprobs`` the same for every prompt token (the first has
    none), which makes the request compute its whole prompt: no cache read (it still caches).

    Logits processors, vLLM's semantics, applied in this order before temperature:
    ``logit_bias`` (token id -> added bias in [-100, 100]); ``min_tokens`` (EOS and stop token ids
    are masked, and stop strings not looked for, until that many tokens exist);
    ``repetition_penalty`` (> 0; a token already in the prompt or output has its logit divided by
    it when positive, multiplied when negative); ``frequency_penalty`` and ``presence_penalty``
    (in [-2, 2]; subtract ``count * frequency + presence`` from each token already generated).
    ``min_p`` (in [0, 1]) drops tokens whose probability is below ``min_p`` times the top one's,
    after temperature. ``best_of`` (>= n) generates that many choices and keeps the ``n`` with
    the highest cumulative log-probability. ``skip_special_tokens`` leaves special tokens out of
    the text. ``structured_outputs`` constrains every choice to a grammar (`StructuredOutputs`);
    a choice ends when its grammar is complete.
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
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: Mapping[int, float] | None = None
    best_of: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_str_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_int_tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _as_bias(self.logit_bias))
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("n", self.n, minimum=1)
        self._check_controls()
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise InvalidParam(name, f"{name} must be <= {MAX_LOGPROBS}, got {value}")
        if any(s == "" for s in self.stop):
            raise InvalidParam("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParam(
                "stop_token_ids", f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}"
            )

    def _check_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidParam(name, f"{name} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 1e4:
            raise InvalidParam("repetition_penalty",
                               f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParam("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidParam("min_tokens", f"min_tokens ({self.min_tokens}) must be <= "
                               f"max_tokens ({self.max_tokens})")
        if self.best_of is not None:
            _check_int("best_of", self.best_of, minimum=1)
            if self.best_of < self.n:
                raise InvalidParam("best_of", f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputs
        ):
            raise InvalidParam("structured_outputs", "structured_outputs must be StructuredOutputs")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParam(name, f"{name} must be a boolean")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def num_choices(self) -> int:
        """Choices generated: ``best_of`` when given, else ``n``."""
        return self.best_of or self.n

    @property
    def ranks_choices(self) -> bool:
        """More choices are generated than returned: each needs its cumulative logprob."""
        return self.num_choices > self.n

    @property
    def processes_logits(self) -> bool:
        """Any logits processor applies (not every step: see `logits_processors`)."""
        return bool(
            self.logit_bias or self.min_tokens or self.repetition_penalty != 1.0
            or self.frequency_penalty or self.presence_penalty
        )

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


def _as_bias(value: object) -> Mapping[int, float] | None:
    """A token id -> bias mapping (ids may come as decimal strings, as in the OpenAI API)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidParam("logit_bias", f"logit_bias must map token ids to numbers, got {value!r}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise InvalidParam("logit_bias", f"logit_bias key {key!r} is not a token id") from None
        if token_id < 0 or isinstance(key, bool):
            raise InvalidParam("logit_bias", f"logit_bias key {key!r} is not a token id")
        _check_number("logit_bias", bias)
        if not -100.0 <= bias <= 100.0:
            raise InvalidParam(
                "logit_bias", f"logit_bias for token {token_id} must be in [-100, 100], got {bias}"
            )
        out[token_id] = float(bias)
    return out or None


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
