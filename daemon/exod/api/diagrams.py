"""The machines drawn (Mermaid, DOT or SVG): each kind of machine, and one instance's in its live state."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

import fsm
from exod.api.errors import ApiError, responses
from exod.api.render import MEDIA_TYPES, Format, GraphvizMissing, render
from exod.controller import Controller
from exod.requests import InstanceNotFound


def router(controller: Controller) -> APIRouter:
    api = APIRouter()

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

    return api


async def _diagram(machine: Any, fmt: Format, state: str | None) -> Response:
    try:
        body = await render(machine, fmt, state)
    except fsm.InvalidConfig as exc:
        raise ApiError(400, str(exc), param="state") from exc
    except GraphvizMissing as exc:
        raise ApiError(501, str(exc), param="format") from exc
    return Response(body, media_type=MEDIA_TYPES[fmt])
