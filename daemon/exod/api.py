"""The daemon's HTTP API: FastAPI, served by hypercorn's trio worker inside the daemon's trio run.

FastAPI because it derives request validation and the OpenAPI document from the same type hints, and
it runs on anyio, hence under trio. Every error has OpenAI's shape (`exod.errors`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import trio
from fastapi import FastAPI, Header, Query
from fastapi.responses import Response
from fastapi.security import APIKeyHeader, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import ASGIApp, Receive, Scope, Send

import fsm
from exod import chat, completions, messages, responses_api
from exod.agent import Agent
from exod.agent import router as agent_router
from exod.controller import Controller, PlacementRefused, StoreUnavailable
from exod.errors import ApiError, install, responses
from exod.etcd import EtcdUnavailable
from exod.etcd_state import stored_status
from exod.forward import Follower
from exod.journal import WRITE_RETRY
from exod.membership import Membership
from exod.metrics import Metrics
from exod.models import InvalidModelId
from exod.render import MEDIA_TYPES, Format, GraphvizMissing, render
from exod.requests import InstanceNotFound
from exod.state import StateUnavailable
from exod.status import NODE

MAX_BODY_BYTES = 1 << 20
MAX_TOKENS_CEILING = 4096
KEEPALIVE_S = 15.0
OPEN_PATHS = frozenset({"/health"})  # answered without the API key
# what a node that is not the cluster's controller answers itself; it refuses the rest, naming the controller
FOLLOWER_PATHS = ("/health", "/nodes", "/instances", "/events", "/metrics", "/diagrams/", "/docs", "/openapi.json")
MAX_SEQ = 2**63 - 1  # the log's sequence numbers are SQLite INTEGERs: signed 64-bit


class RetryOverrides(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # `"max_retries": true` is a mistake, not 1

    initial: float | None = Field(None, gt=0, le=3600)
    factor: float | None = Field(None, ge=1, le=100)
    cap: float | None = Field(None, gt=0, le=86400)
    max_retries: int | None = Field(None, ge=1, le=1000)
    reset_after: float | None = Field(None, gt=0, le=7 * 86400)


class PlaceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # `"ranks": "2"` or `true` is a mistake, not 2 or 1

    model: str = Field(..., min_length=3, max_length=200, description="a Hugging Face repo id, org/name")
    ranks: int = Field(1, ge=1, le=64)
    nodes: list[str] | None = Field(None, min_length=1, max_length=64, description="place on these nodes only")
    retry: RetryOverrides | None = None


def _policy(base: fsm.RetryPolicy, overrides: RetryOverrides | None) -> fsm.RetryPolicy | None:
    if overrides is None:
        return None
    b = base.backoff
    o = overrides
    return fsm.RetryPolicy(
        backoff=fsm.Backoff(
            initial=b.initial if o.initial is None else o.initial,
            factor=b.factor if o.factor is None else o.factor,
            cap=b.cap if o.cap is None else o.cap,
            jitter=b.jitter,
        ),
        max_retries=base.max_retries if o.max_retries is None else o.max_retries,
        reset_after=base.reset_after if o.reset_after is None else o.reset_after,
    )


def _document_security(app: FastAPI) -> None:
    """Say in the OpenAPI document how to authenticate, in FastAPI's own security schemes: a bearer token, or
    Anthropic's ``x-api-key``. `_Guard` checks them, before any route (unknown paths and body limits too)."""
    schemes = {"bearer": HTTPBearer(), "apiKey": APIKeyHeader(name="x-api-key")}
    documented = app.openapi

    def openapi() -> dict[str, Any]:
        schema = documented()
        components = schema.setdefault("components", {})
        components["securitySchemes"] = {
            name: scheme.model.model_dump(mode="json", by_alias=True, exclude_none=True)
            for name, scheme in schemes.items()
        }
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                if path not in OPEN_PATHS:
                    operation["security"] = [{name: []} for name in schemes]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the document


