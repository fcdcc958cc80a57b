"""Reading an API request's parameters: logprob bounds, tools and tool_choice, the output
constraint (``response_format`` / ``structured_outputs``), prompts, messages, stream options.
Each failure is an `ApiError` (400) naming the field. No engine calls here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

from prefixcache.cache.pins import TTLS
from prefixcache.engine.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputs
from prefixcache.errors import InvalidParam
from prefixcache.server import protocol
from prefixcache.server.errors import ApiError
from prefixcache.server.messages_body import chat_body_of
from prefixcache.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    JSONObject,
    MessagesRequest,
    ResponsesRequest,
)
from prefixcache.server.tools import render_messages

if TYPE_CHECKING:
    from prefixcache.model.tokenizer import Tokenizer

__all__ = [
    "as_prompts",
    "check_logprobs",
    "continuous_usage",
    "include_usage",
    "message_dict",
    "prompt_token_ids",
    "render_chat",
    "response_messages",
    "response_status",
    "retention_s",
    "sampling_params_of",
    "structured_of",
    "tool_choice_of",
]


def check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(400, f"{param} must be between 0 and {MAX_LOGPROBS}, got {value}",
                       param=param)


def tool_choice_of(
    body: ChatCompletionRequest,
) -> tuple[list[JSONObject], str | JSONObject]:
    """The request's tools (as plain dicts) and its tool_choice, checked against each other."""
    tools = [t.model_dump(exclude_none=True, exclude_unset=False) for t in body.tools or []]
    for tool in tools:
        for key in list(tool):
            if key not in ("type", "function"):
                del tool[key]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "two tools have the same name", param="tools")
    choice: str | JSONObject = (
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


def message_dict(message: ChatMessage) -> JSONObject:
    out: JSONObject = {"role": message.role, "content": message.text()}
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


def sampling_params_of(
    body: protocol._SamplingFields, max_tokens: int, *, logprobs: int | None,
    prompt_logprobs: int | None, best_of: int | None = None,
    structured: StructuredOutputs | None = None,
) -> SamplingParams:
    """The sampling fields completions and chat share, as the engine's parameters (raises
    ValueError for a value the engine refuses)."""
    return SamplingParams(
        max_tokens=max_tokens, temperature=float(body.temperature),
        top_p=float(body.top_p), top_k=body.top_k, min_p=float(body.min_p), seed=body.seed,
        stop=tuple([body.stop] if isinstance(body.stop, str) else body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
        n=body.n, best_of=best_of, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        presence_penalty=float(body.presence_penalty),
        frequency_penalty=float(body.frequency_penalty),
        repetition_penalty=float(body.repetition_penalty),
        # OpenAI's ids are decimal strings: SamplingParams reads them (its ``_as_bias``)
        min_tokens=body.min_tokens, logit_bias=cast("Mapping[int, float] | None", body.logit_bias),
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        structured_outputs=structured,
    )


def retention_s(retention: str | None,
                options: protocol.PromptCacheOptions | None = None) -> float | None:
    """How long the whole prompt is pinned. OpenAI's ``prompt_cache_retention``: ``24h`` pins
    it for a day; ``prompt_cache_options`` (which supersedes it: both given is a 400) pins its
    implicit breakpoint, the whole prompt, for ``ttl`` (``30m`` by default, ``12h``), none in
    ``explicit`` mode (there is no explicit breakpoint but a pin). Otherwise the prompt stays
    only as long as the cache keeps it (None)."""
    if options is not None:
        if retention is not None:
            raise ApiError(400, "give prompt_cache_options.ttl or prompt_cache_retention, not "
                           "both", param="prompt_cache_retention")
        return _OPTION_TTLS[options.ttl] if options.mode == "implicit" else None
    return TTLS["24h"] if retention == "24h" else None


_OPTION_TTLS = {"30m": 1800.0, "12h": 43200.0}  # prompt_cache_options.ttl


def include_usage(body: protocol._SamplingFields) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def continuous_usage(body: protocol._SamplingFields) -> bool:
    return include_usage(body) and bool(
        body.stream_options and body.stream_options.continuous_usage_stats)


def as_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
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


def render_chat(
    tokenizer: Tokenizer, messages_in: list[ChatMessage], param: str,
    add_generation_prompt: bool, tools: list[JSONObject] | None, literal_content: bool,
    allow_empty: bool = False,
) -> list[int]:
    """The token ids of a conversation through the model's chat template (``literal_content``:
    marker strings inside message content stay text; ``allow_empty``: render a conversation
    with no content too, as a cut after a tools breakpoint is)."""
    messages = [message_dict(m) for m in messages_in]
    if not allow_empty and not any(m["content"] or m.get("tool_calls") for m in messages):
        raise ApiError(400, f"the {param} are empty" if param == "messages" else
                       f"the {param} is empty", param=param)
    messages, extra = render_messages(messages, tools, tokenizer.chat_template)
    try:
        ids = tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt,
                                    literal_content=literal_content, **extra)
    except ValueError as exc:
        raise ApiError(400, f"cannot apply the chat template: {exc}", param=param) from None
    return list(ids)


def prompt_token_ids(
    path: str, body: object, tokenizer: Tokenizer, literal_content: bool
) -> tuple[list[int], str | None] | None:
    """The first prompt's token ids and the client's ``cache_salt`` for a request body to
    ``path``, as the endpoint will compute them; None for a path without a prompt. Raises
    `ApiError` or pydantic's ValidationError for a body the endpoint would reject."""
    if path == "/v1/completions":
        completion = CompletionRequest.model_validate(body)
        prompt = as_prompts(completion.prompt)[0]
        ids = list(tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        return ids, completion.cache_salt
    if path == "/v1/chat/completions":
        chat = ChatCompletionRequest.model_validate(body)
        tools, choice = tool_choice_of(chat)
        return render_chat(tokenizer, chat.messages, "messages", chat.add_generation_prompt,
                           tools if choice != "none" else None, literal_content), chat.cache_salt
    if path == "/v1/responses":
        response = ResponsesRequest.model_validate(body)
        return (render_chat(tokenizer, response_messages(response), "input", True, None,
                            literal_content), response.cache_salt)
    if path == "/v1/messages":
        messages = MessagesRequest.model_validate(body)
        chat = chat_body_of(messages)
        tools, choice = tool_choice_of(chat)
        return render_chat(tokenizer, chat.messages, "messages", True,
                           tools if choice != "none" else None, literal_content), chat.cache_salt
    return None


def prompt_cache_key(body: object) -> str | None:
    """OpenAI's ``prompt_cache_key`` of a request body (a routing hint), if it has one."""
    key = body.get("prompt_cache_key") if isinstance(body, dict) else None
    return key if isinstance(key, str) and key else None
