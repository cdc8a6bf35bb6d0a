"""The daemon's HTTP API (instance management and live state), on FastAPI.

FastAPI because it derives request validation and the OpenAPI document from
the same type hints; it runs on anyio, hence under trio and hypercorn's trio
worker in the daemon's own trio run.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

import fsm
from exod.controller import Controller, InstanceNotFound
from exod.models import InvalidModelId


class RetryOverrides(BaseModel):
    model_config = ConfigDict(extra="forbid")

    initial: float | None = Field(None, gt=0, le=3600)
    factor: float | None = Field(None, ge=1, le=100)
    cap: float | None = Field(None, gt=0, le=86400)
    max_retries: int | None = Field(None, ge=1, le=1000)
    reset_after: float | None = Field(None, gt=0, le=7 * 86400)


class PlaceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., min_length=3, max_length=200, description="a Hugging Face repo id, org/name")
    ranks: int = Field(1, ge=1, le=64)
    retry: RetryOverrides | None = None


def _policy(base: fsm.RetryPolicy, overrides: RetryOverrides | None) -> fsm.RetryPolicy | None:
    if overrides is None:
        return None
    backoff = base.backoff
    return fsm.RetryPolicy(
        backoff=fsm.Backoff(
            initial=overrides.initial if overrides.initial is not None else backoff.initial,
            factor=overrides.factor if overrides.factor is not None else backoff.factor,
            cap=overrides.cap if overrides.cap is not None else backoff.cap,
            jitter=backoff.jitter,
        ),
        max_retries=overrides.max_retries if overrides.max_retries is not None else base.max_retries,
        reset_after=overrides.reset_after if overrides.reset_after is not None else base.reset_after,
    )


def create_app(controller: Controller) -> FastAPI:
    app = FastAPI(title="exod", version=fsm.__version__)

    def find(instance_id: str) -> dict[str, Any]:
        for inst in controller.status()["instances"]:
            if inst["instance_id"] == instance_id:
                return inst
        raise HTTPException(404, f"no instance {instance_id!r}")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/instances", status_code=201)
    async def place(body: PlaceRequest) -> dict[str, Any]:
        try:
            policy = _policy(controller.config.policy, body.retry)
            instance_id = controller.place(body.model, body.ranks, policy=policy)
        except (InvalidModelId, fsm.InvalidConfig) as exc:
            raise HTTPException(422, str(exc)) from exc
        return find(instance_id)

    @app.get("/instances")
    async def instances() -> dict[str, Any]:
        return controller.status()

    @app.get("/instances/{instance_id}")
    async def instance(instance_id: str) -> dict[str, Any]:
        return find(instance_id)

    @app.delete("/instances/{instance_id}")
    async def delete(instance_id: str) -> dict[str, Any]:
        try:
            controller.delete(instance_id)
        except InstanceNotFound as exc:
            raise HTTPException(404, str(exc)) from exc
        return find(instance_id)

    return app
