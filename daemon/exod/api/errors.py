"""HTTP errors in OpenAI's shape, so an OpenAI client reports them as it would OpenAI's own.

The OpenAPI document says the same as the wire: every error an operation can send is listed with this
shape (`ErrorBody`), and FastAPI's default 422 (which this API never sends) is replaced by the 400 it does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

# OpenAI's own names: everything a client got wrong is an invalid_request_error.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_LOCATIONS = {"body", "query", "header", "path", "cookie"}  # FastAPI's first `loc` part: not part of the name


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _union_member(part: object) -> bool:
    """pydantic names the member of a union that failed in the error's place (``str``, ``list[...]``,
    ``function-after[...]``): not part of the parameter's name."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS)


def _encodable(text: str) -> str:
    """``text`` with anything UTF-8 cannot encode (a lone surrogate from a JSON ``\\ud800``) written as an escape,
    so that echoing a client's bad input back can never turn a 400 into a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class Answered(Exception):
    """Raised through a route whose answer is already complete, to end it there (a HEAD's headers are sent:
    `exod.api.middleware.HeadAsGet`); the error handlers let it pass unlogged."""


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
        anthropic: str | None = None,
    ) -> None:
        message = _encodable(message)
        self.anthropic = anthropic  # the message in Anthropic's words, where they differ from OpenAI's
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.param = None if param is None else _encodable(param)
        self.error_type = error_type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def response(self, path: str = "") -> JSONResponse:
        """OpenAI's error shape; Anthropic's on its Messages API (``path``), Ollama's on its API: the one each
        dialect's clients read."""
        if path.startswith(OLLAMA_PATHS):
            body: dict[str, Any] = {"error": self.message}
        elif path.startswith(ANTHROPIC_PATHS):
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
            message = self.message if self.anthropic is None else self.anthropic
            body = {"type": "error", "error": {"type": kind, "message": message}}
        else:
            body = {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


ANTHROPIC_PATHS = ("/v1/messages",)
OLLAMA_PATHS = ("/api/",)
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error response: OpenAI's shape."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Every error response of Anthropic's Messages API: its shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class OllamaErrorBody(BaseModel):
    """Every error response of Ollama's API: its shape."""

    error: str


def responses(*statuses: int, anthropic: bool = False, ollama: bool = False) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of an operation that can send these error statuses (in Anthropic's or Ollama's shape)."""
    body = AnthropicErrorBody if anthropic else OllamaErrorBody if ollama else ErrorBody
    return {status: {"model": body, "description": HTTPStatus(status).phrase} for status in statuses}


def install(app: FastAPI, *, everywhere: Callable[[str], tuple[int, ...]] = lambda _path: ()) -> None:
    """Answer every error in OpenAI's shape, and say so in the OpenAPI document.

    ``everywhere(path)`` names the statuses a middleware can send on ``path`` before any route runs (401, 413):
    routes cannot declare those themselves.
    """

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return ApiError(exc.status_code, message, headers=dict(exc.headers or {})).response(request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, Answered):  # nothing went wrong; the response below is never sent
            return JSONResponse({}, status_code=200)
        logging.getLogger("exod.api").exception("unhandled error")
        error = ApiError(500, f"internal error ({type(exc).__name__}); see the daemon's log")
        return error.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its place is a character offset, not a parameter
            return ApiError(400, _json_error(first, exc.body)).response(request.url.path)
        loc = [part for part in first.get("loc", ()) if not _union_member(part)]
        if loc and loc[0] in _LOCATIONS:
            loc = loc[1:]
        where = ".".join(str(part) for part in loc)
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return ApiError(400, message, param=where or None).response(request.url.path)

    plain_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _documented(plain_openapi(), everywhere)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the document


def _json_error(error: dict[str, Any], body: object) -> str:
    """Where a body is not JSON, as an editor shows it: line and column."""
    offset = next((part for part in error.get("loc", ()) if isinstance(part, int)), None)
    why = error.get("ctx", {}).get("error", "invalid JSON")
    if offset is None or not isinstance(body, str | bytes):
        return f"the request body is not valid JSON: {why}"
    text = body if isinstance(body, str) else body.decode("utf-8", "replace")
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"the request body is not valid JSON: {why} at line {line}, column {column}"


def _documented(schema: dict[str, Any], everywhere: Callable[[str], tuple[int, ...]]) -> dict[str, Any]:
    """FastAPI's document with 422 (never sent) replaced by 400, and the middleware's statuses added."""
    bodies = [(ErrorBody, "serialization"), (AnthropicErrorBody, "serialization"), (OllamaErrorBody, "serialization")]
    _, defs = models_json_schema(bodies, ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs["$defs"])
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, operations in schema.get("paths", {}).items():
        shape = (
            "AnthropicErrorBody"
            if path.startswith(ANTHROPIC_PATHS)
            else "OllamaErrorBody"
            if path.startswith(OLLAMA_PATHS)
            else "ErrorBody"
        )
        error = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}}
        for operation in operations.values():
            answers = operation.setdefault("responses", {})
            statuses = [400] if answers.pop("422", None) is not None else []
            for status in (*statuses, *everywhere(path)):
                answers.setdefault(str(status), {"description": HTTPStatus(status).phrase, **error})
    return schema
