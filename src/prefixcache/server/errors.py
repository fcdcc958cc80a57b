"""OpenAI-style API errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Owns the `ApiError` exception and the FastAPI exception handlers that turn validation failures
(FastAPI's default 422), HTTP errors and unexpected exceptions into that body. Messages name the
problem and never echo prompt text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixcache.errors import describe_exception
from prefixcache.server.protocol import JSONObject

__all__ = ["ApiError", "anthropic_error_body", "error_body", "install_error_handlers",
           "is_anthropic_path", "stream_error_event"]

logger = logging.getLogger("prefixcache.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    429: "rate_limit_error",
    503: "server_error",
}


class ApiError(Exception):
    """An error answered to the client with ``status`` and an OpenAI error body."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param, self.code),
                            status_code=self.status)


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    """The routes of Anthropic's API, whose errors take Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_body(status: int, message: str) -> JSONObject:
    """``{"type": "error", "error": {"type", "message"}}``, as Anthropic's API answers."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def stream_error_event(path: str, status: int, message: str) -> str:
    """The server-sent event that ends a stream of route ``path`` on a failure after it began,
    in the route's shape, so a client reads an error instead of a stream that merely stops:
    Anthropic's ``error`` event, the Responses API's, or OpenAI's ``data: {"error": ...}``."""
    if is_anthropic_path(path):
        data, kind = anthropic_error_body(status, message), "error"
    elif path == "/v1/responses":
        kind = "error"
        data = {"type": "error", "code": error_body(status, message)["error"]["type"],
                "message": message, "param": None}
    else:
        data, kind = error_body(status, message), None
    line = f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
    return line if kind is None else f"event: {kind}\n{line}"


def _respond(request: Request, exc: ApiError) -> JSONResponse:
    if is_anthropic_path(request.url.path):
        return JSONResponse(anthropic_error_body(exc.status, exc.message),
                            status_code=exc.status)
    return exc.response()


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONObject:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _field_path(loc: Sequence[str | int]) -> str | None:
    """``messages.0.role`` from a pydantic location, without "body" and union member tags."""
    parts = [str(p) for p in loc if p != "body" and not _is_type_tag(p)]
    return ".".join(parts) or None


def _is_type_tag(part: str | int) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _validation_message(errors: Sequence[JSONObject]) -> tuple[str, str | None]:
    """One line for the first validation error, plus the offending parameter's name. A value
    error (our own checks) explains more than a union's "not a string" branch: it goes first."""
    errors = sorted(errors, key=lambda e: e.get("type") != "value_error")
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    if kind == "json_invalid":
        return f"malformed JSON body: {first.get('msg', 'cannot parse')}", None
    param = _field_path(first.get("loc", ()))
    same = [e.get("msg", "") for e in errors if _field_path(e.get("loc", ())) == param]
    msg = "; or ".join(dict.fromkeys(same)) or first.get("msg", "invalid value")
    if kind == "missing" and param is None:
        return "the request body is missing: send a JSON object", None
    if kind == "missing":
        return f"missing required parameter {param!r}", param
    if kind == "extra_forbidden":
        return f"unknown parameter {param!r}", param
    if param is None:
        return f"invalid request body: {msg}", None
    return f"invalid value for {param!r}: {msg}", param


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(exc.errors())
    return _respond(request, ApiError(400, message, param=param))


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _respond(request, exc)


async def _on_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return _respond(request, ApiError(exc.status_code, str(exc.detail)))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # no traceback text: an exception's message may quote the request (see describe_exception)
    logger.error("internal error: %s", describe_exception(exc))
    return _respond(request, ApiError(500, "internal server error"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(Exception, _on_unexpected)
