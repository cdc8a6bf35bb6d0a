"""Anthropic's Messages API (``POST /v1/messages``), which Claude Code and Anthropic's SDKs speak.

Translated to the chat template's terms: ``system`` is the system turn; ``tool_use`` blocks are the
assistant's tool calls; ``tool_result`` blocks are ``tool`` turns; tools' ``input_schema`` is their
parameters; ``tool_choice`` ``any`` or ``tool`` makes the prompt begin the call. Accepted but not enforced:
``thinking``, ``metadata``; the ``anthropic-version`` and ``anthropic-beta`` headers are read by no one.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator

from exod import generated as g
from exod.api.chat import LENIENT, MAX_MESSAGE_CHARS, MAX_MESSAGES, Text, stop_list, unicode_text
from exod.api.errors import ApiError, responses
from exod.api.generation import Generation, Held, Output, ToolCall, event_stream, sse
from exod.api.sse import EventStream
from exod.controller import Controller
from exod.requests import REQUIRED, RequestFailed

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicMessage(BaseModel):
    model_config = LENIENT

    role: Literal["user", "assistant"]
    content: Text | list[dict[str, Any]]


class AnthropicTool(BaseModel):
    model_config = LENIENT

    name: Text = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: Text | None = Field(None, max_length=MAX_MESSAGE_CHARS)
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class MessagesRequest(BaseModel):
    model_config = LENIENT

    model: Text = Field(..., min_length=1, max_length=200)
    max_tokens: int = Field(..., ge=1)
    messages: list[AnthropicMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    system: Text | list[dict[str, Any]] | None = None
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[AnthropicTool] | None = Field(None, max_length=128)
    tool_choice: dict[str, Any] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        return stop_list(value)

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat templates take it (OpenAI's message shapes)."""
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": _text(self.system, "system")})
        for i, message in enumerate(self.messages):
            out += _turn(message, f"messages.{i}.content")
        return out

    def forced_tool(self) -> str | None:
        """``any``: some tool must be called; ``tool``: that one (`exod.runner.output.forced_call`)."""
        choice = self.tool_choice or {}
        if choice.get("type") == "any":
            return REQUIRED
        return str(choice["name"]) if choice.get("type") == "tool" and choice.get("name") else None

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or (self.tool_choice or {}).get("type") == "none":
            return None
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
            }
            for t in self.tools
        ]


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ApiError(400, f"{where}: only text blocks are supported here, got {block.get('type')!r}", param=where)
        texts.append(unicode_text(block["text"]))
    return "".join(texts)


