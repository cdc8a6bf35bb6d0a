"""Server-sent events (`exod.api.sse`): the framing, and the response as an ASGI server drives it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

from exod.api.sse import EventStream, comment, event


def test_an_event_is_framed_with_its_id_and_name_first():
    assert event('{"a": 1}') == b'data: {"a": 1}\n\n'
    assert event("[DONE]", "done", id="7") == b"id: 7\nevent: done\ndata: [DONE]\n\n"
    assert comment("etcd is away\nretrying") == b": etcd is away retrying\n\n"


@pytest.mark.parametrize("data", ["two\nlines", "carriage\rreturn"])
def test_data_of_more_than_one_line_is_refused(data):
    with pytest.raises(ValueError, match="one line"):
        event(data)


class Client:
    """What an ASGI server gives the response: the body's messages as sent, a disconnect when told."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gone = trio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    @property
    def body(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def run(response: EventStream, client: Client, *also: Any, returned: Any = None) -> None:
    """Serve ``response`` to ``client`` beside ``also``'s tasks, on a clock that jumps (a hang fails at 600 s);
    ``returned`` is called the moment the response returns."""

    async def main() -> None:
        scope = {"type": "http", "method": "GET"}
        with trio.fail_after(600):
            if not also:  # what the response raises reaches the test as it is
                await response(scope, client.receive, client.send)
                return
            async with trio.open_nursery() as nursery:
                for task in also:
                    nursery.start_soon(task)
                await response(scope, client.receive, client.send)
                if returned is not None:
                    returned()
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_each_yield_is_one_write_and_the_end_closes_the_body():
    async def events() -> AsyncIterator[bytes]:
        yield event("1")
        yield event("2") + event("3")  # ready together: one write

    client = Client()
    run(EventStream(events()), client)
    start = client.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream") and b"content-length" not in headers
    assert client.body == [b"data: 1\n\n", b"data: 2\n\ndata: 3\n\n", b""]
    assert client.sent[-1]["more_body"] is False


def test_a_quiet_stream_gets_a_keepalive_and_a_busy_one_none():
    async def events(pause: float) -> AsyncIterator[bytes]:
        for i in range(3):
            await trio.sleep(pause)
            yield event(str(i))

    quiet, busy = Client(), Client()
    run(EventStream(events(25), keepalive=10), quiet)
    run(EventStream(events(5), keepalive=10), busy)
    keepalive = comment("keepalive")
    silence = [keepalive, keepalive]  # at 10 and 20 s after the last write, the event at 25
    assert quiet.body == [*silence, event("0"), *silence, event("1"), *silence, event("2"), b""]
    assert keepalive not in busy.body


@pytest.mark.parametrize("waiting_in", ["the stream", "a write"])
def test_a_client_that_goes_away_closes_the_stream_at_once(waiting_in):
    closed: list[str] = []

    async def events() -> AsyncIterator[bytes]:
        try:
            yield event("first")
            await trio.sleep_forever()
            yield event("never")
        finally:
            closed.append("closed")

    client = Client()
    if waiting_in == "a write":  # the client took the first event and no more: the response waits in send
        taken = client.send

        async def send(message: dict[str, Any]) -> None:
            await taken(message)
            if message.get("body"):
                await trio.sleep_forever()

        client.send = send  # type: ignore[method-assign]

    async def hang_up() -> None:
        await trio.sleep(1)
        client.gone.set()

    closed_by_then: list[str] = []
    run(EventStream(events()), client, hang_up, returned=lambda: closed_by_then.extend(closed))
    assert closed_by_then == ["closed"]  # not left to the garbage collector
    assert client.body == [event("first")]  # no end of the body: nobody is there to read it


def test_an_error_of_the_stream_is_raised_as_itself():
    async def events() -> AsyncIterator[bytes]:
        yield event("first")
        raise KeyError("broken")

    with pytest.raises(KeyError, match="broken"):
        run(EventStream(events()), Client())
