"""The OpenAI wire format: pydantic request and response models for completions, chat and
responses, plus vLLM's tokenizer endpoints.

Requests are lenient about *names* and strict about *values*, as vLLM's server is: a field this
server does not know is accepted and ignored (`Lenient.ignored_fields` lists them; the server
logs their names, or rejects them under ``--strict-api``); a known field keeps its type and range
checks (400 with ``param`` set). An explicit ``null`` means the field's default. Responses are
plain dicts. No engine types here; each API's serving object translates between the two.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)
from pydantic import StrictStr as _PlainStr

__all__ = [
    "JSONObject",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "Lenient",
    "ResponsesRequest",
    "StreamOptions",
    "TokenizeRequest",
    "Usage",
    "chat_choice",
    "chat_chunk",
    "chat_response",
    "completion_choice",
    "completion_chunk",
    "completion_response",
    "model_card",
    "model_list",
    "new_id",
    "usage",
    "usage_chunk",
]

JSONObject = dict[str, Any]  # a JSON object as the wire carries it (a body, a chunk, a part)


def _encodable(text: str) -> str:
    """Reject text UTF-8 cannot encode (a lone surrogate such as "\\ud800", which JSON allows)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the text holds a lone surrogate (U+{ord(text[exc.start]):04X} at character "
            f"{exc.start}) that UTF-8 cannot encode"
        ) from None
    return text


# every string of a request: strict, and encodable, so no tokenizer, HMAC or log line meets one
StrictStr = Annotated[_PlainStr, AfterValidator(_encodable)]
Number = StrictInt | StrictFloat
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]


class Lenient(BaseModel):
    """Unknown fields are kept aside (`ignored_fields`), an explicit null is the default."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: object) -> object:
        if isinstance(data, dict) and None in data.values():
            known = cls.model_fields
            return {k: v for k, v in data.items() if not (v is None and k in known)}
        return data

    def ignored_fields(self) -> list[str]:
        """Names of the fields this server does not know (top level only)."""
        return sorted(self.model_extra or ())


class StreamOptions(Lenient):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(Lenient):
    name: StrictStr = "response"
    description: StrictStr | None = None
    schema_: JSONObject | StrictBool = Field(default=True, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(Lenient):
    """vLLM's ``structured_outputs`` extension: exactly one constraint."""

    json_: JSONObject | StrictStr | StrictBool | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class _SamplingFields(Lenient):
    """Fields shared by completions and chat (OpenAI's and vLLM's extensions)."""

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0  # extension (vLLM)
    min_p: Number = 0.0  # extension (vLLM)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None  # extension (vLLM)
    ignore_eos: StrictBool = False  # extension (vLLM)
    min_tokens: StrictInt = 0  # extension (vLLM)
    include_stop_str_in_output: StrictBool = False  # extension (vLLM)
    skip_special_tokens: StrictBool = True  # extension (vLLM)
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: StrictStr | None = None  # extension (vLLM): narrows reuse inside the namespace
    user: StrictStr | None = None
    # OpenAI's prompt caching: "24h" pins the prompt's blocks (within the tenant's budget); the
    # key is a routing hint, never part of a block's identity
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_key: StrictStr | None = None
    frequency_penalty: Number = 0.0
    presence_penalty: Number = 0.0
    repetition_penalty: Number = 1.0  # extension (vLLM)
    logit_bias: dict[StrictStr, Number] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None  # extension (vLLM)
    prompt_logprobs: StrictInt | None = None  # extension (vLLM)


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class TextPart(Lenient):
    type: Literal["text", "input_text", "output_text"]
    text: StrictStr


