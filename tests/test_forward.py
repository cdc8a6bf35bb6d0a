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

    follower = Follower(never, Membership(), api_key="k")  # type: ignore[arg-type]
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
