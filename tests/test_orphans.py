"""exod.host.orphans: a process left by a dead daemon is found by pid + start time and killed; others are spared."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from exod.host.orphans import is_same_process, reap_orphans, start_ticks
from exod.state.sqlite import ProcessRecord


def _orphan() -> int:
    """A grandchild whose parent has exited: not our child, like a runner of a dead daemon."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
            " start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,"
            " stderr=subprocess.DEVNULL); print(p.pid)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def test_orphan_with_matching_start_time_is_killed():
    pid = _orphan()
    try:
        record = ProcessRecord("i/0", 1, pid, start_ticks(pid))
        assert is_same_process(record)
        assert reap_orphans([record]) == [record]
        assert start_ticks(pid) is None or _is_zombie(pid)
    finally:
        _kill_quietly(pid)


def test_recycled_pid_is_spared():
    pid = _orphan()
    try:
        stale = ProcessRecord("i/0", 1, pid, start_ticks(pid) - 1)  # same pid, another start time
        assert not is_same_process(stale)
        assert reap_orphans([stale]) == []
        assert start_ticks(pid) is not None
    finally:
        _kill_quietly(pid)


def test_gone_process_is_skipped():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = start_ticks(proc.pid)
    proc.wait()
    assert reap_orphans([ProcessRecord("i/0", 1, proc.pid, ticks or 1)]) == []


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return False


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)
