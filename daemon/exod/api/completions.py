"""OpenAI's legacy text completions (``POST /v1/completions``): a raw prompt, no chat template."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator, model_validator
from sse_starlette import EventSourceResponse, ServerSentEvent

from exod import generated as g
from exod.api.chat import LENIENT, MAX_CHOICES, MAX_MESSAGE_CHARS, Guided, StreamOptions, Text, stop_list
from exod.api.errors import ApiError, responses
from exod.api.generation import Generation, Output, Usage, event_stream, sse, usage
from exod.controller import Controller
from exod.requests import RequestFailed


class CompletionRequest(Guided):
    """Accepted but not enforced: ``suffix`` (no model here fills in the middle), ``best_of`` equal to ``n``."""

    model_config = LENIENT

    model: Text = Field(..., min_length=1, max_length=200)
    prompt: Text | list[Text] | list[int] = Field(..., description="a string, or a list of token ids")
    max_tokens: int | None = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    suffix: Text | None = None
    user: Text | None = Field(None, max_length=256)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str] | list[int]) -> str | list[int]:
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            if len(value) != 1:
                raise ValueError("one prompt per request: send a string (or a list of one)")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, str) and len(value) > MAX_MESSAGE_CHARS:
            raise ValueError(f"at most {MAX_MESSAGE_CHARS} characters")
        return value  # type: ignore[return-value]

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        return stop_list(value)

    @model_validator(mode="after")
    def _echo_needs_text(self) -> CompletionRequest:
        if self.echo and not isinstance(self.prompt, str):
            raise ValueError("echo needs the prompt as text")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported: each choice is a sample of its own")
        return self


def router(controller: Controller, metrics: Any, max_tokens_ceiling: int) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/completions", response_model=None, responses=responses(400, 404, 429, 502, 503))
    async def complete(body: CompletionRequest) -> JSONResponse | EventSourceResponse:
        generation = Generation(controller, metrics, body.model, prompt="prompt", constraint=body.guided_param)
        max_tokens = body.max_tokens or 16
        if max_tokens > max_tokens_ceiling:
            raise generation.rejected(
                ApiError(400, f"max_tokens must be at most {max_tokens_ceiling}", param="max_tokens")
            )
        prompt = {"prompt_text": body.prompt} if isinstance(body.prompt, str) else {"prompt_tokens": body.prompt}
        streams = await generation.start(
            body.n,
            **prompt,
            max_tokens=max_tokens,
            seed=body.seed,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=body.stop,
            logprobs=body.logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=body.logit_bias or None,
            grammar=body.guided(),
        )
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time())}
        head["model"] = body.model
        echo = body.prompt if body.echo and isinstance(body.prompt, str) else ""

        if not body.stream:
            outputs = await generation.outputs()
            choices = [
                {
                    "index": i,
                    "text": echo + o.text,
                    "logprobs": _legacy_logprobs(o.logprobs, len(echo)) if body.logprobs is not None else None,
                    "finish_reason": _finish(o),
                }
                for i, o in enumerate(outputs)
            ]
            return JSONResponse(head | {"choices": choices, "usage": usage(outputs).openai()})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> ServerSentEvent:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return sse(head | {"choices": [choice]})

        async def events() -> AsyncIterator[ServerSentEvent]:
            dones: list[g.Done] = []
            try:
                for index, stream in enumerate(streams):
                    if echo:
                        yield chunk(index, echo)
                    async for item in generation.pieces(stream):
                        if isinstance(item, g.Token) and (item.text or item.chosen is not None):
                            logprobs = _legacy_logprobs([item], 0) if body.logprobs is not None else None
                            yield chunk(index, item.text, logprobs=logprobs)
                        elif isinstance(item, g.Done):
                            dones.append(item)
                            yield chunk(index, "", _finish(Output(done=item)))
                generation.record("ok", sum(d.completion_tokens for d in dones))
                if include_usage:
                    yield sse(head | {"choices": [], "usage": Usage.of(dones).openai()})
            except RequestFailed as exc:
                generation.record("error")
                yield sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
            finally:
                generation.close()
            yield sse("[DONE]")

        return event_stream(events())

    return api


def _finish(output: Output) -> str:
    reason = output.finish_reason
    return "stop" if reason == g.FinishReason.TOOL_CALLS.value else reason  # no tools here


def _legacy_logprobs(tokens: list[g.Token], offset: int) -> dict[str, Any]:
    """The legacy shape: parallel lists of tokens, their log-probabilities, the likeliest others, offsets."""
    chosen = [t for t in tokens if t.chosen is not None]
    offsets, at = [], offset
    for t in chosen:
        assert t.chosen is not None
        offsets.append(at)
        at += len(t.chosen.text)
    return {
        "tokens": [t.chosen.text for t in chosen if t.chosen],
        "token_logprobs": [t.chosen.logprob for t in chosen if t.chosen],
        "top_logprobs": [{a.text: a.logprob for a in t.top_logprobs or []} for t in chosen],
        "text_offset": offsets,
    }
