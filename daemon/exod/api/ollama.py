"""Ollama's API, as its clients use it: ``/api/chat`` and ``/api/generate`` (streamed as NDJSON unless asked not
to; generate's ``context`` returned and taken back), ``/api/embed`` and the legacy ``/api/embeddings``,
``/api/tags`` (the models served and those of this node's cache), ``/api/show``, ``/api/ps``, ``/api/version``.
Pull, delete, copy, create and push: `exod.api.ollama_models`.

Many desktop apps and editor plugins speak only Ollama. Like the other dialects this translates shapes only;
errors are Ollama's ``{"error": "..."}`` (`exod.api.errors`). A model may be named as Ollama users write it:
without its organisation (``tiny-qwen2``) where exactly one served model has that name (several: a 400 that
names them), and with a ``:latest`` tag.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import trio
from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, field_validator

import fsm
from exod import generated as g
from exod.api.chat import LENIENT, MAX_MESSAGE_CHARS, MAX_MESSAGES, Text, stop_list
from exod.api.embeddings import embed, not_honoured
from exod.api.errors import ApiError, responses
from exod.api.generation import Generation, Held, Output, ToolCall
from exod.api.instances import refused, unstored
from exod.config import DEFAULT, Default, keep_alive
from exod.controller import Controller, StoreUnavailable
from exod.host.model_store import local_models
from exod.host.models import ModelCard
from exod.host.packaged import packaged
from exod.placer import InstanceBusy, PlacementRefused
from exod.requests import InstanceNotFound, ModelNotReady, RequestFailed, RequestStream

log = logging.getLogger("exod.ollama")

MAX_CONTEXT_IDS = 1 << 17  # a context's token ids: more than any model here reads
API_VERSION = "0.6.0"  # the Ollama API this speaks, for clients that check it before using a feature


class OllamaOptions(BaseModel):
    """The sampling options exod has; Ollama's others (num_ctx, repeat_penalty, mirostat …) are ignored."""

    model_config = LENIENT

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    num_predict: int | None = Field(None, ge=-2)  # -1: until the end (here: the ceiling), -2: fill the context
    stop: list[Text] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str]:
        return stop_list(value)

    def sampling(self, ceiling: int) -> dict[str, Any]:
        predict = self.num_predict
        return {
            "max_tokens": ceiling if predict is None or predict < 0 else min(max(predict, 1), ceiling),
            "temperature": 0.8 if self.temperature is None else self.temperature,  # Ollama's default
            "top_p": 0.9 if self.top_p is None else self.top_p,
            "top_k": 40 if self.top_k is None else self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
        }


class OllamaFunctionCall(BaseModel):
    model_config = LENIENT

    name: Text = Field(..., min_length=1, max_length=64)
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(BaseModel):
    model_config = LENIENT

    function: OllamaFunctionCall


class OllamaMessage(BaseModel):
    model_config = LENIENT

    role: Literal["system", "user", "assistant", "tool"]
    content: Text = Field("", max_length=MAX_MESSAGE_CHARS)
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: Text | None = Field(None, max_length=64)

    def for_template(self, where: str) -> dict[str, Any]:
        if self.images:
            raise ApiError(400, f"{where}.images: exod serves text models; send text only", param=f"{where}.images")
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": f"call_{c.function.name}", "type": "function", "function": c.function.model_dump()}
                for c in self.tool_calls
            ]
        if self.role == "tool" and self.tool_name:
            message["tool_call_id"], message["name"] = f"call_{self.tool_name}", self.tool_name
        return message


class OllamaTool(BaseModel):
    model_config = LENIENT

    type: Literal["function"] = "function"
    function: dict[str, Any]


class _Request(BaseModel):
    model_config = LENIENT

    model: Text = Field(..., min_length=1, max_length=200)
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    stream: bool = True  # Ollama streams unless told not to
    format: Literal["json", ""] | dict[str, Any] | None = None  # the output held to JSON, or to this schema
    keep_alive: float | str | None = None  # how long the model stays loaded after this request (0: unload now)

    def kept(self) -> float | Default | None:
        """The request's keep-alive (`exod.config.keep_alive`), or `DEFAULT`: its instance's own."""
        if self.keep_alive is None:
            return DEFAULT
        try:
            return keep_alive(self.keep_alive)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="keep_alive") from exc

    def grammar(self) -> dict[str, Any] | None:
        if self.format == "json":
            return {"json_schema": {"type": "object"}}
        return {"json_schema": self.format} if isinstance(self.format, dict) else None


