"""Requests to any node of a cluster: a node that is not the controller forwards them to the one that is.

The controller keeps the request book and hears every rank's reports (through the agents), so it is where
a chat request is served, wherever rank 0 runs; a placement or a deletion is the controller's to make. A
node that is not the controller answers what it can from etcd (`/nodes`, `/instances`, `/events`, its
health and metrics, its agent's endpoints) and forwards everything else, streamed both ways, with the
caller's own headers but its credentials: the node checks the client's API key itself and sends it on to
no one; the controller takes the cluster's token in its place (`exod.cluster.token`). That token is the
cluster's own credential at every node, whatever the node is now: a forwarded request that lands on a node
which stepped down or is taking over is a 503 to try again, never a 401 for a key it no longer carries.

The hop keeps the API's promises: the controller's status codes and error shapes come back as they are;
a controller that cannot be reached is a 502 (503 while none is elected, and while the node elected is
taking over: its machines are the last term's until it has restored the cluster's); a node that cannot reach
etcd forwards to the controller it last knew, or says which of the two it cannot reach.

No hop waits forever (``[cluster] forward_idle``, the bound): a controller's host gone silent (packets
dropped, no reset) or its daemon stopped is told from one that is still generating by what it says. A
forwarded stream carries a keep-alive every `NODE_KEEPALIVE_S` (`exod.api.sse`); a plain answer comes whole,
once generated, so while it is awaited (and through Ollama's NDJSON, which has no comment to keep alive with)
the controller's ``/health`` speaks for it, asked once every `PROBE_S` per controller, however many wait.
Silent past the bound: a 504 before the answer began, and a stream ends with the dialect's error event (and
``data: [DONE]``), as when the controller dies mid-stream. TCP keep-alive ends a connection whose peer went
away while nothing was in flight (`exod.cluster.tls.peer_transport`).
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING

import attrs
import httpx
import trio
from starlette.types import ASGIApp, Receive, Scope, Send

from exod.api.auth import WRONG_KEY, holds_cluster_token, holds_key
from exod.api.errors import ANTHROPIC_PATHS, ApiError
from exod.cluster.etcd import EtcdUnavailable
from exod.cluster.membership import Membership
from exod.cluster.token import FORWARDED_BY, HEADER, NODE_KEEPALIVE_S

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
PROBE_S = NODE_KEEPALIVE_S  # how often a controller's /health is asked while a plain answer is awaited from it
PROBE_TIMEOUT_S = 5.0
CLOSE_S = 5.0  # to close the controller's answer, however it ended
FORWARDED = FORWARDED_BY.lower().encode()
CREDENTIALS = frozenset({b"authorization", b"x-api-key", HEADER.lower().encode()})  # never sent on


def controlling(membership: Membership, controller: Controller) -> bool:
    """This node answers as the cluster's controller: elected, and its controller runs that term. Between the
    two (`exod.serve`'s take-over: the last state read from etcd, the runners it names recovered) its machines
    are another term's or none, and a request given to its book then would be lost with that book."""
    return membership.term is not None and controller.running


def _unavailable(message: str) -> ApiError:
    """No controller to forward to now, for a moment: the client should try again shortly."""
    return ApiError(503, message, code="controller_unavailable", headers={"Retry-After": "1"})


@attrs.frozen
class Target:
    """Where a request goes: the controller's node and API URL; ``etcd_lost`` (why etcd cannot be reached)
    when it is only the controller this node last knew."""

    node_id: str
    url: str
    etcd_lost: str | None = None


class Follower:
    """ASGI middleware of a cluster node: answer here, or forward to the controller."""

    def __init__(
        self, app: ASGIApp, membership: Membership, controller: Controller, api_key: str | None = None
    ) -> None:
        self.app, self.membership, self.controller, self.api_key = app, membership, controller, api_key
        self.idle = membership.config.idle_bound
        # no read timeout: a plain answer comes once generated; `_vouch` and the keep-alives bound the silence
        self._client = membership.peer_client(httpx.Timeout(CONNECT_TIMEOUT_S, read=None, write=self.idle))
        self._answered: dict[str, float] = {}  # a controller's URL -> when its /health last answered (trio time)
        self._asked: dict[str, float] = {}  # -> when it was last asked
        self._asking: dict[str, trio.Lock] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or answered_here(scope) or controlling(self.membership, self.controller):
            await self.app(scope, receive, send)
            return
        target = await self._controller_for(scope)
        if isinstance(target, ApiError):
            await target.response(scope["path"])(scope, receive, send)
            return
        await self._forward(target, scope, receive, send)

    async def _controller_for(self, scope: Scope) -> Target | ApiError:
        """The controller to forward ``scope`` to, or the error to answer instead."""
        headers = scope["headers"]
        from_a_node = holds_cluster_token(headers, self.membership.config.token)  # the cluster's, at every node
        if self.api_key and not from_a_node and not holds_key(headers, self.api_key):
            return ApiError(401, WRONG_KEY, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        me = self.membership.node_id
        if self.membership.term is not None:  # elected, not serving yet: forwarded, it would come back here
            return _unavailable(f"node {me} is taking over as the cluster's controller: try again shortly")
        if any(k.lower() == FORWARDED for k, _ in headers):  # one hop only: never a loop mid-election
            return _unavailable(f"forwarded to node {me}, which is not the controller (any more): try again")
        try:
            node_id, url = await self.membership.controller()
        except EtcdUnavailable as exc:  # cut from etcd: the controller the others see, or the last one it saw
            known = await self.membership.controller_seen_by_peers() or self.membership.last_known_controller
            if known is None:
                reason = f"degraded: node {me} cannot reach the cluster's etcd ({exc}) and knows no controller"
                return _unavailable(f"{reason} to forward to: try again, or ask another node")
            return Target(*known, etcd_lost=str(exc))  # it serves the request, or says it is not the controller
        if node_id == me:  # itself, last seen before etcd went out of reach: it stepped down since
            known = await self.membership.controller_seen_by_peers()
            if known is None:
                return _unavailable(f"node {me} stepped down as the controller and knows no other yet: try again")
            return Target(*known)
        if node_id is None:
            return _unavailable(
                "no node of the cluster is its controller yet (an election is under way): try again shortly"
            )
        if not url:
            return _unavailable(f"the cluster's controller, node {node_id}, has no API address yet: try again shortly")
        return Target(node_id, url)

    async def _forward(self, target: Target, scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:  # the body as it came (`exod.api.app`'s guard has bounded it already)
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        query = scope.get("query_string", b"").decode()
        url = self.membership.peer_url(target.url)
        dropped = HOP_BY_HOP | CREDENTIALS | {b"content-length"}
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in dropped]
        headers.append((FORWARDED, self.membership.node_id.encode()))
        headers.append((HEADER.encode(), self.membership.config.token.encode()))
        path = f"{url}{scope['path']}" + (f"?{query}" if query else "")
        request = self._client.build_request(scope["method"], path, headers=headers, content=body)
        relay = _Relay(target, scope, receive, send)
        with trio.CancelScope(deadline=trio.current_time() + self.idle) as bound:  # moved on by what it hears
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._vouch, url, bound, relay)
                await self._relay(request, relay, bound)
                nursery.cancel_scope.cancel()
        if bound.cancelled_caught:
            log.warning("forward to node %s: nothing heard for %g s", target.node_id, self.idle)
            await relay.silent(self.idle)

    async def _relay(self, request: httpx.Request, relay: _Relay, bound: trio.CancelScope) -> None:
        """The controller's answer to ``request``, as it comes; every part heard moves ``bound`` on (not the
        time the client takes to read it: a slow client is not a silent controller)."""
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            await relay.unreachable(exc)
            return
        try:
            bound.deadline = math.inf
            await relay.start(response)
            bound.deadline = trio.current_time() + self.idle
            try:
                async for chunk in response.aiter_raw():
                    bound.deadline = math.inf
                    await relay.body(chunk)
                    bound.deadline = trio.current_time() + self.idle
            except httpx.HTTPError as exc:  # the controller went away mid-answer
                log.warning("forward to node %s broke mid-answer: %s", relay.target.node_id, exc)
                await relay.fail(f"went away mid-stream ({type(exc).__name__})")
            await relay.end()
        finally:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_S):
                await response.aclose()

    async def _vouch(self, url: str, bound: trio.CancelScope, relay: _Relay) -> None:
        """While no stream's keep-alives speak for the controller (its answer's head not come yet, a plain
        body, Ollama's NDJSON), its /health does: each answer moves ``bound`` on."""
        while not relay.keeps_alive:
            answered = await self._answered_at(url)
            if answered is not None and not relay.keeps_alive:
                bound.deadline = max(bound.deadline, answered + self.idle)
            await trio.sleep(PROBE_S)

    async def _answered_at(self, url: str) -> float | None:
        """When the controller at ``url`` last answered its /health; asked again if not in the last `PROBE_S`,
        once for every request waiting on it."""
        async with self._asking.setdefault(url, trio.Lock()):
            if trio.current_time() - self._asked.get(url, -math.inf) >= PROBE_S:
                self._asked[url] = trio.current_time()
                try:
                    health = await self._client.get(f"{url}/health", timeout=PROBE_TIMEOUT_S)
                    if health.status_code == 200:
                        self._answered[url] = trio.current_time()
                except httpx.HTTPError:
                    pass
        return self._answered.get(url)


