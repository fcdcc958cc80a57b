"""Anthropic's Messages body as the chat completions body it means: ``system`` first, text
blocks joined, ``tool_use`` blocks an assistant's tool calls, ``tool_result`` blocks tool
messages, ``tools`` and ``tool_choice`` mapped to the chat machinery's. The endpoint
(`messages.py`) and the cluster's ingress (`request_params.prompt_token_ids`) both read it."""

from __future__ import annotations

import json

from prefixcache.server.errors import ApiError
from prefixcache.server.protocol import (
    ChatCompletionRequest,
    JSONObject,
    MessagesCountRequest,
    MessagesRequest,
    MessagesText,
    MessagesToolResult,
    MessagesToolUse,
)

__all__ = ["chat_body_of", "chat_fields"]


def chat_body_of(body: MessagesCountRequest) -> ChatCompletionRequest:
    """The chat completions body a Messages body means."""
    try:
        return ChatCompletionRequest.model_validate(chat_fields(body))
    except ValueError as exc:
        raise ApiError(400, f"invalid messages: {exc.__class__.__name__}",
                       param="messages") from None


def chat_fields(body: MessagesCountRequest) -> JSONObject:
    """The fields of the chat completions body ``body`` means."""
    messages: list[JSONObject] = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else "".join(
            block.text for block in body.system)
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts = [b.text for b in message.content if isinstance(b, MessagesText)]
        uses = [b for b in message.content if isinstance(b, MessagesToolUse)]
        results = [b for b in message.content if isinstance(b, MessagesToolResult)]
        if message.role == "assistant":
            if results:
                raise ApiError(400, "tool_result blocks belong in user turns",
                               param=f"messages.{i}.content")
            item: JSONObject = {"role": "assistant", "content": "".join(texts)}
            if uses:
                item["tool_calls"] = [
                    {"id": u.id, "type": "function",
                     "function": {"name": u.name, "arguments": json.dumps(u.input)}}
                    for u in uses]
            messages.append(item)
            continue
        if uses:
            raise ApiError(400, "tool_use blocks belong in assistant turns",
                           param=f"messages.{i}.content")
        messages += [{"role": "tool", "tool_call_id": r.tool_use_id, "content": r.text()}
                     for r in results]
        if texts or not results:
            messages.append({"role": "user", "content": "".join(texts)})
    tools = [{"type": "function", "function": {
        "name": t.name, "parameters": t.input_schema,
        **({"description": t.description} if t.description is not None else {})}}
        for t in body.tools or []]
    fields: JSONObject = {"model": body.model, "messages": messages}
    if tools:
        fields["tools"] = tools
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, stream=body.stream)
        if body.stop_sequences:
            fields["stop"] = body.stop_sequences
        if body.cache_salt is not None:
            fields["cache_salt"] = body.cache_salt
    return fields


def _tool_choice(choice: JSONObject) -> str | JSONObject:
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, "tool_choice must be {'type': 'auto' | 'any' | 'none'} or "
                   "{'type': 'tool', 'name': ...}", param="tool_choice")
