"""The daemon's HTTP API: FastAPI, served by hypercorn's trio worker inside the daemon's trio run.

FastAPI because it derives request validation and the OpenAPI document from the same type hints, and
it runs on anyio, hence under trio. Every error has OpenAI's shape (`exod.api.errors`).
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from starlette.types import ASGIApp

import fsm
from exod.api import (
    chat,
    completions,
    dashboard,
    diagrams,
    docs,
    embeddings,
    events,
    health,
    instances,
    messages,
    ollama,
    ollama_models,
    responses_api,
    tokens,
)
from exod.api.auth import authentication, node_authentication
from exod.api.errors import install
from exod.api.forward import Follower
from exod.api.metrics import Metrics
from exod.api.middleware import BodyCap, HeadAsGet, HostAllowList, JsonBodies, RequestId, cors
from exod.cluster.agent import Agent
from exod.cluster.agent import router as agent_router
from exod.cluster.membership import Membership
from exod.controller import Controller

MAX_BODY_BYTES = 1 << 20
MAX_TOKENS_CEILING = 4096
OPEN_PATHS = frozenset({"/health"})  # answered without the API key


def create_app(
    controller: Controller,
    *,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_tokens_ceiling: int = MAX_TOKENS_CEILING,
    membership: Membership | None = None,
    agent: Agent | None = None,
    cors_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] = (),
) -> ASGIApp:
    """The daemon's API: each concern's router, in the order the OpenAPI document lists their paths, inside
    what wraps every request (`exod.api.middleware`). ``allowed_hosts``: the names it answers to besides its
    addresses, ``localhost`` and a cluster node's advertised address (`exod.config.ServeConfig.host_names`)."""
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
        """What can answer on ``path`` that its route does not declare: the key's check (401), `BodyCap`
        (413), `exod.api.http_server` (408), `HostAllowList` (421)."""
        return (401, 408, 413, 421) if api_key and path not in OPEN_PATHS else (408, 413, 421)

    install(app, everywhere=guarded)
    if agent is not None:  # a cluster's node: its controller drives the runners placed here through it
        if not cluster_token:
            raise ValueError("a cluster node's agent needs the cluster's token (`exod cluster-token`)")
        app.include_router(agent_router(agent), dependencies=node_authentication(cluster_token))
    metrics = Metrics(controller, None if membership is None else membership.malformed)
    for dialect in (chat, completions, messages, responses_api, tokens, embeddings, ollama, ollama_models):
        app.include_router(dialect.router(controller, metrics, max_tokens_ceiling), dependencies=authenticated)
    app.include_router(health.router(controller, metrics, membership, authenticated, agent))  # /health: no key
    app.include_router(instances.router(controller, membership), dependencies=authenticated)
    app.include_router(diagrams.router(controller), dependencies=authenticated)
    app.include_router(events.router(controller), dependencies=authenticated)
    app.include_router(docs.router(app), dependencies=authenticated)
    dashboard.install(app, api_key=bool(api_key))
    served: ASGIApp = app if membership is None else Follower(app, membership, controller, api_key)
    names = ["localhost", *allowed_hosts, *([] if membership is None else [membership.config.advertise])]
    bodies = BodyCap(JsonBodies(served, cors_origins), max_body_bytes)  # every body read as JSON, whatever its type
    return RequestId(HeadAsGet(HostAllowList(cors(bodies, cors_origins), names)))
