"""What wraps every request (`exod.api.middleware`): the request's id, HEAD, CORS — on a small app of the same
shape as the daemon's, through httpx's ASGI transport; the daemon's own are checked in tests/test_api.py."""

from __future__ import annotations

import httpx
import pytest
import trio
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from exod.api.errors import install
from exod.api.middleware import BodyCap, HeadAsGet, RequestId, cors
from exod.config import cors_origin


def app(origins: tuple[str, ...] = ()) -> object:
    inner = FastAPI()
    install(inner)  # the daemon's error handlers: a HEAD's end must not look like an error to them

    @inner.get("/thing")
    async def thing() -> dict:
        return {"answer": 42}

    @inner.post("/thing")
    async def post_thing() -> dict:
        return {"posted": True}

    @inner.get("/forever")
    async def forever() -> StreamingResponse:
        async def lines():
            while True:
                yield b"data: tick\n\n"
                await trio.sleep(0.01)

        return StreamingResponse(lines(), media_type="text/event-stream")

    return RequestId(HeadAsGet(cors(BodyCap(inner, 1024), origins)))


async def call(asgi, method: str, path: str, **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(asgi), base_url="http://exod") as client:
        with trio.fail_after(10):
            return await client.request(method, path, **kwargs)


def run(asgi, method: str, path: str, **kwargs) -> httpx.Response:
    return trio.run(lambda: call(asgi, method, path, **kwargs))


def test_every_answer_carries_a_request_id_the_clients_own_when_usable():
    asgi = app()
    fresh = [run(asgi, "GET", "/thing").headers["x-request-id"] for _ in range(2)]
    assert fresh[0] != fresh[1] and all(i.startswith("req_") for i in fresh)
    assert run(asgi, "GET", "/thing", headers={"x-request-id": "client-7"}).headers["x-request-id"] == "client-7"
    for unusable in ("has space", "x" * 129, ""):  # not echoed into a header as it came
        given = run(asgi, "GET", "/thing", headers={"x-request-id": unusable}).headers["x-request-id"]
        assert given.startswith("req_")
    assert run(asgi, "GET", "/nowhere").headers["x-request-id"].startswith("req_")  # errors too
    assert run(asgi, "POST", "/thing", content=b"x" * 2048).status_code == 413


def test_head_is_answered_wherever_get_is_with_its_headers_and_no_body(caplog):
    asgi = app()
    get, head = run(asgi, "GET", "/thing"), run(asgi, "HEAD", "/thing")
    assert head.status_code == get.status_code == 200
    assert head.content == b"" and head.headers["content-length"] == get.headers["content-length"]
    assert head.headers["content-type"] == get.headers["content-type"]
    endless = run(asgi, "HEAD", "/forever")  # an endless stream's HEAD ends: its headers are all it owes
    assert endless.status_code == 200 and endless.headers["content-type"].startswith("text/event-stream")
    assert run(asgi, "HEAD", "/nowhere").status_code == 404
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # every HEAD once logged "unhandled error"


PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}


def test_cors_is_off_unless_asked():
    asgi = app()
    assert "access-control-allow-origin" not in run(asgi, "GET", "/thing", headers={"origin": "http://a.test"}).headers
    refused = run(asgi, "OPTIONS", "/thing", headers={"origin": "http://a.test", **PREFLIGHT})
    assert refused.status_code == 405 and "access-control-allow-origin" not in refused.headers


def test_cors_answers_the_preflight_of_a_listed_origin_and_never_allows_credentials():
    asgi = app(("http://a.test",))
    preflight = run(asgi, "OPTIONS", "/thing", headers={"origin": "http://a.test", **PREFLIGHT})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://a.test"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in preflight.headers
    got = run(asgi, "GET", "/thing", headers={"origin": "http://a.test", "authorization": "Bearer k"})
    assert got.headers["access-control-allow-origin"] == "http://a.test"
    assert "x-request-id" in got.headers["access-control-expose-headers"]
    other = run(asgi, "OPTIONS", "/thing", headers={"origin": "http://b.test", **PREFLIGHT})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert "access-control-allow-origin" not in run(asgi, "GET", "/thing", headers={"origin": "http://b.test"}).headers
    anyone = app(("*",))
    assert (
        run(anyone, "GET", "/thing", headers={"origin": "http://c.test"}).headers["access-control-allow-origin"] == "*"
    )


@pytest.mark.parametrize("good", ["*", "http://localhost:3000", "https://app.example.org", "chrome-extension://abc"])
def test_an_origin_is_written_as_browsers_send_it(good):
    assert cors_origin(good) == good


@pytest.mark.parametrize("bad", ["http://localhost:3000/", "localhost:3000", "https://a.test/path", "", "**"])
def test_anything_else_is_refused_saying_how_to_write_one(bad):
    with pytest.raises(ValueError, match=r"scheme://host\[:port\]"):
        cors_origin(bad)
