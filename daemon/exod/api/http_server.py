"""The daemon's HTTP server: HTTP/1.1 by h11 (`exod.api.http11`), HTTP/2 by hypercorn, behind limits on what a
client can hold.

Why not ``hypercorn.trio.serve`` as it is: it accepts every connection it is offered (it has no limit of its
own, hypercorn issue #81), and a request whose headers are in but whose body never comes is waited for
forever. A local client that opens connections and sends half a request each holds file descriptors until
the daemon has none left to start runners with.

Theory of operation: a connection passes four gates, each with one limit.

* **accept**: the listener takes a slot before it accepts, and the connection gives it back when it
  closes, at once when its client hangs up (`_Connection`). With every slot taken the next client waits in
  the kernel's backlog (connected, not accepted: no file descriptor here, nothing read) until a connection
  closes; once the backlog is full too, the kernel refuses.
* **headers**: a keep-alive timer runs from connect, and from the end of each response, until a request's
  headers are complete; a client that has not sent them by then is closed.
* **body**: `RequestDeadline` lets the client keep the app waiting for its body ``read_timeout`` in all;
  late, the request is a 408 and the connection is closed. Only waiting on the client counts: an answer
  may take as long as it needs.
* **response**: no limit on how long. ``/events`` and long completions stream for as long as they last.
  (hypercorn's own ``read_timeout`` is therefore not used: on HTTP/2 it cuts off a client that only
  listens.) But a client has ``send_timeout`` to take each part of the answer (`_Connection`): one that
  stops reading (its buffers full) is cut off as if it had hung up, and what its request held (a
  runner's batch slot) is freed.

A client can still trickle its body a byte at a time for ``read_timeout``: the limits bound what it holds
and for how long, not that it is served before others.

A connection's first bytes say its protocol: HTTP/2's preface (a client with prior knowledge) goes to
hypercorn's per-connection `TCPServer`, anything else is HTTP/1.1, served by `exod.api.http11` (a third of a
short request's cost was hypercorn's, #30; an ``Upgrade: h2c`` is not taken). Of hypercorn's ``worker_serve``
this keeps the lifespan, and serves the connections with `trio.serve_listeners` over limited listeners.

Plain HTTP, and in a cluster with node-to-node TLS (`exod.cluster.tls`) TLS as well, on the same port: a
connection that opens with a TLS handshake record is served over TLS with the node's certificate, then as
above. Such a cluster's credential is taken only from a peer whose certificate its CA signed (`_NodeGate`).
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import ssl
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import repr_socket_addr, wrap_app
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exod.api.errors import ApiError
from exod.api.http11 import Http11, send_whole
from exod.cluster.agent import AGENT_PATHS
from exod.cluster.token import HEADER
from exod.config import ServeConfig

log = logging.getLogger("exod.http")


def hypercorn_config(config: ServeConfig) -> HypercornConfig:
    """hypercorn's settings for ``config``: where to bind, and how long an idle connection or headers may take."""
    hc = HypercornConfig()
    hc.bind = [f"{config.host}:{config.port}"]
    hc.accesslog = None
    hc.keep_alive_timeout = config.keep_alive_timeout  # also the time a new connection has for its headers
    hc.read_timeout = None  # the body has `RequestDeadline`; responses have no limit (see the module docstring)
    return hc


class RequestDeadline:
    """ASGI middleware: a client may keep the app waiting for its request body ``timeout`` seconds in all.

    Only the app's waits for body bytes count, so an app that takes its time to read or to answer is never
    cut off. A late client's request is cancelled out of the app (trio's `Cancelled` passes every
    ``except Exception``), then answered 408 with ``Connection: close``.
    """

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app, self.timeout = app, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        budget = self.timeout
        body_done = late = answered = False
        with trio.CancelScope() as request:

            async def receive_in_time() -> Message:
                nonlocal budget, body_done, late
                if body_done:
                    return await receive()
                asked = trio.current_time()
                with trio.move_on_after(budget):
                    message = await receive()
                    budget -= trio.current_time() - asked
                    body_done = message["type"] != "http.request" or not message.get("more_body", False)
                    return message
                late = True
                request.cancel()
                await trio.sleep_forever()  # raises Cancelled at once: the app unwinds as on any cancellation

            async def send_tracked(message: Message) -> None:
                nonlocal answered
                answered = answered or message["type"] == "http.response.start"
                await send(message)

            await self.app(scope, receive_in_time, send_tracked)
        if late and not answered:
            error = ApiError(
                408,
                f"the request body took over {self.timeout:g} s to arrive; send it whole, at once",
                headers={"Connection": "close"},
            )
            await error.response(scope["path"])(scope, receive, send)


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # how an HTTP/2 client with prior knowledge opens (RFC 9113 §3.4)