def _turn(message: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: tool results become ``tool`` turns, tool uses the tool calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in message.content:
        match block.get("type"):
            case "text" if isinstance(block.get("text"), str):
                texts.append(unicode_text(block["text"]))
            case "tool_use" if message.role == "assistant":
                function = {"name": str(block.get("name", "")), "arguments": block.get("input", {})}
                calls.append({"id": block.get("id"), "type": "function", "function": function})
            case "tool_result" if message.role == "user":
                content = block.get("content", "")
                text = content if isinstance(content, str) else _text(content, where)
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
            case "thinking" | "redacted_thinking":
                continue  # a model that thought aloud: nothing for the template
            case other:
                raise ApiError(
                    400,
                    f"{where}: a {message.role} block of type {other!r} is not supported here "
                    "(text, tool_use from the assistant, tool_result from the user)",
                    param=where,
                )
    turns = list(results)
    if calls:
        turns.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
    elif texts or not results:
        turns.append({"role": message.role, "content": "".join(texts)})
    return turns


def router(controller: Controller, metrics: Any, max_tokens_ceiling: int) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/messages", response_model=None, responses=responses(400, 404, 429, 502, 503, anthropic=True))
    async def messages(body: MessagesRequest) -> JSONResponse | EventStream:
        generation = Generation(controller, metrics, body.model)
        if body.max_tokens > max_tokens_ceiling:
            raise generation.rejected(
                ApiError(400, f"max_tokens must be at most {max_tokens_ceiling}", param="max_tokens")
            )
        [stream] = await generation.start(
            messages=body.chat_messages(),
            max_tokens=body.max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=body.stop_sequences,
            tools=body.chat_tools(),
            tool_choice=body.forced_tool(),
            top_k=body.top_k or 0,
        )
        message_id = f"msg_{secrets.token_hex(12)}"
        head = {"id": message_id, "type": "message", "role": "assistant", "model": body.model}

        if not body.stream:
            [output] = await generation.outputs()
            return JSONResponse(head | _message(output))

        async def events() -> AsyncIterator[bytes]:
            index = 0
            text_open = False
            start = head | {"content": [], "stop_reason": None, "stop_sequence": None}
            start["usage"] = {"input_tokens": 0, "output_tokens": 0}
            # the message's start goes out with the first text, a block's start with its first delta, the last
            # block's stop with the message's
            held = Held(sse({"type": "message_start", "message": start}, "message_start"))
            try:
                async for item in generation.pieces(stream):
                    match item:
                        case g.Token(text=text) if text:
                            if not text_open:
                                block = {"type": "content_block_start", "index": index}
                                held.add(sse(block | {"content_block": {"type": "text", "text": ""}}, block["type"]))
                                text_open = True
                            delta = {"type": "text_delta", "text": text}
                            held.add(
                                sse(
                                    {"type": "content_block_delta", "index": index, "delta": delta},
                                    "content_block_delta",
                                )
                            )
                        case ToolCall():
                            if text_open:
                                held.add(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
                                index, text_open = index + 1, False
                            use = {"type": "tool_use", "id": _tool_use_id(item), "name": item.name, "input": {}}
                            delta = {"type": "input_json_delta", "partial_json": item.arguments}
                            held.add(
                                sse(
                                    {"type": "content_block_start", "index": index, "content_block": use},
                                    "content_block_start",
                                ),
                                sse(
                                    {"type": "content_block_delta", "index": index, "delta": delta},
                                    "content_block_delta",
                                ),
                                sse({"type": "content_block_stop", "index": index}, "content_block_stop"),
                            )
                            index += 1
                        case g.Done():
                            if text_open:
                                block_stop = sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                                held.add(block_stop, said=False)
                            stop = {"stop_reason": _stop_reason(item), "stop_sequence": item.stop_sequence}
                            counted = _usage(item)
                            held.add(
                                sse({"type": "message_delta", "delta": stop, "usage": counted}, "message_delta"),
                                sse({"type": "message_stop"}, "message_stop"),
                                said=False,
                            )
                            generation.record("ok", item.completion_tokens)
                    if due := held.due(stream):
                        yield due
            except RequestFailed as exc:
                generation.record("error")
                held.add(sse({"type": "error", "error": {"type": "api_error", "message": str(exc)}}, "error"))
            finally:
                generation.close()
            if rest := held.take():
                yield rest

        return event_stream(events())

    return api


def _message(output: Output) -> dict[str, Any]:
    assert output.done is not None
    content: list[dict[str, Any]] = [{"type": "text", "text": output.text}] if output.text else []
    content += [
        {"type": "tool_use", "id": _tool_use_id(c), "name": c.name, "input": _input(c.arguments)}
        for c in output.tool_calls
    ]
    return {
        "content": content,
        "stop_reason": _stop_reason(output.done),
        "stop_sequence": output.done.stop_sequence,
        "usage": _usage(output.done),
    }


def _usage(done: g.Done) -> dict[str, int]:
    """Anthropic's count: ``input_tokens`` are those not read from the prompt cache, which are counted apart."""
    return {
        "input_tokens": done.prompt_tokens - done.cached_tokens,
        "cache_read_input_tokens": done.cached_tokens,
        "output_tokens": done.completion_tokens,
    }


def _stop_reason(done: g.Done) -> str:
    if done.stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS[done.finish_reason.value]


def _tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}  # what the model wrote, if not JSON
