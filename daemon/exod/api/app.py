"""The daemon's HTTP API: FastAPI, served by hypercorn's trio worker inside the daemon's trio run.

FastAPI because it derives request validation and the OpenAPI document from the same type hints, and
it runs on anyio, hence under trio. Every error has OpenAI's shape (`exod.api.errors`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Any

import trio
from fastapi import APIRouter, FastAPI, Header, Query, Security
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import ASGIApp, Receive, Scope, Send

import fsm
from exod.api import chat, completions, dashboard, messages, responses_api
from exod.api.errors import ApiError, install, responses
from exod.api.forward import Follower
from exod.api.metrics import Metrics
from exod.cluster.agent import Agent
from exod.cluster.agent import router as agent_router
from exod.cluster.etcd import EtcdUnavailable
from exod.cluster.etcd_state import stored_status
from exod.cluster.membership import Membership
from exod.controller import Controller, PlacementRefused, StoreUnavailable
from exod.host.models import InvalidModelId
from exod.render import MEDIA_TYPES, Format, GraphvizMissing, render
from exod.requests import InstanceNotFound
from exod.state.journal import WRITE_RETRY
from exod.state.store import StateUnavailable
from exod.status import NODE

MAX_BODY_BYTES = 1 << 20
MAX_TOKENS_CEILING = 4096
KEEPALIVE_S = 15.0
OPEN_PATHS = frozenset({"/health"})  # answered without the API key
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


# module-level, as FastAPI resolves the annotations that name them in this module's namespace
_BEARER = HTTPBearer(scheme_name="bearer", auto_error=False)
_X_API_KEY = APIKeyHeader(name="x-api-key", scheme_name="apiKey", auto_error=False)


def _authentication(api_key: str | None) -> list[Any]:
    """The dependency every route but /health carries: a bearer token, or Anthropic's ``x-api-key`` (its
    clients send that one). FastAPI's security helpers read the headers and document both schemes."""
    if not api_key:
        return []
    expected = api_key.encode()

    async def authenticated(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)],
        x_api_key: Annotated[str | None, Security(_X_API_KEY)],
    ) -> None:
        given = credentials.credentials if credentials is not None else x_api_key
        # bytes as they came (Starlette decodes headers as latin-1): any value compares, none raises
        if given is None or not secrets.compare_digest(given.encode("latin-1"), expected):
            raise ApiError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return [Security(authenticated)]


