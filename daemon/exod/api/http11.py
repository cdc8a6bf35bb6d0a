"""An HTTP/1.1 connection served with h11 directly: each request is the connection's own task's work.

Why not hypercorn's, which served it until 2026-12 (and still serves HTTP/2, `exod.api.http_server`): for each
request it builds a stream object, spawns the application as a task of its own and passes every event through
three layers (its protocol wrapper, its h11 protocol, the stream), taking a lock and a shielded scope at each
write. On a trivial ASGI app a one-shot streamed request took 0.97 ms through it and 0.55 ms here (the standard
library's ``http.server``: 0.57), a third of what separated a request's cost in exod from mlx_lm.server's (#30).

Theory of operation. `Http11.serve` reads a request's head, runs the application with the ``receive`` and
``send`` of that request, and when both sides are done with it (h11's ``DONE``) starts the next; anything else
closes the connection. The limits are the server's (`exod.api.http_server`): the head must come within
``keep_alive_timeout`` of the connection opening or the last answer ending; the body's deadline is a
middleware's; each write has ``send_timeout`` to be taken, or the connection is closed as if the client had
hung up. Once the body is read, ``receive`` waits for the client to go (``http.disconnect``), which is how a
streaming answer learns that nobody listens any more; writes to a client that has gone are dropped.
"""

from __future__ import annotations

import contextlib
import email.utils
import logging
import time
from typing import Any
from urllib.parse import unquote

import h11
import trio
from starlette.types import ASGIApp, Message

log = logging.getLogger("exod.http")

MAX_HEAD = 64 * 1024  # bytes of a request's head (and of what a client sends ahead while it is answered)
READ_SIZE = 64 * 1024
_NO_BODY = frozenset({204, 304})


class _Date:
    """The ``Date`` header (RFC 9110 §6.6.1), formatted once a second rather than at every answer."""

    second, value = -1, b""

    @classmethod
    def now(cls) -> bytes:
        second = int(time.time())
        if second != cls.second:
            cls.second, cls.value = second, email.utils.formatdate(second, usegmt=True).encode()
        return cls.value


async def send_whole(stream: trio.abc.SendStream, data: bytes, timeout: float) -> bool:
    """Send ``data`` whole or not at all, within ``timeout``: a write cut midway would garble the stream, so it
    is shielded, but a shielded scope's own deadline still ends it (a client that takes nothing for that long is
    gone). Whether the client took it; both protocols' writes (HTTP/2's in `exod.api.http_server`)."""
    try:
        with trio.CancelScope(shield=True, deadline=trio.current_time() + timeout) as waited:
            await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False
    if waited.cancelled_caught:
        log.warning("a client took nothing for %g s: its connection is closed", timeout)
    return not waited.cancelled_caught


class _Gone(Exception):
    """The client went, or took nothing for ``send_timeout``: the connection is over."""


