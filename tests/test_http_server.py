"""exod.api.http_server: a client that sends half a request, or opens too many connections, cannot hold the daemon.

Real sockets on 127.0.0.1 (port 0) and a trivial ASGI app, in-process under ``trio.run``; short limits, so
each test takes about a second of real time.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from exod.api.http_server import serve_http
from exod.config import DaemonConfig, ServeConfig

REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"
FREED: list[float] = []  # when a /flood request let go of what it held (trio time)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body (as exod's API does), then answers; ``/lazy`` reads late, ``/slow`` answers late,
    ``/stream`` trickles its answer."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/lazy":
        await trio.sleep(1)
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/flood":  # answers for ever, a megabyte at a time, until the client goes (as Starlette's
        try:  # streams do: they watch for the disconnect)
            async with trio.open_nursery() as streaming:

                async def until_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    streaming.cancel_scope.cancel()

                streaming.start_soon(until_disconnect)
                while True:
                    await send({"type": "http.response.body", "body": b"x" * (1 << 20), "more_body": True})
        finally:
            FREED.append(trio.current_time())
    if scope["path"] == "/slow":
        await trio.sleep(1.5)
    if scope["path"] == "/stream":
        for _ in range(6):
            await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
            await trio.sleep(0.25)
    await send({"type": "http.response.body", "body": b"got %d bytes" % len(body)})


def serving(tmp_path: Path, body: Callable[[int], Awaitable[Any]], **limits: Any) -> Any:
    """Run ``serve_http(app)`` on a free port, then ``body(port)``, then stop the server; all within 20 s."""
    config = ServeConfig(daemon=DaemonConfig(state_dir=tmp_path), port=0, **limits)

    async def main() -> Any:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                urls = await nursery.start(partial(serve_http, app, config))
                assert urls[0].startswith("http://127.0.0.1:")
                result = await body(int(urls[0].rsplit(":", 1)[1]))
                nursery.cancel_scope.cancel()
        return result

    return trio.run(main)


async def connect(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


async def until_closed(stream: trio.SocketStream, limit: float = 10.0) -> tuple[float, bytes]:
    """Read until the server closes the connection: (seconds it took, what it sent)."""
    started, data = trio.current_time(), b""
    with trio.fail_after(limit):
        while True:
            try:
                chunk = await stream.receive_some()
            except trio.BrokenResourceError:  # reset: closed just the same
                break
            if not chunk:
                break
            data += chunk
    return trio.current_time() - started, data


async def answered_within(stream: trio.SocketStream, seconds: float) -> bytes | None:
    """The first bytes of the answer, or None if nothing came in ``seconds``."""
    with trio.move_on_after(seconds):
        return await stream.receive_some()
    return None


def test_half_sent_headers_are_closed_at_the_keep_alive_timeout(tmp_path):
    async def body(port: int) -> tuple[float, bytes]:
        stream = await connect(port)
        await stream.send_all(b"POST / HTTP/1.1\r\nHost: test\r\n")  # the blank line never comes
        return await until_closed(stream)

    elapsed, data = serving(tmp_path, body, keep_alive_timeout=0.5, read_timeout=5)
    assert 0.4 <= elapsed < 3 and data == b""


def test_a_kept_alive_connection_serves_again_and_is_closed_a_keep_alive_timeout_after_its_last_answer(tmp_path):
    """The keep-alive timer runs again from each answer's end, and stops while a request is served."""

    async def body(port: int) -> tuple[list[bytes], float, bytes]:
        stream = await connect(port)
        heads = []
        for _ in range(3):  # each within the timeout of the one before
            await trio.sleep(0.3)
            await stream.send_all(b"GET /slow HTTP/1.1\r\nHost: test\r\n\r\n")  # an answer longer than the timeout
            data = b""
            while not data.endswith(b"got 0 bytes\r\n0\r\n\r\n"):  # the chunked body's end
                data += await stream.receive_some()
            heads.append(data.split(b"\r\n", 1)[0])
        elapsed, rest = await until_closed(stream)
        return heads, elapsed, rest

    heads, elapsed, rest = serving(tmp_path, body, keep_alive_timeout=0.5, read_timeout=5)
    assert heads == [b"HTTP/1.1 200 "] * 3
    assert 0.4 <= elapsed < 3 and rest == b""


def test_half_sent_body_is_a_408_and_closed_at_the_read_timeout(tmp_path):
    async def body(port: int) -> tuple[float, bytes]:
        stream = await connect(port)
        await stream.send_all(b"POST / HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\n" + b"x" * 40)
        return await until_closed(stream)

    elapsed, data = serving(tmp_path, body, keep_alive_timeout=5, read_timeout=0.5)
    assert 0.4 <= elapsed < 3
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    error = json.loads(payload)["error"]
    assert error["type"] == "invalid_request_error" and "took over 0.5 s to arrive" in error["message"]