@attrs.define
class _Relay:
    """The client's side of one forward: what it was sent so far, and how to end it in its dialect."""

    target: Target
    scope: Scope
    receive: Receive
    send: Send
    started: bool = False
    keeps_alive: bool = False  # a server-sent-event stream: its keep-alives speak for the controller
    ndjson: bool = False
    ended: bool = False

    async def start(self, response: httpx.Response) -> None:
        kind = response.headers.get("content-type", "")
        self.keeps_alive, self.ndjson = kind.startswith("text/event-stream"), kind.startswith("application/x-ndjson")
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
        await self.send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        self.started = True

    async def body(self, chunk: bytes) -> None:
        await self.send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self) -> None:
        if not self.ended:
            self.ended = True
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def fail(self, what: str) -> None:
        """The end of an answer whose controller is lost, in the dialect's words: a stream's error event (and
        ``[DONE]``), an NDJSON error line; a plain body is cut short (its length is not met: a client fails)."""
        message = f"the cluster's controller, node {self.target.node_id}, {what}"
        if self.keeps_alive:
            await self.body(_ended(message, anthropic=self.scope["path"].startswith(ANTHROPIC_PATHS)))
        elif self.ndjson:
            await self.body(json.dumps({"error": message}).encode() + b"\n")

    async def silent(self, idle: float) -> None:
        """Nothing heard from the controller for ``idle`` seconds, its /health included: 504 if the answer has
        not begun, the dialect's error at its end otherwise."""
        if self.ended:
            return
        if self.started:
            await self.fail(f"went silent mid-stream: nothing for {idle:g} s ([cluster] forward_idle)")
            await self.end()
            return
        what = f"answered nothing for {idle:g} s ([cluster] forward_idle), nor did its /health"
        if self.target.etcd_lost is not None:
            await self.unreachable(httpx.ReadTimeout(what))
            return
        message = f"the cluster's controller, node {self.target.node_id}, {what}: it is gone or stopped; try again"
        error = ApiError(504, message, code="controller_lost", headers={"Retry-After": "1"})
        await error.response(self.scope["path"])(self.scope, self.receive, self.send)
        self.ended = True

    async def unreachable(self, exc: httpx.HTTPError) -> None:
        """No answer began: the request could not be sent (502), or its connection broke before the answer's
        head (502, ``controller_lost``: TCP keep-alive found its host gone); 503 where the controller is only
        the one this node last knew, its etcd out of reach."""
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        node = f"node {self.target.node_id}"
        if self.target.etcd_lost is not None:
            message = (
                f"degraded: this node cannot reach the cluster's etcd ({self.target.etcd_lost}), nor the controller "
                f"it last knew, {node} at {self.target.url} ({why}): try again, or ask another node"
            )
            error = ApiError(503, message, code="controller_unavailable", headers={"Retry-After": "1"})
        elif isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
            message = f"the cluster's controller, {node}, could not be reached: {why}"
            error = ApiError(502, message, headers={"Retry-After": "1"})
        else:
            message = f"the cluster's controller, {node}, was lost before it answered ({why}): try again shortly"
            error = ApiError(502, message, code="controller_lost", headers={"Retry-After": "1"})
        await error.response(self.scope["path"])(self.scope, self.receive, self.send)
        self.ended = True


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


def _ended(message: str, *, anthropic: bool = False) -> bytes:
    """The end of a stream whose controller is lost, in the dialect's own words."""
    if anthropic:
        error = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(error)}\n\n".encode()
    openai = {"message": message, "type": "server_error", "param": None, "code": "controller_lost"}
    return f"data: {json.dumps({'error': openai})}\n\ndata: [DONE]\n\n".encode()
