"""Limits applied before a request reaches the endpoints: body size and header read time.

`BodyLimit` is an ASGI middleware answering 413 (OpenAI error body) to a request body over
``max_bytes``, from its Content-Length before reading anything, or while a chunked body streams
in. Either way the answer is written first and the rest of the upload is then read and dropped,
for a bounded time and size, before the connection closes (nginx's lingering close): a server
that closes with unread bytes makes the kernel reset the connection, and a client still uploading
then reads a connection error instead of the 413 (and the openai SDK retries it).
`HeaderTimeoutH11Protocol` is uvicorn's h11 protocol with a deadline for a request's headers
(uvicorn's own keep-alive timeout only runs between requests), so connections that never finish
their headers are closed instead of held open.
"""

from __future__ import annotations

import asyncio
import json

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from prefixcache.server.errors import anthropic_error_body, error_body, is_anthropic_path

__all__ = ["BodyLimit", "HeaderTimeoutH11Protocol", "header_timeout_protocol"]

# after a 413, how much more of the upload is read and dropped, and for how long, at most
MIN_DISCARD_BYTES = 64 << 20
DISCARD_SECONDS = 3.0


class BodyLimit:
    """ASGI middleware: bodies over ``max_bytes`` get 413 and never reach the app whole."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            # a client waiting for "100 Continue" has sent nothing and will send nothing
            await self._reject(scope, send, receive if not _expects_continue(scope) else None)
            return
        # read the whole body (at most max_bytes) before the app sees it: an app that reads
        # the body itself would turn a failure here into its own 400
        parts: list[bytes] = []
        received = 0
        while True:
            message: Message = await receive()
            if message["type"] != "http.request":  # the client went away mid-body
                return
            parts.append(message.get("body", b""))
            received += len(parts[-1])
            if received > self.max_bytes:
                parts.clear()
                await self._reject(scope, send, receive if message.get("more_body") else None)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            message: Message = await receive()  # later calls: disconnect detection
            return message

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, send: Send, rest: Receive | None) -> None:
        """Answer 413, then read and drop the ``rest`` of the body (if any is still coming)
        before completing the response, which is when the connection closes."""
        message = f"the request body is larger than this server's limit of {self.max_bytes} bytes"
        payload = (anthropic_error_body(413, message) if is_anthropic_path(scope.get("path", ""))
                   else error_body(413, message, code="request_too_large"))
        body = json.dumps(payload).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        try:
            await send({"type": "http.response.start", "status": 413, "headers": headers})
        except h11.LocalProtocolError:  # uvicorn has already answered a malformed body 400
            return
        await send({"type": "http.response.body", "body": body, "more_body": rest is not None})
        if rest is not None:
            await self._discard(rest)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _discard(self, receive: Receive) -> None:
        """Read and drop what is left of an oversized upload, up to ``max(4 * max_bytes,
        MIN_DISCARD_BYTES)`` and ``DISCARD_SECONDS``; larger or slower uploads are cut off.
        Nothing is kept, and the event loop serves every other request meanwhile."""
        budget = max(4 * self.max_bytes, MIN_DISCARD_BYTES)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DISCARD_SECONDS
        while budget > 0:
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                message: Message = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            budget -= len(message.get("body", b""))


def _expects_continue(scope: Scope) -> bool:
    return any(name == b"expect" and value.lower() == b"100-continue"
               for name, value in scope.get("headers", ()))


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class HeaderTimeoutH11Protocol(H11Protocol):
    """h11 with a deadline: a request whose headers are not complete ``header_timeout_s`` after
    its first byte (or after the connection opened) closes the connection."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_request():
            self._cancel_header_timer()
        elif self._header_timer is None:
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 for a body that breaks HTTP's framing, unless an answer is already on
        its way (a 413 whose rest is being dropped): then the connection just closes."""
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()
            return
        super().send_400_response(msg)

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if not self._in_request() and not self.transport.is_closing():
            self.transport.close()


def header_timeout_protocol(timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class for uvicorn's ``http=`` option, with this header deadline."""
    return type("HeaderTimeoutH11", (HeaderTimeoutH11Protocol,), {"header_timeout_s": timeout_s})
