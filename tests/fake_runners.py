"""In-process stand-ins for runner processes and the model cache, for driving a `Controller` on a mock clock.

``Controller(config, store, spawn=FakeFleet(...), models=FakeModels(...), wall=lambda: WALL)`` inside
``trio.run(..., clock=trio.testing.MockClock(autojump_threshold=0))`` runs the whole daemon — planner,
machines, store, request book — with no subprocess, no thread and no file of a model: every wait is a trio
sleep, so virtual time jumps straight to the next thing that happens and a test can assert exact times.
(Autojump and real work do not mix: with a real process or a thread at work, the clock would jump over it
and fire the watchdogs.)

`FakeRunner` is the real `exod.host.supervisor.Supervisor` with its process replaced by trio tasks that act like
`exod.runner`: the command queue (`post`, `outbox`), the stall watchdog (`Supervisor.watchdog`, fed every
report, exactly as for a real process), and the stop rule (Shutdown → ``stop_grace`` → SIGTERM) are
the Supervisor's own; only what a real process does is simulated:

* ``Connect`` → Status(JOINING), then Status(JOINED); ``Load`` → Status(WEIGHTS), a `Progress` per layer,
  Status(LOADED); ``WarmUp`` → Status(WARMING_UP), Status(READY); ``Generate`` → rank 0 streams `TOKENS`
  (other ranks send a `Heartbeat` per token), then every rank sends `Done`. Each step takes the `Timing`'s
  virtual seconds.
* ``Shutdown`` ends the process (exit 0) after ``Timing.exit``, as the runner's reader thread does; a ``Ping``
  (the heartbeat) is answered at once, hung or not, as that thread does.
* A fault comes the way it comes to a real runner: `DaemonConfig.faults` → `RunnerSpec.fault`
  (``PHASE:KIND``, `exod.runner.faults`), with the injector's meaning: ``sigkill`` ends it (exit −9, unannounced),
  ``exception`` reports a retryable `Failed` and exits 1, ``exit0`` exits 0 unannounced, ``hang`` goes
  silent and ignores Shutdown (SIGTERM after ``stop_grace`` ends it), ``slow`` pauses `exod.runner.faults.SLOW_S`.
  A ``ready`` fault fires ``Timing.ready_fault`` after Ready. A model `FakeModels` calls defective fails
  its load with a non-retryable `Failed`, as corrupt weights do. `FakeRunner.kill` is a SIGKILL from outside.

Fake pids start at 2**22: Linux never hands out a pid above 2**22 − 1 (PID_MAX_LIMIT), so no process has one.
The controller records them with start time 0 (`exod.host.orphans.start_ticks` finds no such process), and
`exod.host.orphans.reap_orphans` never signals a record whose start time is unknown: nothing real can be killed.
"""

from __future__ import annotations

import math
import signal
from pathlib import Path
from typing import Any

import attrs
import trio

import fsm
from exod.host.models import ModelFiles, ModelNotFound, ProgressCallback
from exod.host.orphans import start_ticks
from exod.host.supervisor import Listener, RunnerSpec, Supervisor, Timeouts
from exod.runner import protocol as p
from exod.runner.faults import SLOW_S, Fault, FaultKind, FaultPhase

FAKE_PID_BASE = 1 << 22  # above Linux's PID_MAX_LIMIT (and macOS's 99998): never a real process
FAKE_MODEL_ROOT = Path("/nonexistent/exod-fake-models")  # what `FakeModels.path` answers; nothing reads it
TOKENS = ("A", " state", " machine", " is", " a", " graph", ".")
PROMPT_TOKENS = 9


@attrs.frozen
class Timing:
    """How long each step of a fake runner takes, in (virtual) seconds."""

    connect: float = 0.5  # Connect → joined
    layers: int = 4
    layer: float = 0.25  # per layer, while loading
    warm_up: float = 0.5  # WarmUp → ready
    token: float = 0.125  # per generated token
    exit: float = 0.125  # Shutdown (or a fault) → the process is gone
    ready_fault: float = 0.25  # a ``ready:*`` fault fires this long after Ready (the runner uses a timer)


