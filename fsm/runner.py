"""The runner lifecycle: one runner = one OS process = one rank of an instance.

Theory of operation
-------------------
Six states of the design card (``RunnerState``), with sub-phases as compound
states; the four a process passes through while it works are grouped as
Running, so that ``fail``, ``stop`` and ``exited`` are declared once for them::

    Running(Idle → Connecting(joining → joined) → Loading(weights → loaded → warming_up)
            → Ready(available ⇄ busy)) → Shutdown(stopping → stopped)
    Running or Shutdown.stopping → Failed → Shutdown.stopped

Running is a grouping, not a state of the card: ``runner_state`` and
``phase`` are read from the leaf, which is also what snapshots keep.

* ``connect`` is legal only from Idle and only for world_size > 1; a single
  rank goes Idle → Loading directly (``load`` is guarded both ways).
* Failed is terminal for the process: its only exit is to Shutdown.stopped
  when the process is reaped (``exited``). Nothing leads back to Idle; a new
  process is a new machine with a higher incarnation.
* A process that exits while not stopping is Failed, even with exit code 0:
  ``exited`` from a running state passes through Failed (recording the cause)
  and, the process being gone, on to Shutdown.stopped in the same event.
  So is one that exits while stopping before our stop reached it
  (``stop_delivered=False``): its real last status was a failure.
* Failed always carries its cause: ``fail`` is refused without one.
* The failure stays recorded after Shutdown, so "this runner failed" is still
  true of its last status (the rule exo's supervisor broke by overwriting it).
* Every event names ``(runner_id, incarnation)``; an event from an older
  incarnation is ignored and changes nothing.

This module knows nothing of processes, clocks or other ranks: the supervisor
feeds it events; the planner reads its status.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

import attrs
from statemachine import State

from fsm._machine import Lifecycle, Outcome, Step
from fsm._validate import integer, is_count, show
from fsm.errors import IncarnationMismatch, InvalidConfig, InvalidEvent
from fsm.failure import Failure


class RunnerState(enum.Enum):
    """The six states of the design card (the machine groups the first four under `running`)."""

    IDLE = "idle"  #: the process exists and has been told nothing yet
    CONNECTING = "connecting"  #: joining its ring with the other ranks (world_size > 1 only)
    LOADING = "loading"  #: reading the weights, then warming up
    READY = "ready"  #: serving, or waiting for requests
    FAILED = "failed"  #: terminal for the process: it is stopped and reaped, never revived
    SHUTDOWN = "shutdown"  #: being stopped, or reaped


class RunnerPhase(enum.Enum):
    """Sub-phases of the compound states (Idle and Failed have none)."""

    JOINING = "joining"  #: told to connect; joining its ring
    JOINED = "joined"  #: this rank joined; waiting for the others
    WEIGHTS = "weights"  #: reading weights, with layer progress
    LOADED = "loaded"  #: waiting for all ranks to be loaded
    WARMING_UP = "warming_up"  #: every rank loaded; running its warm-up
    AVAILABLE = "available"  #: ready, serving no request
    BUSY = "busy"  #: ready, serving >= 1 request
    STOPPING = "stopping"  #: asked to stop; its exit is owed
    STOPPED = "stopped"  #: reaped: the process is gone (final)


_PARENT = {
    RunnerPhase.JOINING: RunnerState.CONNECTING,
    RunnerPhase.JOINED: RunnerState.CONNECTING,
    RunnerPhase.WEIGHTS: RunnerState.LOADING,
    RunnerPhase.LOADED: RunnerState.LOADING,
    RunnerPhase.WARMING_UP: RunnerState.LOADING,
    RunnerPhase.AVAILABLE: RunnerState.READY,
    RunnerPhase.BUSY: RunnerState.READY,
    RunnerPhase.STOPPING: RunnerState.SHUTDOWN,
    RunnerPhase.STOPPED: RunnerState.SHUTDOWN,
}


# -- events -----------------------------------------------------------------------


@attrs.frozen
class RunnerEvent:
    """Base of the runner's events: every one names the process it is about."""

    name: ClassVar[str]
    runner_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    incarnation: int = attrs.field(validator=integer(InvalidEvent))

    def payload(self) -> dict[str, Any]:
        """The event's fields the machine's guards and callbacks take (as keyword arguments of ``send``)."""
        return {}


