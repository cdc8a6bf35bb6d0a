"""exod.state.statedir: one daemon per state directory, even with its lock file deleted; nothing open to others."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from reliability_report import attack

from daemon_harness import runner_pids, start_daemon, wait_instance
from exod.host import ring
from exod.host.tiny_model import make_tiny_model
from exod.state.statedir import AlreadyRunning, StateDirError, state_dir_lock, write_private

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")

CONFIG = """
[daemon]
host = "127.0.0.1"
port = 0
offline = true

[retry]
initial = 0.2
cap = 1.0
max_retries = 5

[[place]]
model = "exod/tiny-qwen2"
ranks = 2
"""

# A second process takes the lock: exit 3 with the message if refused, 0 if it got the directory.
TAKE_LOCK = """
import sys
from pathlib import Path
from exod.state.statedir import AlreadyRunning, state_dir_lock
try:
    with state_dir_lock(Path(sys.argv[1])):
        pass
except AlreadyRunning as exc:
    print(exc)
    sys.exit(3)
"""


def take_lock_elsewhere(state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", TAKE_LOCK, str(state)], capture_output=True, text=True, timeout=60)


def modes_open_to_others(root: Path) -> list[str]:
    """Every path under ``root`` (itself included) with a group or other permission bit, and its mode."""
    found = []
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode & 0o077:
            found.append(f"{oct(mode)} {path.relative_to(root.parent)}")
    return found


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """Processes started in the block inherit ``mask``: the daemon's modes must not depend on its caller's."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def env(tmp_path):
    hf = tmp_path / "hf"
    make_tiny_model("exod/tiny-qwen2", layers=2, hf_home=hf)
    (tmp_path / "exod.toml").write_text(CONFIG)
    return {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}


def stop(daemon: subprocess.Popen[bytes]) -> int:
    """SIGTERM (every runner is stopped and reaped), SIGKILL if it does not end."""
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
    try:
        return daemon.wait(timeout=30)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
        raise


# -- the lock, in-process ---------------------------------------------------------------------


def test_the_lock_holds_the_directory_not_the_file(tmp_path):
    state = tmp_path / "state"
    with state_dir_lock(state):
        (state / "daemon.lock").unlink()  # a clean-up script, or a user, removes the file
        refused = take_lock_elsewhere(state)
        assert refused.returncode == 3, refused.stderr
        assert f"another exod daemon is using {state}" in refused.stdout
        with pytest.raises(AlreadyRunning), state_dir_lock(state):  # another open of it, in this process too
            pass
    assert take_lock_elsewhere(state).returncode == 0  # released with the block


def test_an_older_exod_holding_only_daemon_lock_is_respected(tmp_path):
    import fcntl

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    with (state / "daemon.lock").open("a") as f:  # what exod did before it locked the directory
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(AlreadyRunning, match="another exod daemon"), state_dir_lock(state):
            pass
    with state_dir_lock(state):
        pass  # and the directory's own lock was released by the refusal


def test_a_state_dir_open_to_others_is_made_private_with_a_warning(tmp_path, caplog):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="exod.state.statedir"), state_dir_lock(state):
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert "was open to other users (mode 0755); it is now 0700" in caplog.text


def test_a_state_dir_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "state").write_text("not a directory")
    with (
        pytest.raises(StateDirError, match=r"cannot use the state directory .* pass another --state-dir"),
        state_dir_lock(tmp_path / "state"),
    ):
        pass


def test_new_directories_and_hostfiles_are_private_whatever_the_umask(tmp_path):
    with umask(0), state_dir_lock(tmp_path / "a" / "state"):
        path = ring.hostfile(tmp_path / "a" / "state" / "run" / "i-1" / "gen1.hostfile.json", 2)
    assert path.exists()
    assert modes_open_to_others(tmp_path / "a") == []


# -- real daemons ------------------------------------------------------------------------------


