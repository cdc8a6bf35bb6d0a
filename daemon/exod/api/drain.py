"""Draining: on SIGTERM or SIGINT the daemon stops taking work, and lets the work it took finish.

Why: a request cut without an answer is lost to its client, which cannot tell "not done" from "never
arrived"; a stream cut without an error and ``[DONE]`` looks like a complete answer. So nothing in
progress is cut silently.

Theory of operation. `serve` runs `Drain.run` once, between the signal and stopping the runners:

1. **gate**: from then on `Gate` answers every new HTTP request itself: 503 in its dialect's shape, with
   ``Retry-After`` and ``Connection: close`` (the client retries, on this daemon once it is back or on
   another). ``/health`` says 200 ``draining``, with the count still in progress (the daemon is alive);
   ``/ready``, like every other path, is a 503.
2. **wait**: the requests that came in before keep running, until the last one has sent its answer, for at
   most ``drain_timeout``; a second signal ends the wait at once (`Drain.hurry`).
3. **end the rest**: ``end_rest`` (the request book's `fail_all`) ends what is still running: a stream gets
   what was generated, an error event and ``data: [DONE]``; a plain request a 503. Those answers get
   `ANSWER_GRACE_S` to be written; a client that does not read them is cut.

A request counts from the gate until its whole answer is sent, not until its last token is in, so a
response is never cut between the two. ``/events`` does not count: it streams for as long as its client
listens, and would hold every drain to its timeout; it ends with the daemon.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import trio
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from exod.api.errors import ApiError
from exod.cluster.agent import AGENT_PATHS

RETRY_AFTER_S = 5  # a restart, the usual reason for a SIGTERM, has an instance Ready again in seconds
ANSWER_GRACE_S = 5.0  # for the ended requests to write their error; only a client that does not read waits it out
HEALTH = "/health"  # answered while draining: the daemon is alive
UNCOUNTED = frozenset({"/events"})  # endless streams: counting them would make every drain wait out its timeout
# The controller's commands to this node's agent are not client requests: while draining, they stop the runners
CONTROL_PLANE = AGENT_PATHS


def unavailable(message: str) -> ApiError:
    """The 503 of a daemon that is going away: nothing failed, and the same request succeeds once it is back."""
    return ApiError(503, message, headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})


class Drain:
    """The HTTP requests in progress, counted by `Gate`; once `run` starts, new ones are refused."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = trio.Event()  # set (and replaced) whenever the count falls to 0
        self._patience = trio.CancelScope()  # the wait of step 2; `hurry` cancels it

    async def run(self, timeout: float, end_rest: Callable[[str], None]) -> int:
        """Refuse new requests, wait up to ``timeout`` for those in progress, then ``end_rest(why)`` and give
        their answers `ANSWER_GRACE_S`. Returns how many were still in progress when the wait ended."""
        self.draining = True
        self._patience.deadline = trio.current_time() + timeout
        with self._patience:
            await self.wait_idle()
        left = self.in_flight
        end_rest(
            "exod is shutting down and ended this request before it finished (requests in progress get "
            f"{timeout:g} s: [limits] drain_timeout); retry it once exod is back, or on another daemon"
        )
        with trio.move_on_after(ANSWER_GRACE_S):
            await self.wait_idle()
        return left

    def hurry(self) -> None:
        """Stop waiting for the requests in progress: `run` ends them now (a second signal)."""
        self._patience.cancel()

    async def wait_idle(self) -> None:
        """Until no counted request is in progress."""
        if self.in_flight:
            await self._idle.wait()

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """One request in progress, for as long as the block runs."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()
                self._idle = trio.Event()


class Gate:
    """ASGI middleware: counts each HTTP request in `Drain` while it runs, and answers new ones while draining."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(CONTROL_PLANE):
            await self.app(scope, receive, send)
        elif self.drain.draining:
            await self._refuse(scope["path"])(scope, receive, send)
        elif scope["path"] in UNCOUNTED:
            await self.app(scope, receive, send)
        else:
            with self.drain.counted():
                await self.app(scope, receive, send)

    def _refuse(self, path: str) -> JSONResponse:
        if path == HEALTH:
            body = {"status": "draining", "in_flight": self.drain.in_flight}
            return JSONResponse(body, headers={"Connection": "close"})
        return unavailable(
            "exod is shutting down and takes no new requests; "
            f"retry in {RETRY_AFTER_S} s, once it is back, or on another daemon"
        ).response(path)  # in the dialect of the path: found by the fault campaign (#26) on /v1/messages