@attrs.frozen
class Connect(RunnerEvent):
    """Told to join its ring (`Cluster.execute` of a ConnectRunner sends it)."""

    name = "connect"


@attrs.frozen
class Connected(RunnerEvent):
    """This rank joined the distributed group."""

    name = "connected"


@attrs.frozen
class Load(RunnerEvent):
    """Told to read the weights (`Cluster.execute` of a LoadModel sends it)."""

    name = "load"


@attrs.frozen
class Progress(RunnerEvent):
    """The caller's report of layers read so far (optional): it shows progress and resets the load watchdog."""

    name = "progress"
    layers_loaded: int = attrs.field(validator=integer(InvalidEvent))
    layers_total: int = attrs.field(validator=integer(InvalidEvent))

    def __attrs_post_init__(self) -> None:
        if self.layers_total == 0 or self.layers_loaded > self.layers_total:
            raise InvalidEvent(
                f"progress must satisfy 0 <= layers_loaded <= layers_total and layers_total > 0, "
                f"got {self.layers_loaded}/{self.layers_total}"
            )

    def payload(self) -> dict[str, Any]:
        """The layer counts, which the machine records for progress views."""
        return {"layers_loaded": self.layers_loaded, "layers_total": self.layers_total}


@attrs.frozen
class WeightsLoaded(RunnerEvent):
    """The caller's report: every layer is read."""

    name = "weights_loaded"


@attrs.frozen
class WarmUp(RunnerEvent):
    """Told to warm up (`Cluster.execute` of a WarmUp action sends it)."""

    name = "warm_up"


@attrs.frozen
class Warmed(RunnerEvent):
    """The caller's report: the warm-up ran; the runner is Ready."""

    name = "warmed"


@attrs.frozen
class RequestStarted(RunnerEvent):
    """A request was forwarded to the runner (`Cluster.execute` of a ForwardRequest sends it): it is busy."""

    name = "request_started"


@attrs.frozen
class RequestFinished(RunnerEvent):
    """The caller's report: a request ended, however it ended; the last one makes the runner available."""

    name = "request_finished"


@attrs.frozen
class Fail(RunnerEvent):
    """The runner failed, with its cause (the caller's report, or a watchdog's through FailStalled)."""

    name = "fail"
    failure: Failure = attrs.field(validator=attrs.validators.instance_of(Failure))

    def payload(self) -> dict[str, Any]:
        """The cause, which Failed always keeps."""
        return {"failure": self.failure}


@attrs.frozen
class Stop(RunnerEvent):
    """The runner is being stopped (`Cluster.execute` of a StopRunner sends it); its exit is owed."""

    name = "stop"


@attrs.frozen
class Exited(RunnerEvent):
    """The process ended and was reaped. ``exit_code`` < 0 means killed by signal −code."""

    name = "exited"
    exit_code: int = attrs.field(validator=attrs.validators.instance_of(int))
    detail: str = ""  # last stderr lines
    # Whether our stop (the ask, or a signal) reached the process before it ended. An exit that beat
    # the stop is the process's own doing: a failure, recorded as such even though we were stopping it.
    stop_delivered: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    def payload(self) -> dict[str, Any]:
        """What the guards need to tell a clean stop from a failure."""
        return {"exit_code": self.exit_code, "detail": self.detail, "stop_delivered": self.stop_delivered}


# -- snapshot ---------------------------------------------------------------------


@attrs.frozen
class RunnerSnapshot:
    """A runner's whole state as a value (`RunnerLifecycle.snapshot`), its failure included."""

    runner_id: str
    incarnation: int
    rank: int
    world_size: int
    leaf: str
    layers_loaded: int = 0
    layers_total: int = 0
    in_flight: int = 0
    stop_requested: bool = False
    failure: Failure | None = None


# -- the machine ------------------------------------------------------------------


