"""Tool calling in chat: tools into the prompt, a grammar for ``required`` / named calls, and the
model's ``<tool_call>`` blocks back out as OpenAI ``tool_calls``.

The convention is Hermes/Qwen's: a call is ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` in the assistant's text. A chat template that takes ``tools`` renders them (and
assistant ``tool_calls``, with arguments as objects) itself; for one that does not (the built-in
models'), `render_messages` writes a tools section into the system message, the assistant's past
calls as ``<tool_call>`` blocks and tool results as ``<tool_response>`` user turns, so every
template can hold a tool conversation. ``tool_choice`` ``required`` or a named function becomes a
Lark grammar whose arguments follow the function's ``parameters`` schema (llguidance's ``%json``;
undeclared arguments are not generated unless the schema allows them);
``auto`` parses what the model chose to write. `ToolCallStream` does the same parse on a stream,
holding back text that may start a call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from prefixcache.engine.sampling_params import StructuredOutputs
from prefixcache.server.protocol import JSONObject

__all__ = [
    "ToolCallStream",
    "parse_tool_calls",
    "render_messages",
    "tool_grammar",
]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# a call is one line of compact JSON, as the tools section shows it to the model
_CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def _tools_section(tools: list[JSONObject]) -> str:
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou can call functions to answer the user. Their signatures, one JSON object "
        f"per line:\n<tools>\n{listing}\n</tools>\n\nTo call one, reply with its name and "
        "arguments as a JSON object between tags, one call per block:\n"
        f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}'
    )


def _arguments_object(arguments: object) -> object:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _block(function: JSONObject) -> str:
    """A past call, written back as the model would have written it."""
    call = {"name": function.get("name"), "arguments": _arguments_object(function.get("arguments"))}
    return f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}"


def render_messages(
    messages: list[JSONObject], tools: list[JSONObject] | None, template: str | None
) -> tuple[list[JSONObject], JSONObject]:
    """The messages (and template keyword arguments) to render a tool conversation with
    ``template``: as they are plus ``tools=`` where the template takes tools, else rewritten
    into plain turns (tools section, ``<tool_call>`` blocks, ``<tool_response>`` turns)."""
    takes_tools = template is not None and "tools" in template
    if takes_tools:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {**c, "function": {**c.get("function", {}), "arguments": _arguments_object(
                        c.get("function", {}).get("arguments"))}}
                    for c in m["tool_calls"]]
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if m.get("tool_calls"):
            blocks = [_block(c.get("function", {})) for c in m["tool_calls"]]
            content = "\n".join([content, *blocks] if content else blocks)
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        section = _tools_section(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}".strip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, {}


def tool_grammar(
    tools: list[JSONObject], choice: str | JSONObject, parallel: bool
) -> StructuredOutputs:
    """A grammar for ``required`` (one call, or several with ``parallel``, of any tool) or a named
    function (exactly one call of it): each call's arguments follow its ``parameters``."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
        repeat = False
    else:
        chosen, repeat = tools, parallel
    schemas = [
        {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
         "properties": {"name": {"const": t["function"]["name"]},
                        "arguments": _closed(t["function"].get("parameters"))}}
        for t in chosen
    ]
    schema: JSONObject = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": _CALL_JSON}
    body = f'call: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {json.dumps(schema)}'
    start = 'start: call ("\\n" call)*' if repeat else "start: call"
    return StructuredOutputs("grammar", f"{start}\n{body}")


def _closed(parameters: JSONObject | None) -> JSONObject:
    """The arguments' schema; one that says nothing of undeclared arguments gets none generated
    (as OpenAI's strict mode), so a forced call ends with the arguments it declares."""
    schema = dict(parameters or {"type": "object"})
    if schema.get("type") == "object" and "properties" in schema:
        schema.setdefault("additionalProperties", False)
    return schema


def _call(payload: str) -> JSONObject | None:
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": data["name"],
                         "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> tuple[str | None, list[JSONObject]]:
    """The text outside ``<tool_call>`` blocks (None if empty) and the calls inside them; a block
    that is not a call stays text."""
    calls: list[JSONObject] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


@dataclass(slots=True)
class ToolCallStream:
    """Splits a streamed answer into content deltas and whole tool calls as they complete."""

    text: str = ""
    emitted: int = 0  # characters of `text` handled (sent as content, or parsed as calls)
    num_calls: int = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[JSONObject]]:
        """Content safe to send now, and the calls completed now (each with its ``index``)."""
        self.text += delta
        content: list[str] = []
        calls: list[JSONObject] = []
        while True:
            rest = self.text[self.emitted:]
            at = rest.find(OPEN)
            if at < 0:
                hold = 0 if final else _partial_suffix(rest, OPEN)
                content.append(rest[: len(rest) - hold])
                self.emitted += len(rest) - hold
                break
            content.append(rest[:at])
            end = rest.find(CLOSE, at)
            if end < 0:
                self.emitted += at
                if final:  # an unfinished block: it is text after all
                    content.append(rest[at:])
                    self.emitted += len(rest) - at
                break
            call = _call(rest[at + len(OPEN): end].strip())
            if call is None:
                content.append(rest[at: end + len(CLOSE)])
            else:
                calls.append({"index": self.num_calls, **call})
                self.num_calls += 1
            self.emitted += end + len(CLOSE)
        text = "".join(content)
        if self.num_calls:  # once calls began, whitespace between blocks is not content
            text = text.strip()
        return text, calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