class ChatMessage(Lenient):
    """One message; fields beyond these (``refusal``, ``audio``...) are kept and ignored."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[JSONObject] | None = None  # an assistant's past calls
    tool_call_id: StrictStr | None = None  # the call a tool message answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


FunctionName = Annotated[_PlainStr, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionDef(Lenient):
    name: FunctionName
    description: StrictStr | None = None
    parameters: JSONObject | None = None
    strict: StrictBool | None = None


class ToolDef(Lenient):
    type: Literal["function"]
    function: FunctionDef


class _FunctionName(Lenient):
    name: StrictStr


class PromptCacheOptions(Lenient):
    """OpenAI's ``prompt_cache_options``: ``comparison_response_id`` asks for diagnostics against
    that response; ``prewarm`` computes and caches the prompt, generating nothing."""

    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m", "12h"] = "30m"
    comparison_response_id: StrictStr | None = None
    prewarm: StrictBool = False


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: _FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    add_generation_prompt: StrictBool = True  # extension (vLLM)
    # OpenAI's mode and ttl; comparison_response_id is our extension (as on /v1/responses)
    prompt_cache_options: PromptCacheOptions | None = None


class ResponsesFormat(Lenient):
    """``text.format`` of the Responses API: plain text, any JSON object, or a JSON Schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr = "response"
    schema_: JSONObject | StrictBool = Field(default=True, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class ResponsesText(Lenient):
    format: ResponsesFormat | None = None


class ResponsesRequest(Lenient):
    """``POST /v1/responses``, the subset clients use: text (or JSON) in, text (or JSON) out."""

    model: StrictStr
    input: StrictStr | Annotated[list[ChatMessage], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    stream: StrictBool = False
    previous_response_id: StrictStr | None = None
    tools: list[JSONObject] | None = None
    store: StrictBool | None = None
    user: StrictStr | None = None
    cache_salt: StrictStr | None = None  # extension (vLLM)
    text: ResponsesText | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_options: PromptCacheOptions | None = None


# ---- the Anthropic Messages API ----------------------------------------------------------------


class MessagesText(Lenient):
    """A text block; ``cache_control`` marks a cache breakpoint (the prefix through it is
    pinned)."""

    type: Literal["text"]
    text: StrictStr
    cache_control: JSONObject | None = None


class MessagesToolUse(Lenient):
    """An assistant's past tool call."""

    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: JSONObject
    cache_control: JSONObject | None = None


class MessagesToolResult(Lenient):
    """A user turn's answer to a tool call."""

    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[MessagesText] = ""
    is_error: StrictBool = False
    cache_control: JSONObject | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)


MessagesBlock = Annotated[MessagesText | MessagesToolUse | MessagesToolResult,
                          Field(discriminator="type")]


class MessagesMessage(Lenient):
    role: Literal["user", "assistant"]
    content: StrictStr | Annotated[list[MessagesBlock], Field(min_length=1)]


class MessagesTool(Lenient):
    name: FunctionName
    description: StrictStr | None = None
    input_schema: JSONObject
    cache_control: JSONObject | None = None


class MessagesCountRequest(Lenient):
    """``POST /v1/messages/count_tokens``."""

    model: StrictStr
    messages: Annotated[list[MessagesMessage], Field(min_length=1)]
    system: StrictStr | list[MessagesText] | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: JSONObject | None = None


class MessagesDiagnostics(Lenient):
    """Asks why the cache missed: compared with ``previous_message_id``'s request (None: the
    first turn, opting in)."""

    previous_message_id: StrictStr | None = None


class MessagesRequest(MessagesCountRequest):
    """``POST /v1/messages``, as Anthropic documents it (``cache_salt``: our extension)."""

    max_tokens: StrictInt
    stop_sequences: list[StrictStr] | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0
    stream: StrictBool = False
    metadata: JSONObject | None = None
    cache_control: JSONObject | None = None  # the automatic breakpoint: the whole prompt
    cache_salt: StrictStr | None = None
    diagnostics: MessagesDiagnostics | None = None


class WarmRequest(Lenient):
    """``POST /v1/cache/warm``: a ``prompt`` (text or token ids) or chat ``messages`` to prefill
    into the caller's namespace, pinned for ``ttl`` (``5m``, ``1h``, ``24h`` or seconds)."""

    model: StrictStr
    prompt: StrictStr | TokenIds | None = None
    messages: list[ChatMessage] | None = None
    ttl: Literal["5m", "1h", "24h"] | Number | None = None
    cache_salt: StrictStr | None = None
    stream: StrictBool = False  # a warm-up answers once: true is refused


class TokenizeRequest(Lenient):
    """vLLM's ``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered by the template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(Lenient):
    model: StrictStr | None = None
    tokens: list[StrictInt]


class PurgeRequest(Lenient):
    """``POST /cache/purge``: the tenant (of the tenants file; ``default`` without one) whose
    blocks leave the lower tiers."""

    tenant: StrictStr


# ---- responses ------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


def usage(
    num_prompt: int, num_completion: int, num_cached: int, num_external: int | None = None,
    num_written: int = 0, num_public: int | None = None,
) -> JSONObject:
    """OpenAI's usage block: ``prompt_tokens_details`` has the tokens read from the cache
    (``cached_tokens``) and written to it (``cache_write_tokens``); with lower KV tiers it also
    splits the cached tokens into ``local_cached_tokens`` (RAM) and ``external_cached_tokens``
    (a tier); a prompt that starts with a declared public prefix has ``public_cached_tokens``,
    the cached tokens read from public blocks (the rest are the caller's own)."""
    details = {"cached_tokens": num_cached, "cache_write_tokens": num_written}
    if num_public is not None:
        details["public_cached_tokens"] = num_public
    if num_external is not None:
        details["local_cached_tokens"] = num_cached - num_external
        details["external_cached_tokens"] = num_external
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=details,
    ).model_dump()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _envelope(rid: str, obj: str, model: str, created: int) -> JSONObject:
    return {"id": rid, "object": obj, "created": created, "model": model}


def completion_choice(
    index: int, text: str, reason: str | None, logprobs: JSONObject | None = None
) -> JSONObject:
    return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}


