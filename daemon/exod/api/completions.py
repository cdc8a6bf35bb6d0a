"""OpenAI's legacy text completions (``POST /v1/completions``): a raw prompt, no chat template."""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator, model_validator

from exod import generated as g
from exod.api.chat import LENIENT, MAX_CHOICES, MAX_MESSAGE_CHARS, Guided, StreamOptions, Text, stop_list
from exod.api.errors import ApiError, responses
from exod.api.generation import Generation, Held, Output, Usage, event_stream, gathered, sse, usage
from exod.api.sse import EventStream
from exod.controller import Controller
from exod.requests import RequestFailed

MAX_PROMPTS = 64  # prompts in one request (evaluation harnesses send a batch); n choices each


class CompletionRequest(Guided):
    """OpenAI's legacy completions, as evaluation harnesses use them too: several prompts (text or token ids),
    ``echo`` with the prompt's own log-probabilities, ``max_tokens: 0`` to score a prompt and generate
    nothing. Accepted but not enforced: ``suffix`` (no model here fills in the middle), ``best_of`` equal to
    ``n``."""

    model_config = LENIENT

    model: Text = Field(..., min_length=1, max_length=200)
    prompt: Text | list[Text] | list[int] | list[list[int]] = Field(
        ..., description="a string, strings, token ids, or lists of token ids: one prompt each"
    )
    max_tokens: int | None = Field(16, ge=0)
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
    def _prompts(cls, value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
        if isinstance(value, str) or (value and all(isinstance(v, int) for v in value)):
            value = [value]  # type: ignore[list-item]
        if not value:
            raise ValueError("no prompt: send a string, or a list of them")
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
        for i, prompt in enumerate(value):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if isinstance(prompt, str) and len(prompt) > MAX_MESSAGE_CHARS:
                raise ValueError(f"prompt {i}: at most {MAX_MESSAGE_CHARS} characters")
        return value  # type: ignore[return-value]

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        return stop_list(value)

    @model_validator(mode="after")
    def _choices(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported: each choice is a sample of its own")
        if len(self.prompt) * self.n > 4 * MAX_PROMPTS:
            raise ValueError(f"at most {4 * MAX_PROMPTS} choices (prompts × n) per request")
        return self

    def submits(self) -> list[dict[str, Any]]:
        """Each prompt as the request book takes it."""
        return [{"prompt_text": p} if isinstance(p, str) else {"prompt_tokens": p} for p in self.prompt]  # type: ignore[union-attr]


def router(controller: Controller, metrics: Any, max_tokens_ceiling: int) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/completions", response_model=None, responses=responses(400, 404, 429, 502, 503))
    async def complete(body: CompletionRequest) -> JSONResponse | EventStream:
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens > max_tokens_ceiling:
            refused = ApiError(400, f"max_tokens must be at most {max_tokens_ceiling}", param="max_tokens")
            raise Generation(controller, metrics, body.model).rejected(refused)
        common = {
            "max_tokens": max_tokens,
            "seed": body.seed,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "stop": body.stop,
            "logprobs": body.logprobs,
            "presence_penalty": body.presence_penalty or 0.0,
            "frequency_penalty": body.frequency_penalty or 0.0,
            "logit_bias": body.logit_bias or None,
            "grammar": body.guided(),
        }
        if body.echo:  # the prompt as the model read it, scored where log-probabilities are asked for
            common |= {"echo_prompt": True, "prompt_logprobs": body.logprobs}
        submits = [common | prompt for prompt in body.submits()]
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time())}
        head["model"] = body.model

        def generation() -> Generation:
            return Generation(controller, metrics, body.model, prompt="prompt", constraint=body.guided_param)

        if not body.stream:

            async def complete_one(i: int) -> list[Output]:
                one = generation()
                await one.start(body.n, **submits[i])
                return await one.outputs()

            done = await gathered(controller, [functools.partial(complete_one, i) for i in range(len(submits))], body.n)
            choices = [
                _choice(i * body.n + j, body, body.prompt[i], output)
                for i, outputs in enumerate(done)
                for j, output in enumerate(outputs)
            ]
            counted = [usage(outputs) for outputs in done]
            total = Usage(sum(u.prompt for u in counted), sum(u.completion for u in counted))
            return JSONResponse(head | {"choices": choices, "usage": total.openai()})

        first = generation()  # refused before the stream begins: an HTTP error, like any request's
        first_streams = await first.start(body.n, **submits[0])
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> bytes:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return sse(head | {"choices": [choice]})

        async def events() -> AsyncIterator[bytes]:
            counted: list[Usage] = []
            current = first
            held = Held()  # a choice's finish goes out with what follows it: the next text, or the usage and [DONE]
            try:
                for i in range(len(submits)):  # prompt by prompt, each started as the one before ends
                    if i:
                        if done := held.take():  # the next prompt may wait for a runner: what is done goes out first
                            yield done
                        current = generation()
                        streams = await current.start(body.n, **submits[i])
                    else:
                        streams = first_streams
                    dones: list[g.Done] = []
                    for j, stream in enumerate(streams):
                        index = i * body.n + j
                        if due := held.due(stream):
                            yield due
                        async for item in current.pieces(stream):
                            if isinstance(item, g.Prompt):
                                text = body.prompt[i] if isinstance(body.prompt[i], str) else item.text
                                logprobs = _prompt_logprobs(item, text) if body.logprobs is not None else None
                                held.add(chunk(index, text, logprobs=logprobs))
                            elif isinstance(item, g.Token) and (item.text or item.chosen is not None):
                                logprobs = _legacy_logprobs([item], 0) if body.logprobs is not None else None
                                held.add(chunk(index, item.text, logprobs=logprobs))
                            elif isinstance(item, g.Done):
                                dones.append(item)
                                held.add(chunk(index, "", _finish(Output(done=item))), said=False)
                            if due := held.due(stream):
                                yield due
                    current.record("ok", sum(d.completion_tokens for d in dones))
                    counted.append(Usage.of(dones))
                if include_usage:
                    total = Usage(sum(u.prompt for u in counted), sum(u.completion for u in counted))
                    held.add(sse(head | {"choices": [], "usage": total.openai()}))
            except (RequestFailed, ApiError) as exc:
                current.record("error")
                message = exc.message if isinstance(exc, ApiError) else str(exc)
                held.add(sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}}))
            finally:
                current.close()
            yield held.take() + sse("[DONE]")

        return event_stream(events())

    return api