def test_slow_answers_and_long_streams_are_not_cut_by_the_timeouts(tmp_path):
    """Only waiting on the client counts; on HTTP/1.1 and on HTTP/2 (where hypercorn's read_timeout would cut)."""

    async def body(port: int) -> list[tuple[str, int, str]]:
        seen = []
        for http2 in (False, True):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", http1=not http2, http2=http2) as c:
                for path in ("/lazy", "/slow", "/stream"):
                    response = await c.post(path, content=b"hello", timeout=10)
                    seen.append((response.http_version, response.status_code, response.text))
        return seen

    seen = serving(tmp_path, body, keep_alive_timeout=0.3, read_timeout=0.3)
    assert [(version, status) for version, status, _ in seen] == [("HTTP/1.1", 200)] * 3 + [("HTTP/2", 200)] * 3
    assert all(text.endswith("got 5 bytes") for _, _, text in seen)
    assert seen[2][2].count("tick") == seen[5][2].count("tick") == 6


def test_a_client_that_stops_reading_a_stream_is_cut_off_at_the_send_timeout_and_its_request_freed(tmp_path):
    """Issue #25: a stream whose client never reads was never cut, and kept what its request held."""

    async def body(port: int) -> tuple[float, float]:
        FREED.clear()
        stream = await connect(port)
        asked = trio.current_time()
        await stream.send_all(b"GET /flood HTTP/1.1\r\nHost: test\r\n\r\n")  # and never reads again
        with trio.fail_after(10):
            while not FREED:
                await trio.sleep(0.05)
        await stream.aclose()
        return FREED[0] - asked, trio.current_time() - asked

    freed_after, _ = serving(tmp_path, body, send_timeout=0.5)
    assert 0.5 <= freed_after < 5  # the buffers fill within a moment; then half a second, and it is let go


def test_connections_beyond_the_limit_wait_until_one_closes_and_the_server_keeps_serving(tmp_path):
    async def body(port: int) -> dict[str, Any]:
        holders = [await connect(port) for _ in range(2)]  # the limit: idle, holding their slots
        await trio.sleep(0.2)  # both accepted
        extra = [await connect(port) for _ in range(3)]  # connected in the kernel's backlog, not accepted
        for stream in extra:
            await stream.send_all(REQUEST)
        waited = [await answered_within(stream, 0.3) for stream in extra]
        await holders[0].aclose()  # one slot free: one of the waiting is served
        freed = await answered_within(extra[0], 5)
        for stream in extra:
            await stream.aclose()
        await holders[1].aclose()
        async with httpx.AsyncClient() as client:  # all closed: the server answers as before
            after = [(await client.get(f"http://127.0.0.1:{port}/", timeout=5)).status_code for _ in range(3)]
        return {"waited": waited, "freed": freed, "after": after}

    result = serving(tmp_path, body, keep_alive_timeout=10, read_timeout=10, max_connections=2)
    assert result["waited"] == [None, None, None]
    assert result["freed"] is not None and result["freed"].startswith(b"HTTP/1.1 200")
    assert result["after"] == [200, 200, 200]


def test_the_limit_holds_under_a_flood_of_half_sent_requests(tmp_path):
    """50 clients each send half a request; with 4 slots and short timeouts every one is closed, none hangs."""

    async def body(port: int) -> tuple[list[float], int]:
        closed: list[float] = []

        async def half(i: int) -> None:
            stream = await connect(port)
            await stream.send_all(b"POST / HTTP/1.1\r\nHost: test\r\nContent-Length: 10\r\n\r\nabc")
            elapsed, _ = await until_closed(stream, limit=15)
            closed.append(elapsed)

        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(half, i)
        async with httpx.AsyncClient() as client:
            status = (await client.get(f"http://127.0.0.1:{port}/", timeout=5)).status_code
        return closed, status

    closed, status = serving(tmp_path, body, keep_alive_timeout=0.2, read_timeout=0.2, max_connections=4)
    assert len(closed) == 50 and status == 200
    assert max(closed) >= 0.2 * 50 / 4 * 0.8  # served four at a time, each one for its read timeout


def test_a_client_that_hangs_up_frees_its_slot_at_once(tmp_path):
    """hypercorn alone keeps a closed idle connection until its keep-alive timeout: one-shot clients would queue."""

    async def body(port: int) -> float:
        started = trio.current_time()
        for _ in range(10):
            async with httpx.AsyncClient() as client:  # a new connection each time, closed after the answer
                assert (await client.get(f"http://127.0.0.1:{port}/", timeout=15)).status_code == 200
        return trio.current_time() - started

    assert serving(tmp_path, body, keep_alive_timeout=10, max_connections=2) < 5