class FakeRunner(Supervisor):
    """A `Supervisor` whose runner process is simulated in trio (see the module docstring)."""

    def __init__(self, spec: RunnerSpec, listener: Listener, timeouts: Timeouts, *, pid: int, fleet: FakeFleet):
        super().__init__(spec, listener, timeouts)
        assert start_ticks(pid) is None, f"fake pid {pid} names a real process"
        self.fleet = fleet
        self.fake_pid = pid
        self.fault = Fault.parse(spec.fault) if spec.fault else None
        self.created_at = trio.current_time()
        self.exited_at: float | None = None
        self.tail = ""
        self.hung = False  # a ``hang`` fault fired: Shutdown is ignored
        self.reports: list[tuple[float, p.Report]] = []  # what it said, when
        self._work_send, self._work = trio.open_memory_channel[p.Command](math.inf)
        self._gone = trio.Event()
        self._nursery: trio.Nursery | None = None

    def __repr__(self) -> str:
        s = self.spec
        return f"<FakeRunner {s.runner_id}/{s.incarnation} pid={self.fake_pid} exit={self.exit_code}>"

    # -- the process's life, under the real Supervisor's watchdog and stop rule ----------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.pid = self.fake_pid
        self.listener.on_spawned(self.spec, self.fake_pid)
        task_status.started()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.watchdog.run)  # the Supervisor's stall watchdog, unchanged
            nursery.start_soon(self._read_commands)
            nursery.start_soon(self._main)
            nursery.start_soon(self._stop_escalation)
            await self._gone.wait()
            nursery.cancel_scope.cancel()
        self.listener.on_exit(self.spec, self.exit_code, self.tail, self.stop_delivered)

    def kill(self) -> None:
        """SIGKILL from outside (an operator, the OOM killer): the process is gone, unannounced."""
        self._exit(-signal.SIGKILL, "Killed")

    @property
    def alive(self) -> bool:
        return self.pid is not None and not self._gone.is_set()

    def _exit(self, code: int, tail: str = "") -> None:
        if not self._gone.is_set():
            self.exit_code, self.tail, self.exited_at = code, tail, trio.current_time()
            self._gone.set()

    async def _stop_escalation(self) -> None:
        """`Supervisor._stop_when_asked` with a simulated process: ask, wait ``stop_grace``, then SIGTERM."""
        await self.stop_requested.wait()
        self.watchdog.disarm()
        self.post(p.Shutdown())
        await trio.sleep(self.timeouts.stop_grace)  # cancelled by `run` if the process ends before
        self.stop_delivered = True
        self._exit(-signal.SIGTERM)  # the runner installs no SIGTERM handler: it dies, hung or not

    # -- the runner's reader thread: Shutdown at once, everything else queued for the main thread ------

    async def _read_commands(self) -> None:
        async for command in self.outbox:
            if isinstance(command, p.Ping):  # the heartbeat: answered here at once, whatever the main thread does
                if not self._gone.is_set():  # (not kept in `reports`: no test reads the heartbeat there)
                    pong = p.Pong(runner_id=self.spec.runner_id, incarnation=self.spec.incarnation)
                    self.listener.on_report(self.spec, pong)
                continue
            if not isinstance(command, p.Shutdown):
                self._work_send.send_nowait(command)
                continue
            self.stop_delivered = True  # the Supervisor sets it once Shutdown is written to the socket
            await self._fault_at(FaultPhase.STOPPING, main_thread=False)
            if self.hung:
                continue  # a hung runner does not answer: the supervisor escalates
            await trio.sleep(self.fleet.timing.exit)
            self._exit(0)
            return

    # -- the runner's main thread ------------------------------------------------------------------------

    async def _main(self) -> None:
        t = self.fleet.timing
        async for command in self._work:
            match command:
                case p.Connect():
                    self._send(p.Status, phase=p.Phase.JOINING)
                    await self._fault_at(FaultPhase.CONNECTING)
                    await trio.sleep(t.connect)
                    self._send(p.Status, phase=p.Phase.JOINED)
                case p.Load(model_path=path):
                    self._send(p.Status, phase=p.Phase.WEIGHTS)
                    if (defect := self.fleet.models.defect(path)) is not None:
                        await self._die_of(defect, retryable=False)
                    for layer in range(1, t.layers + 1):
                        await trio.sleep(t.layer)
                        self._send(p.Progress, layers_loaded=layer, layers_total=t.layers)
                        await self._fault_at(FaultPhase.LOADING)
                    self._send(p.Status, phase=p.Phase.LOADED)
                case p.WarmUp():
                    self._send(p.Status, phase=p.Phase.WARMING_UP)
                    await self._fault_at(FaultPhase.WARMING_UP)
                    await trio.sleep(t.warm_up)
                    self._send(p.Status, phase=p.Phase.READY)
                    if self.fault is not None and self.fault.phase is FaultPhase.READY:
                        assert self._nursery is not None
                        self._nursery.start_soon(self._ready_fault)
                case p.Generate():
                    await self._generate(command)

    async def _generate(self, request: p.Generate) -> None:
        tokens = TOKENS[: request.max_tokens]
        for index, text in enumerate(tokens, start=1):
            await trio.sleep(self.fleet.timing.token)
            if self.spec.rank == 0:
                self._send(p.Token, request_id=request.request_id, text=text, token_id=index)
            else:
                self._send(p.Heartbeat, request_id=request.request_id, tokens=index)
            if index == 1:
                await self._fault_at(FaultPhase.BUSY)
        reason = p.FinishReason.LENGTH if len(tokens) == request.max_tokens else p.FinishReason.STOP
        self._send(
            p.Done,
            request_id=request.request_id,
            finish_reason=reason,
            prompt_tokens=PROMPT_TOKENS,
            completion_tokens=len(tokens),
        )

    async def _ready_fault(self) -> None:
        await trio.sleep(self.fleet.timing.ready_fault)
        await self._fault_at(FaultPhase.READY, main_thread=False)

    async def _fault_at(self, phase: FaultPhase, *, main_thread: bool = True) -> None:
        """`exod.runner.faults.Injector.at`, simulated."""
        if self.fault is None or self.fault.phase is not phase:
            return
        kind = self.fault.kind
        if kind is FaultKind.SIGKILL:
            self._exit(-signal.SIGKILL)
            await trio.sleep_forever()  # `run` ends this task with the process
        elif kind is FaultKind.EXIT0:
            self._exit(0)
            await trio.sleep_forever()
        elif kind is FaultKind.EXCEPTION:
            await self._die_of(f"InjectedFault: injected fault: exception while {phase.value}", retryable=True)
        elif kind is FaultKind.HANG:
            self.hung = True
            if main_thread:
                await trio.sleep_forever()  # silent: only the watchdog (then SIGTERM) ends it
        elif kind is FaultKind.SLOW:
            await trio.sleep(SLOW_S)

    async def _die_of(self, error: str, *, retryable: bool) -> None:
        """Report `Failed` and exit 1, like the runner's main loop on an exception."""
        exception_type, _, message = error.partition(": ")
        self._send(p.Failed, exception_type=exception_type, message=message, traceback="", retryable=retryable)
        await trio.sleep(self.fleet.timing.exit)
        self._exit(1, error)
        await trio.sleep_forever()

    def _send(self, cls: type[p.Report], **fields: Any) -> None:
        """A line on the control channel: what `Supervisor._read_until_eof` does with it, minus the socket."""
        if self._gone.is_set():
            return
        report = cls(runner_id=self.spec.runner_id, incarnation=self.spec.incarnation, **fields)
        self.reports.append((trio.current_time(), report))
        self.watchdog.feed(report)
        self.listener.on_report(self.spec, report)


