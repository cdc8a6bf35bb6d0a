"""Requests to any node of a cluster: a node that is not the controller forwards them to the one that is.

The controller keeps the request book and hears every rank's reports (through the agents), so it is where
a chat request is served, wherever rank 0 runs; a placement or a deletion is the controller's to make. A
node that is not the controller answers what it can from etcd (`/nodes`, `/instances`, `/events`, its
health and metrics, its agent's endpoints) and forwards everything else, streamed both ways, with the
caller's own headers but its credentials: the node checks the client's API key itself and sends it on to
no one; the controller takes the cluster's token in its place (`exod.cluster.token`).

The hop keeps the API's promises: the controller's status codes and error shapes come back as they are;
a controller that cannot be reached is a 502 (503 while none is elected, and while the node elected is
taking over: its machines are the last term's until it has restored the cluster's); one that dies mid-stream
ends a server-sent-event stream with an error event and ``data: [DONE]``, never a hang.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from exod.api.auth import WRONG_KEY, holds_key
from exod.api.errors import ANTHROPIC_PATHS, ApiError
from exod.cluster.etcd import EtcdUnavailable
from exod.cluster.membership import Membership
from exod.cluster.token import HEADER

if TYPE_CHECKING:
    from exod.controller import Controller

log = logging.getLogger("exod.forward")

# what a node that is not the controller answers itself (GET and HEAD); it forwards the rest
FOLLOWER_PATHS = (
    "/ui/",  # the dashboard's assets (its page is "/")
    "/health",
    "/nodes",
    "/instances",
    "/events",
    "/metrics",
    "/diagrams/",
    "/docs",
    "/openapi.json",
)
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade", b"host"})
CONNECT_TIMEOUT_S = 5.0
FORWARDED = b"x-exod-forwarded-by"
CREDENTIALS = frozenset({b"authorization", b"x-api-key", HEADER.lower().encode()})  # never sent on


def controlling(membership: Membership, controller: Controller) -> bool:
    """This node answers as the cluster's controller: elected, and its controller runs that term. Between the
    two (`exod.serve`'s take-over: the last state read from etcd, the runners it names recovered) its machines
    are another term's or none, and a request given to its book then would be lost with that book."""
    return membership.term is not None and controller.running


def _unavailable(message: str) -> ApiError:
    """No controller to forward to now, for a moment: the client should try again shortly."""
    return ApiError(503, message, code="controller_unavailable", headers={"Retry-After": "1"})


class Follower:
    """ASGI middleware of a cluster node: answer here, or forward to the controller."""

    def __init__(
        self, app: ASGIApp, membership: Membership, controller: Controller, api_key: str | None = None
    ) -> None:
        self.app, self.membership, self.controller, self.api_key = app, membership, controller, api_key
        self._client = membership.peer_client(httpx.Timeout(CONNECT_TIMEOUT_S, read=None, write=None))  # TLS if set

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or answered_here(scope) or controlling(self.membership, self.controller):
            await self.app(scope, receive, send)
            return
        target = await self._controller_for(scope)
        if isinstance(target, ApiError):
            await target.response(scope["path"])(scope, receive, send)
            return
        await self._forward(*target, scope, receive, send)

    async def _controller_for(self, scope: Scope) -> tuple[str, str] | ApiError:
        """The controller's node and API address to forward ``scope`` to, or the error to answer instead."""
        if self.api_key and not holds_key(scope["headers"], self.api_key):
            return ApiError(401, WRONG_KEY, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        me = self.membership.node_id
        if self.membership.term is not None:  # elected, not serving yet: forwarded, it would come back here
            return _unavailable(f"node {me} is taking over as the cluster's controller: try again shortly")
        try:
            node_id, url = await self.membership.controller()
        except EtcdUnavailable as exc:
            reason = f"degraded: the cluster's etcd cannot be reached: {exc}"
            return ApiError(503, reason, headers={"Retry-After": "1"})
        if any(k.lower() == FORWARDED for k, _ in scope["headers"]):  # one hop only: never a loop mid-election
            return _unavailable(f"forwarded to node {me}, which is not the controller either: try again")
        if node_id is None:
            return _unavailable(
                "no node of the cluster is its controller yet (an election is under way): try again shortly"
            )
        if not url:
            return _unavailable(f"the cluster's controller, node {node_id}, has no API address yet: try again shortly")
        return node_id, url

    async def _forward(self, node_id: str, url: str, scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:  # the body as it came (`exod.api.app`'s guard has bounded it already)
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        query = scope.get("query_string", b"").decode()
        target = f"{self.membership.peer_url(url)}{scope['path']}" + (f"?{query}" if query else "")
        dropped = HOP_BY_HOP | CREDENTIALS | {b"content-length"}
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in dropped]
        headers.append((FORWARDED, self.membership.node_id.encode()))
        headers.append((HEADER.encode(), self.membership.config.token.encode()))
        request = self._client.build_request(scope["method"], target, headers=headers, content=body)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            message = f"the cluster's controller, node {node_id}, could not be reached: {type(exc).__name__}: {exc}"
            await ApiError(502, message, headers={"Retry-After": "1"}).response(scope["path"])(scope, receive, send)
            return
        streaming = response.headers.get("content-type", "").startswith("text/event-stream")
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP],
                }
            )
            try:
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as exc:  # the controller went away mid-answer
                log.warning("forward to node %s broke mid-answer: %s", node_id, exc)
                if streaming:
                    ended = _ended(node_id, exc, anthropic=scope["path"].startswith(ANTHROPIC_PATHS))
                    await send({"type": "http.response.body", "body": ended, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()


def answered_here(scope: Scope) -> bool:
    """What a node answers itself: its agent's endpoints, and reads of what etcd holds or it knows."""
    path = scope["path"]
    if path.startswith("/agent/"):  # every node is an agent of the controller
        return True
    reads = scope["method"] in ("GET", "HEAD")
    return reads and (
        path == "/"  # the dashboard's page; its assets are under /ui/
        or any(path == p or path.startswith(p if p.endswith("/") else p + "/") for p in FOLLOWER_PATHS)
    )


def _ended(node_id: str, exc: Exception, *, anthropic: bool = False) -> bytes:
    """The end of a stream whose controller went away, in the dialect's own words."""
    message = f"the cluster's controller, node {node_id}, went away mid-stream ({type(exc).__name__})"
    if anthropic:
        error = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(error)}\n\n".encode()
    openai = {"message": message, "type": "server_error", "param": None, "code": "controller_lost"}
    return f"data: {json.dumps({'error': openai})}\n\ndata: [DONE]\n\n".encode()
