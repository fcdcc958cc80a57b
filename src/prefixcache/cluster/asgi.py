"""One HTTP request carried to a replica and run through its ASGI app in-process.

The cluster's ingress reads the client's request (method, path, headers, body), adds the prompt's
block digests for the router, and sends it to an engine replica; the replica runs it through the
same FastAPI app `prefixcache serve` runs, and streams back a `ResponseHead` and then the body's
chunks as the app writes them (server-sent events arrive as they are produced). When the caller
stops reading, the app sees ``http.disconnect``, which aborts the engine request. No Ray here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ForwardedRequest", "ResponseHead", "run_asgi"]

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Receive, Send], Awaitable[None]]


@dataclass(slots=True)
class ForwardedRequest:
    """What the ingress sends a replica: the client's request and its prompt's block digests
    (empty when the body names no prompt the ingress could read: the replica still answers)."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    block_digests: list[bytes] = field(default_factory=list)
    affinity_key: bytes | None = None  # prompt_cache_key, scoped to the tenant (cluster.digests)
    pin: str | None = None  # a replica's id: this request goes to that replica (/metrics)


@dataclass(slots=True)
class ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]


async def run_asgi(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
    """Run ``request`` through ``app``; yield its `ResponseHead`, then each non-empty body chunk."""
    scope: Message = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path,
        "raw_path": request.path.encode(), "query_string": request.query, "root_path": "",
        "headers": request.headers, "client": ("ingress", 0), "server": ("replica", 0),
    }
    out: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await out.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await out.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ResponseHead(int(message["status"]), list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task
    finally:
        disconnected.set()  # the caller went away (or we are done): the app aborts its request
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 5)