class FakeFleet:
    """The `exod.host.supervisor.Spawn` to give the controller: makes `FakeRunner`s and keeps every one of them."""

    def __init__(self, models: FakeModels, timing: Timing = Timing()) -> None:
        self.models = models
        self.timing = timing
        self.runners: list[FakeRunner] = []

    def __call__(self, spec: RunnerSpec, listener: Listener, timeouts: Timeouts) -> FakeRunner:
        runner = FakeRunner(spec, listener, timeouts, pid=FAKE_PID_BASE + len(self.runners), fleet=self)
        self.runners.append(runner)
        return runner

    def generation(self, incarnation: int) -> list[FakeRunner]:
        """The runners created for one generation, by rank."""
        return sorted((r for r in self.runners if r.spec.incarnation == incarnation), key=lambda r: r.spec.rank)

    def runner(self, rank: int, incarnation: int) -> FakeRunner:
        (found,) = [r for r in self.generation(incarnation) if r.spec.rank == rank]
        return found

    def created_at(self, incarnation: int) -> list[float]:
        return [r.created_at for r in self.generation(incarnation)]

    def reaped_at(self, incarnation: int) -> float:
        """When the last process of a generation was gone."""
        times = [r.exited_at for r in self.generation(incarnation)]
        assert times and None not in times, f"generation {incarnation} is not fully reaped: {times}"
        return max(t for t in times if t is not None)


