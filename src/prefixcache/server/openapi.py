"""The server's OpenAPI description, complete: what each route answers, errors included.

FastAPI derives the request bodies from the pydantic models in `protocol`; this module adds what
it cannot see: the answers (each route's JSON or event stream, and every error status the route
raises, in OpenAI's error shape or, on ``/v1/messages``, Anthropic's), the two ways to send an
API key, and one operation id per method. FastAPI's default 422 is dropped: validation failures
are answered 400 (`errors`). The description is what schema-driven fuzzers and client generators
read (``GET /openapi.json``), so a status or shape the server answers and this omits is a defect.
"""

from __future__ import annotations

import warnings

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from prefixcache.server.errors import is_anthropic_path
from prefixcache.server.protocol import JSONObject

__all__ = ["install_openapi", "operation_id"]

_OBJECT: JSONObject = {"type": "object"}
_STRING: JSONObject = {"type": "string"}
_INTEGER: JSONObject = {"type": "integer"}
_NUMBER: JSONObject = {"type": "number"}


def _object(required: dict[str, JSONObject], **optional: JSONObject) -> JSONObject:
    """An object with ``required`` properties (more are allowed: the answers grow)."""
    return {"type": "object", "required": list(required),
            "properties": {**required, **optional}}


def _array(items: JSONObject) -> JSONObject:
    return {"type": "array", "items": items}


def _nullable(schema: JSONObject) -> JSONObject:
    return {"anyOf": [schema, {"type": "null"}]}


_OPENAI_ERROR = _object({"error": _object({
    "message": _STRING, "type": _STRING, "param": _nullable(_STRING), "code": _nullable(_STRING),
})})
_ANTHROPIC_ERROR = _object({"type": {"const": "error"},
                            "error": _object({"type": _STRING, "message": _STRING})})
_USAGE = _object({"prompt_tokens": _INTEGER, "completion_tokens": _INTEGER,
                  "total_tokens": _INTEGER},
                 prompt_tokens_details=_object({"cached_tokens": _INTEGER},
                                               public_cached_tokens=_INTEGER))
_MODEL = _object({"id": _STRING, "object": {"const": "model"}, "created": _INTEGER,
                  "owned_by": _STRING}, max_model_len=_INTEGER,
                 precision=_object({"dtype": _STRING, "weights": _STRING, "precision": _STRING},
                                   dtype_auto={"type": "object"},
                                   kernels=_object({"gemm": _STRING, "attention": _STRING,
                                                    "batch_invariant": {"type": "boolean"}})))
_PIN = _object({"id": _STRING, "num_tokens": _INTEGER, "ttl_s": _NUMBER,
                "expires_in_s": _NUMBER, "last_block_digest": _STRING})

# each route's successful JSON answer ("stream" routes also answer text/event-stream)
_ANSWERS: dict[str, JSONObject] = {
    "/v1/completions": _object({
        "id": _STRING, "object": {"const": "text_completion"}, "created": _INTEGER,
        "model": _STRING, "usage": _USAGE,
        "choices": _array(_object({"index": _INTEGER, "text": _STRING,
                                   "finish_reason": _nullable(_STRING)})),
    }),
    "/v1/chat/completions": _object({
        "id": _STRING, "object": {"const": "chat.completion"}, "created": _INTEGER,
        "model": _STRING, "usage": _USAGE,
        "choices": _array(_object({"index": _INTEGER, "message": _object({"role": _STRING}),
                                   "finish_reason": _nullable(_STRING)})),
    }),
    "/v1/responses": _object({
        "id": _STRING, "object": {"const": "response"}, "created_at": _INTEGER,
        "status": _STRING, "model": _STRING, "output": _array(_OBJECT),
        "usage": _object({"input_tokens": _INTEGER, "output_tokens": _INTEGER,
                          "total_tokens": _INTEGER,
                          "input_tokens_details": _object({"cached_tokens": _INTEGER})}),
    }),
    "/v1/messages": _object({
        "id": _STRING, "type": {"const": "message"}, "role": {"const": "assistant"},
        "model": _STRING, "content": _array(_object({"type": _STRING})),
        "stop_reason": _nullable(_STRING),
        "usage": _object({"input_tokens": _INTEGER, "output_tokens": _INTEGER,
                          "cache_creation_input_tokens": _INTEGER,
                          "cache_read_input_tokens": _INTEGER}),
    }),
    "/v1/messages/count_tokens": _object({"input_tokens": _INTEGER}),
    "/v1/models": _object({"object": {"const": "list"}, "data": _array(_MODEL)}),
    "/v1/models/{model_id}": _MODEL,
    "/tokenize": _object({"count": _INTEGER, "max_model_len": _INTEGER,
                          "tokens": _array(_INTEGER)}),
    "/detokenize": _object({"prompt": _STRING}),
    "/tokenizer_info": _object({"tokenizer_class": _STRING}),
    "/health": _object({"status": _STRING}),
    "/metrics": _STRING,
    "/v1/cache/warm": _object({"object": {"const": "cache.warm"}, "prompt_tokens": _INTEGER,
                               "cached_tokens": _INTEGER, "cache_write_tokens": _INTEGER,
                               "pinned_tokens": _INTEGER,
                               "ttl_s": _nullable(_NUMBER)}),
    "/v1/cache/pins": _object({"object": {"const": "list"}, "data": _array(_PIN)}),
    "/v1/cache/pins/{pin_id}": _object({"id": _STRING, "deleted": {"type": "boolean"}}),
    "/reset_prefix_cache": _object({"reset": {"type": "boolean"}, "pins_released": _INTEGER}),
    "/cache/purge": _object({"tenant": _STRING, "domain": _STRING, "removed": _OBJECT}),
}
_STREAMED = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
# one server-sent event of a streamed answer (OpenAPI 3.1: a stream's schema describes each event);
# ``data`` is a JSON chunk, or ``[DONE]`` at the end of an OpenAI stream
_EVENT = _object({"data": _STRING}, event=_STRING, id=_STRING)

