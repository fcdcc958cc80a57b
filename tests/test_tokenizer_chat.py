# ruff: noqa: E501  (chat templates below are verbatim jinja; their lines stay whole)
"""Tokenizer, chat templates (rendered exactly like transformers) and incremental detokenization."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from prefixcache.model import IncrementalDetokenizer, Tokenizer
from prefixcache.model.byte_tokenizer import BYTE_CHAT_TEMPLATE, write_byte_tokenizer
from prefixcache.model.chat_template import ChatTemplateError

# ChatML with tools, in the style of Qwen2.5: tojson, loop controls, a default system prompt.
CHATML_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
        {{- '<|im_start|>assistant' }}
        {%- for call in message.tool_calls %}
            {{- '\\n<tool_call>\\n' }}{{- {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}{{- '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Llama-3.1 style: namespace, strftime_now, raise_exception, a date string kwarg.
LLAMA31_STYLE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{%- set ns.system = message['content'] | trim %}{%- endif %}
{%- endfor %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Today Date: ' + date_string + '\\n\\n' + ns.system + '<|eot_id|>' }}
{%- for message in messages if message['role'] != 'system' %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter <heute> & ß",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "  Hello, wörld! 👋  "}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "18°C"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytetok")
    write_byte_tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [260, 257]}))
    return path


@pytest.fixture(scope="module")
def ours(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="module")
def theirs(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.mark.parametrize(
    "template",
    [BYTE_CHAT_TEMPLATE, CHATML_TOOLS, LLAMA31_STYLE],
    ids=["tiny", "chatml_tools", "llama31_style"],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(ours, theirs, template, add_generation_prompt):
    for index, messages in enumerate(CONVERSATIONS):
        if template is LLAMA31_STYLE and index == 2:
            continue  # tool role is not part of that template
        kwargs = {"tools": TOOLS} if template is CHATML_TOOLS else {}
        expected = theirs.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        got = ours.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt, **kwargs
        )
        assert got == expected
        ids = ours.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        assert ids == theirs.encode(expected, add_special_tokens=False)


def test_default_template_and_special_tokens(ours):
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|begin_of_text|><|start_header_id|>user")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ours.bos_token_id == 256 and ours.eos_token_ids == (260, 257)
    assert ours.vocab_size == 264


def test_template_errors_are_clear(ours):
    with pytest.raises(ChatTemplateError, match="alternate"):
        ours.apply_chat_template(
            [{"role": "assistant", "content": "x"}], chat_template=LLAMA31_STYLE
        )
    with pytest.raises(ChatTemplateError, match="unknown role"):
        ours.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="syntax"):
        ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% if %}")
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        ours.apply_chat_template([])


def test_sandbox_blocks_attribute_escape(ours):
    evil = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception, match="unsafe|access"):
        ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template=evil)


def test_encode_decode_round_trip(ours, theirs):
    text = "naïve café — 東京 🚀 <|eot_id|> end"
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ids[0] == ours.bos_token_id
    assert ours.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text
    assert ours.decode(ids) == text.replace("<|eot_id|>", "")
    assert ours.encode(text, add_special_tokens=False) == ids[1:]


def test_decode_skips_ids_the_tokenizer_does_not_know(ours):
    """Embeddings padded past the vocabulary: such ids decode to nothing, never an error."""
    assert ours.decode([9999, -1]) == ""
    assert ours.decode(ours.encode("ab", add_special_tokens=False) + [9999]) == "ab"


def test_incremental_detokenizer_never_emits_broken_utf8(ours):
    text = "a€b 東京🚀 ñ!"
    ids = ours.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(ours)
    deltas = [detok.add(token_id) for token_id in ids]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == text
    # the 4 bytes of the rocket emoji produce nothing until the last one
    rocket = ids.index(0xF0)
    assert deltas[rocket : rocket + 3] == ["", "", ""] and deltas[rocket + 3] == "🚀"
    assert detok.flush() == ""


def test_incremental_detokenizer_flushes_incomplete_tail(ours):
    detok = IncrementalDetokenizer(ours)
    assert detok.add(ord("x")) == "x"
    assert detok.add(0xE2) == ""  # first byte of a 3-byte character
    assert detok.add(260) == ""  # a special token, skipped
    assert detok.flush() == "\ufffd"
