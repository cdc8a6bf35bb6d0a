"""exod.api.http_server: a client that sends half a request, or opens too many connections, cannot hold the daemon.

Real sockets on 127.0.0.1 (port 0) and a trivial ASGI app, in-process under ``trio.run``; short limits, so
each test takes about a second of real time.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
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
    if scope["path"] == "/boom":
        raise RuntimeError("planted: fails before answering")
    if scope["path"] == "/ignore-body":  # answers without reading what the client sends
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ignored"})
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
    if scope["path"] == "/half":
        await send({"type": "http.response.body", "body": b"a part", "more_body": True})
        raise RuntimeError("planted: fails midway through its answer")
    if scope["path"] == "/two-writers":  # as a stream and its keepalive do: two tasks writing one answer
        async with trio.open_nursery() as writers:
            for who in (b"a", b"b"):
                writers.start_soon(write_parts, send, who)
    if scope["path"].startswith("/scope/"):
        seen = {k: scope[k] for k in ("method", "path", "http_version")}
        seen |= {"raw_path": scope["raw_path"].decode(), "query": scope["query_string"].decode()}
        await send({"type": "http.response.body", "body": json.dumps(seen).encode() + b"\n", "more_body": True})
    if scope["path"] == "/slow":
        await trio.sleep(1.5)
    if scope["path"] == "/stream":
        for _ in range(6):
            await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
            await trio.sleep(0.25)
    await send({"type": "http.response.body", "body": b"got %d bytes" % len(body)})


async def write_parts(send: Any, who: bytes) -> None:
    for i in range(20):
        await send({"type": "http.response.body", "body": b"%s%d;" % (who, i), "more_body": True})


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


def test_the_head_is_due_a_keep_alive_timeout_after_connecting_however_its_first_bytes_came(tmp_path):
    """Reading the first bytes (to tell HTTP/2 from HTTP/1.1) does not restart the clock: no twice the timeout."""

    async def body(port: int) -> tuple[float, bytes]:
        stream = await connect(port)
        connected = trio.current_time()
        await trio.sleep(0.7)
        await stream.send_all(b"POST / HTTP/1.1\r\n")  # the first bytes late, the rest never
        _, data = await until_closed(stream)
        return trio.current_time() - connected, data

    elapsed, data = serving(tmp_path, body, keep_alive_timeout=1.0, read_timeout=5)
    assert 0.9 <= elapsed < 1.5 and data == b""


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


END = b"\r\n0\r\n\r\n"  # a chunked body's last chunk


async def answers(stream: trio.SocketStream, n: int) -> list[bytes]:
    """The next ``n`` whole answers (chunked, as the test app's are) on ``stream``."""
    data = b""
    with trio.fail_after(10):
        while data.count(END) < n:
            chunk = await stream.receive_some()
            assert chunk, f"closed before {n} answers: {data!r}"
            data += chunk
    return [answer + END for answer in data.split(END)[:n]]


def test_pipelined_requests_are_answered_in_order_on_one_connection(tmp_path):
    async def body(port: int) -> list[bytes]:
        stream = await connect(port)
        await stream.send_all(b"".join(b"GET /scope/%d HTTP/1.1\r\nHost: test\r\n\r\n" % i for i in range(3)))
        return await answers(stream, 3)

    got = serving(tmp_path, body)
    assert [json.loads(a.split(b"\r\n\r\n", 1)[1].split(b"\r\n")[1])["path"] for a in got] == [
        "/scope/0",
        "/scope/1",
        "/scope/2",
    ]


def test_what_the_app_is_told_of_a_request(tmp_path):
    """The path decoded (and raw), the query, the version; an ``Upgrade: h2c`` is answered in HTTP/1.1."""

    async def body(port: int) -> bytes:
        stream = await connect(port)
        await stream.send_all(
            b"GET /scope/a%20b?x=1&y=%C3%A9 HTTP/1.1\r\nHost: test\r\n"
            b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
        )
        return (await answers(stream, 1))[0]

    answer = serving(tmp_path, body)
    head, _, chunked = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"\r\ndate: " in head.lower()
    assert json.loads(chunked.split(b"\r\n")[1]) == {
        "method": "GET",
        "path": "/scope/a b",
        "raw_path": "/scope/a%20b",
        "query": "x=1&y=%C3%A9",
        "http_version": "1.1",
    }


def test_a_client_that_expects_100_continue_is_told_to_send_its_body(tmp_path):
    async def body(port: int) -> tuple[bytes | None, bytes]:
        stream = await connect(port)
        await stream.send_all(b"POST / HTTP/1.1\r\nHost: test\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        told = await answered_within(stream, 5)  # the body is not sent until then
        await stream.send_all(b"hello")
        return told, (await answers(stream, 1))[0]

    told, answer = serving(tmp_path, body)
    assert told is not None and told.startswith(b"HTTP/1.1 100 ")
    assert answer.startswith(b"HTTP/1.1 200") and b"got 5 bytes" in answer


def test_a_request_that_is_not_http_is_a_400_and_closed(tmp_path):
    async def body(port: int) -> tuple[float, bytes]:
        stream = await connect(port)
        await stream.send_all(b"HELLO THERE\r\n\r\n")
        return await until_closed(stream)

    _, data = serving(tmp_path, body)
    assert data.startswith(b"HTTP/1.1 400 ") and b"connection: close" in data.lower()


def test_an_app_that_fails_is_a_500_before_its_answer_and_an_unfinished_answer_after(tmp_path, caplog):
    async def body(port: int) -> list[bytes]:
        seen = []
        for path in (b"/boom", b"/half"):
            stream = await connect(port)
            await stream.send_all(b"GET %s HTTP/1.1\r\nHost: test\r\n\r\n" % path)
            seen.append((await until_closed(stream))[1])
        return seen

    boom, half = serving(tmp_path, body)
    assert boom.startswith(b"HTTP/1.1 500 ") and b"connection: close" in boom.lower()
    assert half.startswith(b"HTTP/1.1 200 ") and b"a part" in half and not half.endswith(END)  # cut: not whole
    assert [r.getMessage() for r in caplog.records if r.name == "exod.http"] == [
        "the API failed on GET /boom",
        "the API failed on GET /half",
    ]


def test_a_head_answer_has_no_body_and_the_connection_serves_on(tmp_path):
    async def body(port: int) -> tuple[bytes, bytes]:
        stream = await connect(port)
        await stream.send_all(b"HEAD / HTTP/1.1\r\nHost: test\r\n\r\n")
        with trio.fail_after(5):
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                head += await stream.receive_some()
        await stream.send_all(b"GET /scope/after HTTP/1.1\r\nHost: test\r\n\r\n")
        return head, (await answers(stream, 1))[0]

    head, after = serving(tmp_path, body)
    assert head.startswith(b"HTTP/1.1 200 ") and b"got" not in head
    assert after.startswith(b"HTTP/1.1 200 ") and b"/scope/after" in after  # nothing of the HEAD's body before it


def test_an_answer_to_a_request_whose_body_was_not_read_ends_the_connection(tmp_path, caplog):
    """What is left of that body cannot be told from a next request: the connection is not used again."""

    async def body(port: int) -> tuple[float, bytes, int]:
        stream = await connect(port)
        await stream.send_all(b"POST /ignore-body HTTP/1.1\r\nHost: test\r\nContent-Length: 10\r\n\r\n")
        elapsed, data = await until_closed(stream)
        async with httpx.AsyncClient() as client:
            status = (await client.get(f"http://127.0.0.1:{port}/", timeout=5)).status_code
        return elapsed, data, status

    elapsed, data, status = serving(tmp_path, body, keep_alive_timeout=10)
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"ignored" + END) and elapsed < 5
    assert status == 200 and not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_two_tasks_writing_one_answer_write_in_turn(tmp_path):
    async def body(port: int) -> bytes:
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://127.0.0.1:{port}/two-writers", timeout=10)
            assert response.status_code == 200
            return response.content

    content = serving(tmp_path, body)
    parts = content.split(b";")[:-1]
    assert sorted(parts) == sorted([b"a%d" % i for i in range(20)] + [b"b%d" % i for i in range(20)])


def test_a_client_that_resets_before_it_is_accepted_costs_nothing(tmp_path, caplog):
    """Its address can no longer be asked for: the connection is over before it began, quietly."""

    async def body(port: int) -> int:
        holder = await connect(port)  # the only slot: the next connection waits in the backlog
        await trio.sleep(0.2)
        reset = await connect(port)
        reset.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await reset.aclose()  # a reset, while it is still in the backlog
        await holder.aclose()  # the slot is free: the reset connection is accepted now
        async with httpx.AsyncClient() as client:
            return (await client.get(f"http://127.0.0.1:{port}/", timeout=5)).status_code

    assert serving(tmp_path, body, max_connections=1) == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
