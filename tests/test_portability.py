"""The paths exod takes where Linux's own calls are missing (macOS, MLX's main platform), run here on Linux:
the runner's watchdog without POLLRDHUP (its hang-up and its deadline), and process start times through
psutil."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from exod.host.orphans import start_ticks
from exod.runner.watchdog import Ending, watch

WAYS = [pytest.param(True, id="POLLRDHUP"), pytest.param(False, id="portable")]


def watching(
    control: socket.socket, alive_r: int, rdhup: bool, deadline_r: int | None = None
) -> tuple[list[Ending], threading.Thread]:
    said: list[Ending] = []
    thread = threading.Thread(target=lambda: said.append(watch(control.fileno(), alive_r, deadline_r, rdhup=rdhup)))
    thread.start()
    return said, thread


@pytest.mark.parametrize("rdhup", WAYS)
@pytest.mark.parametrize("unread", [b"", b'{"type": "warm_up"}\n'])
def test_the_channel_hanging_up_is_seen_whatever_is_left_unread(rdhup, unread):
    ours, peer = socket.socketpair()
    alive_r, alive_w = os.pipe()
    try:
        peer.sendall(unread)  # commands the runner has not read: they must not count as the peer's presence
        said, thread = watching(ours, alive_r, rdhup)
        thread.join(0.3)
        assert thread.is_alive()  # nothing happened yet: it waits, it does not spin out
        peer.close()
        thread.join(5)
        assert said == [Ending.HUNG_UP]
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
        said, thread = watching(ours, alive_r, rdhup)
        os.close(alive_w)  # the runner's end of the pipe: it exited
        thread.join(5)
        assert said == [Ending.EXITED]
    finally:
        ours.close()
        peer.close()
        os.close(alive_r)


@pytest.mark.parametrize("rdhup", WAYS)
def test_a_deadline_ends_the_watch_once_it_passes_unextended_and_not_before(rdhup):
    ours, peer = socket.socketpair()
    alive_r, alive_w = os.pipe()
    deadline_r, deadline_w = os.pipe()
    try:
        peer.sendall(b'{"type": "warm_up"}\n')  # unread commands do not end it either
        os.write(deadline_w, b"%.6f\n" % (time.monotonic() + 3600))  # far away: it waits
        said, thread = watching(ours, alive_r, rdhup, deadline_r)
        thread.join(0.3)
        assert thread.is_alive() and said == []
        extended = []
        for _ in range(4):  # each extension moves it on: 0.4 s ahead, renewed every 0.2 s
            extended.append(time.monotonic() + 0.4)
            os.write(deadline_w, b"%.6f\n" % extended[-1])
            time.sleep(0.2)
        assert thread.is_alive() and said == []
        thread.join(5)  # no more extensions: it passes
        ended = time.monotonic()
        assert said == [Ending.DEADLINE] and ended >= extended[-1]
        assert ours.recv(100) == b'{"type": "warm_up"}\n'  # nothing was consumed
    finally:
        for fd in (alive_r, alive_w, deadline_r, deadline_w):
            os.close(fd)
        ours.close()
        peer.close()


@pytest.mark.parametrize("rdhup", WAYS)
def test_a_deadline_pipe_whose_writer_is_gone_leaves_the_hang_up_to_decide(rdhup):
    ours, peer = socket.socketpair()
    alive_r, alive_w = os.pipe()
    deadline_r, deadline_w = os.pipe()
    try:
        os.close(deadline_w)  # no deadline was ever given, and none will be
        said, thread = watching(ours, alive_r, rdhup, deadline_r)
        thread.join(0.3)
        assert thread.is_alive()
        peer.close()
        thread.join(5)
        assert said == [Ending.HUNG_UP]
    finally:
        for fd in (alive_r, alive_w, deadline_r):
            os.close(fd)
        ours.close()


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
