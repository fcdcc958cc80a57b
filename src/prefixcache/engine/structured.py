"""Structured output: a grammar per request, its allowed tokens masked into each step's logits.

The grammar engine is llguidance (chosen by measurement: `docs/structured-output.md`): a JSON
Schema, a regex, a list of choices or a Lark grammar becomes an llguidance grammar, compiled and
validated once per (spec, tokenizer) and cached; each constrained choice holds an `LLMatcher`
that computes the next-token bitmask and accepts each sampled token (tokens are only ever
accepted, never rolled back). `mask_logits` applies the bitmasks of a step's constrained rows
as one batched masked fill. A grammar that allows no token ends its choice (never the step).

llguidance is the ``structured`` extra; without it a constrained request is refused with a
message saying so.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from prefixcache.engine.sampling_params import StructuredOutputs
from prefixcache.errors import InvalidParam, have_extra

__all__ = ["GrammarCompiler", "mask_logits"]

_CACHE_SIZE = 256
# JSON as a model likes to write it (indented or compact), but at most 12 whitespace characters
# between two tokens of JSON, so an unsure model cannot pad forever
_JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,12}"}


class GrammarCompiler:
    """Turns `StructuredOutputs` into matchers for one tokenizer; compiled grammars are cached."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltokenizer: Any = None
        self._grammars: OrderedDict[StructuredOutputs, str] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, spec: StructuredOutputs, param: str = "structured_outputs") -> Any:
        """A fresh matcher for ``spec``; a spec the library rejects raises `InvalidParam`
        naming ``param``, with the library's message."""
        import llguidance

        grammar = self.grammar(spec, param)
        return llguidance.LLMatcher(self.lltokenizer(), grammar)

    def grammar(self, spec: StructuredOutputs, param: str = "structured_outputs") -> str:
        """The compiled (and validated) llguidance grammar of ``spec``, cached."""
        with self._lock:
            cached = self._grammars.get(spec)
            if cached is not None:
                self._grammars.move_to_end(spec)
                return cached
        if not have_extra("llguidance"):
            raise InvalidParam(param, "structured output needs the grammar engine: "
                                      "pip install 'prefixcache[structured]'")
        import llguidance

        grammar = _to_llguidance(spec, param)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer())
        if error:
            raise InvalidParam(param, f"invalid {spec.kind}: {error.strip()}")
        with self._lock:
            self._grammars[spec] = grammar
            while len(self._grammars) > _CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    def lltokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built once per engine, on first use."""
        with self._lock:
            if self._lltokenizer is None:
                import llguidance

                self._lltokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=list(self.tokenizer.eos_token_ids) or None)
            return self._lltokenizer


def _to_llguidance(spec: StructuredOutputs, param: str) -> str:
    import llguidance

    build = llguidance.LLMatcher
    if spec.kind == "json":
        try:
            schema = json.loads(spec.value)
        except json.JSONDecodeError as exc:
            raise InvalidParam(param, f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidParam(param, "a JSON schema must be an object (or true/false)")
        return str(build.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS))  # type: ignore[arg-type]
    if spec.kind == "json_object":
        return str(build.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS))  # type: ignore[arg-type]
    if spec.kind == "regex":
        return str(build.grammar_from_regex(spec.value))
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        alternatives = " | ".join(json.dumps(c) for c in choices)
        return str(build.grammar_from_lark(f"start: {alternatives}"))
    return str(build.grammar_from_lark(spec.value))  # "grammar": Lark (or llguidance JSON)


def mask_logits(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Any]) -> list[int]:
    """Mask ``logits`` [R, V] in place: row ``rows[i]`` keeps only what ``matchers[i]`` allows.
    Returns the rows whose grammar allows no token at all (their choice must end)."""
    if not rows:
        return []
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    for i, matcher in enumerate(matchers):
        matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
    packed = bitmask.numpy()
    blocked = torch.from_numpy(
        np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")[:, :vocab] == 0
    )
    if len(rows) == logits.shape[0]:  # every row constrained: mask in place
        logits.masked_fill_(blocked, float("-inf"))
    else:
        index = torch.tensor(list(rows))
        selected = logits.index_select(0, index)
        selected.masked_fill_(blocked, float("-inf"))
        logits.index_copy_(0, index, selected)
    return [rows[i] for i in np.flatnonzero(~packed.any(axis=1)).tolist()]
