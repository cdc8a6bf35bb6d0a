"""Finding and reaping runner processes that a previous daemon started.

A daemon killed with SIGKILL leaves its runners behind: they are no longer
our children, so they cannot be waited on. Each one was recorded with its pid
*and* its kernel start time; a process is ours only if both still match, so a
recycled pid is never killed by mistake.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Iterable

import psutil

from exod.state.sqlite import ProcessRecord


def start_ticks(pid: int) -> int | None:
    """The process's start time (ms since the epoch, from the kernel, by psutil on Linux and macOS alike), or
    None if there is no such process. With the pid it names one process: a recycled pid starts later."""
    try:
        return round(psutil.Process(pid).create_time() * 1000)
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:  # it exists, but cannot be looked at (another user's): not ours to identify
        return 0


def is_same_process(record: ProcessRecord) -> bool:
    """Only a process whose start time is known and matches is ours: never kill what cannot be identified."""
    if record.start_ticks <= 0:
        return False
    ticks = start_ticks(record.pid)
    return ticks is not None and ticks == record.start_ticks


def _wait_gone(pid: int, timeout: float) -> bool:
    """Wait for a non-child to exit: a pidfd becomes readable at exit (no polling interval on Linux)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if start_ticks(pid) is None:
                return True
            time.sleep(0.01)
        return start_ticks(pid) is None
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


def reap_orphans(records: Iterable[ProcessRecord], timeout: float = 5.0) -> list[ProcessRecord]:
    """SIGKILL every recorded process that is still the one we started; returns those that were killed."""
    killed = []
    for record in records:
        if not is_same_process(record):
            continue
        try:
            os.kill(record.pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        if not _wait_gone(record.pid, timeout):
            raise RuntimeError(f"runner pid {record.pid} survived SIGKILL for {timeout} s")
        killed.append(record)
    return killed