FAKE_MODEL_FILES = frozenset({"config.json", "model.safetensors"})  # what every fake model has


class FakeModels(ModelFiles):
    """`ModelFiles` with no hub and no cache: a fetch takes ``delay`` virtual seconds; no thread, no file.

    ``failures``: model id → how many fetches fail (`ModelNotFound`) before one succeeds (``math.inf``: all).
    ``defective``: model id → the error a runner loading it reports, non-retryable (corrupt weights).
    """

    def __init__(
        self,
        *,
        delay: float = 1.0,
        failures: dict[str, float] | None = None,
        defective: dict[str, str] | None = None,
    ) -> None:
        super().__init__(hf_home=FAKE_MODEL_ROOT, offline=True)
        self.delay = delay
        self.failures = dict(failures or {})
        self.defective = dict(defective or {})
        self.fetches: list[tuple[float, str, str]] = []  # (started at, model id, "ok" or the error)

    async def fetch(self, model_id: str, progress: ProgressCallback) -> Path:
        started = trio.current_time()
        await trio.sleep(self.delay / 2)
        progress(50, 100)
        await trio.sleep(self.delay / 2)
        if self.failures.get(model_id, 0) > 0:
            self.failures[model_id] -= 1
            error = f"model {model_id!r} is neither cached nor reachable (fake hub)"
            self.fetches.append((started, model_id, error))
            raise ModelNotFound(error)
        progress(100, 100)
        self.fetches.append((started, model_id, "ok"))
        self._paths[model_id] = FAKE_MODEL_ROOT / model_id
        self._manifest[model_id] = FAKE_MODEL_FILES  # found whole: `ModelFiles.lost` judges by these
        return self._paths[model_id]

    def path(self, model_id: str) -> Path:
        if model_id not in self._paths:
            raise ModelNotFound(f"{model_id} is not in the fake cache")
        return self._paths[model_id]

    def vanished(self, model_id: str) -> bool:
        return model_id in self._manifest and model_id not in self._paths

    def facts(self, model_id: str) -> fsm.ModelFacts | None:
        """Every model is on the fake hub: fetchable, its facts unknown (admission checks the limits alone)."""
        return None

    def defect(self, model_path: str) -> str | None:
        """What loading ``model_path`` fails with, if its model is defective."""
        model_id = Path(model_path).relative_to(FAKE_MODEL_ROOT).as_posix()
        return self.defective.get(model_id)
