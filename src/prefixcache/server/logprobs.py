"""Log probabilities on the wire: the engine's per-token entries in OpenAI's and vLLM's shapes.

The engine reports, per token, ``{"token_id", "logprob", "top": {id: logprob}}`` (and a ``rank``
for prompt tokens). Completions want parallel lists (``tokens``, ``token_logprobs``,
``top_logprobs`` keyed by token text, ``text_offset``), with the chosen token always among the
top ones; chat wants ``content: [{token, logprob, bytes, top_logprobs}]``; vLLM's
``prompt_logprobs`` a list of ``{id: {logprob, rank, decoded_token}}``. Token text is each id
decoded alone (special tokens included), memoised; a token that is only part of a UTF-8
character is named by its bytes, ``bytes:\\xe2\\x80``, as OpenAI does, so no two tokens share
a name in a ``top_logprobs`` dict.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prefixcache.server.protocol import JSONObject

if TYPE_CHECKING:
    from prefixcache.model.tokenizer import Tokenizer

__all__ = ["TokenText", "chat_logprobs", "completion_logprobs", "vllm_prompt_logprobs"]

Entry = JSONObject


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte (GPT-2's table), inverted:
    printable Latin-1 bytes stand for themselves, the other 68 map to U+0100 onwards."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(0x100 + i) for i, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_level_alphabet()


class TokenText:
    """Each token id's text alone (what the logprobs name it by), and its bytes; memoised."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes_of(self, token_id: int) -> list[int]:
        return list(self._lookup(token_id)[1])

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        found = self._memo.get(token_id)
        if found is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = text.encode("utf-8")
            if "\ufffd" in text:  # part of a character: name it by its bytes
                raw = self._raw_bytes(token_id) or raw
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            found = self._memo[token_id] = (text, raw)
        return found

    def _raw_bytes(self, token_id: int) -> bytes | None:
        backend = getattr(self.tokenizer, "backend", None)
        piece = backend.id_to_token(token_id) if backend is not None else None
        if piece is None:
            return None
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        if all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)  # byte-level BPE
        return None


def completion_logprobs(
    entries: Sequence[Entry | None], first_token_id: int | None, text: TokenText, offset: int
) -> tuple[JSONObject, int]:
    """The completions ``logprobs`` object for ``entries`` (None: the first prompt token, which
    has no logprob; ``first_token_id`` names it), text offsets from ``offset``. Returns the
    object and the offset after its last token."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entry in entries:
        if entry is None:
            token_id = first_token_id if first_token_id is not None else 0
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token_id = entry["token_id"]
            token_logprobs.append(entry["logprob"])
            top = {text(token_id): entry["logprob"]}  # the chosen token is always listed
            for t, lp in entry["top"].items():
                top.setdefault(text(t), lp)
            top_logprobs.append(top)
        piece = text(token_id)
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}
    return body, offset


def chat_logprobs(entries: Sequence[Entry], num_top: int, text: TokenText) -> JSONObject:
    """The chat ``logprobs`` object: ``content`` per token, each with its ``num_top`` best."""
    content = []
    for entry in entries:
        piece = text(entry["token_id"])
        ranked = sorted(entry["top"].items(), key=lambda item: -item[1])[:num_top]
        content.append({
            "token": piece,
            "logprob": entry["logprob"],
            "bytes": text.bytes_of(entry["token_id"]),
            "top_logprobs": [{"token": text(t), "logprob": lp, "bytes": text.bytes_of(t)}
                             for t, lp in ranked],
        })
    return {"content": content, "refusal": None}


def vllm_prompt_logprobs(
    entries: Sequence[Entry | None], text: TokenText
) -> list[dict[str, JSONObject] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position, None for the first, else the prompt
    token and the top alternatives by id, each ``{logprob, rank, decoded_token}``."""
    out: list[dict[str, JSONObject] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = sorted(entry["top"].items(), key=lambda item: -item[1])
        item = {str(t): {"logprob": lp, "rank": r, "decoded_token": text(t)}
                for r, (t, lp) in enumerate(ranked, start=1)}
        item[str(entry["token_id"])] = {"logprob": entry["logprob"], "rank": entry.get("rank"),
                                        "decoded_token": text(entry["token_id"])}
        out.append(item)
    return out
