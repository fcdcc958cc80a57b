"""Log probabilities on the wire: the engine's per-token entries in OpenAI's and vLLM's shapes.

The engine reports, per token, ``{"token_id", "logprob", "top": {id: logprob}}`` (and a ``rank``
for prompt tokens). Completions want parallel lists (``tokens``, ``token_logprobs``,
``top_logprobs`` keyed by token text, ``text_offset``), with the chosen token always among the
top ones; chat wants ``content: [{token, logprob, bytes, top_logprobs}]``; vLLM's
``prompt_logprobs`` a list of ``{id: {logprob, rank, decoded_token}}``. Token text is each id
decoded alone (special tokens included), memoised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TokenText", "chat_logprobs", "completion_logprobs", "vllm_prompt_logprobs"]

Entry = dict[str, Any]


class TokenText:
    """Each token id's text alone (what the logprobs name it by), decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._memo.get(token_id)
        if text is None:
            text = self._memo[token_id] = self.tokenizer.decode([token_id],
                                                                skip_special_tokens=False)
        return text


def completion_logprobs(
    entries: Sequence[Entry | None], first_token_id: int | None, text: TokenText, offset: int
) -> tuple[dict[str, Any], int]:
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
            top = {text(t): lp for t, lp in entry["top"].items()}
            top.setdefault(text(token_id), entry["logprob"])  # the chosen token is always listed
            top_logprobs.append(top)
        piece = text(token_id)
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}
    return body, offset


def chat_logprobs(entries: Sequence[Entry], num_top: int, text: TokenText) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``content`` per token, each with its ``num_top`` best."""
    content = []
    for entry in entries:
        piece = text(entry["token_id"])
        ranked = sorted(entry["top"].items(), key=lambda item: -item[1])[:num_top]
        content.append({
            "token": piece,
            "logprob": entry["logprob"],
            "bytes": list(piece.encode("utf-8")),
            "top_logprobs": [{"token": text(t), "logprob": lp,
                              "bytes": list(text(t).encode("utf-8"))} for t, lp in ranked],
        })
    return {"content": content, "refusal": None}


def vllm_prompt_logprobs(
    entries: Sequence[Entry | None], text: TokenText
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position, None for the first, else the prompt
    token and the top alternatives by id, each ``{logprob, rank, decoded_token}``."""
    out: list[dict[str, dict[str, Any]] | None] = []
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
