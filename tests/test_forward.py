"""What a cluster node that is not the controller answers itself, and what it forwards (`exod.api.forward`)."""

from __future__ import annotations

import pytest

from exod.api.forward import answered_here


@pytest.mark.parametrize(
    ("method", "path", "here"),
    [
        ("GET", "/", True),  # the dashboard: its page and assets are the same on every node
        ("GET", "/ui/dashboard.js", True),
        ("HEAD", "/ui/dashboard.css", True),
        ("GET", "/instances", True),  # reads of what etcd holds
        ("GET", "/instances/tiny-1", True),
        ("GET", "/diagrams/runner", True),
        ("GET", "/events", True),
        ("GET", "/agent/reports", True),
        ("POST", "/agent/runners", True),  # every node is an agent of the controller
        ("POST", "/", False),
        ("POST", "/instances", False),  # writes go to the controller
        ("DELETE", "/instances/tiny-1", False),
        ("POST", "/v1/chat/completions", False),
        ("GET", "/v1/models", False),
        ("GET", "/uix", False),  # a prefix of a path is not the path
        ("GET", "/instancesx", False),
    ],
)
def test_a_follower_answers_reads_and_the_dashboard_itself_and_forwards_the_rest(method, path, here) -> None:
    assert answered_here({"type": "http", "method": method, "path": path}) is here


class Membership:
    """`exod.cluster.membership.Membership` as the follower reads it: not the controller; node-1 is."""

    term = None
    node_id = "node-2"

    def __init__(self) -> None:
        from exod.cluster.membership import ClusterConfig

        self.config = ClusterConfig("http://etcd", "node-2", "127.0.0.2", token="c" * 43)

    async def controller(self) -> tuple[str, str]:
        return "node-1", "http://controller.test"

    def peer_client(self, timeout: object) -> object:
        import httpx

        return httpx.AsyncClient(timeout=timeout)  # a cluster without TLS between its nodes

    def peer_url(self, url: str) -> str:
        return url


class Controller:
    """`exod.controller.Controller` as the follower reads it: whether it runs this node's term."""

    running = False


def test_a_node_elected_answers_nothing_as_the_controller_until_its_controller_runs_the_term() -> None:
    """Between its election and its take-over's end (the last state read from etcd, the runners recovered), a
    node's machines are an earlier term's or none, and a request put in its book then was lost with that book
    when the take-over replaced it (the flaky `…cut_off_from_etcd…` test saw the earlier term's "ready"): it
    answers 503, retry shortly; forwarded, the request would come back to it. Reads come from etcd meanwhile."""
    import httpx
    import trio

    from exod.api.forward import Follower

    forwarded: list[str] = []
    reached: list[str] = []

    async def app(scope, receive, send) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"here"})

    membership, controller = Membership(), Controller()
    follower = Follower(app, membership, controller)  # type: ignore[arg-type]
    follower._client = httpx.AsyncClient(
        transport=httpx.MockTransport(
            lambda r: (forwarded.append(r.url.path), httpx.Response(200, stream=httpx.ByteStream(b"there")))[1]
        )
    )

    async def ask(term: object, running: bool) -> tuple[int, dict | str]:
        membership.term, controller.running = term, running  # type: ignore[assignment]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(follower), base_url="http://node-2") as client:
            answer = await client.post("/v1/chat/completions", json={})
            await client.get("/instances/tiny-1")  # a read: answered here in every case
            return answer.status_code, answer.json() if answer.status_code == 503 else answer.text

    async def main() -> list[tuple[int, dict | str]]:
        return [await ask(None, False), await ask("term", False), await ask("term", True)]

    follower_, taking_over, controlling = trio.run(main)
    assert follower_[0] == 200 and forwarded == ["/v1/chat/completions"]  # not elected: forwarded
    status, body = taking_over
    assert status == 503 and body["error"]["code"] == "controller_unavailable"  # type: ignore[index]
    assert "node-2 is taking over as the cluster's controller" in body["error"]["message"]  # type: ignore[index]
    assert controlling == (200, "here")
    assert reached == ["/instances/tiny-1", "/instances/tiny-1", "/v1/chat/completions", "/instances/tiny-1"]


def test_a_follower_checks_the_clients_key_itself_and_forwards_the_cluster_token_in_its_place() -> None:
    """The client's key never leaves the node it was sent to; the controller gets the cluster's token."""
    import httpx
    import trio

    from exod.api.forward import Follower

    seen: list[httpx.Request] = []

    def controller(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, stream=httpx.ByteStream(b"{}"))  # streamed back, as a real controller's is

    async def never(scope, receive, send) -> None:
        raise AssertionError("a forwarded request reached the follower's own app")

    follower = Follower(never, Membership(), Controller(), api_key="k")  # type: ignore[arg-type]
    follower._client = httpx.AsyncClient(transport=httpx.MockTransport(controller))

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(follower), base_url="http://node-2") as client:
            chat = "/v1/chat/completions"
            return [
                await client.post(chat, json={}),
                await client.post(chat, json={}, headers={"Authorization": "Bearer wrong"}),
                await client.post(chat, json={}, headers={"Authorization": "Bearer k", "X-Exod-Cluster-Token": "x"}),
                await client.post("/v1/messages", json={}, headers={"x-api-key": "k"}),
            ]

    none, wrong, bearer, anthropic = trio.run(main)
    assert [r.status_code for r in (none, wrong)] == [401, 401] and none.json()["error"]["code"] == "invalid_api_key"
    assert bearer.status_code == anthropic.status_code == 200 and len(seen) == 2
    for request in seen:
        assert "authorization" not in request.headers and "x-api-key" not in request.headers
        assert request.headers["x-exod-cluster-token"] == "c" * 43  # the caller's own value is never passed on
        assert request.headers["x-exod-forwarded-by"] == "node-2"