# the statuses each route answers besides 200 and those every route shares (below)
_ERRORS: dict[str, tuple[int, ...]] = {
    "/v1/completions": (429,),
    "/v1/chat/completions": (429,),
    "/v1/responses": (429,),
    "/v1/messages": (429,),
    "/v1/cache/warm": (429,),
    "/v1/models/{model_id}": (404,),
    "/v1/cache/pins/{pin_id}": (404,),
    "/reset_prefix_cache": (403, 409),
    "/cache/purge": (403, 404, 503),
    "/metrics": (403,),
    "/health": (503,),
}
# what one answer lets a client call next (OpenAPI links; stateful fuzzers follow them)
_LINKS: dict[tuple[str, str], JSONObject] = {
    ("/v1/cache/warm", "post"): {"ListPins": {"operationId": "pins"}},
    ("/v1/cache/pins", "get"): {"DeletePin": {
        "operationId": "delete_pin", "parameters": {"pin_id": "$response.body#/data/0/id"}}},
}
_DESCRIPTIONS = {400: "invalid request", 401: "missing or invalid API key",
                 403: "the key may not do this", 404: "no such object",
                 409: "conflicts with the server's state", 413: "the body is over the limit",
                 429: "the queue is full: retry later", 503: "not available now"}
_SUMMARY = ("An OpenAI- and Anthropic-compatible LLM server with a content-addressed prefix cache "
            "(prefixcache).")
_KEYS: list[JSONObject] = [{"bearer": []}, {"x-api-key": []}]


def _statuses(path: str, operation: JSONObject) -> list[int]:
    found = list(_ERRORS.get(path, ()))
    if path != "/health":
        found.append(401)  # anonymous callers, where a tenants file is given
    if "requestBody" in operation:
        found += [400, 413]  # every body is validated, and over the limit is refused
    return sorted(set(found))


def _one_model(components: JSONObject, model: str) -> None:
    """Every request's ``model`` is the one model this server serves."""
    for body in components.get("schemas", {}).values():
        field = body.get("properties", {}).get("model")
        if field is not None:
            body["properties"]["model"] = {"type": "string", "enum": [model],
                                           "title": field.get("title", "Model")}


def _complete(schema: JSONObject, model: str) -> JSONObject:
    components = schema.setdefault("components", {})
    _one_model(components, model)
    components.setdefault("schemas", {}).update(
        {"OpenAIError": _OPENAI_ERROR, "AnthropicError": _ANTHROPIC_ERROR})
    for name in ("HTTPValidationError", "ValidationError"):
        components["schemas"].pop(name, None)
    components["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer"},
        "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
    }
    for path, operations in schema["paths"].items():
        error_ref = {"$ref": "#/components/schemas/"
                     + ("AnthropicError" if is_anthropic_path(path) else "OpenAIError")}
        for method, operation in operations.items():
            if method == "head":  # the GET route's name is the GET's id
                operation["operationId"] += "_head"
            answers = operation.setdefault("responses", {})
            answers.pop("422", None)
            media = "text/plain" if path == "/metrics" else "application/json"
            content = {media: {"schema": _ANSWERS.get(path, _OBJECT)}}
            if path in _STREAMED:
                content["text/event-stream"] = {"schema": _EVENT}
            answers["200"] = {"description": "the answer", "content": content}
            if (path, method) in _LINKS:
                answers["200"]["links"] = _LINKS[path, method]
            for status in _statuses(path, operation):
                answers[str(status)] = {"description": _DESCRIPTIONS[status],
                                        "content": {"application/json": {"schema": error_ref}}}
            operation["security"] = [] if path == "/health" else _KEYS
    return schema


def operation_id(route: APIRoute) -> str:
    """A route's operation id: its function's name (``completions``, ``chat``, ``messages``)."""
    return route.name


def install_openapi(app: FastAPI, model: str) -> None:
    """Serve the completed description at ``/openapi.json`` (built once, on first request) for
    a server of ``model``; ``app`` is made with ``generate_unique_id_function=operation_id``."""

    def openapi() -> JSONObject:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # GET and HEAD share a route: ids fixed below
                warnings.filterwarnings("ignore", "Duplicate Operation ID")
                base = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                   description=_SUMMARY)
            app.openapi_schema = _complete(base, model)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
