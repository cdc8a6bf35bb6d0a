"""`exod serve` as a real process: CLI round trip, SIGKILL of the daemon, restart on the same state dir."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from daemon_harness import assert_log_conforms, exod, runner_pids, start_daemon, wait_instance
from exod.host.tiny_model import make_tiny_model

CONFIG = """
[daemon]
host = "127.0.0.1"
port = 0
offline = true

[retry]
initial = 0.2
cap = 1.0
max_failures = 5

[[place]]
model = "exod/tiny-qwen2"
ranks = 2
"""


@pytest.fixture
def env(tmp_path):
    hf = tmp_path / "hf"
    make_tiny_model("exod/tiny-qwen2", layers=2, hf_home=hf)
    (tmp_path / "exod.toml").write_text(CONFIG)
    return {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}


def test_daemon_sigkill_and_restart_restores_state_and_reaps_orphans(tmp_path, env):
    daemon, url = start_daemon(tmp_path, env, "--place", "exod/tiny-qwen2:2")  # the config names it too
    try:
        ready = wait_instance(url, lambda i: i["state"] == "ready")
        iid = ready["instance_id"]
        assert len(httpx.get(f"{url}/instances", timeout=10).json()["instances"]) == 1  # one per model, not two
        # one failure first, so there is a retry count to restore
        first = sorted(runner_pids())
        assert len(first) == 2
        os.kill(first[1], signal.SIGKILL)
        recovered = wait_instance(url, lambda i: i["state"] == "ready" and i["generation"] == 2)
        assert recovered["attempts"] == 1
        orphans = sorted(runner_pids())
        assert len(orphans) == 2 and not set(orphans) & set(first)
        # status through the CLI, live
        live = exod("status", "--state-dir", str(tmp_path / "state"), env=env).stdout
        assert "# live" in live and iid in live and "attempts=1/5" in live
    finally:
        daemon.kill()  # SIGKILL: no cleanup at all
        daemon.wait()

    offline = exod("status", "--state-dir", str(tmp_path / "state"), env=env).stdout
    assert "no daemon is running" in offline and "attempts=1/5" in offline
    assert " ready " not in offline and "available" not in offline  # no runner shown serving: none runs

    daemon, url = start_daemon(tmp_path, env)
    try:
        again = wait_instance(url, lambda i: i["state"] == "ready" and i["generation"] == 3)
        assert again["instance_id"] == iid  # restored, not placed a second time
        assert again["attempts"] == 1  # a daemon restart costs no retry
        assert len(httpx.get(f"{url}/instances", timeout=10).json()["instances"]) == 1
        now = sorted(runner_pids())
        assert len(now) == 2 and not set(now) & set(orphans)  # orphans reaped, no duplicates
        # the CLI drives the live daemon
        placed = exod("place", "exod/tiny-qwen2", "--ranks", "1", "--url", url, env=env).stdout.strip()
        bad = exod("place", "../../etc", "--url", url, env=env, check=False)
        assert bad.returncode != 0 and "org/name" in bad.stderr
        assert exod("delete", placed, "--url", url, env=env).returncode == 0
        missing = exod("delete", "nope", "--url", url, env=env, check=False)
        assert missing.returncode != 0 and "404" in missing.stderr
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
    assert runner_pids() == []
    assert_log_conforms(tmp_path / "state" / "state.db")  # two daemons, one crash: the log still replays


def test_a_second_daemon_on_the_same_state_dir_is_refused(tmp_path, env):
    daemon, _ = start_daemon(tmp_path, env)
    try:
        second = exod(
            "serve",
            "--config",
            str(tmp_path / "exod.toml"),
            "--state-dir",
            str(tmp_path / "state"),
            env=env,
            check=False,
        )
        assert second.returncode != 0 and "another exod daemon" in second.stderr
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
    assert runner_pids() == []


def test_corrupt_state_file_refuses_to_start_and_is_kept(tmp_path, env):
    state = tmp_path / "state"
    state.mkdir()
    (state / "state.db").write_bytes(b"garbage" * 64)
    result = exod("serve", "--config", str(tmp_path / "exod.toml"), "--state-dir", str(state), env=env, check=False)
    assert result.returncode != 0 and "left untouched" in result.stderr
    assert (state / "state.db").read_bytes() == b"garbage" * 64


def test_api_key_guards_every_endpoint_but_health(tmp_path, env):
    daemon, url = start_daemon(tmp_path, env, "--no-place", "--api-key", "s3cret")
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        for path in ("/instances", "/v1/models", "/metrics", "/openapi.json"):
            denied = httpx.get(f"{url}{path}")
            assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
            assert denied.headers["www-authenticate"] == "Bearer"
            assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        status = exod("status", "--url", url, env={**env, "EXOD_API_KEY": "s3cret"})
        assert "no instances" in status.stdout
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)


def test_binding_beyond_loopback_needs_a_key_or_insecure(tmp_path, env):
    refused = exod("serve", "--host", "0.0.0.0", "--state-dir", str(tmp_path / "s"), env=env, check=False)
    assert refused.returncode != 0 and "--api-key" in refused.stderr
    assert not (tmp_path / "s" / "state.db").exists()  # refused before touching anything


def test_a_port_in_use_is_one_line_and_starts_nothing(tmp_path, env):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        state = tmp_path / "s"
        args = ("serve", "--config", str(tmp_path / "exod.toml"), "--port", str(port), "--state-dir", str(state))
        refused = exod(*args, env=env, check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert (
        refused.stderr.strip().splitlines()[-1]
        == f"Error: port {port} is in use on 127.0.0.1; pick another with --port"
    )
    assert not (state / "state.db").exists() and runner_pids() == []  # nothing placed, nothing started


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('[daemon]\noffline = "no"\n', "[daemon] offline: input should be a valid boolean, got 'no'"),
        ("[daemon]\nhost = 5\n", "[daemon] host: input should be a valid string, got 5"),
        ("place = 3\n", "place must be written [[place]] (one per entry)"),
    ],
)
def test_a_wrong_configuration_is_one_line_naming_the_key(tmp_path, env, text, named):
    (tmp_path / "bad.toml").write_text(text)
    refused = exod(
        "serve", "--config", str(tmp_path / "bad.toml"), "--state-dir", str(tmp_path / "s"), env=env, check=False
    )
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().endswith(named) and len(refused.stderr.strip().splitlines()) == 1