class RunnerLifecycle(Lifecycle):
    """One runner process, from spawn to reaping. See the module docstring."""

    machine_name = "runner"
    snapshot_type = RunnerSnapshot

    class running(State.Compound):
        idle = State(initial=True)

        class connecting(State.Compound):
            joining = State(initial=True)
            joined = State()

        class loading(State.Compound):
            weights = State(initial=True)
            loaded = State()
            warming_up = State()

        class ready(State.Compound):
            available = State(initial=True)
            busy = State()

    failed = State()

    class shutdown(State.Compound):
        stopping = State(initial=True)
        stopped = State(final=True)

    # python-statemachine tries the active leaf's transitions before its ancestors'; no state inside
    # `running` declares fail, stop or exited, so `running`'s transitions are the ones taken.
    connect = running.idle.to(running.connecting, cond="multi_rank")
    connected = running.connecting.joining.to(running.connecting.joined)
    load = running.idle.to(running.loading, cond="single_rank") | running.connecting.joined.to(running.loading)
    progress = running.loading.weights.to.itself(internal=True, on="_record_progress")
    weights_loaded = running.loading.weights.to(running.loading.loaded, on="_record_all_layers")
    warm_up = running.loading.loaded.to(running.loading.warming_up)
    warmed = running.loading.warming_up.to(running.ready)
    request_started = running.ready.available.to(running.ready.busy, on="_request_in") | running.ready.busy.to.itself(
        internal=True, on="_request_in"
    )
    request_finished = running.ready.busy.to(
        running.ready.available, cond="last_request", on="_request_out"
    ) | running.ready.busy.to.itself(internal=True, unless="last_request", on="_request_out")
    fail = running.to(failed, cond="has_cause") | shutdown.stopping.to(failed, cond="has_cause")
    stop = running.to(shutdown) | failed.to.itself(internal=True, on="_record_stop_request")
    exited = (
        shutdown.stopping.to(shutdown.stopped, cond="stop_reached_it")
        | shutdown.stopping.to(failed, on="_exit_while_running")
        | failed.to(shutdown.stopped)
        | running.to(failed, on="_exit_while_running")
    )

    def __init__(
        self,
        runner_id: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        incarnation: int = 0,
        _snapshot: RunnerSnapshot | None = None,
    ) -> None:
        if not isinstance(runner_id, str) or not runner_id:
            raise InvalidConfig(f"runner_id must be a non-empty str, got {runner_id!r}")
        for label, value, low in (("world_size", world_size, 1), ("rank", rank, 0), ("incarnation", incarnation, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidConfig(f"{label} must be an int >= {low}, got {value!r}")
        if rank >= world_size:
            raise InvalidConfig(f"rank {rank} is out of range for world_size {world_size}")
        snap = _snapshot or RunnerSnapshot(runner_id, incarnation, rank, world_size, leaf="idle")
        self._adopt(snap)
        super().__init__(start_leaf=snap.leaf if _snapshot else None)

    def _adopt(self, snap: RunnerSnapshot) -> None:
        """Take the extended state from a snapshot (construction and `reload` share it)."""
        # straight into __dict__: python-statemachine checks every setattr, and `reload` is a hot path
        self.__dict__.update(
            runner_id=snap.runner_id,
            incarnation=snap.incarnation,
            rank=snap.rank,
            world_size=snap.world_size,
            layers_loaded=snap.layers_loaded,
            layers_total=snap.layers_total,
            in_flight=snap.in_flight,
            stop_requested=snap.stop_requested,
            failure=snap.failure,
        )

    # -- guards -------------------------------------------------------------

    @property
    def multi_rank(self) -> bool:
        """Guard of ``connect``: only a rank of two or more joins a ring."""
        return self.world_size > 1

    @property
    def single_rank(self) -> bool:
        """Guard of ``load`` from Idle: a single rank has no ring to join first."""
        return self.world_size == 1

    @property
    def last_request(self) -> bool:
        """The request finishing is the only one in flight: Busy goes back to Available."""
        return self.in_flight == 1

    @staticmethod
    def has_cause(failure: Failure | None = None) -> bool:
        """Failed always says why: a bare ``send("fail")`` is refused."""
        return isinstance(failure, Failure)

    @staticmethod
    def stop_reached_it(stop_delivered: bool = True) -> bool:
        """An exit while stopping is clean only if our stop reached the process first."""
        return stop_delivered

    # -- actions ------------------------------------------------------------

    def _record_progress(self, layers_loaded: int, layers_total: int) -> None:
        self.layers_loaded, self.layers_total = layers_loaded, layers_total

    def _record_all_layers(self) -> None:
        self.layers_loaded = self.layers_total

    def _request_in(self) -> None:
        self.in_flight += 1

    def _request_out(self) -> None:
        self.in_flight -= 1

    def on_enter_failed(self, failure: Failure | None = None) -> None:
        """Failed keeps its cause, and serves nothing: its requests ended with it."""
        if failure is not None:
            self.failure = failure
        self.in_flight = 0

    def _record_stop_request(self) -> None:
        self.stop_requested = True

    def on_enter_shutdown(self) -> None:
        """A stopping runner takes no requests: the stop is recorded, and what was in flight ends with it."""
        self.stop_requested = True
        self.in_flight = 0

    def _exit_while_running(self, exit_code: int, detail: str = "") -> None:
        self.failure = Failure.exited(exit_code, detail)
        self.raise_("exited")  # the process is gone: Failed leads straight on to Shutdown.stopped

    def _why_refused(self, event: str) -> str:
        if event == "connect" and self.leaf == "idle":
            return "connect needs world_size > 1; a single rank goes straight to load"
        if event == "load" and self.leaf == "idle":
            return "a multi-rank runner must connect (join its group) before it loads"
        if event == "fail" and self.leaf not in ("failed", "stopped"):
            return "a failure needs its cause: apply(Fail(runner_id, incarnation, failure=Failure(...)))"
        if self.leaf == "failed":
            return "a Failed runner is never revived: stop it, reap it, start a new incarnation"
        return ""

    # -- the typed door -----------------------------------------------------

    def apply(self, event: RunnerEvent) -> Outcome:
        """Handle an event about this runner; stale incarnations are ignored, not errors."""
        if not isinstance(event, RunnerEvent):
            raise InvalidEvent(f"expected a RunnerEvent, got {type(event).__name__}")
        if event.runner_id != self.runner_id:
            raise InvalidEvent(f"event for runner {event.runner_id!r} sent to runner {self.runner_id!r}")
        if event.incarnation < self.incarnation:
            return Outcome.ignored(f"stale incarnation {event.incarnation} < {self.incarnation}")
        if event.incarnation > self.incarnation:
            raise IncarnationMismatch(
                f"runner {self.runner_id!r} is incarnation {self.incarnation}; "
                f"event names {event.incarnation}: a newer incarnation is a new process, created by a CreateRunner "
                "action (Cluster.execute), or as a new RunnerLifecycle by a caller driving this machine alone"
            )
        if self._leaf in _SERVING and isinstance(event, (RequestStarted, RequestFinished)):
            return self._request(event)
        return self._fire(event.name, **event.payload())

    def _request(self, event: RequestStarted | RequestFinished) -> Outcome:
        """``request_started`` / ``request_finished`` in Ready, as declared, without python-statemachine's
        engine (about 100 µs an event, two events a request, on the path of every request): their only
        effects are the count in flight and Available ⇄ Busy, states with no entry or exit actions.
        tests/test_runner.py holds this to the engine, event by event."""
        if isinstance(event, RequestStarted):
            target = _BUSY
            self.__dict__["in_flight"] = self.in_flight + 1
        elif self._leaf == _BUSY:
            target = _AVAILABLE if self.last_request else _BUSY
            self.__dict__["in_flight"] = self.in_flight - 1
        else:  # finished while Available: refused, as the engine refuses it
            return self._fire(event.name, **event.payload())
        if target == self._leaf:  # the internal self-transition: no step
            return Outcome(accepted=True, steps=())
        step = Step(event.name, self._leaf, target)
        self.model.state, self._leaf = _SERVING[target], target
        return Outcome(accepted=True, steps=(step,))

    # -- views ----------------------------------------------------------------

    @property
    def runner_state(self) -> RunnerState:
        """The state of the design card: the leaf's parent for a sub-phase (`running` only groups them)."""
        phase = _PHASES.get(self.leaf)
        return RunnerState(self.leaf) if phase is None else phase_parent(phase)

    @property
    def phase(self) -> RunnerPhase | None:
        """The sub-phase as an enum (None in Idle and Failed, which have none): what watchdogs time."""
        return _PHASES.get(self.leaf)

    @property
    def alive(self) -> bool:
        """False only once the process has been reaped."""
        return self.leaf != RunnerPhase.STOPPED.value

    def snapshot(self) -> RunnerSnapshot:
        """The whole state, failure included, so "this runner failed" survives a restart."""
        return RunnerSnapshot(
            runner_id=self.runner_id,
            incarnation=self.incarnation,
            rank=self.rank,
            world_size=self.world_size,
            leaf=self.leaf,
            layers_loaded=self.layers_loaded,
            layers_total=self.layers_total,
            in_flight=self.in_flight,
            stop_requested=self.stop_requested,
            failure=self.failure,
        )

    @classmethod
    def from_snapshot(cls, snapshot: RunnerSnapshot) -> RunnerLifecycle:
        """Restore what `snapshot` returned; `SnapshotError` for a state no runner could be in."""
        cls.check_snapshot(snapshot)
        return cls(
            snapshot.runner_id,
            rank=snapshot.rank,
            world_size=snapshot.world_size,
            incarnation=snapshot.incarnation,
            _snapshot=snapshot,
        )

    @classmethod
    def _snapshot_plainly_fine(cls, s: RunnerSnapshot) -> bool:
        ws, rank, inc, loaded, total, in_flight = (
            s.world_size,
            s.rank,
            s.incarnation,
            s.layers_loaded,
            s.layers_total,
            s.in_flight,
        )
        return (
            type(s.runner_id) is str
            and s.runner_id != ""
            and type(ws) is int
            and type(rank) is int
            and 0 <= rank < ws
            and type(inc) is int
            and inc >= 0
            and type(loaded) is int
            and type(total) is int
            and 0 <= loaded <= total
            and type(in_flight) is int
            and ((in_flight >= 1) if s.leaf == _BUSY else (in_flight == 0))
            and (s.stop_requested is True or (s.stop_requested is False and s.leaf not in _SHUTDOWN_LEAVES))
            and (type(s.failure) is Failure if s.failure is not None else s.leaf != _FAILED)
        )

    @classmethod
    def _snapshot_problem(cls, s: RunnerSnapshot) -> str | None:
        """What no runner could be: bad types or ranges, a count that contradicts the leaf, a cause-less failure."""
        if not isinstance(s.runner_id, str) or not s.runner_id:
            return f"runner_id must be a non-empty str, got {show(s.runner_id)}"
        if not is_count(s.world_size, 1):
            return f"world_size must be an int >= 1, got {show(s.world_size)}"
        if not is_count(s.rank) or s.rank >= s.world_size:
            return f"rank must be an int >= 0 and < world_size {show(s.world_size)}, got {show(s.rank)}"
        if not is_count(s.incarnation):
            return f"incarnation must be an int >= 0, got {show(s.incarnation)}"
        if not (is_count(s.layers_loaded) and is_count(s.layers_total) and s.layers_loaded <= s.layers_total):
            return (
                "layers must satisfy 0 <= layers_loaded <= layers_total, "
                f"got layers_loaded={show(s.layers_loaded)}, layers_total={show(s.layers_total)}"
            )
        busy = s.leaf == _BUSY
        if not is_count(s.in_flight, 1 if busy else 0) or (s.in_flight and not busy):
            where = "in busy" if busy else f"0 outside busy (leaf {show(s.leaf)})"
            return f"in_flight must be {'>= 1 ' if busy else ''}{where}, got {show(s.in_flight)}"
        if not isinstance(s.stop_requested, bool):
            return f"stop_requested must be a bool, got {show(s.stop_requested)}"
        if not s.stop_requested and s.leaf in _SHUTDOWN_LEAVES:  # entering Shutdown records the stop
            return f"stop_requested must be True in {s.leaf}, got False"
        if s.failure is None:
            if s.leaf == _FAILED:
                return "failure: a failed runner always carries its cause, got None"
        elif not isinstance(s.failure, Failure):
            return f"failure must be a Failure or None, got {type(s.failure).__name__}"
        return None


_PHASES = {phase.value: phase for phase in RunnerPhase}
_SHUTDOWN_LEAVES = frozenset({RunnerPhase.STOPPING.value, RunnerPhase.STOPPED.value})
_AVAILABLE, _BUSY, _FAILED = RunnerPhase.AVAILABLE.value, RunnerPhase.BUSY.value, RunnerState.FAILED.value
# Ready's leaves, and python-statemachine's configuration value for each (`RunnerLifecycle._request`)
_SERVING = {leaf: RunnerLifecycle._configuration_value(leaf) for leaf in (_AVAILABLE, _BUSY)}


def phase_parent(phase: RunnerPhase) -> RunnerState:
    """The state of the design card a sub-phase belongs to."""
    return _PARENT[phase]
