"""Probes for whoever runs the daemon: liveness (/health, without the key), readiness, Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import fsm
from exod.api.errors import ApiError, responses
from exod.api.metrics import Metrics
from exod.cluster.agent import Agent
from exod.cluster.membership import Membership
from exod.controller import RETRY_AFTER, Controller


def router(
    controller: Controller,
    metrics: Metrics,
    membership: Membership | None,
    authenticated: list[Any],
    agent: Agent | None = None,
) -> APIRouter:
    """/health answers anyone (`exod.api.app.OPEN_PATHS`); the others carry ``authenticated``."""
    api = APIRouter()

    def degraded() -> str | None:
        """Why the daemon cannot write its state now (its store, or in a cluster etcd, or the record of its
        agent's runners), if it cannot; in a cluster whose state in etcd cannot be restored, which key, why,
        and the command that repairs it (`exod.cluster.repair`: the controller's journal says it)."""
        if membership is not None and membership.presence.lost is not None:
            return f"the cluster's etcd cannot be reached: {membership.presence.lost}"
        if agent is not None and agent.book.error is not None:
            return agent.book.error
        return controller.status()["degraded"]

    @api.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the daemon answers; degraded (it serves, but cannot write its state) says why."""
        reason = degraded()
        return {"status": "ok"} if reason is None else {"status": "degraded", "reason": reason}

    @api.get("/ready", responses=responses(503), dependencies=authenticated)
    async def ready() -> dict[str, Any]:
        """Readiness: at least one instance is Ready, and the state can be written."""
        if (reason := degraded()) is not None:
            raise ApiError(503, f"degraded: {reason}", headers={"Retry-After": str(int(RETRY_AFTER))})
        ready_state = fsm.InstanceState.READY.value
        ready = [i["instance_id"] for i in controller.status()["instances"] if i["state"] == ready_state]
        if not ready:
            raise ApiError(503, "no instance is Ready yet", headers={"Retry-After": "1"})
        return {"status": "ready", "instances": ready}

    @api.get("/metrics", response_class=Response, dependencies=authenticated)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return api
