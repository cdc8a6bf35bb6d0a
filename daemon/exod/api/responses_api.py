"""OpenAI's Responses API (``POST /v1/responses``), stateless: every request carries the whole conversation.

``input`` is a string or items (messages, ``function_call`` and ``function_call_output``); ``instructions``
is the system turn; ``tool_choice`` ``required`` or a named function makes the prompt begin the call;
``text.format`` holds the output to JSON or a schema (`exod.runner.grammar`). Refused with a clear 400:
``previous_response_id`` (nothing is stored). Accepted but not enforced: ``parallel_tool_calls``, ``store``,
``reasoning``, ``metadata``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, model_validator

from exod import generated as g
from exod.api.chat import LENIENT, MAX_MESSAGE_CHARS, MAX_MESSAGES, Text, format_grammar, text_of
from exod.api.errors import ApiError, responses
from exod.api.generation import Generation, Held, Output, ToolCall, event_stream, sse
from exod.api.sse import EventStream
from exod.controller import Controller
from exod.requests import REQUIRED, RequestFailed

_ROLES = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


class FunctionTool(BaseModel):
    model_config = LENIENT

    type: Literal["function"]
    name: Text = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: Text | None = Field(None, max_length=MAX_MESSAGE_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON of a schema (the output held to it)."""

    model_config = LENIENT

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Text | None = Field(None, max_length=64)
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs its schema")
        return self

    def grammar(self) -> dict[str, Any] | None:
        return format_grammar(self.type, self.schema_)