async def _opening(stream: trio.SocketStream, timeout: float) -> bytes:
    """The connection's first bytes, enough to tell HTTP/2's preface from an HTTP/1.1 request; b"" if the
    client sent nothing within ``timeout`` (the headers gate) or closed."""
    opening = b""
    with trio.move_on_after(timeout):
        while H2_PREFACE.startswith(opening[: len(H2_PREFACE)]) and len(opening) < len(H2_PREFACE):
            try:
                data = await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return b""
            if not data:
                return b""
            opening += data
        return opening
    return b""


class _Replayed(trio.abc.HalfCloseableStream):
    """``stream`` with the bytes already read of it put back in front, for hypercorn to read again."""

    def __init__(self, stream: trio.SocketStream, read: bytes) -> None:
        self.stream, self._read = stream, read
        self.socket = stream.socket

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._read:
            await trio.lowlevel.checkpoint()
            data, self._read = self._read, b""
            return data
        return await self.stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


TLS_HANDSHAKE = 0x16  # the first byte of a TLS connection: a handshake record (RFC 8446 §5.1)
_TOKEN_HEADER = HEADER.lower().encode()


class _Secured(trio.abc.HalfCloseableStream):
    """A connection served over TLS, as `Http11` and hypercorn read a plain one (its ``socket``); ``peer`` is
    the subject of the certificate the client showed, which the CA signed (None: it showed none)."""

    def __init__(self, stream: trio.SSLStream[_Replayed], socket: Any) -> None:
        self.tls, self.socket = stream, socket
        certificate = stream.getpeercert()
        self.peer = None if not certificate else str(certificate.get("subject") or certificate.get("subjectAltName"))

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.tls.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.tls.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.tls.wait_send_all_might_not_block()

    async def send_eof(self) -> None:  # TLS 1.2 has no half-close: `aclose` says close_notify
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await self.tls.aclose()


async def _handshake(
    stream: trio.SocketStream, opening: bytes, context: ssl.SSLContext, within: float
) -> _Secured | None:
    """The TLS handshake of a connection that opened with ``opening``; None if it failed (a certificate of another
    CA, said in the log: a node misconfigured is found there) or took over ``within``. The client is hung up on."""
    tls = trio.SSLStream(_Replayed(stream, opening), context, server_side=True)
    with trio.move_on_after(within):
        try:
            await tls.do_handshake()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            peer = _address(stream)
            log.info("TLS handshake refused from %s: %s", peer, exc.__cause__ or exc or "the client hung up")
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
            return None
        return _Secured(tls, stream.socket)
    with trio.CancelScope(shield=True):
        await trio.aclose_forcefully(stream)
    return None


def _address(stream: trio.SocketStream) -> str:
    try:
        return repr_socket_addr(stream.socket.family, stream.socket.getpeername())
    except OSError:
        return "a client that hung up"


