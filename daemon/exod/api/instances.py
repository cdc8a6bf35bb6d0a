"""Placing models and reading what is placed where: the instances, and the nodes they are placed on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

import fsm
from exod.api.errors import ApiError, responses
from exod.api.forward import controlling
from exod.cluster.election import Deposed
from exod.cluster.etcd import EtcdUnavailable
from exod.cluster.etcd_state import MalformedState, stored_cluster
from exod.cluster.membership import Membership
from exod.config import DEFAULT, keep_alive
from exod.controller import RETRY_AFTER, Controller, NotStoredYet, StoreUnavailable
from exod.host.models import InvalidModelId
from exod.placer import InstanceBusy, PlacementRefused
from exod.requests import InstanceNotFound
from exod.status import NODE, status_of, unvouched


class RetryOverrides(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # `"max_retries": true` is a mistake, not 1

    initial: float | None = Field(None, gt=0, le=3600)
    factor: float | None = Field(None, ge=1, le=100)
    cap: float | None = Field(None, gt=0, le=86400)
    max_failures: int | None = Field(None, ge=1, le=1000, description="charged failures before it gives up")
    max_retries: int | None = Field(None, ge=1, le=1000, description="max_failures' old name, same meaning")
    reset_after: float | None = Field(None, gt=0, le=7 * 86400)


class PlaceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # `"ranks": "2"` or `true` is a mistake, not 2 or 1

    model: str = Field(..., min_length=3, max_length=200, description="a Hugging Face repo id, org/name")
    ranks: int = Field(1, ge=1, le=64)
    nodes: list[str] | None = Field(None, min_length=1, max_length=64, description="place on these nodes only")
    retry: RetryOverrides | None = None
    keep_alive: float | str | None = Field(
        None,
        description="park it when unused this long: seconds, or a duration (5m, 1h); negative: never. "
        "Default: [models] keep_alive",
    )


def _policy(base: fsm.RetryPolicy, overrides: RetryOverrides | None) -> fsm.RetryPolicy | None:
    if overrides is None:
        return None
    if overrides.max_failures is not None and overrides.max_retries is not None:
        raise ApiError(400, "retry: max_retries is the old name of max_failures: give only max_failures", param="retry")
    b = base.backoff
    o = overrides
    return fsm.RetryPolicy(
        backoff=fsm.Backoff(
            initial=b.initial if o.initial is None else o.initial,
            factor=b.factor if o.factor is None else o.factor,
            cap=b.cap if o.cap is None else o.cap,
            jitter=b.jitter,
        ),
        max_failures=next((n for n in (o.max_failures, o.max_retries) if n is not None), base.max_failures),
        reset_after=base.reset_after if o.reset_after is None else o.reset_after,
    )


# unknown model: not found; asking for more than the model or the limits allow: never satisfiable as asked;
# a limit reached, or no memory: a conflict with what is placed now (deleting an instance may resolve it)
_REFUSAL_STATUS = {
    fsm.Refusal.UNKNOWN_MODEL: (404, "model"),
    fsm.Refusal.TOO_MANY_RANKS: (422, "ranks"),
    fsm.Refusal.LIMIT_REACHED: (409, None),
    fsm.Refusal.NO_MEMORY: (409, "ranks"),
}


def refused(exc: PlacementRefused) -> ApiError:
    """A refused placement (or unpark), in HTTP: 404, 422 or 409 (`_REFUSAL_STATUS`)."""
    status, param = _REFUSAL_STATUS[exc.refusal]
    return ApiError(status, str(exc), param=param, code=exc.refusal.value)


async def _residency(change: Callable[[str], Awaitable[None]], instance_id: str) -> None:
    """A park or an unpark, its refusals as HTTP errors."""
    try:
        await change(instance_id)
    except InstanceNotFound as exc:
        raise ApiError(404, str(exc)) from exc
    except InstanceBusy as exc:
        raise ApiError(409, str(exc), headers={"Retry-After": "1"}) from exc
    except PlacementRefused as exc:
        raise ApiError(409, str(exc), code=exc.refusal.value) from exc
    except StoreUnavailable as exc:
        raise unstored(exc) from exc
    except Deposed as exc:
        raise deposed(exc) from exc


def deposed(exc: Deposed) -> ApiError:
    """503: the change raced this node's step-down, and etcd refused its write (`exod.cluster.election.Deposed`):
    nothing of it was stored, and the next controller, elected in a moment, is the one to ask."""
    message = f"{exc}: nothing was stored; try again shortly, and the cluster's next controller answers"
    return ApiError(503, message, code="controller_unavailable", headers={"Retry-After": "1"})


def unstored(exc: StoreUnavailable) -> ApiError:
    """503: the state could not be written. ``code: not_stored_yet`` when the change was made all the same and will
    be written once the store takes it: neither done nor undone, so a client asks again what became of it."""
    code = "not_stored_yet" if isinstance(exc, NotStoredYet) else None
    return ApiError(503, str(exc), headers={"Retry-After": str(int(RETRY_AFTER))}, code=code)


CONTROLLER_CHECK_S = 2.0  # how long a node waits for the controller's /health before it vouches for nothing


async def _answers(url: str) -> bool:
    """Whether the daemon at ``url`` answers its /health (open without the key) in time."""
    try:
        async with httpx.AsyncClient(timeout=CONTROLLER_CHECK_S) as client:
            return (await client.get(f"{url}/health")).status_code == 200
    except httpx.HTTPError:
        return False


def router(controller: Controller, membership: Membership | None) -> APIRouter:
    api = APIRouter()

    async def current() -> dict[str, Any]:
        """The instances: the controller's own, or on another node of a cluster what etcd holds of them, as
        its controller last wrote it; while that controller does not answer, what may have changed since is
        said to be unknown (a dead controller's instances are not Ready, whatever it wrote last)."""
        if membership is None or controlling(membership, controller):
            return controller.status()
        try:
            cluster = await stored_cluster(membership.etcd, membership.prefix)
            node_id, url = await membership.controller()
        except EtcdUnavailable as exc:
            raise ApiError(503, str(exc), headers={"Retry-After": "1"}) from exc
        except MalformedState as exc:  # the snapshot in etcd is not exod's: said, counted, never trusted
            membership.malformed["snapshot"] += 1
            raise ApiError(503, str(exc), headers={"Retry-After": "1"}) from exc
        doc = {**status_of(cluster), "degraded": None}
        if membership.term is not None or node_id == membership.node_id:  # its own /health would vouch for it
            why = "stepping down or taking over: what is still true, its restore decides"
            doc = unvouched(doc, f"the last state written; node {membership.node_id} is not the controller now ({why})")
        elif url is None or not await _answers(url):
            doc = unvouched(
                doc,
                f"the last state written by the controller ({node_id or 'none elected'}), which does not answer now",
            )
        return doc

    async def find(instance_id: str) -> dict[str, Any]:
        for inst in (await current())["instances"]:
            if inst["instance_id"] == instance_id:
                return inst
        raise ApiError(404, f"no instance {instance_id!r}")

    @api.post("/instances", status_code=201, responses=responses(400, 404, 409, 422, 503))
    async def place(body: PlaceRequest) -> dict[str, Any]:
        """Place a model; `fsm.admit` decides up front, and a refusal stores nothing (nor does a placement that
        races the controller's step-down: 503, to ask the next one)."""
        if membership is not None and membership.presence.lost is not None:
            raise ApiError(503, f"degraded: {membership.presence.lost}", headers={"Retry-After": "1"})
        try:
            kept = DEFAULT if body.keep_alive is None else keep_alive(body.keep_alive)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="keep_alive") from exc
        try:
            policy = _policy(controller.config.policy, body.retry)
            instance_id = await controller.place(
                body.model, body.ranks, policy=policy, nodes=body.nodes, keep_alive=kept
            )
        except (InvalidModelId, fsm.InvalidConfig) as exc:
            raise ApiError(400, str(exc), param="ranks" if str(exc).startswith("ranks") else "model") from exc
        except PlacementRefused as exc:
            raise refused(exc) from exc
        except StoreUnavailable as exc:
            raise unstored(exc) from exc
        except Deposed as exc:
            raise deposed(exc) from exc
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

    @api.post("/instances/{instance_id}/park", responses=responses(404, 409, 503))
    async def park(instance_id: str) -> dict[str, Any]:
        """Park the instance: its runners stop and free their memory; its placement and retry budget stay, and
        the next request for it (or an unpark) brings it back. 409 while a request is in flight on it."""
        await _residency(controller.park, instance_id)
        return await find(instance_id)

    @api.post("/instances/{instance_id}/unpark", responses=responses(404, 409, 503))
    async def unpark(instance_id: str) -> dict[str, Any]:
        """Bring a parked instance back now, parking least recently used idle ones if it needs their memory;
        409 if it does not fit even so (saying what each node lacks), or while it is still parking."""
        await _residency(controller.unpark, instance_id)
        return await find(instance_id)

    @api.delete("/instances/{instance_id}", responses=responses(404, 503))
    async def delete(instance_id: str) -> dict[str, Any]:
        try:
            await controller.delete(instance_id)
        except InstanceNotFound as exc:
            raise ApiError(404, str(exc)) from exc
        except StoreUnavailable as exc:
            raise unstored(exc) from exc
        except Deposed as exc:
            raise deposed(exc) from exc
        return await find(instance_id)

    return api
