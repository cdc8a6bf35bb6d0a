"""The paths exod takes where Linux's own calls are missing (macOS, MLX's main platform), run here on Linux:
the runner's hang-up watchdog without POLLRDHUP, and process start times through psutil."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest

from exod.host.orphans import start_ticks
from exod.runner.process import hung_up

WAYS = [pytest.param(True, id="POLLRDHUP"), pytest.param(False, id="portable")]


def watch(control: socket.socket, alive_r: int, rdhup: bool) -> tuple[list[bool], threading.Thread]:
    said: list[bool] = []
    thread = threading.Thread(target=lambda: said.append(hung_up(control.fileno(), alive_r, rdhup=rdhup)))
    thread.start()
    return said, thread


@pytest.mark.parametrize("rdhup", WAYS)
@pytest.mark.parametrize("unread", [b"", b'{"type": "warm_up"}\n'])
def test_the_channel_hanging_up_is_seen_whatever_is_left_unread(rdhup, unread):
    ours, peer = socket.socketpair()
    alive_r, alive_w = os.pipe()
    try:
        peer.sendall(unread)  # commands the runner has not read: they must not count as the peer's presence
        said, thread = watch(ours, alive_r, rdhup)
        thread.join(0.3)
        assert thread.is_alive()  # nothing happened yet: it waits, it does not spin out
        peer.close()
        thread.join(5)
        assert said == [True]
        assert ours.recv(100) == unread  # nothing was consumed
    finally:
        ours.close()
        os.close(alive_r)
        os.close(alive_w)


@pytest.mark.parametrize("rdhup", WAYS)
def test_the_runner_exiting_ends_the_watch_without_a_hangup(rdhup):
    ours, peer = socket.socketpair()
    alive_r, alive_w = os.pipe()
    try:
        peer.sendall(b'{"type": "shutdown"}\n')
        said, thread = watch(ours, alive_r, rdhup)
        os.close(alive_w)  # the runner's end of the pipe: it exited
        thread.join(5)
        assert said == [False]
    finally:
        ours.close()
        peer.close()
        os.close(alive_r)


def test_start_times_name_one_process_and_vanish_with_it():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        first = start_ticks(child.pid)
        assert first is not None and first > 0 and start_ticks(child.pid) == first  # stable
        assert first >= start_ticks(os.getpid())  # started after this process
    finally:
        child.kill()
        child.wait()
    assert start_ticks(child.pid) is None