def test_deleting_the_lock_file_does_not_let_a_second_daemon_in(tmp_path, env):
    state = tmp_path / "state"
    first, url = start_daemon(tmp_path, env)
    try:
        ready = wait_instance(url, lambda i: i["state"] == "ready")
        runners = runner_pids()
        assert len(runners) == 2
        (state / "daemon.lock").unlink()

        args = [sys.executable, "-m", "exod", "serve", "--config", str(tmp_path / "exod.toml")]
        second = subprocess.Popen(
            [*args, "--state-dir", str(state)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            _, stderr = second.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            stop(second)  # it got in: stop it the graceful way, so that its runners go too
            pytest.fail("a second daemon started on a state directory in use")
        assert second.returncode != 0
        assert f"another exod daemon is using {state}" in stderr and "Traceback" not in stderr

        assert runner_pids() == runners  # the first daemon's runners: neither reaped nor duplicated
        now = wait_instance(url, lambda i: True)
        assert (now["instance_id"], now["state"], now["generation"]) == (ready["instance_id"], "ready", 1)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        assert stop(first) == 0
    assert runner_pids() == []
    attack(
        "lock deleted",
        f"daemon.lock deleted under a running daemon: a second `exod serve` exited {second.returncode} with "
        f"'another exod daemon is using …'; the first's {len(runners)} runners untouched, still Ready at generation 1",
    )


def test_a_state_dir_removed_under_a_running_daemon_stops_it_and_says_so(tmp_path, env):
    """Issue #25: `rm -rf` of the state directory under a running daemon: it served on from a deleted database,
    and a second daemon started on the same path beside it. It notices that the directory at its path is not
    the one it holds, stops taking work, stops its runners, and exits saying why; then a daemon on the path
    starts on a clean directory, alone."""
    state = tmp_path / "state"
    first, url = start_daemon(tmp_path, env)
    try:
        wait_instance(url, lambda i: i["state"] == "ready")
        assert len(runner_pids()) == 2
        shutil.rmtree(state)
        code = first.wait(timeout=60)  # a check every second, then a drain and the runners' stop
    finally:
        if first.poll() is None:
            stop(first)
    said = (tmp_path / "serve.log").read_text()
    assert code == 1 and runner_pids() == []
    assert f"the state directory {state} is gone" in said and "start exod again" in said
    second, _ = start_daemon(tmp_path, env)
    assert stop(second) == 0
    assert runner_pids() == []
    attack(
        "state dir removed",
        f"`rm -rf` of a running daemon's state dir: it exited {code} within a minute, its runners stopped, "
        "and a daemon started on the path afterwards ran alone",
    )


def test_nothing_in_the_state_dir_is_open_to_other_users(tmp_path, env):
    state = tmp_path / "state"
    with umask(0):  # the most permissive caller: every mode comes from the daemon itself
        daemon, url = start_daemon(tmp_path, env)
    try:
        wait_instance(url, lambda i: i["state"] == "ready")
        assert len(list(state.glob("run/*/gen1.hostfile.json"))) == 1
        assert len(list(state.glob("logs/*/rank*-gen1.log"))) == 2
        assert {"state.db", "state.db-wal", "daemon.json", "daemon.lock"} <= {p.name for p in state.iterdir()}
        assert modes_open_to_others(state) == []
    finally:
        assert stop(daemon) == 0
    assert modes_open_to_others(state) == []


def test_a_file_the_daemon_writes_is_never_seen_half_written(tmp_path: Path) -> None:
    """`daemon.json` is read by the CLI (and by tests) while the daemon may be writing it: every read finds a
    whole file, the old one or the new, 0600, and no part file is left beside it."""
    import json

    path = tmp_path / "daemon.json"
    write_private(path, json.dumps({"pid": 0, "url": "http://127.0.0.1:1"}))
    seen: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            seen.append(path.read_text())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for n in range(2000):
            write_private(path, json.dumps({"pid": n, "url": "http://127.0.0.1:" + "1" * (n % 50 + 1)}))
    finally:
        done.set()
        reader.join()
    assert len(seen) > 100 and all(json.loads(text)["url"] for text in seen)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and os.listdir(tmp_path) == ["daemon.json"]
