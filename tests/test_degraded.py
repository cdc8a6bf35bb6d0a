"""A store that cannot write (disk full, I/O error) degrades the daemon, never ends it: runners keep
serving, placements wait, /health says why, and nothing is lost: it is written once the store takes it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest
import trio
from reliability_report import attack
from test_controller_clock import MODEL, Sim, chat, instance, ready_at, simulate, until

from daemon_harness import start_daemon, wait_instance
from exod.controller import StoreUnavailable
from exod.host.tiny_model import make_tiny_model
from exod.state.journal import WRITE_RETRY
from exod.state.sqlite import Store

FULL = sqlite3.OperationalError("database or disk is full")


def test_a_full_disk_degrades_the_controller_and_nothing_is_lost(tmp_path, monkeypatch):
    disk = {"full": False}
    real_save, real_record = Store.save, Store.record_process

    def save(self, *args, **kwargs):
        if disk["full"]:
            raise FULL
        return real_save(self, *args, **kwargs)

    def record_process(self, record):
        if disk["full"]:
            raise FULL
        return real_record(self, record)

    monkeypatch.setattr(Store, "save", save)
    monkeypatch.setattr(Store, "record_process", record_process)

    async def body(sim: Sim):
        c = sim.controller
        iid = await c.place(MODEL, 2)
        await until(c, ready_at(iid, 1))
        logged = len(list(await c.transitions()))
        disk["full"] = True
        sim.fleet.runner(1, 1).kill()  # a failure while nothing can be written: generation 2 comes up anyway
        while c.status()["degraded"] is None:
            await trio.sleep(0.1)
        await trio.sleep(30)
        during = c.status()
        served = await chat(c, iid, max_tokens=3)
        with pytest.raises(StoreUnavailable, match="database or disk is full"):
            await c.place(MODEL, 1)
        unwritten = len(list(await c.transitions())) - logged
        disk["full"] = False
        await trio.sleep(WRITE_RETRY + 0.1)  # no event needed: the controller tries again on its own
        return (
            during,
            served,
            unwritten,
            c.status(),
            [e for _, e in await c.transitions()][logged:],
            c.store.processes(),
        )

    during, served, unwritten, after, written, processes = simulate(tmp_path, body)
    assert "database or disk is full" in during["degraded"] and unwritten == 0
    assert instance(during, during["instances"][0]["instance_id"])["generation"] == 2  # recovered, meanwhile
    assert served  # still serving
    assert after["degraded"] is None
    moves = [(e.machine, e.source, e.target) for e in written]
    assert ("instance", "ready", "recovering") in moves and ("instance", "starting", "ready") in moves
    assert sorted(r.incarnation for r in processes) == [2, 2]  # the records of generation 2's processes too


# -- a real daemon on a small tmpfs that fills up ----------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the injected-error test covers it")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.usefixtures("no_runner_left_behind")
def test_a_daemon_whose_disk_fills_keeps_serving_and_writes_again_when_space_returns(tmp_path, small_disk):
    hf = tmp_path / "hf"
    make_tiny_model(MODEL, layers=2, hf_home=hf)
    (tmp_path / "exod.toml").write_text(
        f'[daemon]\nhost = "127.0.0.1"\nport = 0\noffline = true\n'
        f'[retry]\ninitial = 0.2\ncap = 1.0\n[[place]]\nmodel = "{MODEL}"\nranks = 2\n'
    )
    env = {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    daemon, url = start_daemon(tmp_path, env, state=small_disk / "state")
    filler = small_disk / "filler"

    def chat() -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)

    try:
        ready = wait_instance(url, lambda i: i["state"] == "ready")
        fill(filler)
        filled_at = time.time()
        assert chat().status_code == 200  # its runners' busy/available transitions cannot be written
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"{url}/health", timeout=10).json())["status"] != "degraded":
            assert time.monotonic() < deadline, health
            time.sleep(0.1)
        assert "disk is full" in health["reason"] or "disk I/O error" in health["reason"]
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 503
        refused = httpx.post(f"{url}/instances", json={"model": MODEL, "ranks": 1}, timeout=10)
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert chat().status_code == 200  # the instance keeps serving
        filler.unlink()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health", timeout=10).json()["status"] != "ok":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    with sqlite3.connect(small_disk / "state" / "state.db") as db:
        busy = db.execute(
            "SELECT count(*) FROM transitions WHERE machine = 'runner' AND target = 'busy' AND time > ?", (filled_at,)
        ).fetchone()[0]
    assert busy >= 2 * 2  # both requests, both ranks: written once space returned, nothing lost
    attack(
        "disk full",
        f"a 4 MiB tmpfs state dir filled up: /health said '{health['reason'].replace(str(small_disk), 'TMPFS')}', "
        "/ready 503, placements 503, "
        f"chat 200 throughout; {busy} transitions of the outage written once space returned",
    )
    assert ready["state"] == "ready"

    # A restart on a full disk: degraded from the start, never a traceback; whole again once space returns.
    fill(filler)
    port = free_port()
    log = (tmp_path / "restart.log").open("wb")
    args = ["--config", str(tmp_path / "exod.toml"), "--state-dir", str(small_disk / "state"), "--port", str(port)]
    daemon = subprocess.Popen([sys.executable, "-m", "exod", "serve", *args], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        health = poll(lambda: httpx.get(f"{url}/health", timeout=5).json(), lambda h: h["status"] == "degraded")
        assert "disk is full" in health["reason"] or "disk I/O error" in health["reason"]
        filler.unlink()
        poll(lambda: httpx.get(f"{url}/instances", timeout=5).json()["instances"][0], lambda i: i["state"] == "ready")
        poll(lambda: httpx.get(f"{url}/health", timeout=5).json(), lambda h: h["status"] == "ok")  # written again
        assert chat().status_code == 200
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    assert "Traceback" not in (tmp_path / "restart.log").read_text()
    shutil.rmtree(small_disk / "state", ignore_errors=True)


def fill(path) -> None:
    """Write zeros to ``path`` until the disk refuses another byte."""
    with contextlib.suppress(OSError), path.open("wb") as f:
        while True:
            f.write(b"\0" * 65536)
            f.flush()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll(read, done, timeout: float = 60.0):
    """``read()`` until ``done(value)``; connection errors while the daemon starts are waited out."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, IndexError, KeyError):
            value = read()
            if done(value):
                return value
        time.sleep(0.2)
    raise AssertionError(f"timed out; last: {value}")
