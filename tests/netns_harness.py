"""A host of its own for a test (`exod.cluster.netns`): a network namespace joined to this one by a veth pair,
whose link the test can cut and heal. Made by the fixture and removed after the test, with every process
still inside it. Needs root and iproute2 (CI runs as root); elsewhere the test skips, saying why."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from exod.cluster import netns
from exod.cluster.netns import Namespace


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    if (why := netns.unusable()) is not None:
        pytest.skip(f"{why} (CI runs as root)")
    with netns.namespace() as made:
        yield made
