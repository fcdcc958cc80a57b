"""Reading an API request's parameters: logprob bounds, tools and tool_choice, the output
constraint (``response_format`` / ``structured_outputs``), prompts, messages, stream options.
Each failure is an `ApiError` (400) naming the field. No engine calls here."""

from __future__ import annotations

from typing import Any

from prefixcache.engine.sampling_params import MAX_LOGPROBS, StructuredOutputs
from prefixcache.errors import InvalidParam
from prefixcache.server import protocol
from prefixcache.server.errors import ApiError
from prefixcache.server.protocol import ChatCompletionRequest, ChatMessage, ResponsesRequest

__all__ = [
    "as_prompts",
    "check_logprobs",
    "continuous_usage",
    "include_usage",
    "message_dict",
    "response_messages",
    "response_status",
    "structured_of",
    "tool_choice_of",
]


def check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(400, f"{param} must be between 0 and {MAX_LOGPROBS}, got {value}",
                       param=param)


def tool_choice_of(
    body: ChatCompletionRequest,
) -> tuple[list[dict[str, Any]], str | dict[str, Any]]:
    """The request's tools (as plain dicts) and its tool_choice, checked against each other."""
    tools = [t.model_dump(exclude_none=True, exclude_unset=False) for t in body.tools or []]
    for tool in tools:
        for key in list(tool):
            if key not in ("type", "function"):
                del tool[key]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "two tools have the same name", param="tools")
    choice: str | dict[str, Any] = (
        body.tool_choice.model_dump() if isinstance(body.tool_choice, protocol.NamedToolChoice)
        else body.tool_choice or ("auto" if tools else "none"))
    if choice != "none" and not tools:
        raise ApiError(400, f"tool_choice {choice if isinstance(choice, str) else 'function'!r} "
                       "needs tools", param="tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not in "
                           "tools", param="tool_choice")
        choice = {"type": "function", "function": {"name": name}}
    return tools, choice


def message_dict(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def structured_of(body: protocol._SamplingFields) -> tuple[StructuredOutputs | None, str]:
    """The output constraint a request asks for (``response_format`` or vLLM's
    ``structured_outputs``), and the field it came from."""
    fmt = body.response_format
    wanted = fmt is not None and fmt.type != "text"
    if wanted and body.structured_outputs is not None:
        raise ApiError(400, "give response_format or structured_outputs, not both",
                       param="structured_outputs")
    try:
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputs.of(json_object=True), "response_format"
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ApiError(400, "response_format json_schema needs 'json_schema': "
                               "{'name', 'schema'}", param="response_format")
            return StructuredOutputs.of(json=fmt.json_schema.schema_), "response_format"
        so = body.structured_outputs
        if so is None:
            return None, ""
        return StructuredOutputs.of(json=so.json_, regex=so.regex, choice=so.choice,
                                    grammar=so.grammar,
                                    json_object=bool(so.json_object)), "structured_outputs"
    except InvalidParam as exc:
        param = "response_format" if wanted else "structured_outputs"
        raise ApiError(400, str(exc), param=param) from None


def include_usage(body: protocol._SamplingFields) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def continuous_usage(body: protocol._SamplingFields) -> bool:
    return include_usage(body) and bool(
        body.stream_options and body.stream_options.continuous_usage_stats)


def as_prompts(prompt: Any) -> list[str | list[int]]:
    """A completions prompt as a list of prompts: a string, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def response_messages(body: ResponsesRequest) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
    else:
        messages.extend(body.input)
    return messages


def response_status(reason: str | None) -> tuple[str, str | None]:
    if reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None