class _BodyCap:
    """ASGI middleware: a cap on request bodies, declared or chunked, before any route reads one."""

    def __init__(self, app: ASGIApp, max_body: int) -> None:
        self.app, self.max_body = app, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no websocket routes: nothing else gets through unchecked
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            return
        headers = dict(scope.get("headers") or [])
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
    # its document and docs page are routes of ours below, so that they ask for the key like every other
    app = FastAPI(
        title="exod",
        version=fsm.__version__,
        description="Explicit lifecycles for LLM runners.",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    authenticated = _authentication(api_key)
    api = APIRouter(dependencies=authenticated)

    def degraded() -> str | None:
        """Why the daemon cannot write its state now (its store, or in a cluster etcd), if it cannot."""
        if membership is not None and membership.presence.lost is not None:
            return f"the cluster's etcd cannot be reached: {membership.presence.lost}"
        return controller.status()["degraded"]

    def guarded(path: str) -> tuple[int, ...]:
        """What can answer on ``path`` that its route does not declare: the key's check (401), `_BodyCap`
        (413), `exod.api.http_server` (408)."""
        return (401, 408, 413) if api_key and path not in OPEN_PATHS else (408, 413)

    install(app, everywhere=guarded)
    if agent is not None:  # a cluster's node: its controller drives the runners placed here through it
        app.include_router(agent_router(agent), dependencies=authenticated)
    metrics = Metrics(controller)
    for dialect in (chat, completions, messages, responses_api):
        app.include_router(dialect.router(controller, metrics, max_tokens_ceiling), dependencies=authenticated)

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

    @api.get("/ready", responses=responses(503))
    async def ready() -> dict[str, Any]:
        """Readiness: at least one instance is Ready, and the state can be written."""
        if (reason := degraded()) is not None:
            raise ApiError(503, f"degraded: {reason}", headers={"Retry-After": str(int(WRITE_RETRY))})
        ready_state = fsm.InstanceState.READY.value
        ready = [i["instance_id"] for i in controller.status()["instances"] if i["state"] == ready_state]
        if not ready:
            raise ApiError(503, "no instance is Ready yet", headers={"Retry-After": "1"})
        return {"status": "ready", "instances": ready}

    @api.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @api.post("/instances", status_code=201, responses=responses(400, 404, 409, 422, 503))
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

    @api.get("/instances")
    async def instances() -> dict[str, Any]:
        return await current()

    @api.get("/nodes", responses=responses(503))
    async def nodes() -> dict[str, Any]:
        """The cluster's live nodes and its controller, as etcd has them; one host is a cluster of one."""
        if membership is None:
            local = {"node_id": NODE, "api_url": None, "controller": True, "lease_age": None}
            return {"cluster": None, "node_id": NODE, "controller": NODE, "nodes": [local]}
        try:
            return await membership.nodes()
        except EtcdUnavailable as exc:
            raise ApiError(503, f"the cluster's store cannot be reached: {exc}", headers={"Retry-After": "1"}) from exc

    @api.get("/instances/{instance_id}", responses=responses(404))
    async def instance(instance_id: str) -> dict[str, Any]:
        return await find(instance_id)

    @api.delete("/instances/{instance_id}", responses=responses(404))
    async def delete(instance_id: str) -> dict[str, Any]:
        try:
            await controller.delete(instance_id)
        except InstanceNotFound as exc:
            raise ApiError(404, str(exc)) from exc
        return await find(instance_id)

    @api.get("/diagrams/{machine}", response_class=Response, responses=responses(400, 404, 501))
    async def machine_diagram(machine: str, format: Format = Format.MERMAID, state: str | None = None) -> Response:
        """A machine as Mermaid, DOT or SVG, optionally with one state highlighted."""
        cls = fsm.MACHINES.get(machine)
        if cls is None:
            raise ApiError(404, f"no machine {machine!r}; machines: {sorted(fsm.MACHINES)}")
        return await _diagram(cls, format, state)

    @api.get("/instances/{instance_id}/diagram", response_class=Response, responses=responses(404, 501))
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

    @api.get("/events", response_class=EventSourceResponse)
    async def events(
        last_event_id: int | None = Header(None, ge=0, le=MAX_SEQ, description="resume after this sequence number"),
        after: int = Query(0, ge=0, le=MAX_SEQ, description="resume after this sequence number, if no Last-Event-ID"),
    ) -> EventSourceResponse:
        """Server-sent events: every lifecycle transition, from the durable log, resumable.

        A resume point must be a sequence number the log could hold (0..2^63-1), or it is a 400 before the
        stream starts. One beyond the newest entry is not an error: the stream waits for entries past it.
        One older than the log's start (`exod.state.retention` pruned what came after it) gets a ``truncated``
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

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(  # Swagger UI served from the package (tools/vendor_swagger_ui.sh), not a CDN
            openapi_url="/openapi.json",
            title="exod API",
            swagger_js_url=f"{dashboard.ASSETS}/vendor/swagger-ui/swagger-ui-bundle.js",
            swagger_css_url=f"{dashboard.ASSETS}/vendor/swagger-ui/swagger-ui.css",
            swagger_favicon_url="data:,",
            swagger_ui_parameters={"validatorUrl": None},  # no badge fetched from validator.swagger.io
        )

    app.include_router(api)
    dashboard.install(app, api_key=bool(api_key))
    served: ASGIApp = app if membership is None else Follower(app, membership)
    return _BodyCap(served, max_body_bytes)
