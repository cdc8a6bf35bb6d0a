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