class _Guard:
    """ASGI middleware: bearer token on every path but /health, and a cap on request bodies."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no websocket routes: nothing else gets through unchecked
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope["path"] not in OPEN_PATHS:
            # bytes, as they came: any header value compares (a non-ASCII str would make compare_digest raise)
            bearer = secrets.compare_digest(headers.get(b"authorization", b""), f"Bearer {self.api_key}".encode())
            anthropic = secrets.compare_digest(headers.get(b"x-api-key", b""), self.api_key.encode())  # its clients
            if not (bearer or anthropic):
                denied = ApiError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await denied.response(scope["path"])(scope, receive, send)
                return
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            await ApiError(413, f"request body over {self.max_body} bytes").response()(scope, receive, send)
            return
        body, more = b"", True
        while more:  # read it all (bounded) so a chunked body cannot slip past the cap
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await ApiError(413, f"request body over {self.max_body} bytes").response()(scope, receive, send)
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


# unknown model: not found; asking for more than the model or the limits allow: never satisfiable as asked;
# a limit reached, or no memory: a conflict with what is placed now (deleting an instance may resolve it)
_REFUSAL_STATUS = {
    fsm.Refusal.UNKNOWN_MODEL: (404, "model"),
    fsm.Refusal.TOO_MANY_RANKS: (422, "ranks"),
    fsm.Refusal.LIMIT_REACHED: (409, None),
    fsm.Refusal.NO_MEMORY: (409, "ranks"),
}


def create_app(
    controller: Controller,
    *,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_tokens_ceiling: int = MAX_TOKENS_CEILING,
    membership: Membership | None = None,
    agent: Agent | None = None,
) -> ASGIApp:
    app = FastAPI(title="exod", version=fsm.__version__, description="Explicit lifecycles for LLM runners.")

    def degraded() -> str | None:
        """Why the daemon cannot write its state now (its store, or in a cluster etcd), if it cannot."""
        if membership is not None and membership.presence.lost is not None:
            return f"the cluster's etcd cannot be reached: {membership.presence.lost}"
        return controller.status()["degraded"]

    def guarded(path: str) -> tuple[int, ...]:
        """What can answer on ``path`` before any route runs: `_Guard` (401, 413), `exod.http_server` (408)."""
        return (401, 408, 413) if api_key and path not in OPEN_PATHS else (408, 413)

    install(app, everywhere=guarded)
    if api_key:
        _document_security(app)
    if agent is not None:  # a cluster's node: its controller drives the runners placed here through it
        app.include_router(agent_router(agent))
    metrics = Metrics(controller)
    app.include_router(chat.router(controller, metrics, max_tokens_ceiling))
    app.include_router(completions.router(controller, metrics, max_tokens_ceiling))
    app.include_router(messages.router(controller, metrics, max_tokens_ceiling))
    app.include_router(responses_api.router(controller, metrics, max_tokens_ceiling))

    async def current() -> dict[str, Any]:
        """The instances: the controller's own, or on another node of a cluster what etcd holds of them."""
        if membership is None or membership.term is not None:
            return controller.status()
        try:
            return await stored_status(membership.etcd, membership.prefix)
        except StateUnavailable as exc:
            raise ApiError(503, str(exc), headers={"Retry-After": "1"}) from exc

    async def find(instance_id: str) -> dict[str, Any]:
        for inst in (await current())["instances"]:
            if inst["instance_id"] == instance_id:
                return inst
        raise ApiError(404, f"no instance {instance_id!r}")

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the daemon answers; degraded (it serves, but cannot write its state) says why."""
        reason = degraded()
        return {"status": "ok"} if reason is None else {"status": "degraded", "reason": reason}

    @app.get("/ready", responses=responses(503))
    async def ready() -> dict[str, Any]:
        """Readiness: at least one instance is Ready, and the state can be written."""
        if (reason := degraded()) is not None:
            raise ApiError(503, f"degraded: {reason}", headers={"Retry-After": str(int(WRITE_RETRY))})
        ready_state = fsm.InstanceState.READY.value
        ready = [i["instance_id"] for i in controller.status()["instances"] if i["state"] == ready_state]
        if not ready:
            raise ApiError(503, "no instance is Ready yet", headers={"Retry-After": "1"})
        return {"status": "ready", "instances": ready}

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/instances", status_code=201, responses=responses(400, 404, 409, 422, 503))
    async def place(body: PlaceRequest) -> dict[str, Any]:
        """Place a model; `fsm.admit` decides up front, and a refusal stores nothing."""
        if membership is not None and membership.presence.lost is not None:
            raise ApiError(503, f"degraded: {membership.presence.lost}", headers={"Retry-After": "1"})
        try:
            policy = _policy(controller.config.policy, body.retry)
            instance_id = await controller.place(body.model, body.ranks, policy=policy, nodes=body.nodes)
        except (InvalidModelId, fsm.InvalidConfig) as exc:
            raise ApiError(400, str(exc), param="ranks" if str(exc).startswith("ranks") else "model") from exc
        except PlacementRefused as exc:
            status, param = _REFUSAL_STATUS[exc.refusal]
            raise ApiError(status, str(exc), param=param, code=exc.refusal.value) from exc
        except StoreUnavailable as exc:
            raise ApiError(503, str(exc), headers={"Retry-After": str(int(WRITE_RETRY))}) from exc
        return await find(instance_id)

    @app.get("/instances")
    async def instances() -> dict[str, Any]:
        return await current()

    @app.get("/nodes", responses=responses(503))
    async def nodes() -> dict[str, Any]:
        """The cluster's live nodes and its controller, as etcd has them; one host is a cluster of one."""
        if membership is None:
            local = {"node_id": NODE, "api_url": None, "controller": True, "lease_age": None}
            return {"cluster": None, "node_id": NODE, "controller": NODE, "nodes": [local]}
        try:
            return await membership.nodes()
        except EtcdUnavailable as exc:
            raise ApiError(503, f"the cluster's store cannot be reached: {exc}", headers={"Retry-After": "1"}) from exc

    @app.get("/instances/{instance_id}", responses=responses(404))
    async def instance(instance_id: str) -> dict[str, Any]:
        return await find(instance_id)

    @app.delete("/instances/{instance_id}", responses=responses(404))
    async def delete(instance_id: str) -> dict[str, Any]:
        try:
            await controller.delete(instance_id)
        except InstanceNotFound as exc:
            raise ApiError(404, str(exc)) from exc
        return await find(instance_id)

    @app.get("/diagrams/{machine}", response_class=Response, responses=responses(400, 404, 501))
    async def machine_diagram(machine: str, format: Format = Format.MERMAID, state: str | None = None) -> Response:
        """A machine as Mermaid, DOT or SVG, optionally with one state highlighted."""
        cls = fsm.MACHINES.get(machine)
        if cls is None:
            raise ApiError(404, f"no machine {machine!r}; machines: {sorted(fsm.MACHINES)}")
        return await _diagram(cls, format, state)

    @app.get("/instances/{instance_id}/diagram", response_class=Response, responses=responses(404, 501))
    async def instance_diagram(instance_id: str, format: Format = Format.MERMAID) -> Response:
        """The instance's retry machine with its live state highlighted."""
        try:
            machine = controller.instance(instance_id)
        except InstanceNotFound as exc:
            raise ApiError(404, str(exc)) from exc
        return await _diagram(machine, format, None)

    async def _diagram(machine: Any, fmt: Format, state: str | None) -> Response:
        try:
            body = await render(machine, fmt, state)
        except fsm.InvalidConfig as exc:
            raise ApiError(400, str(exc), param="state") from exc
        except GraphvizMissing as exc:
            raise ApiError(501, str(exc), param="format") from exc
        return Response(body, media_type=MEDIA_TYPES[fmt])

    @app.get("/events", response_class=EventSourceResponse)
    async def events(
        last_event_id: int | None = Header(None, ge=0, le=MAX_SEQ, description="resume after this sequence number"),
        after: int = Query(0, ge=0, le=MAX_SEQ, description="resume after this sequence number, if no Last-Event-ID"),
    ) -> EventSourceResponse:
        """Server-sent events: every lifecycle transition, from the durable log, resumable.

        A resume point must be a sequence number the log could hold (0..2^63-1), or it is a 400 before the
        stream starts. One beyond the newest entry is not an error: the stream waits for entries past it.
        One older than the log's start (`exod.retention` pruned what came after it) gets a ``truncated``
        event first, whose id is the last pruned entry's, then the stream from the oldest entry kept.
        """
        start = last_event_id if last_event_id is not None else after

        async def stream() -> AsyncIterator[ServerSentEvent]:
            seen = start
            while True:
                try:
                    if seen < (oldest := await controller.log_start()) - 1:  # also when a slow reader is overtaken
                        doc = {"oldest_seq": oldest, "after": seen}
                        yield ServerSentEvent(data=json.dumps(doc), id=str(oldest - 1), event="truncated")
                        seen = oldest - 1
                    batch = await controller.transitions(after=seen, limit=500)
                    for seq, e in batch:
                        seen = seq
                        doc = {"seq": seq, **e.as_record()}
                        yield ServerSentEvent(data=json.dumps(doc), id=str(seq), event="transition")
                    if len(batch) == 500:
                        continue  # more are waiting
                    with trio.move_on_after(KEEPALIVE_S) as idle:
                        await controller.log_grew(seen)
                    if idle.cancelled_caught:
                        yield ServerSentEvent(comment="keepalive")
                except StateUnavailable as exc:  # the cluster's etcd is away: the stream waits for it
                    yield ServerSentEvent(comment=f"{exc}; trying again")
                    await trio.sleep(1.0)

        return EventSourceResponse(stream(), sep="\n", headers={"Cache-Control": "no-cache"})

    if membership is not None:
        app = Follower(app, membership)
    return _Guard(app, api_key, max_body_bytes)
