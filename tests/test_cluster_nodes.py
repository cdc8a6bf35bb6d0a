"""Three real `exod serve --cluster` daemons on one etcd, advertising 127.0.0.1, .2 and .3: they list each
other from every node, exactly one is the controller, and when its daemon is SIGKILLed another one is
elected once its lease has expired."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from daemon_harness import exod, runner_pids

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")

TTL = 5
CONFIG = f"""
[daemon]
port = 0
offline = true

[cluster]
url = "{{etcd}}"
node_id = "{{node}}"
advertise = "{{address}}"
lease_ttl = {TTL}
"""


def start(tmp_path: Path, etcd: str, n: int) -> tuple[subprocess.Popen[bytes], str]:
    home = tmp_path / f"node-{n}"
    home.mkdir()
    address = f"127.0.0.{n}"
    (home / "exod.toml").write_text(CONFIG.format(etcd=etcd, node=f"node-{n}", address=address))
    args = ["serve", "--config", str(home / "exod.toml"), "--state-dir", str(home / "state"), "--host", address]
    log = (home / "serve.log").open("wb")
    daemon = subprocess.Popen([sys.executable, "-m", "exod", *args], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (home / "state" / "daemon.json").exists():
        assert daemon.poll() is None, (home / "serve.log").read_text()
        assert time.monotonic() < deadline, (home / "serve.log").read_text()
        time.sleep(0.05)
    import json

    return daemon, json.loads((home / "state" / "daemon.json").read_text())["url"]


def nodes(url: str) -> dict:
    return httpx.get(f"{url}/nodes", timeout=10).json()


def until(read, done, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value):
            return value
        assert time.monotonic() < deadline, f"timed out; last: {value}"
        time.sleep(0.1)


def test_three_nodes_list_each_other_elect_one_controller_and_another_when_it_dies(tmp_path, etcd):
    daemons = [start(tmp_path, etcd, n) for n in (1, 2, 3)]
    try:
        views = [
            until(lambda u=url: nodes(u), lambda v: len(v["nodes"]) == 3 and v["controller"], 30) for _, url in daemons
        ]
        controller = views[0]["controller"]
        for view in views:
            assert [n["node_id"] for n in view["nodes"]] == ["node-1", "node-2", "node-3"]
            assert [n["address"] for n in view["nodes"]] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
            assert view["controller"] == controller  # one controller, as every node sees it
            assert [n["node_id"] for n in view["nodes"] if n["controller"]] == [controller]
        assert {n["api_url"] for n in views[0]["nodes"]} == {url for _, url in daemons}

        status = exod("status", "--url", daemons[1][1], env=dict(os.environ)).stdout
        assert "3 node(s), this one node-2" in status and f"node {controller}" in status

        victim = int(controller.removeprefix("node-")) - 1
        daemons[victim][0].send_signal(signal.SIGKILL)  # no goodbye: its lease must run out
        daemons[victim][0].wait()
        killed_at = time.monotonic()
        survivor = daemons[(victim + 1) % 3][1]
        after = until(lambda: nodes(survivor), lambda v: v["controller"] not in (None, controller), 6 * TTL)
        took = time.monotonic() - killed_at
        assert len(after["nodes"]) == 2 and controller not in [n["node_id"] for n in after["nodes"]]
        assert took >= TTL - 2  # not before the dead controller's lease expired
    finally:
        for daemon, _ in daemons:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon, _ in daemons:
            try:
                assert daemon.wait(timeout=30) in (0, -signal.SIGKILL)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
    assert runner_pids() == []


def test_serve_without_its_etcd_says_so_and_exits(tmp_path):
    home = tmp_path / "node-1"
    home.mkdir()
    (home / "exod.toml").write_text(CONFIG.format(etcd="http://127.0.0.1:9", node="node-1", address="127.0.0.1"))
    done = subprocess.run(
        [sys.executable, "-m", "exod", "serve", "--config", str(home / "exod.toml"), "--state-dir", str(home / "s")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "cannot join the cluster" in done.stderr and "Traceback" not in done.stderr


def test_a_node_that_loses_etcd_is_degraded_and_joins_again_when_it_returns(tmp_path, etcd_server):
    daemon, url = start(tmp_path, etcd_server.url, 1)
    try:
        until(lambda: nodes(url), lambda v: v["controller"] == "node-1", 30)
        etcd_server.stop()
        health = until(lambda: httpx.get(f"{url}/health", timeout=10).json(), lambda h: h["status"] != "ok", 3 * TTL)
        assert health["status"] == "degraded" and "etcd cannot be reached" in health["reason"]
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 503
        refused = httpx.post(f"{url}/instances", json={"model": "exod/tiny-qwen2", "ranks": 1}, timeout=10)
        assert refused.status_code == 503 and "degraded" in refused.json()["error"]["message"]
        assert httpx.get(f"{url}/nodes", timeout=10).status_code == 503
        etcd_server.start()  # the same member, its data kept: the node's lease may have expired meanwhile
        until(lambda: httpx.get(f"{url}/health", timeout=10).json(), lambda h: h["status"] == "ok", 6 * TTL)
        back = until(lambda: nodes(url), lambda v: v["controller"] == "node-1" and len(v["nodes"]) == 1, 6 * TTL)
        assert back["nodes"][0]["node_id"] == "node-1"
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
