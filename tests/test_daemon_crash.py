"""`exod serve` SIGKILLed in each instance state and restarted; and 50 requests while a runner dies."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from daemon_harness import assert_log_conforms, runner_pid, runner_pids, start_daemon, wait_instance
from exod.host.tiny_model import make_tiny_model
from exod.state.sqlite import Store

BASE = """
[daemon]
port = 0
offline = true

[retry]
initial = 5.0
cap = 5.0
max_failures = 5

[timeouts]
connect = 30
stop_grace = 3
term_grace = 1

[limits]
max_requests_per_instance = 64

[[place]]
model = "exod/tiny-qwen2"
ranks = 2
"""
FAULTS = {
    "starting": '[[fault]]\nrank = 1\ngeneration = 1\nphase = "connecting"\nkind = "hang"\n',
    "recovering": '[[fault]]\nrank = 1\ngeneration = 1\nphase = "stopping"\nkind = "hang"\n',
}


@pytest.fixture
def env(tmp_path):
    hf = tmp_path / "hf"
    make_tiny_model("exod/tiny-qwen2", layers=2, hf_home=hf)
    return {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("state", ["starting", "ready", "backing_off", "recovering"])
def test_sigkill_in_each_state_restores_everything_and_converges(tmp_path, env, state):
    (tmp_path / "exod.toml").write_text(BASE + FAULTS.get(state, ""))
    daemon, url = start_daemon(tmp_path, env)
    try:
        if state == "starting":
            inst = wait_instance(url, lambda i: i["runners"][1]["phase"] == "joining")
        else:
            inst = wait_instance(url, lambda i: i["state"] == "ready")
        if state in ("backing_off", "recovering"):
            os.kill(runner_pid(0), signal.SIGKILL)  # rank 1 then hangs in its stop (recovering)
            inst = wait_instance(url, lambda i: i["state"] == state, timeout=10)
        orphans = runner_pids()
    finally:
        daemon.kill()  # SIGKILL: nothing is cleaned up
        daemon.wait()
    killed_at = time.time()
    before = inst

    daemon, url = start_daemon(tmp_path, env)
    try:
        restored = httpx.get(f"{url}/instances").json()["instances"][0]
        assert not any(alive(pid) for pid in orphans)  # reaped before anything new started
        assert restored["instance_id"] == before["instance_id"]
        assert restored["attempts"] == before["attempts"]
        if state == "backing_off":
            assert restored["state"] == "backing_off" and restored["next_retry_at"] == before["next_retry_at"]
        final = wait_instance(url, lambda i: i["state"] == "ready", timeout=60)
        assert final["attempts"] == before["attempts"]  # the daemon's crash charged no retry
        assert len(runner_pids()) == 2
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
    assert runner_pids() == []

    store = Store.open(tmp_path / "state" / "state.db")
    seqs, log = zip(*store.transitions(), strict=True)
    store.close()
    assert list(seqs) == list(range(1, len(seqs) + 1))  # the event log has no gap
    assert_log_conforms(tmp_path / "state" / "state.db")
    if state == "backing_off":  # restarted mid-backoff: waits out the remaining deadline, not a fresh one
        start = next(e for e in log if e.event == "start" and e.source == "backing_off")
        assert before["next_retry_at"] <= start.time < killed_at + 5.0  # a fresh wait would end after that


def daemon_usage(pid: int) -> tuple[int, int]:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
    return fds, rss


def test_fifty_requests_while_a_runner_dies_all_end_and_resources_return(tmp_path, env):
    (tmp_path / "exod.toml").write_text(BASE.replace("initial = 5.0", "initial = 0.2"))
    daemon, url = start_daemon(tmp_path, env)
    try:
        wait_instance(url, lambda i: i["state"] == "ready")
        body = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 48}
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)  # warm
        baseline = daemon_usage(daemon.pid)
        statuses: list[int] = []

        def one(seed: int) -> None:
            response = httpx.post(f"{url}/v1/chat/completions", json={**body, "seed": seed}, timeout=90)
            statuses.append(response.status_code)

        threads = [threading.Thread(target=one, args=(seed,)) for seed in range(50)]
        for t in threads:
            t.start()
        # while requests are in flight: a fixed second once came after all fifty had finished (a quiet machine)
        wait_instance(url, lambda i: any(r["phase"] == "busy" for r in i["runners"]), timeout=60)
        os.kill(runner_pid(1), signal.SIGKILL)
        deadline = time.monotonic() + 120
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert len(statuses) == 50 and set(statuses) <= {200, 502, 503}, statuses
        assert 502 in statuses  # some were in flight when the runner died
        wait_instance(url, lambda i: i["state"] == "ready" and i["generation"] == 2)
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        deadline = time.monotonic() + 15  # closed client connections linger until hypercorn's keep-alive ends
        while daemon_usage(daemon.pid)[0] > baseline[0] + 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        fds, rss = daemon_usage(daemon.pid)
        assert fds <= baseline[0] + 2, (baseline, fds)
        assert rss < baseline[1] + 64 * 1024, (baseline, rss)  # kB: no leak per request
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
    assert runner_pids() == []
