"""The OpenAI wire format: pydantic request and response models for completions and chat.

Requests are strict: wrong types and unknown fields are rejected (400 through the error
handlers), and the few standard OpenAI fields this server does not implement are accepted only at
their neutral value. Responses are plain models serialised with ``model_dump``. No engine types
here; `serving` translates between the two.
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
)
from pydantic import StrictStr as _PlainStr

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "Usage",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "model_list",
    "new_id",
    "usage",
    "usage_chunk",
]



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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(_Strict):
    """Fields shared by both endpoints."""

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0  # extension (vLLM)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None  # extension (vLLM)
    ignore_eos: StrictBool = False  # extension (vLLM)
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: StrictStr | None = None  # extension (vLLM): narrows reuse inside the namespace
    user: StrictStr | None = None
    # standard fields accepted only at their neutral value (see `unsupported_fields`)
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None

    def unsupported_fields(self) -> list[str]:
        neutral = {"frequency_penalty": (None, 0), "presence_penalty": (None, 0),
                   "logit_bias": (None, {})}
        return [name for name, ok in neutral.items() if getattr(self, name) not in ok]


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def unsupported_fields(self) -> list[str]:
        out = super().unsupported_fields()
        neutral = {"logprobs": (None,), "echo": (False,), "suffix": (None, ""),
                   "best_of": (None, 1)}
        return out + [name for name, ok in neutral.items() if getattr(self, name) not in ok]


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None

    def unsupported_fields(self) -> list[str]:
        out = super().unsupported_fields()
        return out + (["logprobs"] if self.logprobs else [])


# ---- responses ------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details={"cached_tokens": num_cached},
    ).model_dump()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _envelope(rid: str, obj: str, model: str, created: int) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model}


def completion_response(
    rid: str, model: str, created: int, choices: list[tuple[str, str | None]], use: dict[str, Any]
) -> dict[str, Any]:
    body = _envelope(rid, "text_completion", model, created)
    body["choices"] = [
        {"index": i, "text": text, "finish_reason": reason, "logprobs": None}
        for i, (text, reason) in enumerate(choices)
    ]
    body["usage"] = use
    return body


def chat_response(
    rid: str, model: str, created: int, choices: list[tuple[str, str | None]], use: dict[str, Any]
) -> dict[str, Any]:
    body = _envelope(rid, "chat.completion", model, created)
    body["choices"] = [
        {"index": i, "message": {"role": "assistant", "content": text},
         "finish_reason": reason, "logprobs": None}
        for i, (text, reason) in enumerate(choices)
    ]
    body["usage"] = use
    return body


def completion_chunk(
    rid: str, model: str, created: int, index: int, text: str, reason: str | None
) -> dict[str, Any]:
    body = _envelope(rid, "text_completion", model, created)
    body["choices"] = [{"index": index, "text": text, "finish_reason": reason, "logprobs": None}]
    return body


def chat_chunk(
    rid: str, model: str, created: int, index: int, delta: dict[str, str], reason: str | None
) -> dict[str, Any]:
    body = _envelope(rid, "chat.completion.chunk", model, created)
    body["choices"] = [{"index": index, "delta": delta, "finish_reason": reason,
                        "logprobs": None}]
    return body


def usage_chunk(
    rid: str, obj: str, model: str, created: int, use: dict[str, Any]
) -> dict[str, Any]:
    body = _envelope(rid, obj, model, created)
    body["choices"] = []
    body["usage"] = use
    return body


def model_list(model_id: str, created: int, max_model_len: int) -> dict[str, Any]:
    card = {"id": model_id, "object": "model", "created": created, "owned_by": "prefixcache",
            "max_model_len": max_model_len}
    return {"object": "list", "data": [card]}


def now() -> int:
    return int(time.time())
