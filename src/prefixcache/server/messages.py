"""`POST /v1/messages` (Anthropic's Messages API) and `POST /v1/messages/count_tokens`.

A Messages body becomes the chat body it means — ``system`` first, text blocks joined,
``tool_use`` blocks an assistant's tool calls, ``tool_result`` blocks tool messages, ``tools`` and
``tool_choice`` mapped to the chat machinery's — and runs through the chat endpoint's own checks
and sampling (`OpenAIServingChat.prepare`), so a greedy answer equals
``/v1/chat/completions``'. The answer is rendered as Anthropic's ``message`` object or its event
stream (`MessagesRendering`): text and ``tool_use`` content blocks, ``stop_reason``
(``end_turn``, ``max_tokens``, ``tool_use``), and usage as ``input_tokens`` (computed),
``cache_read_input_tokens`` (served from the prefix cache) and ``cache_creation_input_tokens``
(written and pinned). Each ``cache_control`` breakpoint pins the prefix through its block for
its TTL (`breakpoints`; `cache/pins.py`); the definitions are in ``docs/prompt-caching.md``.
``max_tokens: 0`` is a prewarm: the prompt is computed and cached (and its breakpoints pinned),
the message has no content.
Errors on these routes use Anthropic's shape (`errors.install_error_handlers`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from prefixcache.cache.pins import TTLS
from prefixcache.server.chat import OpenAIServingChat
from prefixcache.server.diagnostics import (
    ENGINE_REASONS,
    NOT_FOUND,
    Diagnosis,
    Outcome,
    Verdict,
)
from prefixcache.server.errors import ApiError
from prefixcache.server.job_runner import JobRunner
from prefixcache.server.jobs import Choice, Job, Step
from prefixcache.server.messages_body import chat_body_of, chat_fields
from prefixcache.server.openapi import operation_id
from prefixcache.server.protocol import (
    ChatMessage,
    JSONObject,
    MessagesCountRequest,
    MessagesRequest,
)
from prefixcache.server.rendering import Rendering
from prefixcache.server.request_params import tool_choice_of
from prefixcache.server.serving_context import ServingContext, text_bytes
from prefixcache.server.tenancy import Tenant
from prefixcache.server.tools import parse_tool_calls

__all__ = ["AnthropicServingMessages", "MessagesRendering", "chat_body_of", "messages_router"]

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


class AnthropicServingMessages:
    """The Messages endpoints: a Messages body is prepared as the chat body it means (by
    ``chat``), its cache breakpoints become pins."""

    def __init__(
        self, context: ServingContext, runner: JobRunner, chat: OpenAIServingChat
    ) -> None:
        self.context = context
        self.runner = runner
        self.chat = chat

    async def create_message(
        self, body: MessagesRequest, tenant: Tenant, http: Request
    ) -> Response:
        if body.max_tokens < 0:
            raise ApiError(400, "max_tokens must be >= 0 (0: a prewarm, the prompt cached and "
                           "nothing generated)", param="max_tokens")
        prewarm = body.max_tokens == 0
        breaks = breakpoints(body)
        chat = chat_body_of(body.model_copy(update={"max_tokens": 1}) if prewarm else body)
        prepared = await self.chat.prepare(chat)
        prepared.options.prefill_only = prewarm
        token_ids = prepared.prompts[0][0]
        bs = self.context.block_size
        for truncated, ttl_s in breaks:
            length = len(token_ids) - 1 if truncated is None else await self._prefix_length(
                truncated, token_ids)
            prepared.options.pins.append((length // bs * bs, ttl_s))
        diagnosis = None
        if body.diagnostics is not None:  # the object is the opt-in, its id the comparison
            diagnosis = self.context.diagnosis(
                tenant, body.cache_salt, token_ids, _segments(body),
                [_without_cache_control(m.model_dump(exclude_none=True)) for m in body.messages],
                body.diagnostics.previous_message_id)
        return await self.runner.serve(MessagesRendering(diagnosis), chat, prepared, tenant,
                                       http)

    async def _prefix_length(self, truncated: MessagesCountRequest, token_ids: list[int]) -> int:
        """How many of ``token_ids`` the conversation cut after a breakpoint renders to (the
        common prefix: a template may close a cut conversation differently)."""
        fields = chat_fields(truncated)
        messages = [ChatMessage.model_validate(m) for m in fields["messages"]] or [
            ChatMessage(role="system", content="")]
        prefix = await self.context.render_messages(messages, "messages", False,
                                                    fields.get("tools"), allow_empty=True)
        n = 0
        for a, b in zip(prefix, token_ids, strict=False):
            if a != b:
                break
            n += 1
        return min(n, len(token_ids) - 1)

    async def count_tokens(self, body: MessagesCountRequest) -> JSONObject:
        context = self.context
        context.check_model(body.model)
        chat = chat_body_of(body)
        tools, choice = tool_choice_of(chat)
        context.check_prompt_bytes(sum(text_bytes(m.text()) for m in chat.messages), "messages")
        token_ids = await context.render_messages(chat.messages, "messages", True,
                                                  tools if choice != "none" else None)
        return {"input_tokens": len(token_ids)}


def messages_router(
    serving: AnthropicServingMessages, auth: Callable[[Request], Tenant]
) -> APIRouter:
    router = APIRouter(generate_unique_id_function=operation_id)

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request,
                       tenant: Tenant = Depends(auth)) -> Response:
        return await serving.create_message(body, tenant, request)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesCountRequest,
                           tenant: Tenant = Depends(auth)) -> JSONObject:
        return await serving.count_tokens(body)

    return router


MAX_BREAKPOINTS = 4


def breakpoints(body: MessagesRequest) -> list[tuple[MessagesCountRequest | None, float]]:
    """The body's cache breakpoints in Anthropic's prefix order (tools, system, messages):
    each the conversation cut right after its block, with its TTL in seconds; the top-level
    ``cache_control`` adds one at the prompt's end (None). At most four."""
    out: list[tuple[MessagesCountRequest | None, float]] = []

    def cut(**update: object) -> MessagesCountRequest:
        return body.model_copy(update={"messages": [], "system": None, **update})

    for i, tool in enumerate(body.tools or []):
        if tool.cache_control is not None:
            out.append((cut(), _ttl(tool.cache_control, f"tools.{i}.cache_control")))
    if isinstance(body.system, list):
        for i, text in enumerate(body.system):
            if text.cache_control is not None:
                out.append((cut(system=body.system[: i + 1]),
                            _ttl(text.cache_control, f"system.{i}.cache_control")))
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            continue
        for j, block in enumerate(message.content):
            if block.cache_control is None:
                continue
            last = message.model_copy(update={"content": message.content[: j + 1]})
            out.append((cut(system=body.system, messages=[*body.messages[:i], last]),
                        _ttl(block.cache_control, f"messages.{i}.content.{j}.cache_control")))
    if body.cache_control is not None:
        out.append((None, _ttl(body.cache_control, "cache_control")))
    if len(out) > MAX_BREAKPOINTS:
        raise ApiError(400, f"at most {MAX_BREAKPOINTS} blocks may have cache_control, "
                       f"found {len(out)}", param="cache_control")
    return out


