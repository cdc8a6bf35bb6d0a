"""One generation as every API dialect needs it: submitted to the request book with its errors mapped to HTTP
(the same in OpenAI's chat, completions and Responses, and in Anthropic's Messages), its outcome counted in
the metrics once, and its output collected or streamed as text, tool calls and log-probabilities.

The dialects (`exod.api.chat`, `exod.api.completions`, `exod.api.responses_api`, `exod.api.messages`) only
translate shapes.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import attrs
import trio

import fsm
from exod import generated as g
from exod.api.drain import unavailable
from exod.api.errors import ApiError
from exod.api.instances import refused, unstored
from exod.api.sse import EventStream
from exod.api.sse import event as sse_event
from exod.controller import Controller, StoreUnavailable
from exod.placer import PlacementRefused
from exod.requests import (
    ConstraintRejected,
    ContextExceeded,
    InstanceNotFound,
    InvalidRequest,
    ModelNotReady,
    Overloaded,
    PoisonRequest,
    PromptRejected,
    QueueTimeout,
    RequestFailed,
    RequestStream,
    ShuttingDown,
)

log = logging.getLogger("exod.requests")
T = TypeVar("T")


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@attrs.define
class Output:
    """All one generation said, once it finished."""

    text: str = ""
    tool_calls: list[ToolCall] = attrs.Factory(list)
    logprobs: list[g.Token] = attrs.Factory(list)  # the tokens that carry their log-probabilities
    done: g.Done | None = None
    prompt: g.Prompt | None = None  # the prompt as the model read it, where asked (``echo_prompt``)
    embedding: g.Embedding | None = None  # the prompt's embedding, where asked (``embed``)

    @property
    def finish_reason(self) -> str:
        assert self.done is not None
        return self.done.finish_reason.value


def context_exceeded(exc: ContextExceeded, prompt: str) -> ApiError:
    """A prompt over the context, in the words clients look for to trim and retry: OpenAI's code and sentence
    (litellm's `ContextWindowExceededError` reads "maximum context length"; LangChain's `ContextOverflowError`
    the code, which recent openai clients leave out of the exception's text, or "prompt is too long"), and
    Anthropic's."""
    return ApiError(
        400,
        f"This model's maximum context length is {exc.context} tokens. However, your {prompt} resulted in "
        f"{exc.prompt_tokens} tokens: the prompt is too long, with no room left for the completion. Please reduce "
        f"the length of the {prompt}.",
        param=prompt,
        code="context_length_exceeded",
        anthropic=f"prompt is too long: {exc.prompt_tokens} tokens > {exc.context - 1} maximum",
    )


def call_id(prefix: str = "call") -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class Generation:
    """One API request's generations (``n`` of them) and its metrics, recorded once whatever happens."""

    def __init__(
        self, controller: Controller, metrics: Any, model: str, *, prompt: str = "messages", constraint: str = ""
    ) -> None:
        self.controller, self.metrics, self.model = controller, metrics, model
        self.prompt = prompt  # the dialect's name for what the prompt is made of, named by its errors
        self.constraint = constraint  # … and for what constrains the output (response_format, format …)
        self.streams: list[RequestStream] = []
        self.embedding = False  # an input's embedding, not a generation: counted apart in the metrics
        self.started = time.monotonic()
        self._recorded = False

    async def start(self, n: int = 1, **submit: Any) -> list[RequestStream]:
        """Queue ``n`` generations (``submit``: `exod.requests.RequestBook.submit`'s arguments) and wait until
        runners took them. Errors before the first token are HTTP errors, streaming or not."""
        self.embedding = bool(submit.get("embed"))
        try:
            await self.controller.requests.vet(submit.get("grammar"), submit.get("tools"), submit.get("tool_choice"))
            instance_id = await self.controller.requests.serving(self.model)  # placed now, if on demand
            cold = self.controller.residency(instance_id) is not fsm.Residency.LOADED
            seed = submit.pop("seed", None)
            for i in range(n):
                each = None if seed is None else seed + i  # n samples, not one sample n times
                self.streams.append(self.controller.requests.submit(instance_id, seed=each, **submit))
        except InstanceNotFound as exc:
            raise self.rejected(ApiError(404, str(exc), param="model", code="model_not_found")) from exc
        except PlacementRefused as exc:  # placed on demand, and refused
            raise self.rejected(refused(exc)) from exc
        except StoreUnavailable as exc:  # placed on demand, not stored yet
            raise self.rejected(unstored(exc)) from exc
        except ModelNotReady as exc:
            raise self.rejected(ApiError(503, str(exc), headers={"Retry-After": str(exc.retry_after)})) from exc
        except ConstraintRejected as exc:
            raise self.rejected(ApiError(400, str(exc), param=self.constraint or None)) from exc
        except PoisonRequest as exc:
            raise self.rejected(ApiError(400, str(exc), param=self.param(exc.param), code="poison_request")) from exc
        except InvalidRequest as exc:
            raise self.rejected(ApiError(400, str(exc), param=self.param(exc.param))) from exc
        except Overloaded as exc:
            busy = ApiError(429, str(exc), headers={"Retry-After": "1"}, code="rate_limit_exceeded")
            raise self.rejected(busy) from exc
        except ShuttingDown as exc:
            raise self.rejected(unavailable(str(exc))) from exc
        finally:
            if len(self.streams) < n:  # a later one was refused: the earlier ones are not wanted
                self.close()
        try:
            for stream in self.streams:
                await stream.started()
        except QueueTimeout as exc:
            self.close()
            raise self.rejected(ApiError(503, str(exc), headers={"Retry-After": "1"})) from exc
        except ContextExceeded as exc:
            self.close()
            raise self.rejected(context_exceeded(exc, self.prompt)) from exc
        except ConstraintRejected as exc:
            self.close()
            raise self.rejected(ApiError(400, str(exc), param=self.constraint or None)) from exc
        except PromptRejected as exc:
            self.close()
            raise self.rejected(ApiError(400, str(exc), param=self.param(exc.param))) from exc
        except ShuttingDown as exc:
            self.close()
            raise self.rejected(unavailable(str(exc))) from exc
        except RequestFailed as exc:
            self.close()
            raise self.rejected(ApiError(502, str(exc), error_type="server_error")) from exc
        except BaseException:
            self.close()
            raise
        if cold:  # it waited for its instance to load (placed on demand, or unparked)
            self.metrics.cold_starts.labels(self.metrics.label(self.model)).observe(self.elapsed)
        return self.streams

    def param(self, field: str | None) -> str:
        """The request's field at fault, in the dialect's words: the runner's ``prompt_tokens`` is what the
        dialect calls the prompt (``prompt``, ``input``, ``messages``)."""
        return field if field is not None and field != "prompt_tokens" else self.prompt

    async def collect(self, stream: RequestStream) -> Output:
        """The whole output of one generation; `ApiError` (502, or 503 when shutting down) if it failed."""
        output = Output()
        try:
            async for item in self.pieces(stream):
                self.take(output, item)
        except ShuttingDown as exc:
            self.record("error")
            raise unavailable(str(exc)) from exc  # 503, not 502: nothing failed
        except RequestFailed as exc:
            self.record("error")
            raise ApiError(502, str(exc), error_type="server_error") from exc
        return output

    async def outputs(self) -> list[Output]:
        """Every generation's whole output, counted in the metrics; the streams closed whatever happens."""
        try:
            outputs = [await self.collect(stream) for stream in self.streams]
            self.finished(outputs)
            return outputs
        finally:
            self.close()

    async def pieces(
        self, stream: RequestStream
    ) -> AsyncIterator[g.Token | ToolCall | g.Done | g.Prompt | g.Embedding]:
        """The output as it comes: tokens (text and log-probabilities), tool calls with their ids, the end.
        `RequestFailed` ends it early (the dialect says so in its own words)."""
        async for item in stream:
            if isinstance(item, g.Done):
                self.metrics.finished(self.model, item, embedded=self.embedding)
            yield ToolCall(call_id(), item.name, item.arguments) if isinstance(item, g.ToolCall) else item

    def finished(self, outputs: list[Output]) -> None:
        self.record("ok", sum(o.done.completion_tokens for o in outputs if o.done is not None))

    def record(self, outcome: str, completion_tokens: int = 0) -> None:
        if self._recorded:
            return
        self._recorded = True
        ids = ", ".join(s.request_id for s in self.streams)
        log.debug("%s [%s]: %s, %d tokens, %.3f s", self.model, ids, outcome, completion_tokens, self.elapsed)
        model = self.metrics.label(self.model)
        self.metrics.requests.labels(model, outcome).inc()
        self.metrics.latency.labels(model).observe(self.elapsed)
        self.metrics.tokens.labels(model).inc(completion_tokens)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def close(self) -> None:
        """The caller is done (or went away): whatever was not recorded was cancelled."""
        self.record("cancelled")  # no-op when an outcome was recorded
        for stream in self.streams:
            stream.close()

    def rejected(self, error: ApiError) -> ApiError:
        """Count ``error`` as this request's outcome, and return it to raise."""
        self._recorded = True
        log.debug("%s: rejected %d: %s", self.model, error.status, error.message)
        self.metrics.requests.labels(self.metrics.label(self.model), f"rejected_{error.status}").inc()
        return error

    @staticmethod
    def take(output: Output, item: g.Token | ToolCall | g.Done | g.Prompt | g.Embedding) -> None:
        """Fold one piece of a generation into its whole ``output``."""
        match item:
            case g.Token():
                output.text += item.text
                if item.chosen is not None:
                    output.logprobs.append(item)
            case ToolCall():
                output.tool_calls.append(item)
            case g.Done():
                output.done = item
            case g.Prompt():
                output.prompt = item
            case g.Embedding():
                output.embedding = item


@attrs.frozen
class Usage:
    """Tokens of ``n`` generations of one prompt: the prompt is counted once, ``cached`` of it came from the
    prompt cache (a conversation's earlier turn)."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0

    @classmethod
    def of(cls, dones: list[g.Done]) -> Usage:
        if not dones:
            return cls()
        return cls(dones[0].prompt_tokens, sum(d.completion_tokens for d in dones), dones[0].cached_tokens)

    def openai(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }


def usage(outputs: list[Output]) -> Usage:
    return Usage.of([o.done for o in outputs if o.done is not None])


def openai_logprobs(tokens: list[g.Token]) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: each token, its log-probability and bytes, and the likeliest others."""

    def entry(alt: g.Alternative) -> dict[str, Any]:
        return {"token": alt.text, "logprob": alt.logprob, "bytes": list(alt.text.encode())}

    return [
        entry(t.chosen) | {"top_logprobs": [entry(a) for a in t.top_logprobs or []]}
        for t in tokens
        if t.chosen is not None
    ]


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event (``event:`` for the dialects that name them: Anthropic's, Responses')."""
    return sse_event(data if isinstance(data, str) else json.dumps(data), event)


class Held:
    """What a streamed answer has made of the output and not written yet. It goes out when something was said
    and the next piece must be waited for (`RequestStream.ready`): what came together (tokens, a last token
    and its end) is one write, not one each. What says nothing alone (a chat's role, a message's start, a
    choice's finish) waits for what follows it."""

    def __init__(self, *parts: bytes) -> None:
        self._parts = list(parts)
        self._said = False

    def add(self, *parts: bytes, said: bool = True) -> None:
        self._parts += parts
        self._said = self._said or said

    def due(self, stream: RequestStream) -> bytes:
        """All that is held if it is time to write it, else nothing."""
        return self.take() if self._said and not stream.ready else b""

    def take(self) -> bytes:
        """All that is held, now (the answer's end, or a wait on something other than the stream)."""
        parts, self._parts, self._said = self._parts, [], False
        return b"".join(parts)


def event_stream(events: AsyncIterator[bytes]) -> EventStream:
    """The response that streams ``events`` (the client going away closes the stream, whose ``finally``
    then counts the request as cancelled)."""
    return EventStream(events)


async def gathered(controller: Controller, jobs: list[Callable[[], Awaitable[T]]], each: int = 1) -> list[T]:
    """The results of ``jobs`` (one call's prompts: its inputs to embed, its prompts to complete), in order,
    run a few at a time: each takes ``each`` of the instance's request slots, and together they take at most
    half of them (`[limits] max_requests_per_instance`), so that a long list waits its turn instead of being
    refused as over the bound, and other clients keep room. The first error is the call's."""
    slots = max(1, controller.config.max_requests_per_instance // (2 * each))
    limiter = trio.CapacityLimiter(slots)
    results: list[Any] = [None] * len(jobs)

    async def run(i: int) -> None:
        async with limiter:
            results[i] = await jobs[i]()

    try:
        async with trio.open_nursery() as nursery:
            for i in range(len(jobs)):
                nursery.start_soon(run, i)
    except* ApiError as group:
        raise group.exceptions[0] from None
    return results
