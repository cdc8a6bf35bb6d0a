"""The daemon's HTTP API: FastAPI, served by hypercorn's trio worker inside the daemon's trio run.

FastAPI because it derives request validation and the OpenAPI document from the same type hints, and
it runs on anyio, hence under trio. Every error has OpenAI's shape (`exod.api.errors`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

import fsm
from exod.api import chat, completions, dashboard, diagrams, docs, events, health, instances, messages, responses_api
from exod.api.auth import authentication, node_authentication
from exod.api.errors import ApiError, install
from exod.api.forward import Follower
from exod.api.metrics import Metrics
from exod.cluster.agent import Agent
from exod.cluster.agent import router as agent_router
from exod.cluster.membership import Membership
from exod.controller import Controller

MAX_BODY_BYTES = 1 << 20
MAX_TOKENS_CEILING = 4096
OPEN_PATHS = frozenset({"/health"})  # answered without the API key


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
            await ApiError(413, f"request body over {self.max_body} bytes").response(scope["path"])(
                scope, receive, send
            )
            return
        body, more = b"", True
        while more:  # read it all (bounded) so a chunked body cannot slip past the cap
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await ApiError(413, f"request body over {self.max_body} bytes").response(scope["path"])(
                    scope, receive, send
                )
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def create_app(
    controller: Controller,
    *,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_tokens_ceiling: int = MAX_TOKENS_CEILING,
    membership: Membership | None = None,
    agent: Agent | None = None,
) -> ASGIApp:
    """The daemon's API: each concern's router, in the order the OpenAPI document lists their paths."""
    # its document and docs page are routes of ours (`exod.api.docs`), so that they ask for the key like every other
    app = FastAPI(
        title="exod",
        version=fsm.__version__,
        description="Explicit lifecycles for LLM runners.",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    cluster_token = membership.config.token if membership is not None else ""
    authenticated = authentication(api_key, cluster_token)

    def guarded(path: str) -> tuple[int, ...]:
        """What can answer on ``path`` that its route does not declare: the key's check (401), `_BodyCap`
        (413), `exod.api.http_server` (408)."""
        return (401, 408, 413) if api_key and path not in OPEN_PATHS else (408, 413)

    install(app, everywhere=guarded)
    if agent is not None:  # a cluster's node: its controller drives the runners placed here through it
        if not cluster_token:
            raise ValueError("a cluster node's agent needs the cluster's token (`exod cluster-token`)")
        app.include_router(agent_router(agent), dependencies=node_authentication(cluster_token))
    metrics = Metrics(controller, None if membership is None else membership.malformed)
    for dialect in (chat, completions, messages, responses_api):
        app.include_router(dialect.router(controller, metrics, max_tokens_ceiling), dependencies=authenticated)
    app.include_router(health.router(controller, metrics, membership, authenticated, agent))  # /health: no key
    app.include_router(instances.router(controller, membership), dependencies=authenticated)
    app.include_router(diagrams.router(controller), dependencies=authenticated)
    app.include_router(events.router(controller), dependencies=authenticated)
    app.include_router(docs.router(app), dependencies=authenticated)
    dashboard.install(app, api_key=bool(api_key))
    served: ASGIApp = app if membership is None else Follower(app, membership, api_key)
    return _BodyCap(served, max_body_bytes)