class Http11:
    """One client's connection, from its first request to its close."""

    def __init__(
        self,
        app: ASGIApp,
        stream: trio.SocketStream,
        *,
        keep_alive_timeout: float,
        send_timeout: float,
        state: dict[str, Any],
    ) -> None:
        self.app, self.stream, self.state = app, stream, state
        self.keep_alive_timeout, self.send_timeout = keep_alive_timeout, send_timeout
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self._writing = trio.Lock()  # an app may write from two tasks (a stream, its keepalive)
        self._gone = False
        try:
            self._client, self._server = stream.socket.getpeername()[:2], stream.socket.getsockname()[:2]
        except OSError:  # reset before it was accepted: `serve` reads that it is over
            self._client = self._server = None

    async def serve(self, first: bytes = b"", *, opened: float | None = None) -> None:
        """Answer requests until the connection ends; ``first``: what was read of it already, since ``opened``
        (trio time; now if not given): the first request's head is due ``keep_alive_timeout`` after it."""
        self.h11.receive_data(first)
        since = trio.current_time() if opened is None else opened
        try:
            while (request := await self._next_request(since)) is not None:
                await self._answer(request)
                if self._gone or self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                    return  # an answer cut short, a body left unread, or `Connection: close`
                self.h11.start_next_cycle()
                since = trio.current_time()
        finally:
            await self._close()

    async def _next_request(self, since: float) -> h11.Request | None:
        """The next request's head, or None once the client closes, errs, or sends none within
        ``keep_alive_timeout`` of ``since`` (the connection's opening, or the last answer's end)."""
        with trio.move_on_at(since + self.keep_alive_timeout):
            while True:
                try:
                    event = self.h11.next_event()
                except h11.RemoteProtocolError as exc:
                    await self._refuse(exc.error_status_hint)
                    return None
                if isinstance(event, h11.Request):
                    return event
                if event is not h11.NEED_DATA:  # ConnectionClosed, or PAUSED with nothing to answer
                    return None
                if not await self._read():
                    return None
        return None  # idle too long, or its head too slow: `exod.api.http_server`'s headers gate

    async def _read(self) -> bool:
        """Feed h11 what the client sends next; False once it has gone."""
        try:
            data = await self.stream.receive_some(READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        self.h11.receive_data(data)  # b"": h11 notes the close
        if not data:
            self._gone = True
        return bool(data)

    async def _answer(self, request: h11.Request) -> None:
        raw_path, _, query = request.target.partition(b"?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.1"},
            "http_version": request.http_version.decode(),
            "method": request.method.decode("ascii").upper(),
            "scheme": "http",
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": list(request.headers),
            "client": self._client,
            "server": self._server,
            "state": self.state.copy(),
            "extensions": {},
        }
        answer = _Answer(self, scope["method"])
        try:
            await self.app(scope, answer.receive, answer.send)
        except Exception:
            log.exception("the API failed on %s %s", scope["method"], scope["path"])
        if not answer.started and not self._gone:
            await self._refuse(500)
        elif not answer.ended:  # the app returned or failed midway: the client cannot tell the answer is whole
            self._gone = True

    async def _refuse(self, status: int) -> None:
        """An empty answer, and the connection closed after it (a request h11 could not read, or no answer)."""
        head = h11.Response(status_code=status, headers=[(b"content-length", b"0"), (b"connection", b"close")])
        with contextlib.suppress(h11.LocalProtocolError, _Gone):
            await self.write(self.h11.send(head) + self.h11.send(h11.EndOfMessage()))
        self._gone = True

    async def write(self, data: bytes) -> None:
        """Send ``data`` (`send_whole`); a client that did not take it is gone (`_Gone`)."""
        if self._gone:
            await trio.lowlevel.checkpoint()  # an app writing on and on to a client that left must let others run
            raise _Gone
        try:
            self._writing.acquire_nowait()  # no checkpoint when nothing else writes (the common case)
        except trio.WouldBlock:
            await self._writing.acquire()
        try:
            taken = await send_whole(self.stream, data, self.send_timeout)
        finally:
            self._writing.release()
        if not taken:
            self._gone = True
            await self.stream.aclose()  # a reader of this connection (`_Answer.receive`) hears it is over
            raise _Gone

    async def _close(self) -> None:
        with trio.CancelScope(shield=True):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await self.stream.send_eof()
            await self.stream.aclose()


async def _disconnect() -> Message:
    await trio.lowlevel.checkpoint()  # as every trio call: an app that loops on `receive` lets the others run
    return {"type": "http.disconnect"}


class _Answer:
    """The ASGI ``receive`` and ``send`` of one request."""

    def __init__(self, connection: Http11, method: str) -> None:
        self.connection, self.head_only = connection, method == "HEAD"
        self.started = self.ended = self._body_read = False
        self._no_body = self.head_only

    async def receive(self) -> Message:
        c = self.connection
        if self._body_read:  # nothing more to read: wait for the client to go
            while not c._gone:
                if len(c.h11.trailing_data[0]) > MAX_HEAD:  # piling up what it sends next: cut it off
                    await c.stream.aclose()
                    c._gone = True
                    break
                await c._read()
            return await _disconnect()
        while True:
            if c.h11.they_are_waiting_for_100_continue:
                try:
                    await c.write(c.h11.send(h11.InformationalResponse(status_code=100, headers=[])))
                except _Gone:
                    return await _disconnect()
            try:
                event = c.h11.next_event()
            except h11.RemoteProtocolError:  # a malformed body: nothing more can be read of this connection
                c._gone = True
                return await _disconnect()
            if isinstance(event, h11.Data):
                return {"type": "http.request", "body": bytes(event.data), "more_body": True}
            if isinstance(event, h11.EndOfMessage):
                self._body_read = True
                return {"type": "http.request", "body": b"", "more_body": False}
            if event is not h11.NEED_DATA or c._gone or not await c._read():
                return await _disconnect()

    async def send(self, message: Message) -> None:
        c, kind = self.connection, message["type"]
        if kind == "http.response.start" and not self.started:
            self.started = True
            status = int(message["status"])
            self._no_body = self.head_only or status in _NO_BODY or status < 200
            headers = [(bytes(k).strip(), bytes(v).strip()) for k, v in message.get("headers", [])]
            headers.append((b"date", _Date.now()))
            data = c.h11.send(h11.Response(status_code=status, headers=headers))
        elif kind == "http.response.body" and self.started and not self.ended:
            body = b"" if self._no_body else bytes(message.get("body", b""))
            data = c.h11.send(h11.Data(data=body)) if body else b""
            if not message.get("more_body", False):
                self.ended = True
                data += c.h11.send(h11.EndOfMessage())
            if not data:
                await trio.lowlevel.checkpoint()
                return
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} (response started: {self.started})")
        with contextlib.suppress(_Gone):  # dropped: the client has gone, and the app hears of it from `receive`
            await c.write(data)
