"""How an API answers a job: `Rendering` (one JSON body, or a stream of server-sent events) and
`ChunkRendering`, the ``data:`` chunks completions and chat stream.

A rendering is handed the job and, to stream, the job's outputs as they arrive (`Step`s from
`job_runner.JobRunner.outputs`); it calls nothing back: the runner queues the job, feeds it and
releases it when the stream ends.
"""

from __future__ import annotations

import abc
import json
from collections.abc import AsyncIterator

from prefixcache.engine.outputs import RequestOutput
from prefixcache.server import protocol
from prefixcache.server.errors import ApiError
from prefixcache.server.jobs import Choice, Job, PromptState, Step
from prefixcache.server.logprobs import TokenText, vllm_prompt_logprobs
from prefixcache.server.protocol import JSONObject

__all__ = ["ChunkRendering", "Rendering", "sse"]


class Rendering(abc.ABC):
    """How one API answers a job: ``body`` once it is done, or ``stream`` as it runs.
    ``id_prefix`` starts the response ids. A failed step arrives as an `ApiError` raised by
    ``outputs``; the stream ends the answer in its API's error shape."""

    id_prefix = ""

    @abc.abstractmethod
    def body(self, job: Job) -> JSONObject: ...

    @abc.abstractmethod
    def stream(self, job: Job, outputs: AsyncIterator[Step]) -> AsyncIterator[str]: ...


class ChunkRendering(Rendering):
    """Completions and chat: one ``data:`` chunk per step that added something, usage when
    asked, then ``data: [DONE]``. ``usage_object`` names the usage chunk's ``object``;
    ``token_text`` names the tokens of the logprobs."""

    usage_object = ""

    def __init__(self, token_text: TokenText) -> None:
        self.token_text = token_text

    def prompt_logprobs(self, prompt: PromptState) -> list[dict[str, JSONObject] | None] | None:
        """vLLM's ``prompt_logprobs`` of ``prompt`` (None until the engine sent them)."""
        if prompt.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(prompt.prompt_logprobs, self.token_text)

    def opening(self, job: Job) -> list[JSONObject]:
        """Chunks sent before the first output (chat: each choice's role)."""
        return []

    @abc.abstractmethod
    def chunk(
        self, job: Job, output: RequestOutput, i: int, choice: Choice
    ) -> JSONObject | None:
        """The chunk for ``output`` (of prompt ``i``), or None when it adds nothing."""

    async def stream(self, job: Job, outputs: AsyncIterator[Step]) -> AsyncIterator[str]:
        for opening in self.opening(job):
            yield sse(opening)
        try:
            async for output, i, choice in outputs:
                chunk = self.chunk(job, output, i, choice)
                if chunk is not None:
                    if job.options.continuous_usage:
                        chunk["usage"] = job.usage()
                    yield sse(chunk)
        except ApiError as exc:
            yield sse({"error": {"message": exc.message, "type": "server_error",
                                 "param": None, "code": None}})
        if job.options.include_usage and job.done:
            usage = protocol.usage_chunk(job.public_id, self.usage_object, job.model,
                                         job.created, job.usage())
            diagnostics = self.diagnostics(job)
            if diagnostics is not None:
                usage["prompt_cache_diagnostics"] = diagnostics
            yield sse(usage)
        yield "data: [DONE]\n\n"

    def diagnostics(self, job: Job) -> JSONObject | None:
        """Why the cache missed, where the request asked (None: it did not)."""
        return None


def sse(payload: JSONObject) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