def _ttl(control: JSONObject, param: str) -> float:
    if control.get("type") != "ephemeral":
        raise ApiError(400, "cache_control.type must be 'ephemeral'", param=param)
    ttl = control.get("ttl", "5m")
    if ttl not in ("5m", "1h"):  # Anthropic's two
        raise ApiError(400, "cache_control.ttl must be '5m' or '1h'", param=param)
    return TTLS[ttl]


def _segments(body: MessagesRequest) -> list[tuple[str, object]]:
    """What Anthropic's diagnostics compare before the messages, in its order (``other``: the
    prompt-affecting fields it reports as ``unavailable``)."""
    def dump(value: object) -> object:
        if isinstance(value, list):
            return [_without_cache_control(v.model_dump(exclude_none=True))
                    if hasattr(v, "model_dump") else v for v in value]
        return value

    return [("model", body.model), ("system", dump(body.system)), ("tools", dump(body.tools)),
            ("other", body.tool_choice)]


def _without_cache_control(value: object) -> object:
    """``value`` without its ``cache_control`` markers (a breakpoint changes no prompt)."""
    if isinstance(value, dict):
        return {k: _without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_control(v) for v in value]
    return value


def anthropic_diagnostics(outcome: Outcome) -> JSONObject | None:
    """Anthropic's ``diagnostics``: null when nothing was compared or nothing changed, else the
    earliest divergence (the engine's own reasons, `ENGINE_REASONS`, where the request changed
    nothing, with their detail beside the token count)."""
    if outcome is None:
        return None
    if outcome == NOT_FOUND:
        return {"cache_miss_reason": {"type": "previous_message_not_found"}}
    assert isinstance(outcome, Verdict)
    if outcome.reason is None:
        return None
    if outcome.reason == "other":
        return {"cache_miss_reason": {"type": "unavailable"}}
    engine = outcome.reason in ENGINE_REASONS
    kind = outcome.reason if engine else f"{outcome.reason}_changed"
    return {"cache_miss_reason": {"type": kind, "cache_missed_input_tokens": outcome.missed_tokens,
                                  **(outcome.detail or {}), **outcome.public_part()}}