class OllamaChatRequest(_Request):
    messages: list[OllamaMessage] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: list[OllamaTool] | None = Field(None, max_length=128)

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.for_template(f"messages.{i}") for i, m in enumerate(self.messages)]


class OllamaGenerateRequest(_Request):
    prompt: Text = Field("", max_length=MAX_MESSAGE_CHARS)
    system: Text | None = Field(None, max_length=MAX_MESSAGE_CHARS)
    raw: bool = False  # the prompt as it is, no chat template
    images: list[str] | None = None
    context: list[int] | None = Field(None, max_length=MAX_CONTEXT_IDS)  # a previous answer's: the talk so far


class OllamaEmbedRequest(BaseModel):
    model_config = LENIENT

    model: Text = Field(..., min_length=1, max_length=200)
    input: Text | list[Text] = Field(..., description="a string, or strings")
    truncate: bool = True  # Ollama's default; here an input over the context is refused, never cut
    dimensions: int | None = Field(None, ge=1)
    keep_alive: float | str | None = None


class OllamaEmbeddingsRequest(BaseModel):
    """The legacy ``/api/embeddings`` (the ollama client's ``embeddings()``, many RAG tools): one prompt."""

    model_config = LENIENT

    model: Text = Field(..., min_length=1, max_length=200)
    prompt: Text = Field("", max_length=MAX_MESSAGE_CHARS)
    options: dict[str, Any] | None = None  # Ollama's model options: nothing here changes an embedding
    keep_alive: float | str | None = None


class ShowRequest(BaseModel):
    model_config = LENIENT

    model: Text | None = Field(None, max_length=200)
    name: Text | None = Field(None, max_length=200)  # older clients send the model under this name


class AmbiguousModel(ValueError):
    """A name without its organisation that more than one served model has: which one is meant is not guessed."""


def resolve(name: str, served: list[str]) -> str:
    """The served model that ``name`` means, as Ollama users write one; ``name`` itself if none does (the
    request then says which are served). `AmbiguousModel` if several do. A tag other than ``latest`` is part of
    the name (``llama3:mine``: ``llama3-mine``, as `exod.api.ollama_models` names a copy), and a packaged model's
    short name (``smollm2``) is the model it is pulled as."""
    base, _, tag = name.partition(":")
    bare = base if tag in ("", "latest") else f"{base}-{tag}"
    if (shipped := packaged(bare)) is not None:
        return shipped.model_id
    if bare in served or "/" in bare:
        return bare
    matches = [m for m in served if m.rsplit("/", 1)[-1] == bare]
    if len(matches) > 1:
        raise AmbiguousModel(
            f"model {name!r} is ambiguous: {', '.join(matches)} are served here; "
            "name the one you mean with its organisation (org/name)"
        )
    return matches[0] if matches else bare


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _details(card: ModelCard) -> dict[str, Any]:
    family = card.model_type or "unknown"
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": family,
        "families": [family],
        "parameter_size": "",
        "quantization_level": "",
    }


def _listed(model_id: str, card: ModelCard) -> dict[str, Any]:
    modified = _at(card.created)
    return {
        "name": model_id,
        "model": model_id,
        "modified_at": modified,
        "size": card.size_bytes,
        "digest": card.revision,
        "details": _details(card),
    }


async def local_ids(controller: Controller) -> list[str]:
    """The whole models of this node's cache (read on a thread: a large cache takes a while to scan)."""
    found = await trio.to_thread.run_sync(local_models, controller.config.hf_home)
    return [m.repo_id for m in found]


async def model_named(controller: Controller, name: str) -> str:
    """The model ``name`` means (`resolve`) among those served and those in this node's cache; 400 if ambiguous.
    The cache is read only where the name is not a served model's."""
    placed = controller.placed_models()
    try:
        found = resolve(name, placed)
        if found in placed or "/" in found:
            return found
        return resolve(name, sorted({*placed, *await local_ids(controller)}))
    except AmbiguousModel as exc:
        raise ApiError(400, str(exc), param="model") from exc