class TextOptions(BaseModel):
    model_config = LENIENT

    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(BaseModel):
    model_config = LENIENT

    model: Text = Field(..., min_length=1, max_length=200)
    # each member its own bound: on the union, `max_length` held a string to 256 characters too
    input: (
        Annotated[Text, Field(max_length=MAX_MESSAGE_CHARS)]
        | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]
    )
    instructions: Text | None = Field(None, max_length=MAX_MESSAGE_CHARS)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    previous_response_id: Text | None = None
    text: TextOptions | None = None

    @model_validator(mode="after")
    def _stateless(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise ValueError(
                "previous_response_id: exod stores no responses; send the whole conversation in input instead"
            )
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            out += _item(item, f"input.{i}", out)
        return out

    def forced_tool(self) -> str | None:
        """``required``: some tool must be called; a named function: that one (`exod.runner.output.forced_call`)."""
        if self.tool_choice == "required":
            return REQUIRED
        if isinstance(self.tool_choice, dict) and self.tool_choice.get("type") == "function":
            return str(self.tool_choice.get("name") or "") or None
        return None

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [
            {"type": "function", "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)}
            for t in self.tools
        ]


def _item(item: dict[str, Any], where: str, before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One input item as chat messages (a function call joins the assistant turn just before it)."""
    kind = item.get("type", "message")
    if kind == "message" and item.get("role") in _ROLES:
        content = item.get("content", "")
        if isinstance(content, list):
            parts = [{"type": "text", "text": c.get("text")} if c.get("type") in _TEXT_PARTS else c for c in content]
            try:
                content = text_of(parts)
            except ValueError as exc:
                raise ApiError(400, f"{where}.content: {exc}", param=f"{where}.content") from None
        return [{"role": _ROLES[item["role"]], "content": content}]
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function"}
        call["function"] = {"name": str(item.get("name", "")), "arguments": item.get("arguments", "{}")}
        if before and before[-1]["role"] == "assistant":
            before[-1].setdefault("tool_calls", []).append(call)
            return []
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        output = item.get("output", "")
        return [{"role": "tool", "tool_call_id": item.get("call_id"), "content": str(output)}]
    if kind == "reasoning":
        return []
    raise ApiError(
        400,
        f"{where}: items of type {kind!r} are not supported here (messages, function_call, function_call_output)",
        param=where,
    )


def router(controller: Controller, metrics: Any, max_tokens_ceiling: int) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/responses", response_model=None, responses=responses(400, 404, 429, 502, 503))
    async def respond(body: ResponsesRequest) -> JSONResponse | EventStream:
        grammar = body.text.format.grammar() if body.text is not None else None
        generation = Generation(
            controller, metrics, body.model, prompt="input", constraint="text.format" if grammar else "tools"
        )
        max_tokens = body.max_output_tokens or min(256, max_tokens_ceiling)
        if max_tokens > max_tokens_ceiling:
            raise generation.rejected(
                ApiError(400, f"max_output_tokens must be at most {max_tokens_ceiling}", param="max_output_tokens")
            )
        [stream] = await generation.start(
            messages=body.chat_messages(),
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            tools=body.chat_tools(),
            tool_choice=body.forced_tool(),
            grammar=grammar,
        )
        shell = _shell(body)

        if not body.stream:
            [output] = await generation.outputs()
            return JSONResponse(_finished(shell, output))

        async def events() -> AsyncIterator[bytes]:
            number = 0

            def event(kind: str, **data: Any) -> bytes:
                nonlocal number
                number += 1
                return sse({"type": kind, "sequence_number": number - 1, **data}, kind)

            output = Output()
            message_id, in_text, index = "", {}, 0
            held = Held()  # a token's delta is one event; the first's comes with the response's and message's starts
            try:
                held.add(
                    event("response.created", response=shell | {"status": "in_progress"}),
                    event("response.in_progress", response=shell | {"status": "in_progress"}),
                )
                text_open = False
                async for item in generation.pieces(stream):
                    match item:
                        case g.Token(text=text) if text:
                            if not text_open:
                                message_id = f"msg_{secrets.token_hex(12)}"
                                message = _message_item(message_id, "", done=False)
                                held.add(event("response.output_item.added", output_index=index, item=message))
                                part = {"type": "output_text", "text": "", "annotations": []}
                                in_text = {"item_id": message_id, "output_index": index, "content_index": 0}
                                held.add(event("response.content_part.added", **in_text, part=part))
                                text_open = True
                            output.text += text
                            held.add(event("response.output_text.delta", **in_text, delta=text, logprobs=[]))
                        case ToolCall():
                            if text_open:
                                held.add(*_text_done(event, message_id, index, output.text))
                                index, text_open = index + 1, False
                            output.tool_calls.append(item)
                            call = _call_item(item, "in_progress") | {"arguments": ""}
                            in_call = {"item_id": call["id"], "output_index": index}
                            held.add(
                                event("response.output_item.added", output_index=index, item=call),
                                event("response.function_call_arguments.delta", **in_call, delta=item.arguments),
                                event("response.function_call_arguments.done", **in_call, arguments=item.arguments),
                                event("response.output_item.done", output_index=index, item=_call_item(item)),
                            )
                            index += 1
                        case g.Done():
                            output.done = item
                    if due := held.due(stream):
                        yield due
                if text_open:
                    held.add(*_text_done(event, message_id, index, output.text))
                if output.done is not None:
                    generation.finished([output])
                    held.add(event("response.completed", response=_finished(shell, output, message_id)))
            except RequestFailed as exc:
                generation.record("error")
                failed = shell | {"status": "failed", "error": {"code": "server_error", "message": str(exc)}}
                held.add(event("response.failed", response=failed))
            finally:
                generation.close()
            yield held.take()

        return event_stream(events())

    return api


def _text_done(event: Any, message_id: str, index: int, text: str) -> list[bytes]:
    """The events that close a message item of text."""
    where = {"item_id": message_id, "output_index": index, "content_index": 0}
    part = {"type": "output_text", "text": text, "annotations": []}
    return [
        event("response.output_text.done", **where, text=text, logprobs=[]),
        event("response.content_part.done", **where, part=part),
        event("response.output_item.done", output_index=index, item=_message_item(message_id, text)),
    ]


def _shell(body: ResponsesRequest) -> dict[str, Any]:
    """The response object before any output: what was asked."""
    return {
        "id": f"resp_{secrets.token_hex(12)}",
        "object": "response",
        "created_at": int(time.time()),
        "model": body.model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "text": {
            "format": (body.text.format if body.text else TextFormat()).model_dump(by_alias=True, exclude_none=True)
        },
        "metadata": {},
    }


def _message_item(message_id: str, text: str, *, done: bool = True) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if done else []
    status = "completed" if done else "in_progress"
    return {"type": "message", "id": message_id, "status": status, "role": "assistant", "content": content}


def _call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def _finished(shell: dict[str, Any], output: Output, message_id: str | None = None) -> dict[str, Any]:
    assert output.done is not None
    items = [_message_item(message_id or f"msg_{secrets.token_hex(12)}", output.text)] if output.text else []
    items += [_call_item(c) for c in output.tool_calls]
    cut = output.done.finish_reason is g.FinishReason.LENGTH
    prompt, completion, cached = output.done.prompt_tokens, output.done.completion_tokens, output.done.cached_tokens
    return shell | {
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": items,
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
    }