class MessagesRendering(Rendering):
    """A job as Anthropic's ``message`` object or its event stream; with a ``diagnosis``, the
    message carries ``diagnostics`` (and leaves its fingerprint under its id)."""

    id_prefix = "msg"

    def __init__(self, diagnosis: Diagnosis | None = None) -> None:
        self.diagnosis = diagnosis

    def _usage(self, job: Job, num_output: int) -> JSONObject:
        """Anthropic's usage: read (served from the cache), created (the breakpoints' prefix
        beyond what was read: written and pinned, 1-hour ones first) and the rest computed."""
        cached = job.prompts[0].num_cached
        pins = job.options.pins
        end_1h = max((n for n, ttl in pins if ttl > 300.0), default=0)
        end = max((n for n, _ in pins), default=0)
        created_1h = max(0, end_1h - cached)
        created_5m = max(0, end - max(cached, end_1h))
        created = created_1h + created_5m
        return {"input_tokens": job.num_prompt_tokens - cached - created,
                "cache_creation_input_tokens": created,
                "cache_read_input_tokens": cached,
                "cache_creation": {"ephemeral_5m_input_tokens": created_5m,
                                   "ephemeral_1h_input_tokens": created_1h},
                "output_tokens": num_output}

    def _blocks(self, job: Job, choice: Choice) -> tuple[list[JSONObject], str]:
        if job.options.prefill_only:  # a prewarm: the prompt is cached, nothing is said
            return [], "max_tokens"
        text: str | None = choice.text
        calls: list[JSONObject] = []
        if job.options.tools:
            text, calls = parse_tool_calls(choice.text)
        blocks: list[JSONObject] = [{"type": "text", "text": text}] if text else []
        for call in calls:
            function = call["function"]
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                arguments = {}
            blocks.append({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix(
                "call_"), "name": function["name"], "input": arguments})
        reason = "tool_use" if calls else _STOP_REASONS.get(choice.reason or "", "end_turn")
        return blocks, reason

    def _message(self, job: Job, content: list[JSONObject], reason: str | None,
                 usage: JSONObject) -> JSONObject:
        message_id = job.public_id.replace("-", "_", 1)
        message: JSONObject = {
            "id": message_id, "type": "message", "role": "assistant", "model": job.model,
            "content": content, "stop_reason": reason, "stop_sequence": None, "usage": usage}
        if self.diagnosis is not None:
            message["diagnostics"] = anthropic_diagnostics(
                self.diagnosis.outcome(message_id, job.prompts[0].num_cached))
        return message

    def body(self, job: Job) -> JSONObject:
        choice = job.prompts[0].choices[0]
        blocks, reason = self._blocks(job, choice)
        return self._message(job, blocks, reason, self._usage(job, job.num_output_tokens))

    async def stream(self, job: Job, outputs: AsyncIterator[Step]) -> AsyncIterator[str]:
        """message_start (once the prefill is done, so its usage says what the cache served),
        ``ping``, then per content block start / deltas / stop, message_delta (stop reason, the
        whole usage) and message_stop, as Anthropic sends them. With tools the answer is parsed
        whole, so its blocks come at the end."""
        choice = job.prompts[0].choices[0]  # a message has one
        live = not (job.options.tools or job.options.prefill_only)
        opened = False
        started = False
        try:
            async for output, _, _ in outputs:
                if not started:  # after the prefill: the usage knows what the cache served
                    started = True
                    for event in _opening(self._message(
                            job, [], None, self._usage(job, job.num_output_tokens))):
                        yield event
                if live and output.text:
                    if not opened:
                        yield _event("content_block_start", index=0, content_block=_EMPTY_TEXT)
                        opened = True
                    yield _event("content_block_delta", index=0,
                                 delta={"type": "text_delta", "text": output.text})
        except ApiError as exc:
            yield _event("error", error={"type": "api_error", "message": exc.message})
            return
        if not started:
            for event in _opening(self._message(job, [], None, self._usage(job, 0))):
                yield event
        blocks, reason = self._blocks(job, choice)
        if live:
            if not opened:
                yield _event("content_block_start", index=0, content_block=_EMPTY_TEXT)
            yield _event("content_block_stop", index=0)
        else:
            for event in _whole_blocks(blocks):
                yield event
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": None},
                     usage=self._usage(job, job.num_output_tokens))
        yield _event("message_stop")


_EMPTY_TEXT: JSONObject = {"type": "text", "text": ""}


def _event(kind: str, **payload: object) -> str:
    data = json.dumps({"type": kind, **payload}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


def _opening(message: JSONObject) -> list[str]:
    """``message_start`` with the message so far, then a ``ping``."""
    return [_event("message_start", message=message), _event("ping")]


def _whole_blocks(blocks: list[JSONObject]) -> list[str]:
    """Each parsed content block (text or ``tool_use``) as start, one delta and stop."""
    events = []
    for index, block in enumerate(blocks):
        if block["type"] == "text":
            events.append(_event("content_block_start", index=index, content_block=_EMPTY_TEXT))
            events.append(_event("content_block_delta", index=index,
                                 delta={"type": "text_delta", "text": block["text"]}))
        else:
            events.append(_event("content_block_start", index=index,
                                 content_block={**block, "input": {}}))
            events.append(_event("content_block_delta", index=index, delta={
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
        events.append(_event("content_block_stop", index=index))
    return events
