"""One supervisor per runner process: spawn it, talk to it, watch it, stop it, reap it.

The supervisor decides nothing about the lifecycle: it turns OS facts (a line on
the control socket, a stall, the process ending) into calls on its `Listener`,
whose owner (the controller) feeds them to the machines. It learns of an exit
the moment it happens: ``Process.wait`` is backed by a pidfd on Linux, so
there is no polling interval.

Stop = ask (``Shutdown``) → grace → SIGTERM → grace → SIGKILL; the process is
always reaped before `run` returns, whatever cancels it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import attrs
import trio

from exod.runner import protocol as p
from exod.runner.batch import BatchLimits
from exod.state.statedir import private_dir, private_opener


@attrs.frozen
class Timeouts:
    """Stall watchdogs per phase, and the grace periods of a stop (seconds). The first three and ``heartbeat``
    are the plan's (`fsm.PhaseLimits`, kept by the controller); the rest are the supervisor's, which needs the
    process."""

    connect: float = 60.0  # Connect → joined
    load_progress: float = 120.0  # Load → each next progress report
    warm_up: float = 120.0  # WarmUp → ready
    generate: float = 300.0  # while requests are outstanding: each next token (rank 0) or finished request
    stop_grace: float = 5.0  # Shutdown sent → SIGTERM
    term_grace: float = 3.0  # SIGTERM → SIGKILL
    heartbeat: float = 10.0  # the last heartbeat answered → failed as stalled, whatever the phase (`fsm.PhaseLimits`)


@attrs.frozen
class RunnerSpec:
    runner_id: str
    incarnation: int
    rank: int
    world_size: int
    hostfile: Path | None
    log_path: Path
    fault: str | None = None  # "PHASE:KIND", for tests (exod.runner.faults); None in production
    script: str | None = None  # text every generation emits instead of sampling, for tests; None in production
    batch: BatchLimits = attrs.Factory(BatchLimits)  # what it decodes at once
    fenced: bool = False  # a cluster's runner: it holds a deadline its agent extends (`Supervisor.extend`)


class Listener(Protocol):
    def on_spawned(self, spec: RunnerSpec, pid: int) -> None: ...
    def on_report(self, spec: RunnerSpec, report: p.Report) -> None: ...
    def on_stall(self, spec: RunnerSpec, phase: str, seconds: float) -> None: ...
    def on_exit(self, spec: RunnerSpec, exit_code: int, stderr_tail: str, stop_delivered: bool) -> None:
        """``stop_delivered``: our stop (Shutdown delivered, or a signal from us) reached it before it ended."""


class Process(Protocol):
    """What the controller needs of a runner's supervisor (`exod.host.supervisor.Supervisor`, or a test's fake)."""

    spec: RunnerSpec
    pid: int | None

    async def run(self) -> None: ...
    def post(self, command: p.Command) -> None: ...
    def stop(self) -> None: ...


class FencedProcess(Process, Protocol):
    """What a cluster's agent needs besides: the runner's deadline, moved on while its node may run it."""

    def extend(self, until: float) -> None: ...


Spawn = Callable[[RunnerSpec, Listener, Timeouts], Process]
FencedSpawn = Callable[[RunnerSpec, Listener, Timeouts], FencedProcess]


TAIL_LINES = 20
# A runner gets a local snapshot path from the daemon and must never reach for a hub itself (a missing
# file would otherwise become a network wait, not an error).
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
RUNNER_ENV = {"TOKENIZERS_PARALLELISM": "false"}
DRAIN_S = 1.0  # after an exit, how long to read what the process wrote before it died
WRITE_BYTES = 65536  # commands written at once at most: what the runner reads at once (`exod.runner.process`)


@contextlib.contextmanager
def _closing(fd: int | None) -> Iterator[None]:
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Unfenced(RuntimeError):
    """A cluster's runner (`RunnerSpec.fenced`) asked to start without its deadline: it could outlive its node's
    authority, so it is not started (DESIGN §5). Its agent gives it one first (`Supervisor.extend`)."""


class Watchdog:
    """Stall detection for one runner's generation: armed by a request, fed by the reports that show progress,
    firing ``on_stall("generating", seconds)`` once when it goes silent for its timeout (trio time). The phases
    of a start are watched by the plan (`fsm.PhaseLimits`), which sees the same reports."""

    def __init__(self, timeouts: Timeouts, on_stall: Callable[[str, float], None]) -> None:
        self.timeouts = timeouts
        self._on_stall = on_stall
        # trio time; None: disarmed. Each token moves it and wakes nobody: `run` looks at it when the one it
        # slept until has passed, so a busy runner costs one wake-up per timeout, not one per token.
        self._deadline: float | None = None
        self._armed = trio.Event()
        self._outstanding = 0  # Generate commands without their Done yet

    def _arm(self) -> None:
        disarmed = self._deadline is None
        self._deadline = trio.current_time() + self.timeouts.generate
        if disarmed:
            self._armed.set()

    def disarm(self) -> None:
        self._deadline = None

    def arm_for(self, command: p.Command) -> None:
        """A request gives the generation its timeout."""
        if isinstance(command, p.Generate):
            self._outstanding += 1
            if self._deadline is None:
                self._arm()

    def feed(self, report: p.Report) -> None:
        """A report of progress re-arms (tokens, heartbeats) or disarms (no request is left)."""
        if isinstance(report, (p.Done, p.RequestError)):
            self._outstanding = max(0, self._outstanding - 1)
        if isinstance(report, (p.Token, p.Heartbeat, p.Done, p.RequestError)) and self._deadline is not None:
            if self._outstanding:
                self._arm()
            else:
                self.disarm()

    async def run(self) -> None:
        while True:
            if self._deadline is None:
                self._armed = trio.Event()  # no checkpoint since the look: an `_arm` from now on sets this one
                await self._armed.wait()
            elif trio.current_time() < self._deadline:
                await trio.sleep_until(self._deadline)  # fed meanwhile: the deadline moved, sleep on
            else:
                self._deadline = None
                self._on_stall("generating", self.timeouts.generate)


class Supervisor:
    def __init__(self, spec: RunnerSpec, listener: Listener, timeouts: Timeouts = Timeouts()) -> None:
        self.spec = spec
        self.listener = listener
        self.timeouts = timeouts
        self.pid: int | None = None
        self._stream: trio.SocketStream | None = None
        self.stop_requested = trio.Event()
        self._outbox_send, self.outbox = trio.open_memory_channel[p.Command](math.inf)
        self.watchdog = Watchdog(timeouts, lambda phase, seconds: listener.on_stall(spec, phase, seconds))
        self.exit_code: int | None = None
        self._drained = trio.Event()
        self.stop_delivered = False  # whether an exit can be the answer to our stop
        self._signals_sent: set[int] = set()
        self.deadline: float | None = None  # (trio time) a fenced runner ends itself past it
        self._deadline_w: int | None = None  # the deadline pipe's write end, while the process runs

    # -- the dead man's switch -------------------------------------------------------------

    def extend(self, until: float) -> None:
        """Move the runner's deadline on to ``until`` (trio time); past it, the runner's watchdog process kills
        it, whatever this daemon is doing (`exod.runner.watchdog`). Set before `run` for the first one."""
        self.deadline = until
        if self._deadline_w is not None:
            self._send_deadline(self._deadline_w)

    def _send_deadline(self, fd: int) -> None:
        assert self.deadline is not None, "a fenced runner needs its first deadline before it runs"
        monotonic = time.monotonic() + (self.deadline - trio.current_time())  # one clock for the whole host
        with contextlib.suppress(OSError):  # a full pipe: the watchdog reads every line; none: the runner is gone
            os.write(fd, b"%.6f\n" % monotonic)

    # -- commands ------------------------------------------------------------------

    def post(self, command: p.Command) -> None:
        """Queue a command; commands reach the process in the order they were posted (`outbox`)."""
        self.watchdog.arm_for(command)
        self._outbox_send.send_nowait(command)

    async def _write_commands(self) -> None:
        """Every command posted, in order; those posted together (a planner pass's: one call's inputs to embed)
        in one write, up to what the runner reads at once, so that it takes them together (`Lockstep.take`)."""
        assert self._stream is not None
        async for command in self.outbox:
            commands, data = [command], command.to_line()
            while len(data) < WRITE_BYTES:
                try:
                    commands.append(self.outbox.receive_nowait())
                except trio.WouldBlock:
                    break
                data += commands[-1].to_line()
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the process is ending; `run` reports the exit
            if any(isinstance(c, p.Shutdown) for c in commands):
                self.stop_delivered = True

    def stop(self) -> None:
        """Ask the process to stop; escalation and reaping happen in `run`."""
        self.stop_requested.set()

    # -- the process --------------------------------------------------------------------

    def _argv(self, control_fd: int, deadline_fd: int | None) -> list[str]:
        s = self.spec
        argv = [sys.executable, "-m", "exod.runner", "--runner-id", s.runner_id, "--incarnation", str(s.incarnation)]
        argv += ["--rank", str(s.rank), "--world-size", str(s.world_size), "--control-fd", str(control_fd)]
        if s.fenced and deadline_fd is None:
            raise Unfenced(f"runner {s.runner_id}/{s.incarnation} is fenced: it runs only with its deadline pipe")
        if deadline_fd is not None:
            argv += ["--deadline-fd", str(deadline_fd)]
        if s.hostfile is not None:
            argv += ["--hostfile", str(s.hostfile)]
        if s.fault is not None:
            argv += ["--fault", s.fault]
        if s.script is not None:
            argv += ["--script", s.script]
        return argv + s.batch.argv()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Spawn, serve until the process ends, report the exit. Cancelling it kills and reaps the process.
        `Unfenced` (nothing started) for a fenced runner without its first deadline."""
        if self.spec.fenced and self.deadline is None:
            s = self.spec
            raise Unfenced(f"runner {s.runner_id}/{s.incarnation} is fenced but has no deadline: it is not started")
        private_dir(self.spec.log_path.parent)  # a log holds the runner's output: 0700 dirs, a 0600 file
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline_r, deadline_w = os.pipe() if self.spec.fenced else (None, None)
        # "w": a log is one process's (its tail is what the exit reports), never appended to another's
        with parent, open(self.spec.log_path, "wb", opener=private_opener) as log, _closing(deadline_w):
            try:
                if deadline_w is not None:
                    os.set_blocking(deadline_w, False)
                    self._send_deadline(deadline_w)  # in the pipe before the runner starts: it holds from the start
                process = await trio.lowlevel.open_process(
                    self._argv(child.fileno(), deadline_r),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=[child.fileno()] + ([] if deadline_r is None else [deadline_r]),
                    start_new_session=True,  # a Ctrl-C to the daemon is the daemon's to handle, not the runners'
                    env=RUNNER_ENV | dict(os.environ) | OFFLINE,
                )
            finally:
                child.close()
                if deadline_r is not None:
                    os.close(deadline_r)
            self._deadline_w = deadline_w
            try:  # from here on, whatever happens, the process is killed if need be and reaped
                self.pid = process.pid
                self._stream = trio.SocketStream(trio.socket.from_stdlib_socket(parent))
                self.listener.on_spawned(self.spec, process.pid)
                task_status.started()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._read_reports)
                    nursery.start_soon(self._write_commands)
                    nursery.start_soon(self.watchdog.run)
                    nursery.start_soon(self._stop_when_asked, process)
                    self.exit_code = await process.wait()
                    with trio.move_on_after(DRAIN_S):  # the last lines (a Failed report) come before EOF
                        await self._drained.wait()
                    nursery.cancel_scope.cancel()
            finally:
                self._deadline_w = None  # closed with the `with`, once the process is reaped
                with trio.CancelScope(shield=True):
                    await self._kill_and_reap(process)
                    if self._stream is not None:
                        await self._stream.aclose()
        self.listener.on_exit(self.spec, self.exit_code, _tail(self.spec.log_path), self._answered_our_stop())

    async def _read_reports(self) -> None:
        try:
            await self._read_until_eof()
        finally:
            self._drained.set()

    async def _read_until_eof(self) -> None:
        assert self._stream is not None
        reader = p.LineReader()
        while True:
            try:
                data = await self._stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return  # EOF: the process is ending; `run` waits for the exit
            try:
                messages = [p.from_json(line) for line in reader.feed(data)]
            except p.ProtocolError as exc:  # a runner that garbles its channel cannot be trusted: fail it
                s = self.spec
                self.listener.on_report(s, p.Failed(s.runner_id, s.incarnation, "ProtocolError", str(exc), "", False))
                self.stop()
                return
            for message in messages:
                if isinstance(message, p.Report):
                    self.watchdog.feed(message)
                    self.listener.on_report(self.spec, message)

    def _answered_our_stop(self) -> bool:
        """Whether the exit can be the answer to our stop. A Shutdown that reached the socket of a process
        someone else had just killed is not an answer: death by a signal we never sent beat our stop."""
        assert self.exit_code is not None
        killed_by_another = self.exit_code < 0 and -self.exit_code not in self._signals_sent
        return self.stop_delivered and not killed_by_another

    async def _stop_when_asked(self, process: trio.Process) -> None:
        await self.stop_requested.wait()
        self.watchdog.disarm()
        self.post(p.Shutdown())
        with trio.move_on_after(self.timeouts.stop_grace):
            await process.wait()
            return
        self.stop_delivered = True
        self._signals_sent.add(signal.SIGTERM)
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(self.timeouts.term_grace):
            await process.wait()
            return
        self._signals_sent.add(signal.SIGKILL)
        process.kill()

    @staticmethod
    async def _kill_and_reap(process: trio.Process) -> None:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        await process.wait()