def _choice(index: int, body: CompletionRequest, prompt: str | list[int], output: Output) -> dict[str, Any]:
    """One choice: the echoed prompt (its text as sent, or the model's reading of token ids) and the text."""
    echo = ""
    if body.echo and output.prompt is not None:
        echo = prompt if isinstance(prompt, str) else output.prompt.text
    logprobs = None
    if body.logprobs is not None:
        logprobs = _legacy_logprobs(output.logprobs, len(echo))
        if body.echo and output.prompt is not None:
            logprobs = _joined(_prompt_logprobs(output.prompt, echo), logprobs)
    return {"index": index, "text": echo + output.text, "logprobs": logprobs, "finish_reason": _finish(output)}


def _prompt_logprobs(prompt: g.Prompt, text: str) -> dict[str, Any]:
    """The echoed prompt's part of the legacy shape: its tokens, their log-probabilities (the first has none:
    nothing precedes it), the likeliest others, offsets."""
    chosen = prompt.logprobs or [None] * len(prompt.tokens)
    top = prompt.top_logprobs or [[] for _ in prompt.tokens]
    offsets, at, tokens = [], 0, []
    for a in chosen:
        offsets.append(at)
        piece = "" if a is None else a.text
        tokens.append(piece)
        at += len(piece)
    if chosen and chosen[0] is None:  # the first token's own text: what the rest does not account for
        first = text[: max(0, len(text) - sum(len(t) for t in tokens[1:]))]
        tokens[0] = first
        offsets = [0] + [o + len(first) for o in offsets[1:]]
    return {
        "tokens": tokens,
        "token_logprobs": [None if a is None else a.logprob for a in chosen],
        "top_logprobs": [None] + [{a.text: a.logprob for a in row} for row in top[1:]],
        "text_offset": offsets,
    }


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + then[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


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