class _NodeGate:
    """ASGI middleware of one connection of a cluster with node-to-node TLS: the cluster's token, and the agents'
    endpoints, are taken only from a peer whose certificate the CA signed (``peer``); anything else is
    answered as it would be without. A token seen on plain HTTP has crossed the network in the clear: refused,
    so that a node misconfigured to send it so is said at once, not served."""

    def __init__(self, app: ASGIApp, peer: str | None, scheme: str) -> None:
        self.app, self.peer, self.scheme = app, peer, scheme

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope["scheme"] = self.scheme
        if self.peer is None and (
            scope["path"].startswith(AGENT_PATHS) or any(k.lower() == _TOKEN_HEADER for k, _ in scope["headers"])
        ):
            message = (
                "this cluster's nodes talk over TLS only: a node's request needs https:// and a certificate of "
                "the cluster's CA ([cluster] tls_cert, tls_key, tls_ca)"
            )
            await ApiError(403, message, code="node_certificate_required").response(scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _Connection(TCPServer):
    """hypercorn's connection (HTTP/2 here), letting go as soon as the client has gone.

    hypercorn keeps a connection whose client closed it until its keep-alive timer ends, socket and all; with
    a limit on connections that would make every one-shot client hold a slot for ``keep_alive_timeout``.
    And it waits for ever for a client to take what it sends (its write is shielded from cancellation): a
    client that stopped reading held its request for as long as the answer lasted. Here a write the client
    has not taken in ``send_timeout`` ends the connection, as a client that hung up does.
    """

    send_timeout = math.inf  # set per server (`serve_http`)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.idle_task = _IdleTimer(self)

    async def protocol_send(self, event: Event) -> None:
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        async with self.send_lock:
            if not await send_whole(self.stream, event.data, self.send_timeout):
                await self.protocol.handle(Closed())

    async def _read_data(self) -> None:
        await super()._read_data()  # returns once the client closed (or the connection failed)
        self.idle_task.end()  # nothing left to wait for: the connection closes when its request is done


class _IdleTimer:
    """hypercorn's keep-alive timer, in its ``SingleTask`` shape: restarted as a connection opens and as each
    response ends, stopped as each request's headers are in. hypercorn's own starts a task at every restart
    (a twentieth of the daemon's CPU on a short request); this one is one task per connection, asleep in a
    scope whose deadline the two move."""

    def __init__(self, connection: _Connection) -> None:
        self.connection = connection
        self._scope = trio.CancelScope(deadline=math.inf)
        self._running = self._ended = False

    async def restart(self, task_group: Any, _action: Any) -> None:
        self._scope.deadline = trio.current_time() + self.connection.config.keep_alive_timeout
        if not self._running:
            self._running = True
            task_group.spawn(self._close_when_idle)

    async def stop(self) -> None:
        self._scope.deadline = math.inf

    def end(self) -> None:
        """The connection is over: nothing to time (its task group waits for this task too)."""
        self._ended = True
        self._scope.cancel()

    async def _close_when_idle(self) -> None:
        with self._scope:
            await trio.sleep_forever()
        if not self._ended:  # idle past the deadline: hypercorn's own way to close
            with trio.CancelScope(shield=True):
                await self.connection._initiate_server_close()


class LimitedListener(trio.abc.Listener[trio.SocketStream]):
    """A listener that accepts only while a slot is free; the slot is the caller's to release when it closes."""

    def __init__(self, listener: trio.SocketListener, slots: trio.Semaphore) -> None:
        self.listener, self.slots = listener, slots

    async def accept(self) -> trio.SocketStream:
        await self.slots.acquire()
        try:
            return await self.listener.accept()
        except BaseException:
            self.slots.release()
            raise

    async def aclose(self) -> None:
        await self.listener.aclose()


class BindError(OSError):
    """The API's address cannot be listened on; the message says why and what to do."""


def bind(config: ServeConfig) -> list[socket.socket]:
    """The API's sockets, bound: done before anything else starts, so that a port in use starts nothing."""
    try:
        return list(hypercorn_config(config).create_sockets().insecure_sockets)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise BindError(f"port {config.port} is in use on {config.host}; pick another with --port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise BindError(f"{config.host} is not an address of this machine; pick another with --host") from None
        raise BindError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None


async def serve_http(
    app: ASGIApp,
    config: ServeConfig,
    sockets: list[socket.socket] | None = None,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``sockets`` (`bind`, by default now) until cancelled; ``task_status`` gets their URLs.

    At most ``config.max_connections`` connections are open at a time; see the module docstring for the rest.
    """
    hc = hypercorn_config(config)
    limited = RequestDeadline(app, config.read_timeout)
    wrapped = wrap_app(limited, hc.wsgi_max_body_size, "asgi")
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(wrapped, hc, lifespan_state)
    context = WorkerContext(None)
    slots = trio.Semaphore(config.max_connections, max_value=config.max_connections)
    tls = None if config.cluster is None or config.cluster.tls is None else config.cluster.tls.server_context()

    async def connection(stream: trio.SocketStream) -> None:
        try:
            opened = trio.current_time()
            opening = await _opening(stream, config.keep_alive_timeout)
            served: ASGIApp = limited
            if tls is not None:  # a cluster's node: TLS or plain HTTP, and a gate for the cluster's credential
                peer, scheme = None, "http"
                if opening[:1] == bytes([TLS_HANDSHAKE]):
                    left = opened + config.keep_alive_timeout - trio.current_time()
                    secured = await _handshake(stream, opening, tls, left)
                    if secured is None:
                        return
                    left = opened + config.keep_alive_timeout - trio.current_time()
                    stream, opening, peer, scheme = secured, await _opening(secured, left), secured.peer, "https"
                served = _NodeGate(limited, peer, scheme)
            if not opening.startswith(H2_PREFACE):
                try:  # a bug of ours on one connection must not end the server's other ones
                    http11 = Http11(
                        served,
                        stream,
                        keep_alive_timeout=config.keep_alive_timeout,
                        send_timeout=config.send_timeout,
                        state=lifespan_state,
                    )
                    await http11.serve(opening, opened=opened)  # closes the stream, at once if nothing came
                except Exception:
                    log.exception("HTTP/1.1 connection failed")
                return
            replayed = _Replayed(stream, opening)
            app_of_connection = wrapped if served is limited else wrap_app(served, hc.wsgi_max_body_size, "asgi")
            h2 = _Connection(app_of_connection, hc, context, ConnectionState(lifespan_state.copy()), replayed)
            h2.send_timeout = config.send_timeout
            await h2
        finally:
            slots.release()

    async with trio.open_nursery() as nursery:
        await nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        sockets = bind(config) if sockets is None else sockets
        listeners = []
        for sock in sockets:
            sock.listen(hc.backlog)
            listeners.append(LimitedListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)), slots))
        await nursery.start(partial(trio.serve_listeners, connection, listeners))  # it closes them when done
        task_status.started([f"http://{repr_socket_addr(s.family, s.getsockname())}" for s in sockets])
