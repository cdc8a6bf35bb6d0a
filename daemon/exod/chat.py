"""OpenAI-compatible chat completions: the request and response shapes users' clients already speak."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from exod import protocol as p
from exod.controller import Controller
from exod.drain import unavailable
from exod.errors import ApiError, responses
from exod.requests import (
    InstanceNotFound,
    InvalidRequest,
    ModelNotReady,
    Overloaded,
    QueueTimeout,
    RequestFailed,
    ShuttingDown,
)

MAX_MESSAGES = 256
MAX_MESSAGE_CHARS = 100_000

# Strict: OpenAI refuses `"max_tokens": "5"` and `"stream": 1`; so does exod, rather than guess what was meant.
_REQUEST = ConfigDict(extra="forbid", strict=True)


def unicode_text(value: str) -> str:
    """Refuse a lone surrogate (JSON lets a client write ``"\\ud800"``): the runner's UTF-8 channel, the
    log and the metrics labels cannot carry it, so it is the client's 400, not the daemon's 500."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains a lone surrogate ({value[exc.start]!r}) at character {exc.start}; send valid Unicode text"
        ) from None
    return value


Text = Annotated[str, AfterValidator(unicode_text)]


class ChatMessage(BaseModel):
    model_config = _REQUEST

    role: Literal["system", "user", "assistant"]
    content: Text = Field(..., max_length=MAX_MESSAGE_CHARS)


class StreamOptions(BaseModel):
    model_config = _REQUEST

    include_usage: bool = False


class ChatRequest(BaseModel):
    """The subset of OpenAI's request that exod honours; anything else is refused, not ignored."""

    model_config = _REQUEST

    model: Text = Field(..., min_length=1, max_length=200)
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    user: Text | None = Field(None, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s or len(s) > 200 for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings of at most 200 characters")
        return [unicode_text(s) for s in stops]


def router(controller: Controller, metrics: Any, max_tokens_ceiling: int) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        seen = controller.placed_models()
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": 0, "owned_by": "exod"} for m in seen],
        }

    @api.post("/v1/chat/completions", response_model=None, responses=responses(400, 404, 429, 502, 503))
    async def chat(body: ChatRequest, request: Request) -> JSONResponse | StreamingResponse:
        max_tokens = body.max_completion_tokens or body.max_tokens or min(256, max_tokens_ceiling)

        def rejected(error: ApiError) -> ApiError:
            metrics.requests.labels(body.model, f"rejected_{error.status}").inc()
            return error

        if max_tokens > max_tokens_ceiling:
            raise rejected(ApiError(400, f"max_tokens must be at most {max_tokens_ceiling}", param="max_tokens"))
        try:
            instance_id = controller.requests.pick(body.model)
            stream = controller.requests.submit(
                instance_id,
                [m.model_dump() for m in body.messages],
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                seed=body.seed,
                stop=body.stop,  # type: ignore[arg-type]  # normalised to a list by the validator
            )
        except InstanceNotFound as exc:
            raise rejected(ApiError(404, str(exc), param="model", code="model_not_found")) from exc
        except ModelNotReady as exc:
            raise rejected(ApiError(503, str(exc), headers={"Retry-After": str(exc.retry_after)})) from exc
        except InvalidRequest as exc:
            raise rejected(ApiError(400, str(exc), param="messages")) from exc
        except Overloaded as exc:
            raise rejected(ApiError(429, str(exc), headers={"Retry-After": "1"}, code="rate_limit_exceeded")) from exc
        except ShuttingDown as exc:
            raise rejected(unavailable(str(exc))) from exc
        try:  # errors before the first token are still real HTTP errors, streaming or not
            await stream.wait_forwarded()
        except QueueTimeout as exc:
            stream.close()
            raise rejected(ApiError(503, str(exc), headers={"Retry-After": "1"})) from exc
        except BaseException:
            stream.close()
            raise
        started = time.monotonic()
        completion_id = f"chatcmpl-{secrets.token_hex(12)}"
        created = int(time.time())

        recorded = False

        def done(outcome: str, completion_tokens: int = 0) -> None:
            nonlocal recorded
            if recorded:
                return
            recorded = True
            metrics.requests.labels(body.model, outcome).inc()
            metrics.latency.labels(body.model).observe(time.monotonic() - started)
            metrics.tokens.labels(body.model).inc(completion_tokens)

        if not body.stream:
            text, final = [], None
            try:
                async for item in stream:
                    if isinstance(item, p.Token):
                        text.append(item.text)
                    else:
                        final = item
                assert final is not None
                done("ok", final.completion_tokens)
            except ShuttingDown as exc:
                done("error")
                raise unavailable(str(exc)) from exc  # 503, not 502: nothing failed
            except RequestFailed as exc:
                done("error")
                raise ApiError(502, str(exc), error_type="server_error") from exc
            finally:
                done("cancelled")  # no-op when an outcome was recorded
                stream.close()
            return JSONResponse(
                {
                    "id": completion_id,
                    "object": "chat.completion",
                    "created": created,
                    "model": body.model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "".join(text)},
                            "finish_reason": final.finish_reason.value,
                        }
                    ],
                    "usage": _usage(final),
                }
            )

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            doc = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            return f"data: {json.dumps(doc)}\n\n"

        async def events() -> AsyncIterator[str]:
            try:
                yield chunk({"role": "assistant", "content": ""})
                async for item in stream:
                    if isinstance(item, p.Token):
                        if item.text:
                            yield chunk({"content": item.text})
                    else:
                        yield chunk({}, item.finish_reason.value)
                        if include_usage:
                            usage = {
                                "id": completion_id,
                                "object": "chat.completion.chunk",
                                "created": created,
                                "model": body.model,
                                "choices": [],
                                "usage": _usage(item),
                            }
                            yield f"data: {json.dumps(usage)}\n\n"
                        done("ok", item.completion_tokens)
            except RequestFailed as exc:
                done("error")
                error = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}}
                yield f"data: {json.dumps(error)}\n\n"
            finally:
                done("cancelled")  # the client went away mid-stream (no-op when an outcome was recorded)
                stream.close()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return api


def _usage(final: p.Done) -> dict[str, int]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }
