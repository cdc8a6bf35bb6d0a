"""OpenAI-compatible chat completions: the request and response shapes users' clients already speak."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from exod import generated as g
from exod.api.errors import ApiError, responses
from exod.api.generation import (
    Generation,
    Held,
    Output,
    ToolCall,
    Usage,
    event_stream,
    openai_logprobs,
    sse,
    usage,
)
from exod.api.sse import EventStream
from exod.controller import Controller
from exod.host.models import ModelCard
from exod.requests import REQUIRED, RequestFailed

MAX_MESSAGES = 256
MAX_MESSAGE_CHARS = 100_000
MAX_CHOICES = 8  # n: each choice is a request of its own

# Known fields are strict (OpenAI refuses `"max_tokens": "5"` and `"stream": 1`, and so does exod, naming the
# field); unknown ones are ignored, as OpenAI's own server and mlx_lm.server do, so that clients sending
# parameters exod has no use for (`store`, `metadata`, `service_tier`, …) are served.
LENIENT = ConfigDict(extra="ignore", strict=True)

# Content parts a chat message may carry; only text reaches a text model.
_TEXT_PARTS = ("text", "input_text")


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


def stop_list(value: str | list[str] | None, most: int = 4) -> list[str]:
    """OpenAI's ``stop`` (or Anthropic's ``stop_sequences``): a string or a list, as a list."""
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > most or any(not s or len(s) > 200 for s in stops):
        raise ValueError(f"up to {most} non-empty strings of at most 200 characters")
    return [unicode_text(s) for s in stops]


def text_of(parts: list[dict[str, Any]]) -> str:
    """The text of a message's content parts; any other part (an image, audio, a file) is refused."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValueError(
                f"content part of type {kind!r} is not supported: exod serves text models; send text parts "
                '({"type": "text", "text": ...}) or a string'
            )
        texts.append(unicode_text(part["text"]))
    return "".join(texts)


class FunctionCall(BaseModel):
    model_config = LENIENT

    name: Text = Field(..., min_length=1, max_length=64)
    arguments: Text = Field("{}", max_length=MAX_MESSAGE_CHARS)


class ToolCallItem(BaseModel):
    model_config = LENIENT

    id: Text | None = Field(None, max_length=200)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = LENIENT

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: the legacy tool
    content: Text | list[dict[str, Any]] | None = None
    name: Text | None = Field(None, max_length=64)
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: Text | None = Field(None, max_length=200)
    function_call: FunctionCall | None = None  # legacy: an assistant's one call, before tool_calls

    @field_validator("content")
    @classmethod
    def _content(cls, value: str | list[dict[str, Any]] | None) -> str | None:
        text = text_of(value) if isinstance(value, list) else value
        if text is not None and len(text) > MAX_MESSAGE_CHARS:
            raise ValueError(f"at most {MAX_MESSAGE_CHARS} characters")
        return text

    @model_validator(mode="after")
    def _said_something(self) -> ChatMessage:
        if self.function_call is not None and not self.tool_calls:  # the legacy call as the one tool call it is
            self.tool_calls = [ToolCallItem(id=f"call_{self.function_call.name}", function=self.function_call)]
        if self.role == "function" and self.name is None:
            raise ValueError("a function message needs the name of the function it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (OpenAI's ``developer`` is the templates' ``system``; a legacy
        ``function`` result is a ``tool`` message answering the call of that name)."""
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        message: dict[str, Any] = {"role": role, "content": self.content}
        if self.role == "function":
            message["tool_call_id"] = f"call_{self.name}"
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _args(c)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _args(call: ToolCallItem) -> Any:
    """A call's arguments as templates expect them: the object (most write it with ``tojson``), else the text."""
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


