"""Incremental detokenization: text deltas that never split a UTF-8 character.

Decodes a short window of recent ids (so tokenizers that strip a leading space at the start of
a decode still join words correctly) and holds text back while it ends in U+FFFD, the mark of
an incomplete byte sequence.
"""

from __future__ import annotations

from prefixcache.model.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``add(token_id)`` returns the newly complete text; ``flush()`` returns what is held."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start: decoded only for context
        self._read_offset = 0  # ids before this have been emitted

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        ids = self.token_ids
        decode = self.tokenizer.decode
        prefix_text = decode(ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full_text = decode(ids[self._prefix_offset :], self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Text still held (an incomplete character at the end is emitted as U+FFFD)."""
        ids = self.token_ids
        decode = self.tokenizer.decode
        prefix_text = decode(ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full_text = decode(ids[self._prefix_offset :], self.skip_special_tokens)
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(ids)
        self.text += delta
        return delta