def router(controller: Controller, metrics: Any, max_tokens_ceiling: int) -> APIRouter:
    api = APIRouter(prefix="/api")

    async def model_of(name: str) -> str:
        return await model_named(controller, name)

    @api.get("/version")
    async def version() -> dict[str, str]:
        return {"version": API_VERSION}

    @api.get("/tags")
    async def tags() -> dict[str, Any]:
        """The models here, as Ollama lists its local ones: those served (placed) and the whole ones of this
        node's cache (pulled, copied, created), which a request places where ``[models] on_demand`` is on."""
        known = sorted({*controller.placed_models(), *await local_ids(controller)})
        return {"models": [_listed(m, controller.model_card(m)) for m in known]}

    @api.get("/ps")
    async def ps() -> dict[str, Any]:
        """The models in memory (an instance loaded, or on its way back from being parked), each with when it
        will be parked (``expires_at``; kept forever: what Ollama writes for ``keep_alive`` -1, `_forever`)."""
        running: dict[str, dict[str, Any]] = {}
        for inst in controller.status()["instances"]:
            if inst["residency"] not in _IN_MEMORY or inst["model_id"] in running:
                continue
            card = controller.model_card(inst["model_id"])
            expires = _expires(inst["keep_alive"], inst["park_at"])
            running[inst["model_id"]] = _listed(inst["model_id"], card) | {
                "expires_at": expires,
                "size_vram": 0,
                "context_length": card.context_length,
                "residency": inst["residency"],
            }
        return {"models": list(running.values())}

    @api.post("/show", responses=responses(400, 404, ollama=True))
    async def show(body: ShowRequest) -> dict[str, Any]:
        name = body.model or body.name
        if not name:
            raise ApiError(400, "model is required", param="model")
        model_id = await model_of(name)
        if model_id not in controller.placed_models() and model_id not in await local_ids(controller):
            raise ApiError(404, f"model {name!r} not found: GET /api/tags lists those here", code="model_not_found")
        card = controller.model_card(model_id)
        details = _details(card)
        info = {"general.architecture": details["family"], f"{details['family']}.context_length": card.context_length}
        return {
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": details,
            "model_info": info,
            "capabilities": ["completion", "tools"] if card.tools else ["completion"],
            "modified_at": _listed(model_id, card)["modified_at"],
        }

    @api.post("/embed", responses=responses(400, 404, 429, 502, 503, ollama=True))
    async def embed_inputs(body: OllamaEmbedRequest) -> dict[str, Any]:
        """Ollama's embeddings: each input's, normalised (`exod.api.embeddings`)."""
        model_id = await model_of(body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not texts or not all(texts):
            raise ApiError(400, "input: send a non-empty string, or non-empty strings", param="input")
        started = time.monotonic()
        vectors, tokens = await embed(controller, metrics, model_id, [{"prompt_text": t} for t in texts])
        if body.dimensions is not None and body.dimensions != len(vectors[0]):
            raise ApiError(400, not_honoured(body.dimensions, len(vectors[0])), param="dimensions")
        took = int((time.monotonic() - started) * 1e9)
        return {
            "model": body.model,
            "embeddings": vectors,
            "total_duration": took,
            "load_duration": 0,
            "prompt_eval_count": tokens,
        }

    @api.post("/embeddings", responses=responses(400, 404, 429, 502, 503, ollama=True))
    async def embeddings(body: OllamaEmbeddingsRequest) -> dict[str, Any]:
        """Ollama's legacy embedding of one prompt, ``{"embedding": [...]}``; an empty prompt, an empty one (Ollama
        answers so, having loaded the model). exod's is normalised, as ``/api/embed``'s; Ollama's legacy one is not."""
        model_id = await model_of(body.model)
        if not body.prompt:
            return {"embedding": []}
        vectors, _tokens = await embed(controller, metrics, model_id, [{"prompt_text": body.prompt}])
        return {"embedding": vectors[0]}

    @api.post("/chat", response_model=None, responses=responses(400, 404, 429, 502, 503, ollama=True))
    async def chat(body: OllamaChatRequest) -> JSONResponse | StreamingResponse:
        model_id = await model_of(body.model)
        generation = Generation(controller, metrics, model_id, constraint="format")
        head = {"model": body.model}
        if not body.messages:  # Ollama's way to load a model, or (keep_alive 0) to unload it
            reason = await _load(controller, model_id, body.kept())
            return JSONResponse(
                head | {"created_at": _now(), "message": _message(""), "done": True, "done_reason": reason}
            )
        tools = [t.model_dump() for t in body.tools or []] or None
        streams = await generation.start(
            messages=body.chat_messages(),
            tools=tools,
            grammar=body.grammar(),
            keep_alive=body.kept(),
            **body.options.sampling(max_tokens_ceiling),
        )
        if not body.stream:
            [output] = await generation.outputs()
            message = _message(output.text, output.tool_calls)
            return JSONResponse(head | {"created_at": _now(), "message": message} | _final(output, generation))

        return _streamed(generation, streams[0], head, lambda text, calls: {"message": _message(text, calls)})

    @api.post("/generate", response_model=None, responses=responses(400, 404, 429, 502, 503, ollama=True))
    async def generate(body: OllamaGenerateRequest) -> JSONResponse | StreamingResponse:
        model_id = await model_of(body.model)
        generation = Generation(controller, metrics, model_id, prompt="prompt", constraint="format")
        head = {"model": body.model}
        if body.images:
            raise generation.rejected(ApiError(400, "images: exod serves text models; send text only", param="images"))
        if not body.prompt:  # Ollama's way to load a model, or (keep_alive 0) to unload it
            reason = await _load(controller, model_id, body.kept())
            return JSONResponse(head | {"created_at": _now(), "response": "", "done": True, "done_reason": reason})
        if body.raw:  # as Ollama: the prompt alone, and no context returned
            prompt: dict[str, Any] = {"prompt_text": body.prompt}
        else:
            system = [{"role": "system", "content": body.system}] if body.system else []
            prompt = {"messages": [*system, {"role": "user", "content": body.prompt}]}
            if body.context:  # the talk so far, then this turn: as Ollama, the ids before the new prompt's
                turn = await _tokens(Generation(controller, metrics, model_id, prompt="prompt"), prompt)
                prompt = {"prompt_tokens": [*body.context, *turn]}
            prompt["echo_prompt"] = True  # its ids start the answer's context

        def context(output: Output, said: list[int]) -> dict[str, Any]:
            read = output.prompt.tokens if output.prompt is not None and not body.raw else None
            return {} if read is None else {"context": [*read, *said]}

        streams = await generation.start(
            **prompt, grammar=body.grammar(), keep_alive=body.kept(), **body.options.sampling(max_tokens_ceiling)
        )
        if not body.stream:
            ids = _Ids(streams[0])
            try:
                output = await generation.collect(ids)  # type: ignore[arg-type]  # a RequestStream's iteration
                generation.finished([output])
            finally:
                generation.close()
            done = head | {"created_at": _now(), "response": output.text} | _final(output, generation)
            return JSONResponse(done | context(output, ids.ids))

        return _streamed(generation, streams[0], head, lambda text, _calls: {"response": text}, last=context)

    return api


_IN_MEMORY = frozenset({fsm.Residency.LOADED.value, fsm.Residency.UNPARKING.value})


_FOREVER_NS = 2**63 - 1  # Ollama's keep_alive -1: the longest Go duration (api.Duration), ~292 years
_LAST = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp()  # the latest time a date can say


def _at(when: float) -> str:
    """``when`` as Ollama writes a time, clamped to what a date can say: whatever is stored (a park time from a
    keep-alive of 1e18 s, taken before keep-alives were bounded), the listing never fails. Not finite: forever."""
    if not math.isfinite(when):
        return _forever()
    return datetime.fromtimestamp(min(max(when, 0.0), _LAST), UTC).isoformat().replace("+00:00", "Z")


def _expires(keep_alive: float | None, park_at: float | None) -> str:
    """``ps``'s ``expires_at`` as Ollama writes it: kept forever, `_forever`; not counting yet (on its way into
    memory, or busy), now plus its keep-alive, as Ollama's ``ps`` says of a model still loading; else when."""
    if keep_alive is None:
        return _forever()
    if park_at is None:
        return _at(time.time() + keep_alive)
    return _at(park_at)


def _forever() -> str:
    """When a model kept loaded forever is unloaded, as Ollama writes it: now plus the longest Go duration (its
    ``keep_alive`` -1 is ``math.MaxInt64`` nanoseconds), a date in the 2300s that every client's parser reads."""
    when = datetime.now(UTC) + timedelta(microseconds=_FOREVER_NS // 1000)
    return when.isoformat().replace("+00:00", "Z")


async def _load(controller: Controller, model_id: str, kept: float | Default | None) -> str:
    """Ollama's load (a request with nothing to say) and unload (the same, ``keep_alive`` 0): the model's idle
    instances are parked; else it is brought into memory (placed, if on demand; unparked, if parked). Returns
    Ollama's ``done_reason``."""
    try:
        instance_id = await controller.requests.serving(model_id)
    except InstanceNotFound as exc:
        raise ApiError(404, f"{exc}; GET /api/tags lists those served", code="model_not_found") from exc
    except PlacementRefused as exc:
        raise refused(exc) from exc
    except StoreUnavailable as exc:
        raise unstored(exc) from exc
    except ModelNotReady:  # loading already
        return "load"
    residency = controller.residency(instance_id)
    try:
        if kept == 0:
            if residency is fsm.Residency.LOADED:
                await controller.park(instance_id)
            return "unload"
        if residency is fsm.Residency.PARKED:
            await controller.unpark(instance_id)
        if kept is not DEFAULT:  # as long as this load asked, from now (its last use)
            controller.hold(instance_id, kept)
    except InstanceBusy as exc:  # a request in flight, or still parking: as Ollama, it is done after it
        log.info("%s: %s", model_id, exc)
    except PlacementRefused as exc:
        raise refused(exc) from exc
    return "load"


def _message(content: str, calls: list[ToolCall] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"function": {"name": c.name, "arguments": _arguments(c.arguments)}} for c in calls]
    return message


def _arguments(text: str) -> Any:
    """Ollama's calls carry their arguments as an object; text that is not one travels as it is."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _final(output: Output, generation: Generation) -> dict[str, Any]:
    """The last object: done, why, and the counts and durations (nanoseconds) Ollama reports."""
    assert output.done is not None
    reason = "length" if output.done.finish_reason is g.FinishReason.LENGTH else "stop"
    total = int(generation.elapsed * 1e9)
    return {
        "done": True,
        "done_reason": reason,
        "total_duration": total,
        "load_duration": 0,
        "prompt_eval_count": output.done.prompt_tokens,
        "eval_count": output.done.completion_tokens,
        "eval_duration": total,
    }


def _streamed(
    generation: Generation,
    stream: RequestStream,
    head: dict[str, Any],
    said: Callable[[str, list[ToolCall]], dict[str, Any]],
    last: Callable[[Output, list[int]], dict[str, Any]] = lambda _output, _ids: {},
) -> StreamingResponse:
    """A generation as Ollama streams it: an object per piece (``said`` shapes text or calls as the endpoint
    does), then the last with the counts (and what ``last`` adds, from the output and the ids of the tokens
    said); a failure is an ``error`` object, never a cut stream."""

    async def lines() -> AsyncIterator[bytes]:
        output = Output()
        held = Held()
        ids: list[int] = []
        try:
            async for item in generation.pieces(stream):
                Generation.take(output, item)
                if isinstance(item, g.Token) and item.token_id is not None:
                    ids.append(item.token_id)
                if isinstance(item, g.Token) and item.text:
                    held.add(_line(head | {"created_at": _now()} | said(item.text, []) | {"done": False}))
                elif isinstance(item, ToolCall):
                    held.add(_line(head | {"created_at": _now()} | said("", [item]) | {"done": False}))
                if due := held.due(stream):
                    yield due
            generation.finished([output])
            held.add(
                _line(head | {"created_at": _now()} | said("", []) | _final(output, generation) | last(output, ids))
            )
        except RequestFailed as exc:
            generation.record("error")
            held.add(_line({"error": str(exc)}))
        finally:
            generation.close()
        yield held.take()

    return _ndjson(lines())


class _Ids:
    """A request's stream that keeps the ids of the tokens it says (Ollama's ``context``)."""

    def __init__(self, stream: RequestStream) -> None:
        self.stream, self.ids = stream, list[int]()

    def __aiter__(self) -> _Ids:
        return self

    async def __anext__(self) -> Any:
        item = await self.stream.__anext__()
        if isinstance(item, g.Token) and item.token_id is not None:
            self.ids.append(item.token_id)
        return item


async def _tokens(generation: Generation, prompt: dict[str, Any]) -> list[int]:
    """The ids of ``prompt`` as the model reads it (its chat template applied), nothing generated."""
    await generation.start(max_tokens=0, echo_prompt=True, **prompt)
    [output] = await generation.outputs()
    return [] if output.prompt is None else list(output.prompt.tokens)


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


def _ndjson(lines: AsyncIterator[bytes]) -> StreamingResponse:
    """Streamed as Ollama does: one JSON object per line. Starlette ends the stream when the client goes
    away, and its ``finally`` counts the request as cancelled."""
    return StreamingResponse(lines, media_type="application/x-ndjson", headers={"Cache-Control": "no-cache"})
