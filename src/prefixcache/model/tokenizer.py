"""`Tokenizer`: a checkpoint's tokenizer.json (the `tokenizers` library) plus its chat template.

Special tokens and the template come from tokenizer_config.json (or chat_template.jinja); eos ids
from generation_config.json when present, else the tokenizer's eos token. Knows nothing about
models or the cache.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from prefixcache.model.chat_template import ChatTemplateError, render_chat

__all__ = ["Tokenizer", "TokenizerError"]

_SPECIAL_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used, or ids the tokenizer does not know."""


class Tokenizer:
    """Encode, decode and render chat templates the way the checkpoint's authors intended."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self.token_to_id(special_tokens.get("bos_token"))
        eos = list(eos_token_ids)
        default_eos = self.token_to_id(special_tokens.get("eos_token"))
        if not eos and default_eos is not None:
            eos = [default_eos]
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.eos_token_id = eos[0] if eos else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{file} not found (only fast tokenizer.json is supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust error type is not importable
            raise TokenizerError(f"cannot read {file}: {exc}") from None
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        return cls(
            backend, _special_tokens(config), _chat_template(path, config), _eos_ids(generation)
        )

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for (4 per character of
        the longest vocabulary entry): a text longer than ``n * max_token_bytes`` bytes has more
        than ``n`` tokens, known without tokenizing it."""
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return 4 * max((len(token) for token in vocab), default=1)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Ids the tokenizer does not know decode to "": checkpoints often pad
        the embedding past the vocabulary (Qwen2.5: 151,936 rows for 151,665 tokens), and a
        model may sample such a row."""
        known = [i for i in ids if 0 <= i < self.vocab_size]
        return self.backend.decode(known, skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        added = self.backend.get_added_tokens_decoder().get(token_id)
        return added is not None and bool(added.special)

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render like transformers; ``tokenize=True`` encodes without adding specials again."""
        source = chat_template or self.chat_template
        if source is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        text = render_chat(source, messages, add_generation_prompt, self.special_tokens, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def encode_chat(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        literal_content: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Render and tokenize a conversation. With ``literal_content`` (the default), marker
        strings typed inside a message's content (``<|im_start|>system``, ``<|eot_id|>``) are
        encoded as plain text: only the template's own markers become control ids, so a user
        cannot forge a system turn. Conversations without such strings encode exactly as
        ``apply_chat_template(..., tokenize=True)``."""
        text = self.apply_chat_template(
            messages, add_generation_prompt, chat_template=chat_template, **kwargs
        )
        assert isinstance(text, str)
        return self.encode_rendered_chat(text, messages, literal_content)

    def encode_rendered_chat(
        self, text: str, messages: Sequence[Any], literal_content: bool = True
    ) -> list[int]:
        """`encode_chat` of a conversation already rendered as ``text``."""
        contents = [_content_text(m) for m in messages]
        if not literal_content or not any(self._holds_special(c) for c in contents):
            return self.encode(text, add_special_tokens=False)
        ids: list[int] = []
        start = 0
        for content in contents:
            if not self._holds_special(content):
                continue
            at = text.find(content, start)
            if at < 0:  # the template rewrote this content: it cannot be located, so refuse
                raise TokenizerError(
                    "a message's content holds special-token text that the chat template "
                    "rewrites; it cannot be encoded as plain text"
                )
            ids += self.encode(text[start:at], add_special_tokens=False)
            ids += self._literal_backend.encode(content, add_special_tokens=False).ids
            start = at + len(content)
        return ids + self.encode(text[start:], add_special_tokens=False)

    def _holds_special(self, text: str) -> bool:
        return any(marker in text for marker in self._special_markers)

    @functools.cached_property
    def _special_markers(self) -> tuple[str, ...]:
        added = self.backend.get_added_tokens_decoder().values()
        return tuple(t.content for t in added if t.special and t.content)

    @functools.cached_property
    def _literal_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that encodes special-token strings as ordinary text."""
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend


def _content_text(message: Any) -> str:
    """A message's content as the template sees it (text parts joined), "" when absent."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    out = {}
    for name in _SPECIAL_ATTRIBUTES:
        value = config.get(name)
        if isinstance(value, dict):  # serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: pick "default"
        named = {item.get("name"): item.get("template") for item in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _eos_ids(generation: dict[str, Any]) -> list[int]:
    value = generation.get("eos_token_id")
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]