class FunctionDef(BaseModel):
    model_config = LENIENT

    name: Text = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: Text | None = Field(None, max_length=MAX_MESSAGE_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = LENIENT

    type: Literal["function"]
    function: FunctionDef

    def for_template(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(BaseModel):
    model_config = LENIENT

    name: Text


class NamedToolChoice(BaseModel):
    model_config = LENIENT

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = LENIENT

    name: Text | None = Field(None, max_length=64)
    schema_: dict[str, Any] | bool = Field(..., alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = LENIENT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response format needs json_schema.schema")
        return self

    def grammar(self) -> dict[str, Any] | None:
        return format_grammar(self.type, None if self.json_schema is None else self.json_schema.schema_)


def format_grammar(kind: str, schema: dict[str, Any] | bool | None) -> dict[str, Any] | None:
    """A response format as the constraint on the output (`exod.runner.grammar`): any JSON object, or JSON
    of the schema; None for plain text."""
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    return {"json_schema": schema} if kind == "json_schema" and schema is not None else None


_GUIDED = ("guided_json", "guided_regex", "guided_grammar")


class Guided(BaseModel):
    """vLLM's extensions that constrain the output, on chat and completions: at most one of them."""

    model_config = LENIENT

    guided_json: dict[str, Any] | None = None  # a JSON schema
    guided_regex: Text | None = Field(None, max_length=MAX_MESSAGE_CHARS)
    guided_grammar: Text | None = Field(None, max_length=MAX_MESSAGE_CHARS)  # llguidance's Lark

    @model_validator(mode="after")
    def _one(self) -> Guided:
        given = [f for f in _GUIDED if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(f"one constraint at a time, got {given}")
        return self

    def guided(self) -> dict[str, Any] | None:
        if self.guided_json is not None:
            return {"json_schema": self.guided_json}
        if self.guided_regex is not None:
            return {"regex": self.guided_regex}
        if self.guided_grammar is not None:
            return {"lark": self.guided_grammar}
        return None

    @property
    def guided_param(self) -> str:
        return next((f for f in _GUIDED if getattr(self, f) is not None), "")


class StreamOptions(BaseModel):
    model_config = LENIENT

    include_usage: bool = False


class ChatRequest(Guided):
    """OpenAI's chat completion request. ``tool_choice``: ``none`` leaves the tools out of the template;
    ``required`` or a named function makes the prompt begin the call (`exod.runner.output.forced_call`), whose
    arguments are then held to the tool's schema; ``response_format`` (and vLLM's ``guided_*``) hold the
    output to a schema (`exod.runner.grammar`). Accepted but not enforced: ``parallel_tool_calls``."""

    model_config = LENIENT

    model: Text = Field(..., min_length=1, max_length=200)
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: Text | None = Field(None, max_length=256)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    functions: list[FunctionDef] | None = Field(None, max_length=128)  # legacy: tools, before there were others
    function_call: Literal["none", "auto"] | NamedFunction | None = None  # legacy: tool_choice

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        return stop_list(value)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases lie in [-100, 100], got {bias} for token {key}")
        return value

    @model_validator(mode="after")
    def _logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.response_format is not None and self.response_format.grammar() and self.guided() is not None:
            raise ValueError("response_format and a guided_* constraint at once: send one of them")
        return self

    def grammar(self) -> dict[str, Any] | None:
        return self.response_format.grammar() if self.response_format is not None else self.guided()

    @property
    def constraint_param(self) -> str:
        """What a constraint that cannot be compiled is named by: its parameter, or the tools of a forced call."""
        if self.guided_param:
            return self.guided_param
        return "response_format" if self.response_format is not None and self.response_format.grammar() else "tools"

    @model_validator(mode="after")
    def _legacy_functions(self) -> ChatRequest:
        """``functions`` and ``function_call`` are the tools they became; the answer then speaks the legacy
        shape too (`legacy`)."""
        if self.functions is None and self.function_call is None:
            return self
        if self.tools is not None or self.tool_choice is not None:
            raise ValueError("send tools and tool_choice, or the legacy functions and function_call, not both")
        self.tools = [Tool(type="function", function=f) for f in self.functions or []]
        choice = self.function_call
        self.tool_choice = (
            NamedToolChoice(type="function", function=choice) if isinstance(choice, NamedFunction) else choice
        )
        return self

    @property
    def legacy(self) -> bool:
        """Asked with ``functions``: a call comes back as ``function_call``, ``finish_reason: function_call``."""
        return self.functions is not None

    def options(self) -> dict[str, Any]:
        """What the runners are asked besides the messages (`exod.runner.protocol.Generate`)."""
        tools = [t.for_template() for t in self.tools or []] if self.tool_choice != "none" else []
        forced = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        return {
            "tool_choice": REQUIRED if self.tool_choice == "required" else forced,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "stop": self.stop,
            "tools": tools or None,
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "logit_bias": self.logit_bias or None,
            "grammar": self.grammar(),
        }


def router(controller: Controller, metrics: Any, max_tokens_ceiling: int) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model(m, controller.model_card(m)) for m in controller.placed_models()]}

    @api.get("/v1/models/{model_id:path}", responses=responses(404))
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in controller.placed_models():
            raise ApiError(
                404,
                f"model {model_id!r} is not placed here: GET /v1/models lists those that are",
                param="model",
                code="model_not_found",
            )
        return _model(model_id, controller.model_card(model_id))

    @api.post("/v1/chat/completions", response_model=None, responses=responses(400, 404, 429, 502, 503))
    async def chat(body: ChatRequest, request: Request) -> JSONResponse | EventStream:
        max_tokens = body.max_completion_tokens or body.max_tokens or min(256, max_tokens_ceiling)
        generation = Generation(controller, metrics, body.model, constraint=body.constraint_param)
        if max_tokens > max_tokens_ceiling:
            raise generation.rejected(
                ApiError(400, f"max_tokens must be at most {max_tokens_ceiling}", param="max_tokens")
            )
        streams = await generation.start(
            body.n,
            messages=[m.for_template() for m in body.messages],
            max_tokens=max_tokens,
            seed=body.seed,
            **body.options(),
        )
        completion_id = f"chatcmpl-{secrets.token_hex(12)}"
        created = int(time.time())
        head = {"id": completion_id, "created": created, "model": body.model}

        if not body.stream:
            outputs = await generation.outputs()
            return JSONResponse(
                head
                | {
                    "object": "chat.completion",
                    "choices": [_choice(i, o, body.logprobs, legacy=body.legacy) for i, o in enumerate(outputs)],
                    "usage": usage(outputs).openai(),
                }
            )

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
            choice = {"index": index, "delta": delta, "finish_reason": finish}
            if body.logprobs:
                choice["logprobs"] = logprobs
            return sse(head | {"object": "chat.completion.chunk", "choices": [choice]})

        async def events() -> AsyncIterator[bytes]:
            dones: list[g.Done] = []
            held = Held()  # a choice's role waits for its first token, its finish for what follows
            try:
                for index, stream in enumerate(streams):  # choice by choice; each chunk says its index
                    if due := held.due(stream):
                        yield due
                    held.add(chunk(index, {"role": "assistant", "content": ""}), said=False)
                    calls = 0
                    async for item in generation.pieces(stream):
                        match item:
                            case g.Token(text=text) if text or item.chosen is not None:
                                logprobs = {"content": openai_logprobs([item])} if item.chosen else None
                                held.add(chunk(index, {"content": text}, logprobs=logprobs))
                            case ToolCall():
                                function = {"name": item.name, "arguments": item.arguments}
                                call = {"index": calls, "id": item.id, "type": "function", "function": function}
                                delta = {"function_call": function} if body.legacy else {"tool_calls": [call]}
                                held.add(chunk(index, delta))
                                calls += 1
                            case g.Done():
                                dones.append(item)
                                finish = _finish_reason(item.finish_reason.value, body.legacy)
                                held.add(chunk(index, {}, finish), said=False)
                        if due := held.due(stream):
                            yield due
                generation.record("ok", sum(d.completion_tokens for d in dones))
                if include_usage:
                    counted = Usage.of(dones).openai()
                    held.add(sse(head | {"object": "chat.completion.chunk", "choices": [], "usage": counted}))
            except RequestFailed as exc:
                generation.record("error")
                held.add(sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}}))
            finally:
                generation.close()  # the client went away mid-stream: cancelled (no-op when recorded)
            yield held.take() + sse("[DONE]")

        return event_stream(events())

    return api


def _model(model_id: str, card: ModelCard) -> dict[str, Any]:
    """OpenAI's model object; ``context_length`` as vLLM's ``max_model_len`` and OpenRouter's name it, for
    clients that size a conversation to the model (null where this node cannot read the model's files)."""
    described = {"id": model_id, "object": "model", "created": card.created, "owned_by": "exod"}
    return described | {"context_length": card.context_length, "max_model_len": card.context_length}


def _finish_reason(reason: str, legacy: bool) -> str:
    return "function_call" if legacy and reason == "tool_calls" else reason


def _choice(index: int, output: Output, logprobs: bool | None, *, legacy: bool = False) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": output.text or (None if output.tool_calls else "")}
    if output.tool_calls and legacy:  # the legacy shape holds one call: the first
        first = output.tool_calls[0]
        message["function_call"] = {"name": first.name, "arguments": first.arguments}
    elif output.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in output.tool_calls
        ]
    return {
        "index": index,
        "message": message,
        "finish_reason": _finish_reason(output.finish_reason, legacy),
        "logprobs": {"content": openai_logprobs(output.logprobs)} if logprobs else None,
    }
