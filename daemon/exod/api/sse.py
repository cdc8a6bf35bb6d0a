"""Server-sent events: their framing, and the response that streams them.

Not sse-starlette, which exod used until 2026-12-06: it runs four tasks per response (the stream, a pinger,
a disconnect watcher, a shutdown watcher) and opens a cancel scope around every event it sends: the
response was 15 % of the daemon's CPU on a one-token request (bench/README.md). Here the stream runs in the
response's task, beside one watcher that ends it when the client goes away and one that sends a keepalive
only after ``keepalive`` seconds of silence. The daemon's shutdown needs no watcher: it drains the HTTP requests itself
(`exod.api.drain`). A stream another node of a cluster forwards (`exod.api.forward`) is kept alive every
`NODE_KEEPALIVE_S` instead: that node ends a stream silent past ``[cluster] forward_idle`` as its controller's loss,
and the comment is what it hears (in every dialect: an SSE client ignores a comment, Anthropic's included).

A stream yields bytes, one event or several: what is ready at the same moment is written as one chunk
(a chat's finish, usage and ``[DONE]``), one write to the client instead of one each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from exod.cluster.token import FORWARDED_BY, NODE_KEEPALIVE_S

KEEPALIVE_S = 15.0  # what proxies commonly allow a quiet connection, with room to spare
_FORWARDED_BY = FORWARDED_BY.lower().encode()
CLOSE_S = 5.0  # for a stream's `finally` (what its request held is released there)


def event(data: str, name: str | None = None, id: str | None = None) -> bytes:
    """One event, framed. ``data`` must be one line (JSON as `json.dumps` writes it by default)."""
    if "\n" in data or "\r" in data:
        raise ValueError("an event's data must be one line: encode it as JSON")
    head = ("" if id is None else f"id: {id}\n") + ("" if name is None else f"event: {name}\n")
    return f"{head}data: {data}\n\n".encode()


def comment(text: str) -> bytes:
    """A comment line: clients ignore it, proxies see the connection is alive."""
    return f": {' '.join(text.splitlines())}\n\n".encode()


class EventStream(Response):
    """A ``text/event-stream`` response of what ``events`` yields, each as it comes.

    The stream ends when ``events`` does, or when the client goes away: then ``events`` is closed (its
    ``finally`` runs, at once), so that what it held (a runner's batch slot) is freed."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], *, keepalive: float = KEEPALIVE_S) -> None:
        # not Response.__init__: it would render an empty body and declare it (content-length: 0)
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events, self.keepalive = events, keepalive
        self._last_write = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._last_write = trio.current_time()
        keepalive = self.keepalive
        if any(k.lower() == _FORWARDED_BY for k, _ in scope.get("headers", ())):  # a node listens for silence
            keepalive = min(keepalive, NODE_KEEPALIVE_S)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._until_disconnect, receive, nursery.cancel_scope)
                nursery.start_soon(self._keep_alive, send, keepalive)
                async for chunk in self.events:
                    self._last_write = trio.current_time()
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                nursery.cancel_scope.cancel()
        except* Exception as group:  # the stream's own error, as it was raised (the watchers raise none)
            raise group.exceptions[0] from None
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:  # its `finally` runs now, even when the response was cancelled; bounded
                with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_S):
                    await aclose()

    @staticmethod
    async def _until_disconnect(receive: Receive, stream: trio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        stream.cancel()

    async def _keep_alive(self, send: Send, keepalive: float) -> None:
        while True:
            await trio.sleep_until(self._last_write + keepalive)
            if trio.current_time() >= self._last_write + keepalive:
                self._last_write = trio.current_time()
                await send({"type": "http.response.body", "body": comment("keepalive"), "more_body": True})
