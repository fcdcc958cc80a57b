"""`POST /v1/responses` (OpenAI's Responses API): ``input`` (text or messages) -> one message.

Text formats (``json_object``, ``json_schema``) through the output grammars; a whole
``response`` object, or its typed event sequence, each event with a ``sequence_number``
(`ResponsesRendering`). Stored responses (``previous_response_id``) and tools are refused.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from prefixcache.engine.sampling_params import StructuredOutputs
from prefixcache.errors import InvalidParam
from prefixcache.server import protocol
from prefixcache.server.errors import ApiError
from prefixcache.server.jobs import Job, RenderOptions
from prefixcache.server.protocol import JSONObject, ResponsesRequest
from prefixcache.server.request_params import response_messages, response_status
from prefixcache.server.serving_base import Rendering, ServingBase, text_bytes
from prefixcache.server.tenancy import Tenant

__all__ = ["ResponsesAPI", "ResponsesRendering"]


class ResponsesAPI(ServingBase):
    """The Responses endpoint."""

    async def responses(
        self, body: ResponsesRequest, tenant: Tenant, http: Request
    ) -> Response:
        self._check_model(body.model)
        self._check_ignored(body)
        if body.previous_response_id is not None:
            raise ApiError(400, "previous_response_id needs stored responses, which this server "
                           "does not keep: send the whole conversation in 'input'",
                           param="previous_response_id")
        if body.tools:
            raise ApiError(400, "tools (built-in or function) are not supported on "
                           "/v1/responses", param="tools")
        messages = response_messages(body)
        self._check_prompt_bytes(sum(text_bytes(m.text()) for m in messages), "input")
        token_ids = await self._off_loop(self._render_messages, (messages, "input", True, None))
        max_tokens = body.max_output_tokens
        if max_tokens is None:
            max_tokens = max(1, min(self.default_max_tokens, self.max_model_len - len(token_ids)))
        fmt = body.text.format if body.text is not None else None
        structured = None
        try:
            if fmt is not None and fmt.type == "json_object":
                structured = StructuredOutputs.of(json_object=True)
            elif fmt is not None and fmt.type == "json_schema":
                structured = StructuredOutputs.of(json=fmt.schema_)
        except InvalidParam as exc:
            raise ApiError(400, str(exc), param="text.format") from None
        params = self._sampling_params(
            param_names={"max_tokens": "max_output_tokens"},
            max_tokens=max_tokens, temperature=float(body.temperature), top_p=float(body.top_p),
            structured_outputs=structured,
        )
        await self._compile(params, "text.format")
        prompts: list[tuple[list[int], str | None]] = [(token_ids, None)]
        return await self._serve(ResponsesRendering(self), body, prompts, params,
                                 RenderOptions(), tenant, http)


class ResponsesRendering(Rendering[ResponsesRequest]):
    """A job as one ``response`` object or the Responses API's event stream."""

    id_prefix = "resp"

    def body(self, job: Job, body: ResponsesRequest) -> JSONObject:
        choice = job.prompts[0].choices[0]
        status, incomplete = response_status(choice.reason)
        message = protocol.response_message(f"msg_{job.public_id[5:]}", choice.text, "completed")
        use = protocol.response_usage(job.num_prompt_tokens, job.num_output_tokens,
                                      job.prompts[0].num_cached)
        return protocol.response_object(job.public_id, body, job.created, status=status,
                                        output=[message], use=use, incomplete_reason=incomplete)

    async def stream(self, job: Job, body: ResponsesRequest) -> AsyncIterator[str]:
        """The event sequence of a streamed response, each event with its ``sequence_number``."""
        sequence = 0
        item_id = f"msg_{job.public_id[5:]}"

        def event(kind: str, **payload: Any) -> str:
            nonlocal sequence
            data = {"type": kind, "sequence_number": sequence, **payload}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

        def snapshot(status: str, use: JSONObject | None = None,
                     output: list[JSONObject] | None = None,
                     incomplete: str | None = None) -> JSONObject:
            return protocol.response_object(job.public_id, body, job.created, status=status,
                                            output=output or [], use=use,
                                            incomplete_reason=incomplete)

        part = {"item_id": item_id, "output_index": 0, "content_index": 0}
        try:
            yield event("response.created", response=snapshot("in_progress"))
            yield event("response.in_progress", response=snapshot("in_progress"))
            yield event("response.output_item.added", output_index=0,
                        item=protocol.response_message(item_id, "", "in_progress"))
            yield event("response.content_part.added", **part, part=protocol.output_text(""))
            choice = job.prompts[0].choices[0]
            while not job.done:
                try:
                    output, _, choice = await self.serving._next(job)
                except ApiError as exc:
                    yield event("error", code="server_error", message=exc.message, param=None)
                    return
                if output.text:
                    yield event("response.output_text.delta", **part, delta=output.text,
                                logprobs=[])
            yield event("response.output_text.done", **part, text=choice.text, logprobs=[])
            yield event("response.content_part.done", **part,
                        part=protocol.output_text(choice.text))
            message = protocol.response_message(item_id, choice.text, "completed")
            yield event("response.output_item.done", output_index=0, item=message)
            status, incomplete = response_status(choice.reason)
            use = protocol.response_usage(job.num_prompt_tokens, job.num_output_tokens,
                                          job.prompts[0].num_cached)
            # "response.completed" even when cut at max_output_tokens (as vLLM): clients wait
            # for it; the response's status says "incomplete"
            yield event("response.completed", response=snapshot(status, use, [message],
                                                                incomplete))
        finally:
            self.serving._finish(job)
