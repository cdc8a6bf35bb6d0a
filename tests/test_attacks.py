"""A local client attacks a real `exod serve` with connections: half-sent requests and more sockets than the
daemon may hold. The daemon keeps the descriptors it needs to restart a runner, closes what is stalled, and
answers again as soon as the attacker lets go. (The other attacks of specs/reliability.md are tested where
the feature lives: tests/test_admission.py, test_degraded.py, test_host_failures.py, test_state_dir.py,
test_drain.py and test_retention.py.)"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
from reliability_report import attack

from daemon_harness import runner_pid, start_daemon, wait_instance
from exod.host.tiny_model import make_tiny_model

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")

MODEL = "exod/tiny-qwen2"
NOFILE = 256  # the daemon's descriptor limit: the attacker offers it many more sockets than that
CONNECTIONS = 48  # max_connections
ATTACKERS = 400
CONFIG = f"""
[daemon]
host = "127.0.0.1"
port = 0
offline = true

[retry]
initial = 0.2
cap = 1.0

[limits]
max_connections = {CONNECTIONS}
keep_alive_timeout = 2.0
read_timeout = 3.0

[[place]]
model = "{MODEL}"
ranks = 2
"""
HALF_HEADERS = b"GET /instances HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # never ends its headers
HALF_BODY = (
    b"POST /instances HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 64\r\n\r\n{"
)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def generation_ready(db: Path, generation: int) -> bool:
    """From the state database itself: the API is what the attacker is holding."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        body = conn.execute("SELECT body FROM snapshot").fetchone()[0]
    import json

    (placement,) = json.loads(body)["instances"].values()
    machine = placement["machine"]
    return machine["leaf"] == "ready" and machine["generation"] >= generation


@pytest.fixture
def env(tmp_path):
    hf = tmp_path / "hf"
    make_tiny_model(MODEL, layers=2, hf_home=hf)
    (tmp_path / "exod.toml").write_text(CONFIG)
    return {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}


@pytest.fixture
def many_sockets():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, max(soft, 4 * ATTACKERS))
    if wanted < 2 * ATTACKERS:
        pytest.skip(f"this test process may open {hard} descriptors; the attack needs {2 * ATTACKERS}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.usefixtures("many_sockets")
def test_a_connection_flood_of_half_sent_requests_costs_the_daemon_nothing_it_needs(tmp_path, env):
    daemon, url = start_daemon(tmp_path, env, nofile=NOFILE)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sockets: list[socket.socket] = []
    try:
        wait_instance(url, lambda i: i["state"] == "ready")
        idle = open_fds(daemon.pid)
        started = time.monotonic()
        for n in range(ATTACKERS):  # as many as the kernel lets connect: accepted, or waiting in the backlog
            s = socket.socket()
            s.settimeout(0.5)
            try:
                s.connect((host, int(port)))
                s.sendall(HALF_BODY if n % 2 else HALF_HEADERS)
            except OSError:
                s.close()
                continue
            sockets.append(s)
        peak = max(open_fds(daemon.pid) for _ in range(20) if time.sleep(0.05) is None)
        assert peak <= idle + CONNECTIONS + 8  # each accepted connection costs one descriptor, and only those
        os.kill(runner_pid(1), signal.SIGKILL)  # a runner must be restarted while the attack goes on
        deadline = time.monotonic() + 60
        while not generation_ready(tmp_path / "state" / "state.db", 2):
            assert time.monotonic() < deadline, "the instance did not come back during the attack"
            time.sleep(0.2)
        recovered = time.monotonic() - started

        closed, answered_408 = 0, 0  # the daemon hangs up on every stalled request, accepted or queued
        deadline = time.monotonic() + 60
        for s in sockets:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            data = b""
            with contextlib.suppress(OSError):
                while chunk := s.recv(4096):
                    data += chunk
            closed += 1
            answered_408 += data.startswith(b"HTTP/1.1 408")
        stalled_for = time.monotonic() - started
        assert closed == len(sockets) and answered_408 > 0

        let_go = time.monotonic()
        for s in sockets:
            s.close()
        health = httpx.get(f"{url}/health", timeout=10)
        answered = time.monotonic() - let_go
        assert health.status_code == 200 and health.json()["status"] == "ok"
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=60,
        )
        assert reply.status_code == 200
    finally:
        for s in sockets:
            s.close()
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    attack(
        "slow clients",
        f"{len(sockets)} half-sent requests (half without the end of their headers, half without their body): "
        f"all closed by the daemon within {stalled_for:.0f} s, {answered_408} of them with a 408",
    )
    attack(
        "fd exhaustion",
        f"{len(sockets)} connections against max_connections = {CONNECTIONS} and RLIMIT_NOFILE = {NOFILE}: "
        f"the daemon's descriptors peaked at {peak} (idle: {idle}); a runner SIGKILLed meanwhile was back "
        f"(generation 2 Ready) {recovered:.1f} s into the attack; /health answered {answered:.2f} s after "
        "the attacker let go",
    )
