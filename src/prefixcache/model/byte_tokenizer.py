"""The built-in models' byte-level tokenizer: 256 byte tokens (id = byte value) plus specials.

Written as a standard tokenizer.json (ByteLevel pre-tokenizer and decoder over a merge-free BPE)
and a tokenizer_config.json carrying a Llama-3-style chat template, so transformers'
AutoTokenizer reads the same files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

__all__ = ["BYTE_CHAT_TEMPLATE", "SPECIAL_TOKENS", "ByteVocab", "write_byte_tokenizer"]

SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
    "<|reserved_0|>",
    "<|reserved_1|>",
)

BYTE_CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "        {{- raise_exception('unknown role: ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {%- if message['content'] is string %}\n"
    "        {%- set content = message['content'] %}\n"
    "    {%- else %}\n"
    "        {%- set content = message['content'] | map(attribute='text') | join('') %}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {{- content | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


@dataclass(frozen=True, slots=True)
class ByteVocab:
    size: int
    bos_id: int
    eos_ids: tuple[int, ...]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte value (what ByteLevel uses)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def build_byte_tokenizer() -> Tokenizer:
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    bos = SPECIAL_TOKENS[0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tokenizer.token_to_id(bos))],
    )
    return tokenizer


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    index = tokenizer.token_to_id(token)
    if index is None:
        raise KeyError(f"{token!r} is not in the byte tokenizer")
    return index


def write_byte_tokenizer(path: Path) -> ByteVocab:
    """Write tokenizer.json and tokenizer_config.json into ``path``."""
    tokenizer = build_byte_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|pad|>",
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
        "chat_template": BYTE_CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    ids = {t: _token_id(tokenizer, t) for t in SPECIAL_TOKENS}
    return ByteVocab(
        size=tokenizer.get_vocab_size(with_added_tokens=True),
        bos_id=ids["<|begin_of_text|>"],
        eos_ids=(ids["<|eot_id|>"], ids["<|end_of_text|>"]),
    )
