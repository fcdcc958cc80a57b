"""Chat templates rendered the way transformers' ``apply_chat_template`` renders them.

Same jinja2 environment (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loopcontrols, a no-op ``generation`` block tag), same globals (``raise_exception``,
``strftime_now``, ``dict``, ``namespace``) and the same ``tojson`` filter, so a template yields
byte-identical prompts, and therefore identical token ids and cache keys.

A template comes with a model's files, so it is read as untrusted input: the sandbox refuses
attribute access outside it, and one rendering is bounded in loop steps (``range``), in the size
of what ``*`` and ``**`` may build, and in output; anything a template raises while rendering is
a `ChatTemplateError`, never another exception.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import asdict, is_dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

from prefixcache.errors import describe_exception

__all__ = ["ChatTemplateError", "compile_template", "normalize_messages", "render_chat"]


class ChatTemplateError(ValueError):
    """The template failed (syntax error, its own ``raise_exception``, or a bound reached)."""


# what one rendering may do, at most: far above what a real template needs (a prompt is at most
# a context's worth of text), far below what would stall a server thread or fill its memory
MAX_RENDER_CHARS = 1 << 24
MAX_LOOP_STEPS = 1 << 20  # ``range`` items, all loops of one rendering together
MAX_POWER_BITS = 4096
_steps_left: ContextVar[list[int]] = ContextVar("chat_template_steps")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with ``*`` and ``**`` checked before they build something huge."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for sized, times in ((left, right), (right, left)):
                if (isinstance(sized, (str, list, tuple)) and isinstance(times, int)
                        and len(sized) * times > MAX_RENDER_CHARS):
                    raise jinja2.exceptions.SecurityError("the chat template repeats too much")
        elif (isinstance(left, int) and isinstance(right, int) and right > 0
              and right * abs(left).bit_length() > MAX_POWER_BITS):
            raise jinja2.exceptions.SecurityError("the chat template's power is too large")
        return super().call_binop(context, operator, left, right)


def _bounded_range(*args: int) -> range:
    """``range`` with the sandbox's size limit, counted against the rendering's loop steps."""
    items = range(*args)
    steps = _steps_left.get([MAX_LOOP_STEPS])
    steps[0] -= len(items)
    if len(items) > MAX_RANGE or steps[0] < 0:
        raise jinja2.exceptions.SecurityError("the chat template loops too long")
    return items


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (assistant-mask marker)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render", [], [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """``dict(...)`` inside templates, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore attributes (no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore attribute {name!r} on a namespace"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per template text; raises ChatTemplateError on a syntax error."""
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    env.globals["range"] = _bounded_range
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error (line {exc.lineno}): {exc}") from None
    except RecursionError:  # the parser recurses once per nesting level
        raise ChatTemplateError("the chat template nests too deeply to parse") from None


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as plain dicts (dataclasses and pydantic models too), None-valued keys dropped."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of message dicts")
    out = []
    for message in messages:
        plain = _plain(message)
        if not isinstance(plain, dict):
            raise ChatTemplateError(f"a chat message must be a dict, got {type(message).__name__}")
        out.append({key: value for key, value in plain.items() if value is not None})
    return out


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return _plain(asdict(value))
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def render_chat(
    source: str,
    messages: Sequence[Any],
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
    **kwargs: Any,
) -> str:
    """The prompt text; keyword arguments override special tokens, as in transformers."""
    template = compile_template(source)
    variables = {**special_tokens, **kwargs}
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    chunks = template.generate(messages=normalize_messages(messages),
                               add_generation_prompt=add_generation_prompt, **variables)
    steps = _steps_left.set([MAX_LOOP_STEPS])
    try:
        return "".join(_bounded_output(chunks))
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from None
    except ChatTemplateError:
        raise
    except Exception as exc:  # the template's own bug (a str + list, a missing key, recursion)
        raise ChatTemplateError(f"chat template failed: {describe_exception(exc)}") from None
    finally:
        _steps_left.reset(steps)


def _bounded_output(chunks: Iterator[str]) -> Iterator[str]:
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_RENDER_CHARS:
            raise ChatTemplateError(f"the chat template renders more than {MAX_RENDER_CHARS} "
                                    "characters")
        yield chunk