def chat_choice(
    index: int, text: str | None, reason: str | None, logprobs: JSONObject | None = None,
    tool_calls: list[JSONObject] | None = None,
) -> JSONObject:
    message: JSONObject = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "finish_reason": reason, "logprobs": logprobs}


def completion_response(
    rid: str, model: str, created: int, choices: list[JSONObject], use: JSONObject
) -> JSONObject:
    body = _envelope(rid, "text_completion", model, created)
    body["choices"] = choices
    body["usage"] = use
    return body


def chat_response(
    rid: str, model: str, created: int, choices: list[JSONObject], use: JSONObject
) -> JSONObject:
    body = _envelope(rid, "chat.completion", model, created)
    body["choices"] = choices
    body["usage"] = use
    return body


def completion_chunk(
    rid: str, model: str, created: int, index: int, text: str, reason: str | None,
    logprobs: JSONObject | None = None,
) -> JSONObject:
    body = _envelope(rid, "text_completion", model, created)
    body["choices"] = [completion_choice(index, text, reason, logprobs)]
    return body


def chat_chunk(
    rid: str, model: str, created: int, index: int, delta: JSONObject, reason: str | None,
    logprobs: JSONObject | None = None,
) -> JSONObject:
    body = _envelope(rid, "chat.completion.chunk", model, created)
    body["choices"] = [{"index": index, "delta": delta, "finish_reason": reason,
                        "logprobs": logprobs}]
    return body


def usage_chunk(
    rid: str, obj: str, model: str, created: int, use: JSONObject
) -> JSONObject:
    body = _envelope(rid, obj, model, created)
    body["choices"] = []
    body["usage"] = use
    return body


def model_card(
    model_id: str, created: int, max_model_len: int, precision: JSONObject | None = None
) -> JSONObject:
    card: JSONObject = {"id": model_id, "object": "model", "created": created,
                        "owned_by": "prefixcache", "max_model_len": max_model_len}  # fmt: skip
    if precision:
        card["precision"] = dict(precision)
    return card


def model_list(
    model_id: str, created: int, max_model_len: int, precision: JSONObject | None = None
) -> JSONObject:
    return {"object": "list", "data": [model_card(model_id, created, max_model_len, precision)]}


def now() -> int:
    return int(time.time())


# ---- the Responses API ------------------------------------------------------------------------


def response_usage(
    num_input: int, num_output: int, num_cached: int, num_written: int = 0,
    num_public: int | None = None,
) -> JSONObject:
    details = {"cached_tokens": num_cached, "cache_write_tokens": num_written}
    if num_public is not None:
        details["public_cached_tokens"] = num_public  # as in `usage`
    return {
        "input_tokens": num_input,
        "input_tokens_details": details,
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_input + num_output,
    }


def response_message(item_id: str, text: str, status: str) -> JSONObject:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [output_text(text)] if status == "completed" else [],
    }


def output_text(text: str) -> JSONObject:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_object(
    rid: str,
    body: ResponsesRequest,
    created: int,
    *,
    status: str,
    output: list[JSONObject],
    use: JSONObject | None,
    incomplete_reason: str | None = None,
) -> JSONObject:
    """A ``response`` object (``status``: in_progress | completed | incomplete)."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": body.model,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": float(body.temperature),
        "top_p": float(body.top_p),
        "output": output,
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "text": {"format": _text_format(body)},
        "truncation": "disabled",
        "store": False,
        "previous_response_id": None,
        "error": None,
        "incomplete_details": (
            {"reason": incomplete_reason} if incomplete_reason is not None else None
        ),
        "metadata": {},
        "user": body.user,
        "usage": use,
    }


def _text_format(body: ResponsesRequest) -> JSONObject:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return {"type": "text"}
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "name": fmt.name, "schema": fmt.schema_,
            "strict": fmt.strict, "description": fmt.description}
