"""The runner's watchdog: a process of its own that ends the runner when its supervisor hangs up, or when its
deadline passes without being extended (the dead man's switch of a cluster's fence, DESIGN §5).

Why a process: native MLX calls can block while holding the GIL — ``mx.distributed.init(backend="ring")``
of a lone rank 0 never returns and starves every Python thread. Only another process can end that. It is
forked before any thread exists and before MLX is imported, and it imports nothing more.

The deadline is an absolute ``CLOCK_MONOTONIC`` time (`time.monotonic`, one clock for every process of a
host), one line of text per extension on a pipe whose write end the supervisor holds. Only the agent of a
cluster's node extends it, and only while the node's lease is surely alive; so a runner outlives its node's
authority by nothing, even when the daemon that supervises it is stalled, paused or deadlocked. Without a
deadline pipe (one host), only the hang-up counts.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import select
import signal
import socket
import time

PEEK_S = 0.05  # without POLLRDHUP: how often a channel with unread commands is looked at again
HANGUP_GRACE_S = 1.0  # time the reader thread gets to end the process cleanly before the watchdog kills it
_pid: int | None = None


class Ending(enum.Enum):
    EXITED = "exited"  # the runner ended: nothing to do
    HUNG_UP = "hung up"  # the supervisor closed the control channel
    DEADLINE = "deadline"  # the deadline passed without an extension


def start(control_fd: int, deadline_fd: int | None = None) -> None:
    """Fork the watchdog of this process. Call it before any thread exists; ``deadline_fd`` is then the
    watchdog's alone (closed here)."""
    global _pid
    parent = os.getpid()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(alive_r)
        os.set_inheritable(alive_w, False)
        if deadline_fd is not None:
            os.close(deadline_fd)
        _pid = pid
        return
    try:  # the watchdog: no imports, no threads, no MLX
        os.close(alive_w)
        ending = watch(control_fd, alive_r, deadline_fd)
        if ending is Ending.HUNG_UP:  # the reader thread ends the runner cleanly if it can
            time.sleep(HANGUP_GRACE_S)
            if not select.select([alive_r], [], [], 0)[0]:
                os.kill(parent, signal.SIGKILL)
        elif ending is Ending.DEADLINE:  # at once: the node's lease may expire soon
            with contextlib.suppress(OSError):
                os.write(
                    2, b"exod.runner: its deadline passed without an extension (its node's authority may be over)\n"
                )
            os.kill(parent, signal.SIGKILL)
    finally:
        os._exit(0)


def stop() -> None:
    """End the watchdog (the runner is exiting on its own)."""
    if _pid is not None:
        with contextlib.suppress(OSError):
            os.kill(_pid, signal.SIGKILL)
            os.waitpid(_pid, 0)


def watch(
    control_fd: int, alive_r: int, deadline_fd: int | None = None, *, rdhup: bool = hasattr(select, "POLLRDHUP")
) -> Ending:
    """Block until the runner exits (closing ``alive_r``), the control channel hangs up, or the deadline read
    from ``deadline_fd`` passes; no deadline has been given yet is no deadline.

    None of it may consume a byte of the channel, which the runner reads. Linux says "peer closed" alone
    (POLLRDHUP). Elsewhere (macOS, MLX's main platform) POLLHUP says it when the peer is gone, and a
    readable channel is peeked at: nothing to read means the peer closed; bytes mean commands the runner
    has yet to read, so look again a little later."""
    poller = select.poll()
    poller.register(alive_r, select.POLLIN)
    poller.register(control_fd, select.POLLRDHUP if rdhup else select.POLLIN | select.POLLHUP)
    if deadline_fd is not None:
        poller.register(deadline_fd, select.POLLIN)
    channel = None if rdhup else socket.socket(fileno=os.dup(control_fd))
    deadline, pending = math.inf, b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return Ending.DEADLINE
            events = dict(poller.poll(None if math.isinf(left) else math.ceil(left * 1000)))
            if alive_r in events:
                return Ending.EXITED
            if deadline_fd is not None and deadline_fd in events:
                data = os.read(deadline_fd, 4096)
                if not data:  # its supervisor is gone: the channel's hang-up says so
                    poller.unregister(deadline_fd)
                    deadline_fd = None
                *lines, pending = (pending + data).split(b"\n")
                if lines:
                    deadline = float(lines[-1])
            if control_fd in events:
                if rdhup or _hung_up(channel, events[control_fd]):
                    return Ending.HUNG_UP
                time.sleep(min(PEEK_S, max(0.0, deadline - time.monotonic())))  # unread commands: not a hang-up
    finally:
        if channel is not None:
            channel.close()


def _hung_up(channel: socket.socket | None, revents: int) -> bool:
    """Without POLLRDHUP: the peer is gone if the channel says so, or reads as ended without data."""
    if revents & (select.POLLHUP | select.POLLERR):
        return True
    assert channel is not None
    try:
        return channel.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset: hung up as well
        return True
