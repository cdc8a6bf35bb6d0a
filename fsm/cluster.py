"""All machines of a cluster in one place, and the rules that tie them together.

`Cluster` is the event-triggered half of the system, composed: it holds one
`InstanceRetry` per instance, one `RunnerLifecycle` per runner slot (the
latest incarnation) and one `DownloadLifecycle` per (node, model), and it
forwards what a runner does to its instance:

=======================  =============================================
runner reaches            instance receives
=======================  =============================================
Ready                     ``rank_ready``
Failed                    ``rank_failed`` (with the cause)
Failed, while stopping    ``rank_failed_while_stopping`` (costs nothing)
Shutdown.stopped          ``rank_stopped``
=======================  =============================================

`execute` applies the *machine side* of a planner action (a created runner
gets its machine, a stop is recorded …); whoever owns the I/O (the daemon, or
a test's fake world) does the rest and reports back with events. Still pure:
no I/O, and time is the caller's ``now``: one clock's readings, monotonic for choice
(`fsm.clock`); a reading earlier than one already seen is taken as that one (the clock
stands still until it catches up). Every accepted step is appended to ``log`` — the
transition log the daemon persists and replays — and every report ignored as a
duplicate or a late one, as an ``ignored`` entry.

After a supervisor restart: `Cluster.from_dict` (``now=`` rebases the snapshot's
times on your clock), ``Cluster.runners()`` (each runner's `Handle`, and whether
its process is owed an exit), then `Cluster.recover` with the runners found alive
(docs/reattach.rst).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import attrs
import cattrs

from fsm import actions as act
from fsm import download as dl
from fsm import instance as inst
from fsm import runner as rn
from fsm._machine import Lifecycle, Outcome, converter, describe_structure_error
from fsm._validate import as_finite_float, show
from fsm.backoff import Backoff
from fsm.clock import Clock
from fsm.errors import IllegalTransition, InvalidConfig, InvalidEvent, SnapshotError
from fsm.failure import Failure
from fsm.log import IGNORED, LogEntry
from fsm.owed import Owed, owed
from fsm.view import (
    ClusterView,
    DownloadStatus,
    InstanceView,
    PendingRequest,
    RetryStatus,
    RunnerStatus,
    Slot,
    slot_of,
)
from fsm.watchdog import UNHEARD, Liveness, PhaseLimits


@attrs.frozen
class Handle:
    """The caller's handle on a runner's process, kept with its machine (and in snapshots) so that a restarted
    supervisor knows which process was which: its ``pid`` and ``started`` (the process's start time, as the
    caller reads it: a pid alone may have been reused)."""

    pid: int = attrs.field(validator=attrs.validators.instance_of(int))
    started: float = attrs.field(converter=float)


@attrs.frozen
class RunnerEntry:
    """The latest incarnation of a runner slot, and where it belongs."""

    machine: rn.RunnerLifecycle
    instance_id: str
    node_id: str
    endpoint: str | None = None  # its ring's HOST:PORT, once published
    since: float | None = None  # when it entered its phase, or last reported progress (`fsm.watchdog`)
    killed: bool = False  # its stop's grace ran out and a kill was asked (`KillRunner`)
    handle: Handle | None = None  # the caller's process handle (`Cluster.attach`)
    liveness: Liveness = UNHEARD  # its heartbeat (`Cluster.heard`, `Cluster.listened`); never persisted


T = TypeVar("T")
V = TypeVar("V")


class Table(dict[str, T], Generic[T, V]):
    """One of a cluster's tables (id → its entry), which, called, gives read-only views of its entries:
    ``cluster.runners()``, ``cluster.instances()``. Each call is a snapshot of the moment."""

    __slots__ = ("_views",)

    def __init__(self, views: Callable[[], Mapping[str, V]], items: Mapping[str, T] = MappingProxyType({})) -> None:
        super().__init__(items)
        self._views = views

    def __call__(self) -> Mapping[str, V]:
        return self._views()


@attrs.frozen
class RunnerInfo:
    """A read-only view of a runner slot's latest incarnation (``Cluster.runners()``): what a re-attaching
    supervisor needs to find its process (``handle``) and to know what became of it."""

    runner_id: str
    instance_id: str
    node_id: str
    rank: int  # its rank in the instance's slots
    incarnation: int  # the generation its process was created for (every report names it)
    state: rn.RunnerState
    phase: rn.RunnerPhase | None
    alive: bool  # its process is not reaped yet (a report of its exit is owed)
    failure: Failure | None
    handle: Handle | None  # what `Cluster.attach` kept: the pid and start time of its process
    endpoint: str | None


@attrs.frozen
class InstanceInfo:
    """A read-only view of an instance (``Cluster.instances()``): its state, its ranks' runners and budget."""

    instance_id: str
    model_id: str
    state: inst.InstanceState
    strategy: inst.RestartStrategy
    runner_ids: tuple[str, ...]  # by rank
    rank_generations: tuple[int, ...]  # the generation each rank runs (one_for_all: all alike)
    failed_ranks: tuple[int, ...]  # one_for_one: ranks waiting for their own restart
    rank_deadlines: tuple[tuple[int, float], ...]  # one_for_one: (rank, when it may restart)
    deadline: float | None  # one_for_all: when the next generation may start (backing off)
    attempts: int  # charged failed generations (or replicas) in the current budget
    max_failures: int | None  # the give-up threshold (`RetryPolicy.max_failures`)
    last_failure: Failure | None
    delete_reason: inst.DeleteReason | None


@attrs.define
class _Placement:
    model_id: str
    slots: tuple[Slot, ...]
    machine: inst.InstanceRetry
    local: bool = False  # the model's files are on its nodes already (the caller answers for them)
    keep_alive: float | None = None  # its own keep-alive, in seconds (None: kept loaded forever)
    keep_alive_now: float | None = None  # the one in force: its own, or the last request's (`Cluster.hold`)
    last_used: float | None = None  # when a request last started or ended on it


class Cluster:
    """In-memory state of every machine; see the module docstring.

    ``clock`` says which clock every ``now`` is read from (`fsm.clock`: feed a monotonic one); ``limits`` are the
    watchdogs (`fsm.watchdog`), kept in snapshots. ``runners`` and ``instances`` are the cluster's own tables;
    call them (``cluster.runners()``, ``cluster.instances()``) for read-only views, and change them only
    through events.
    """

    def __init__(
        self,
        download_policy: Backoff | None = None,
        *,
        runner_cls: type[rn.RunnerLifecycle] = rn.RunnerLifecycle,
        instance_cls: type[inst.InstanceRetry] = inst.InstanceRetry,
        download_cls: type[dl.DownloadLifecycle] = dl.DownloadLifecycle,
        clock: Clock | None = None,
        limits: PhaseLimits | None = None,
    ) -> None:
        self.runner_cls, self.instance_cls, self.download_cls = runner_cls, instance_cls, download_cls
        self.clock = clock or Clock.wall()
        self.limits = limits or PhaseLimits()  # the watchdogs (`fsm.watchdog`); none by default
        self.now_seen: float | None = None  # the latest ``now`` fed: time never goes back
        self.instances = {}  # type: ignore[assignment]  # the property makes it a `Table`
        self.runners = {}  # type: ignore[assignment]
        self.downloads: dict[tuple[str, str], dl.DownloadLifecycle] = {}
        self.download_policy = download_policy or dl.DEFAULT_DOWNLOAD_BACKOFF
        self.log: list[LogEntry] = []

    @property
    def runners(self) -> Table[RunnerEntry, RunnerInfo]:
        """The runner table, by runner id (the cluster's own: change it only through events). Call it,
        ``cluster.runners()``, for read-only `RunnerInfo` views: after `from_dict`, the processes to look for
        (``handle``) and which are still owed an exit (``alive``); see docs/reattach.rst."""
        return self._runners

    @runners.setter
    def runners(self, table: dict[str, RunnerEntry]) -> None:
        self._runners = Table(self._runner_views, table)

    @property
    def instances(self) -> Table[_Placement, InstanceInfo]:
        """The instance table, by instance id (the cluster's own). Call it, ``cluster.instances()``, for
        read-only `InstanceInfo` views: state, runners by rank, budget and backoffs."""
        return self._instances

    @instances.setter
    def instances(self, table: dict[str, _Placement]) -> None:
        self._instances = Table(self._instance_views, table)

    # -- desired state --------------------------------------------------------------

    def place(
        self,
        instance_id: str,
        model_id: str,
        slots: list[Slot] | tuple[Slot, ...],
        *,
        policy: inst.RetryPolicy | None = None,
        seed: int = 0,
        local: bool = False,
        keep_alive: float | None = None,
    ) -> None:
        """A new instance of ``model_id`` on ``slots``; ``local``: its files are on each node already (a model
        directory the caller owns), so nothing is downloaded and no download is owed. ``keep_alive``: seconds
        it stays loaded unused before the plan parks it (None: forever)."""
        _check_keep_alive(keep_alive)
        if instance_id in self.instances:
            raise InvalidConfig(f"instance {instance_id!r} already exists; delete it first or pick another id")
        view = InstanceView(instance_id, model_id, tuple(slots))  # validates the slots
        taken = {s.runner_id for p in self.instances.values() for s in p.slots}
        if clash := taken & {s.runner_id for s in view.slots}:
            raise InvalidConfig(f"runner ids already used by another instance: {sorted(clash)}")
        machine = self.instance_cls(instance_id, world_size=view.world_size, policy=policy, seed=seed)
        self.instances[instance_id] = _Placement(model_id, view.slots, machine, local, keep_alive, keep_alive)

    def move(self, instance_id: str, nodes: Sequence[str]) -> None:
        """Put the ranks of ``instance_id`` on ``nodes`` (rank 0 first) from its next generation on: only
        between generations, when none of its runners is alive (a dead node's ranks move elsewhere)."""
        placement = self._placement(instance_id)
        if len(nodes) != len(placement.slots):
            raise InvalidConfig(f"instance {instance_id!r} has {len(placement.slots)} ranks, not {len(nodes)}")
        if self.has_live_runners(instance_id):
            raise InvalidConfig(f"instance {instance_id!r} still has live runners: move it between generations")
        placement.slots = tuple(
            attrs.evolve(slot, node_id=node) for slot, node in zip(placement.slots, nodes, strict=True)
        )
        for slot in placement.slots:
            if (entry := self.runners.get(slot.runner_id)) is not None:
                self.runners[slot.runner_id] = attrs.evolve(entry, node_id=slot.node_id)

    def delete(self, instance_id: str, now: float) -> Outcome:
        """The user deletes the instance: it goes to Deleted (final), and the plan stops its runners and cancels
        its requests; `forget` it once they are reaped."""
        return self.instance_event(inst.Delete(instance_id, now))

    def park(self, instance_id: str, now: float, reason: act.ParkReason = act.ParkReason.REQUESTED) -> Outcome:
        """Park the instance (`fsm.instance`): refused while requests are in flight on its runners."""
        now = self._time(now)
        placement = self._placement(instance_id)
        busy = sum(
            e.machine.in_flight for s in placement.slots if (e := self.runners.get(s.runner_id)) and e.machine.alive
        )
        outcome = placement.machine.apply(inst.Park(instance_id, now, busy=busy))
        self._record("instance", instance_id, now, outcome, reason.value)
        return outcome

    def unpark(self, instance_id: str, now: float) -> Outcome:
        """Bring a parked instance back; it keeps its own keep-alive again (not the last request's: a request's
        ``keep_alive`` 0 parked it, and would park it again at once)."""
        outcome = self.instance_event(inst.Unpark(instance_id, now))
        if outcome.accepted:
            placement = self._placement(instance_id)
            placement.keep_alive_now = placement.keep_alive
        return outcome

    def hold(self, instance_id: str, keep_alive: float | None, now: float | None = None) -> None:
        """Keep the instance loaded ``keep_alive`` seconds after its last use (None: forever) until its next
        request, which brings back its own keep-alive unless it says otherwise (Ollama's per-request
        ``keep_alive``; 0 parks it once it is idle). Given ``now``, it counts as used then (Ollama's load)."""
        _check_keep_alive(keep_alive)
        placement = self._placement(instance_id)
        if now is not None:
            placement.last_used = self._time(now)
        placement.keep_alive_now = keep_alive

    def forget(self, instance_id: str) -> None:
        """Drop a Deleted instance whose runners are all reaped (its retry budget goes with it)."""
        placement = self.instances[instance_id]
        if not placement.machine.is_deleted:
            raise InvalidConfig(f"instance {instance_id!r} is not deleted")
        if self.has_live_runners(instance_id):
            raise InvalidConfig(f"instance {instance_id!r} still has live runners")
        for slot in placement.slots:
            self.runners.pop(slot.runner_id, None)
        del self.instances[instance_id]

    # -- events -------------------------------------------------------------------------

    def instance_event(self, event: inst.InstanceEvent) -> Outcome:
        """Apply an instance event (`fsm.instance`) and log it. Runner events reach the instance on their own
        (`runner_event`); a caller sends ``Tick`` so a budget reset is seen without another event."""
        event = self._timed(event)
        placement = self._placement(event.instance_id)
        outcome = placement.machine.apply(event)
        self._record("instance", event.instance_id, event.now, outcome)
        return outcome

    def runner_event(self, event: rn.RunnerEvent, now: float) -> Outcome:
        """Apply a runner event and forward what it means to the runner's instance.

        A *report* (``Connected``, ``Progress``, ``WeightsLoaded``, ``Warmed``, ``RequestFinished``, ``Fail``,
        ``Exited``) that the runner cannot take — a second ``Exited`` (two watchers: a pidfd and a poll), news
        of an older incarnation, a report from a process already failed or reaped — changes nothing: it
        returns an ignored `Outcome` whose note says why, and is logged as an ``ignored`` entry (`fsm.log`).
        Two watchers may race; neither ends the supervisor. A *command* the runner refuses (``Load`` before
        it joined …) is the caller's mistake and still raises `IllegalTransition`; a runner id never known
        raises `InvalidEvent`.
        """
        now = self._time(now)
        if event.runner_id not in self.runners:
            raise InvalidEvent(f"no runner {event.runner_id!r}")
        entry = self.runners[event.runner_id]
        machine, instance_id = entry.machine, entry.instance_id
        was_ready = machine.runner_state is rn.RunnerState.READY
        was_failed = machine.failure is not None
        was_stopping = machine.runner_state is rn.RunnerState.SHUTDOWN
        leaf, asked = machine.leaf, machine.stop_requested
        try:
            outcome = machine.apply(event)
        except IllegalTransition as exc:
            if not isinstance(event, _REPORTS):
                raise
            outcome = Outcome.ignored(f"{event.name} refused in {machine.leaf}: a duplicate or late report ({exc})")
        if not outcome.accepted and isinstance(event, _REPORTS):
            self._record_ignored(event, machine, now, outcome)
            return outcome
        news = machine.leaf != leaf or machine.stop_requested != asked or isinstance(event, rn.Progress)
        if outcome.accepted and news:  # the watchdog's clock starts again (`fsm.watchdog`)
            self.runners[event.runner_id] = attrs.evolve(self.runners[event.runner_id], since=now)
        cause = machine.failure.message if machine.failure and not was_failed else ""
        self._record("runner", event.runner_id, now, outcome, cause)
        if not outcome.accepted:
            return outcome
        placement = self.instances.get(instance_id)
        if placement is None:
            return outcome
        if isinstance(event, (rn.RequestStarted, rn.RequestFinished)):
            placement.last_used = now
            if isinstance(event, rn.RequestStarted):  # a request's own keep-alive comes after (`hold`)
                placement.keep_alive_now = placement.keep_alive
        slot = slot_of(placement.slots, event.runner_id)
        assert slot is not None  # a runner entry exists only for a slot of its instance
        gen, rank = machine.incarnation, slot.rank
        if not was_ready and machine.runner_state is rn.RunnerState.READY:
            self.instance_event(inst.RankReady(instance_id, now, gen, rank))
        if not was_failed and machine.failure is not None:
            # A failure while stopping on our request costs nothing (the stop was ours), but may be the cause.
            failed = inst.RankFailedWhileStopping if was_stopping else inst.RankFailed
            self.instance_event(failed(instance_id, now, gen, rank, failure=machine.failure))
        if not machine.alive and any(s.target == rn.RunnerPhase.STOPPED.value for s in outcome.steps):
            self.instance_event(inst.RankStopped(instance_id, now, gen, rank))
        return outcome

    def download_event(self, node_id: str, event: dl.DownloadEvent) -> Outcome:
        """A download's report on ``node_id`` (``download.Complete``, ``DownloadFailed``, ``BytesProgress``,
        ``Invalidate``: the files went missing), applied and logged; the machine is made on first use."""
        event = self._timed(event)
        machine = self._download(node_id, event.model_id)
        outcome = machine.apply(event)
        self._record("download", f"{node_id}:{event.model_id}", event.now, outcome, getattr(event, "reason", ""))
        return outcome

    def recover(self, now: float, adopt: Iterable[str] = ()) -> None:
        """After a supervisor restart: make the machines say what became of the runners it had.

        By default every runner is taken as killed with the old supervisor (exod kills its orphans). Runners
        named in ``adopt`` are ones the caller found still alive and healthy (its `Handle` says which process;
        `runners` lists them). An adopted runner is kept only if it is Ready in its rank's current generation
        (the requests it was serving went with the old supervisor: each is left idle); the plan stops an
        adopted runner that is not kept. What is kept depends on the restart strategy:

        * one_for_all (a ring): a Ready instance whose current generation is adopted whole carries on as it
          was; anything less cannot serve, and a Starting/Ready instance whose generation had runners resumes
          with a new generation (no retry charged; one with none yet lost nothing, and keeps its generation: a
          graceful stop, which says the same, followed by a restart resumes once, not twice).
        * one_for_one (independent replicas): each replica on its own. An adopted Ready replica serves on; a
          replica that is gone is restarted alone at once (``RankLost``: no retry charged, no backoff); a rank
          that had failed keeps its backoff as it was (a restart neither refills nor skips it).

        Then every runner that was alive and is not kept is stopped and reaped, which a Recovering instance
        counts as reaped ranks. Times are on the cluster's clock: after a reboot or a clock step, restore the
        snapshot with `from_dict`'s ``now`` so that its deadlines are rebased first (`fsm.clock`).
        """
        now = self._time(now)
        adopted = set(adopt)
        if unknown := adopted - {rid for rid, e in self.runners.items() if e.machine.alive}:
            raise InvalidConfig(f"cannot adopt {sorted(unknown)}: no live runner of that id")
        kept: set[str] = set()
        for instance_id, placement in self.instances.items():
            m = placement.machine
            current = [(s, e) for s in placement.slots if (e := self.runners.get(s.runner_id)) is not None]
            current = [(s, e) for s, e in current if e.machine.incarnation == m.rank_generations[s.rank]]
            serving = {
                s.runner_id
                for s, e in current
                if e.machine.runner_state is rn.RunnerState.READY
                and e.machine.runner_id in adopted
                and s.rank not in m.failed_ranks
            }
            if m.one_for_one:
                if m.instance_state in _RESUMING:
                    kept |= serving
                    lost = [(s, e) for s, e in current if s.runner_id not in serving]
                    self._lose_replicas(instance_id, now, lost, adopted)
                continue
            if m.instance_state is inst.InstanceState.READY and len(serving) == len(placement.slots):
                kept |= serving
                continue
            if m.instance_state in _RESUMING and current:
                self.instance_event(inst.Resume(instance_id, now))
        for rid in sorted(kept):
            machine = self.runners[rid].machine
            for _ in range(machine.in_flight):  # its requests ended with the old supervisor
                self.runner_event(rn.RequestFinished(rid, machine.incarnation), now)
        for machine in [entry.machine for entry in self.runners.values()]:
            if not machine.alive or machine.runner_id in kept:
                continue
            if machine.runner_id in adopted:
                continue  # alive, but its instance could not keep it: the plan stops it (a stale generation)
            self._reap_orphan(machine, now, forward=True)

    def _lose_replicas(
        self, instance_id: str, now: float, lost: list[tuple[Slot, RunnerEntry]], adopted: set[str]
    ) -> None:
        """one_for_one's part of `recover`: each live replica not kept is gone (unless the caller adopted it,
        alive but not Ready: the plan stops it, a failure of the host's, so charged nothing)."""
        for slot, entry in lost:
            machine = entry.machine
            if not machine.alive or slot.rank in self._placement(instance_id).machine.failed_ranks:
                continue  # reaped already, or failed on its own: its backoff goes on as it was
            gen = machine.incarnation
            if machine.runner_id in adopted:  # its runner fails (the host's doing): the plan stops and reaps it
                failure = Failure.host("adopted after a supervisor restart, but not Ready: restarted")
                self.runner_event(rn.Fail(machine.runner_id, gen, failure=failure), now)
                continue
            self._reap_orphan(machine, now, forward=False)  # the instance hears of it as lost, not as an exit
            self.instance_event(inst.RankLost(instance_id, now, gen, slot.rank))

    def _reap_orphan(self, machine: rn.RunnerLifecycle, now: float, *, forward: bool) -> None:
        """A runner that went with the old supervisor: stopped (unless failed or stopping) and reaped, killed."""
        events: list[rn.RunnerEvent] = []
        if machine.runner_state not in (rn.RunnerState.FAILED, rn.RunnerState.SHUTDOWN):
            events.append(rn.Stop(machine.runner_id, machine.incarnation))
        events.append(rn.Exited(machine.runner_id, machine.incarnation, exit_code=-9))
        for event in events:
            if forward:
                self.runner_event(event, now)
            else:
                self._record("runner", machine.runner_id, now, machine.apply(event))

    # -- the machine side of the planner's actions ---------------------------------------

    def execute(self, action: act.Action, now: float) -> Outcome:
        """Apply what ``action`` means to the machines; returns what the machine said."""
        now = self._time(now)
        match action:
            case act.StartGeneration(instance_id, generation):
                return self.instance_event(inst.Start(instance_id, now, generation))
            case act.RestartRank(instance_id, rank, generation):
                return self.instance_event(inst.StartRank(instance_id, now, generation, rank))
            case act.DeleteInstance(instance_id, _reason):
                return self.instance_event(inst.GiveUp(instance_id, now))
            case act.ParkInstance(instance_id, reason):
                return self.park(instance_id, now, reason)
            case act.UnparkInstance(instance_id):
                return self.unpark(instance_id, now)
            case act.CreateRunner():
                return self._create_runner(action, now)
            case act.StopRunner(runner_id, incarnation, _reason):
                return self.runner_event(rn.Stop(runner_id, incarnation), now)
            case act.StartDownload(node_id, model_id):
                machine = self._download(node_id, model_id)
                if machine.download_state is dl.DownloadState.FAILED:
                    self.download_event(node_id, dl.Retry(model_id, now))
                return self.download_event(node_id, dl.Begin(model_id, now))
            case act.ConnectRunner(runner_id, incarnation):
                return self.runner_event(rn.Connect(runner_id, incarnation), now)
            case act.LoadModel(runner_id, incarnation, model_id):
                return self._load_model(action, now)
            case act.WarmUp(runner_id, incarnation):
                return self.runner_event(rn.WarmUp(runner_id, incarnation), now)
            case act.ForwardRequest(_request_id, runner_id, incarnation):
                return self.runner_event(rn.RequestStarted(runner_id, incarnation), now)
            case act.CancelRequest(_request_id, _instance_id, reason):
                return Outcome(accepted=True, note=reason)  # no machine moves: the request book ends it
            case act.FailStalled(runner_id, incarnation, phase, seconds):
                machine = self.runner(runner_id)
                if machine.incarnation != incarnation or machine.phase is None or machine.phase.value != phase:
                    return Outcome.ignored(f"runner {runner_id!r} left phase {phase} meanwhile")
                return self.runner_event(rn.Fail(runner_id, incarnation, failure=Failure.stalled(phase, seconds)), now)
            case act.FailUnresponsive(runner_id, incarnation, seconds):
                if self._missed(runner_id, incarnation) is None:
                    return Outcome.ignored(f"runner {runner_id!r} {incarnation} answered, failed or stopped meanwhile")
                return self.runner_event(rn.Fail(runner_id, incarnation, failure=Failure.unresponsive(seconds)), now)
            case act.KillRunner(runner_id, incarnation):
                entry = self.runners[runner_id]
                if entry.machine.incarnation != incarnation or not entry.machine.alive:
                    return Outcome.ignored(f"runner {runner_id!r} incarnation {incarnation} is gone")
                self.runners[runner_id] = attrs.evolve(entry, killed=True)
                return Outcome(accepted=True, note="kill")
        raise InvalidEvent(f"unknown action {action!r}")

    def _create_runner(self, action: act.CreateRunner, now: float) -> Outcome:
        """Refuse first, change nothing: a runner is registered only if its instance takes the rank."""
        placement = self._placement(action.instance_id)
        instance = placement.machine
        slot = slot_of(placement.slots, action.runner_id)
        if slot is None:
            raise InvalidEvent(f"instance {action.instance_id!r} has no slot {action.runner_id!r}")
        wanted = instance.rank_generations[slot.rank]
        if action.incarnation > wanted:
            raise InvalidEvent(
                f"cannot create {action.runner_id!r} for generation {action.incarnation}: instance "
                f"{action.instance_id!r} is {instance.leaf}, its rank {slot.rank} at generation {wanted}"
            )
        if instance.instance_state not in _CREATING or action.incarnation < wanted:
            return Outcome.ignored(
                f"instance {action.instance_id!r} moved on: {instance.leaf}, rank {slot.rank} at generation {wanted}"
            )
        parking = [
            iid
            for iid, p in self.instances.items()
            if iid != action.instance_id
            and p.machine.instance_state is inst.InstanceState.PARKING
            and any(s.node_id == action.node_id for s in p.slots)
        ]
        if parking:  # the plan's rule, held at the moment of execution: an earlier action of its round parked it
            return Outcome.ignored(f"{parking[0]!r} is still parking on {action.node_id!r}: its memory is not free")
        previous = self.runners.get(action.runner_id)
        if previous is not None and (previous.machine.alive or previous.machine.incarnation >= action.incarnation):
            raise InvalidEvent(
                f"runner {action.runner_id!r} incarnation {previous.machine.incarnation} is still alive or newer"
            )
        machine = self._new_runner(action)
        self.runners[action.runner_id] = RunnerEntry(machine, action.instance_id, action.node_id, since=now)
        self.log.append(LogEntry(now, "runner", action.runner_id, "create", "", machine.leaf))
        return self.instance_event(inst.RankCreated(action.instance_id, now, action.incarnation, slot.rank))

    def _load_model(self, action: act.LoadModel, now: float) -> Outcome:
        """The download's backoff resets only when the runner really starts loading (the files proved good)."""
        entry = self.runners.get(action.runner_id)
        node_id = "" if entry is None else entry.node_id
        placement = None if entry is None else self.instances.get(entry.instance_id)
        download = self.downloads.get((node_id, action.model_id))
        if placement is not None and placement.local:
            return self.runner_event(rn.Load(action.runner_id, action.incarnation), now)
        if download is None or download.download_state is not dl.DownloadState.COMPLETED:
            raise InvalidEvent(f"cannot load {action.model_id!r} on {node_id!r}: its download is not complete")
        outcome = self.runner_event(rn.Load(action.runner_id, action.incarnation), now)
        if outcome.accepted:
            self.download_event(node_id, dl.LoadStarted(action.model_id, now))
        return outcome

    def _new_runner(self, action: act.CreateRunner) -> rn.RunnerLifecycle:
        return self.runner_cls(
            action.runner_id, rank=action.rank, world_size=action.world_size, incarnation=action.incarnation
        )

    # -- views ---------------------------------------------------------------------------

    def view(self, requests: Iterable[PendingRequest] = ()) -> ClusterView:
        """The planner's input; ``requests`` come from whoever keeps the request book (the daemon, a `World`)."""
        return ClusterView.build(
            instances=[
                InstanceView(
                    iid, p.model_id, p.slots, RetryStatus.of(p.machine), p.local, p.keep_alive_now, p.last_used
                )
                for iid, p in self.instances.items()
            ],
            runners=[
                RunnerStatus.of(
                    e.machine,
                    instance_id=e.instance_id,
                    node_id=e.node_id,
                    endpoint=e.endpoint,
                    since=e.since,
                    killed=e.killed,
                    liveness=e.liveness,
                )
                for e in self.runners.values()
            ],
            downloads=[DownloadStatus.of(m, node_id=node) for (node, _), m in self.downloads.items()],
            requests=list(requests),
            limits=self.limits,
        )

    def _runner_views(self) -> Mapping[str, RunnerInfo]:
        """``cluster.runners()``: every runner slot's latest incarnation, by runner id, as read-only `RunnerInfo`."""
        views = {}
        for rid, e in self.runners.items():
            placement = self.instances.get(e.instance_id)
            slot = None if placement is None else slot_of(placement.slots, rid)
            m = e.machine
            views[rid] = RunnerInfo(
                rid,
                e.instance_id,
                e.node_id,
                m.rank if slot is None else slot.rank,
                m.incarnation,
                m.runner_state,
                m.phase,
                m.alive,
                m.failure,
                e.handle,
                e.endpoint,
            )
        return MappingProxyType(views)

    def _instance_views(self) -> Mapping[str, InstanceInfo]:
        """``cluster.instances()``: every instance, by id, as read-only `InstanceInfo`."""
        return MappingProxyType(
            {
                iid: InstanceInfo(
                    iid,
                    p.model_id,
                    p.machine.instance_state,
                    p.machine.policy.strategy,
                    tuple(s.runner_id for s in sorted(p.slots, key=lambda s: s.rank)),
                    tuple(p.machine.rank_generations),
                    tuple(sorted(p.machine.failed_ranks)),
                    tuple(sorted(p.machine.rank_deadlines.items())),
                    p.machine.deadline,
                    p.machine.attempts,
                    p.machine.policy.max_failures,
                    p.machine.last_failure,
                    p.machine.delete_reason,
                )
                for iid, p in self.instances.items()
            }
        )

    def instance(self, instance_id: str) -> inst.InstanceRetry:
        """The instance's machine, to read (feed it events through `instance_event`, which logs them)."""
        return self._placement(instance_id).machine

    def publish(self, runner_id: str, incarnation: int, endpoint: str) -> bool:
        """The ring endpoint (HOST:PORT) of a runner's incarnation is known to every rank: it may be told to
        connect once every rank's is (`fsm.plan`). False if that incarnation is not the runner's any more."""
        entry = self.runners.get(runner_id)
        if entry is None or entry.machine.incarnation != incarnation or not entry.machine.alive:
            return False
        self.runners[runner_id] = attrs.evolve(entry, endpoint=endpoint)
        return True

    def heard(self, runner_id: str, incarnation: int, now: float) -> bool:
        """The process of a runner's incarnation answered a heartbeat at ``now`` (`fsm.watchdog`). Not a
        machine's event: nothing moves and nothing is logged, so a beat every second costs no write. False if
        that incarnation is not the runner's any more (or is reaped)."""
        return self._liveness(runner_id, incarnation, now, lambda live: live.answered(now))

    def listened(self, runner_id: str, incarnation: int, now: float, *, resumed: bool = False) -> bool:
        """The caller listened to the runner's process until ``now``, without a break unless ``resumed`` (it was
        paused or starved: answers may wait unread, so the runner gets a whole limit again). True if the runner
        has now missed its heartbeat: plan, and `fsm.plan` fails it (`FailUnresponsive`)."""
        self._liveness(runner_id, incarnation, now, lambda live: live.listening_until(now, resumed=resumed))
        return self._missed(runner_id, incarnation) is not None

    def _liveness(self, runner_id: str, incarnation: int, now: float, change: Callable[[Liveness], Liveness]) -> bool:
        now = self._time(now)
        entry = self.runners.get(runner_id)
        if entry is None or entry.machine.incarnation != incarnation or not entry.machine.alive:
            return False
        self.runners[runner_id] = attrs.evolve(entry, liveness=change(entry.liveness))
        return True

    def _missed(self, runner_id: str, incarnation: int) -> float | None:
        """Seconds the runner's process has been silent if it missed its heartbeat (`PhaseLimits.missed`)."""
        entry = self.runners.get(runner_id)
        if entry is None or entry.machine.incarnation != incarnation:
            return None
        status = RunnerStatus.of(entry.machine, instance_id=entry.instance_id, node_id=entry.node_id)
        if not status.alive or status.failed or status.stop_requested:
            return None
        return self.limits.missed(status.phase, entry.liveness, entry.since)

    def owed(self, node_id: str | None = None) -> list[Owed]:
        """The reports the cluster waits for from its caller (`fsm.owed`): when `plan` returns nothing and
        `next_deadline` None, these are why."""
        return owed(self.view(), node_id)

    def attach(self, runner_id: str, incarnation: int, handle: Handle) -> bool:
        """Keep the caller's ``handle`` on the process of a runner's incarnation; False if that incarnation is
        not the runner's any more (or is reaped)."""
        entry = self.runners.get(runner_id)
        if entry is None or entry.machine.incarnation != incarnation or not entry.machine.alive:
            return False
        self.runners[runner_id] = attrs.evolve(entry, handle=handle)
        return True

    def runner(self, runner_id: str) -> rn.RunnerLifecycle:
        """The machine of the runner's latest incarnation, to read (feed it events through `runner_event`, which
        forwards them to its instance)."""
        return self.runners[runner_id].machine

    def has_live_runners(self, instance_id: str) -> bool:
        """Whether any process of the instance is not yet reaped."""
        slots = self._placement(instance_id).slots
        return any(self.runners[s.runner_id].machine.alive for s in slots if s.runner_id in self.runners)

    # -- persistence ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every machine and what ties them together, as JSON-ready data: persist it to survive a restart
        (`from_dict`, then `recover`). It keeps the watchdogs (``limits``, the stop grace among them) and the
        latest ``now`` seen, which `from_dict` rebases every time on (`fsm.clock`)."""
        return {
            "instances": {
                iid: {
                    "model_id": p.model_id,
                    "slots": [attrs.asdict(s) for s in p.slots],
                    "machine": p.machine.to_dict(),
                }
                | ({"local": True} if p.local else {})
                | ({} if p.keep_alive is None else {"keep_alive": p.keep_alive})
                | ({} if p.keep_alive_now == p.keep_alive else {"keep_alive_now": p.keep_alive_now})
                | ({} if p.last_used is None else {"last_used": p.last_used})
                for iid, p in self.instances.items()
            },
            "runners": {
                rid: {"instance_id": e.instance_id, "node_id": e.node_id, "machine": e.machine.to_dict()}
                | ({} if e.endpoint is None else {"endpoint": e.endpoint})
                | ({} if e.since is None else {"since": e.since})
                | ({"killed": True} if e.killed else {})
                | ({} if e.handle is None else {"handle": attrs.asdict(e.handle)})
                for rid, e in self.runners.items()
            },
            "downloads": [{"node_id": node, "machine": m.to_dict()} for (node, _), m in self.downloads.items()],
            "clock": self.clock.to_dict(),
            "limits": attrs.asdict(self.limits),
        } | ({"now": self.now_seen} if self.now_seen is not None else {})

    @classmethod
    def from_dict(
        cls,
        data: dict[str, Any],
        download_policy: Backoff | None = None,
        *,
        clock: Clock | None = None,
        limits: PhaseLimits | None = None,
        now: float | None = None,
    ) -> Cluster:
        """Restore what `to_dict` wrote; raises `SnapshotError` naming the field, and builds nothing, on bad input.

        Times (the clock story, `fsm.clock`): pass ``now``, a reading of the clock you will feed from here on,
        and every time in the snapshot — backoff deadlines, watchdog starts, the instances' clocks — is rebased
        by ``now`` minus the snapshot's ``now``: what was left of a backoff when the snapshot was written is
        left of it now (neither refilled nor skipped; the supervisor's downtime does not count towards it).
        That holds across a reboot, a clock step, or another host, so ``clock`` may then be any clock (say
        ``Clock.monotonic(boot_id)`` of this boot). Without ``now``, times go on as they were written: the
        snapshot's ``clock`` must be the one given (a monotonic clock of another boot is refused: its deadlines
        would mean nothing here), and a reading earlier than the snapshot's ``now`` is taken as that ``now``
        (time stands still until the clock catches up).

        Watchdogs: the snapshot's ``limits`` (every phase limit and the stop grace) are restored; ``limits``
        given replaces them (configuration changed across the restart). A snapshot written before limits were
        saved is refused unless ``limits`` is given: restoring it with none would silently turn every watchdog
        off (pass ``PhaseLimits()`` to mean that).

        Beyond each machine's own checks, the machines must agree: slots list ranks 0..N-1 of one
        instance each, a runner belongs to a slot of an existing instance and matches it, a download
        appears once. (A top-level ``requests`` key, written before requests left the snapshot, is ignored.)
        """
        body = _fields(data, "", ("instances", "runners", "downloads"), ignored=("requests", "clock", "now", "limits"))
        stored = Clock.from_dict(data["clock"]) if "clock" in data else Clock.wall()
        then = data.get("now")
        if then is not None and as_finite_float(then) is None:
            raise SnapshotError(f"now: expected a finite number, got {show(then)}")
        if now is not None:
            if as_finite_float(now) is None:
                raise InvalidConfig(f"now must be a finite number (a reading of your clock), got {now!r}")
            if then is None:
                raise SnapshotError(
                    "now: missing: this snapshot does not say when it was written, so its times cannot be rebased; "
                    "restore it without now= on the clock it was written on"
                )
            body = _rebased(body, float(now) - float(then))
            then, stored = float(now), clock or stored
        elif clock is not None and clock != stored:
            raise SnapshotError(
                f"clock: the snapshot's times are on {stored}, not on {clock}: its deadlines mean nothing on this "
                "clock (pass now=, a reading of this clock, to rebase them; or restore it where it was written)"
            )
        placements = _restore_placements(body["instances"])
        runners = _restore_runners(body["runners"], placements)
        downloads = _restore_downloads(body["downloads"])
        saved = _limits(data["limits"]) if "limits" in data else None
        if saved is None and limits is None:
            raise SnapshotError(
                "limits: missing: this snapshot was written before the watchdogs were saved; pass limits= (the "
                "phase limits and stop grace you run with; PhaseLimits() for none) rather than lose them"
            )
        cluster = cls(download_policy, clock=stored, limits=limits if limits is not None else saved)
        cluster.instances, cluster.runners, cluster.downloads = placements, runners, downloads
        if then is not None:
            cluster.now_seen = float(then)
        return cluster

    # -- internals -----------------------------------------------------------------------

    def _placement(self, instance_id: str) -> _Placement:
        try:
            return self.instances[instance_id]
        except KeyError:
            raise InvalidEvent(f"no instance {instance_id!r}") from None

    def _download(self, node_id: str, model_id: str) -> dl.DownloadLifecycle:
        key = (node_id, model_id)
        if key not in self.downloads:
            self.downloads[key] = self.download_cls(model_id, policy=self.download_policy)
        return self.downloads[key]

    def _time(self, now: float) -> float:
        """The ``now`` to use: the caller's, or the latest seen if the caller's clock stepped back (`fsm.clock`).

        A reading earlier than one seen is clamped, never refused: time stands still until the clock catches up
        (deadlines wait that much longer; none fires early), and no report is lost to a wall-clock step. A
        refused event moves nothing, not even time (`_record` remembers the latest)."""
        return now if self.now_seen is None or now >= self.now_seen else self.now_seen

    def _timed(self, event: E) -> E:
        """``event`` at `_time` of its ``now``."""
        now = self._time(event.now)
        return event if now == event.now else attrs.evolve(event, now=now)

    def _record_ignored(self, event: rn.RunnerEvent, machine: rn.RunnerLifecycle, now: float, why: Outcome) -> None:
        """A report that moved nothing, kept in the log (`fsm.log.IGNORED`) so a duplicate is seen, not lost."""
        self.now_seen = now if self.now_seen is None else max(self.now_seen, now)
        cause = f"{event.name} of incarnation {event.incarnation}: {why.note}"
        self.log.append(LogEntry(now, "runner", event.runner_id, IGNORED, machine.leaf, machine.leaf, cause))

    def _record(self, machine: str, key: str, now: float, outcome: Outcome, cause: str = "") -> None:
        self.now_seen = now if self.now_seen is None else max(self.now_seen, now)
        for step in outcome.steps:
            self.log.append(LogEntry(now, machine, key, step.event, step.source, step.target, cause))


# What a runner's process (or its watcher) reports, as opposed to what the plan commands: a refused report is a
# duplicate or a late one, ignored and logged (`Cluster.runner_event`).
_REPORTS = (rn.Connected, rn.Progress, rn.WeightsLoaded, rn.Warmed, rn.RequestFinished, rn.Fail, rn.Exited)
# Where a runner may be created: a generation starting, or (one_for_one) a rank restarted alone.
_CREATING = (inst.InstanceState.STARTING, inst.InstanceState.DEGRADED)
# Where a generation runs: runners lost with the supervisor make it start again (`Cluster.recover`).
_RESUMING = (inst.InstanceState.STARTING, inst.InstanceState.READY, inst.InstanceState.DEGRADED)


# -- Cluster.from_dict's checks ----------------------------------------------------------------------

M = TypeVar("M", bound=Lifecycle)
E = TypeVar("E", inst.InstanceEvent, dl.DownloadEvent)


def _restore_placements(value: object) -> dict[str, _Placement]:
    placements: dict[str, _Placement] = {}
    owner: dict[str, str] = {}  # runner id -> the instance whose slot it is
    for iid, raw in _mapping(value, "instances").items():
        where = f"instances.{iid}"
        p = _fields(
            raw, where, ("model_id", "slots", "machine"), ignored=("local", "keep_alive", "keep_alive_now", "last_used")
        )
        local = raw.get("local", False)
        if not isinstance(local, bool):
            raise SnapshotError(f"{where}.local: expected a bool, got {show(local)}")
        keep_alive = _optional_time(raw.get("keep_alive"), f"{where}.keep_alive")
        keep_alive_now = _optional_time(raw.get("keep_alive_now", keep_alive), f"{where}.keep_alive_now")
        last_used = _optional_time(raw.get("last_used"), f"{where}.last_used")
        if not isinstance(p["model_id"], str):
            raise SnapshotError(f"{where}.model_id: expected a str, got {show(p['model_id'])}")
        slots = _slots(p["slots"], f"{where}.slots")
        for slot in slots:
            if slot.runner_id in owner:
                raise SnapshotError(
                    f"{where}.slots: runner id {slot.runner_id!r} is also in instance {owner[slot.runner_id]!r}"
                )
            owner[slot.runner_id] = iid
        machine = _machine(inst.InstanceRetry, p["machine"], f"{where}.machine")
        if machine.instance_id != iid:
            raise SnapshotError(f"{where}.machine.instance_id: {machine.instance_id!r} is not {iid!r}")
        if machine.world_size != len(slots):
            raise SnapshotError(f"{where}.machine.world_size: {machine.world_size}, but {len(slots)} slots")
        placements[iid] = _Placement(p["model_id"], slots, machine, local, keep_alive, keep_alive_now, last_used)
    return placements


def _limits(value: object) -> PhaseLimits:
    """The snapshot's watchdogs: every field of `PhaseLimits`, each seconds > 0 or None."""
    names = tuple(f.name for f in attrs.fields(PhaseLimits))
    _fields(value, "limits", (), ignored=names)  # a dict of known keys
    try:
        return PhaseLimits(**value)  # type: ignore[arg-type]
    except (InvalidConfig, TypeError, ValueError) as exc:
        raise SnapshotError(f"limits: {exc}") from None


def _rebased(body: dict[str, Any], delta: float) -> dict[str, Any]:
    """A copy of the snapshot's body with every time moved by ``delta`` (durations such as keep-alive stay);
    what is not a number is left for the restore to refuse."""

    def move(value: Any) -> Any:
        return value + delta if as_finite_float(value) is not None else value

    def moved(raw: Any, keys: tuple[str, ...]) -> Any:
        return {k: move(v) if k in keys else v for k, v in raw.items()} if isinstance(raw, dict) else raw

    def instance(raw: Any) -> Any:
        raw = moved(raw, ("last_used",))
        if isinstance(raw, dict) and isinstance(raw.get("machine"), dict):
            m = moved(raw["machine"], ("deadline", "ready_since", "clock"))
            if isinstance(m.get("rank_deadlines"), list):
                m["rank_deadlines"] = [
                    [p[0], move(p[1])] if isinstance(p, (list, tuple)) and len(p) == 2 else p
                    for p in m["rank_deadlines"]
                ]
            raw = {**raw, "machine": m}
        return raw

    def download(raw: Any) -> Any:
        if isinstance(raw, dict) and isinstance(raw.get("machine"), dict):
            return {**raw, "machine": moved(raw["machine"], ("retry_at", "clock"))}
        return raw

    instances, runners, downloads = body["instances"], body["runners"], body["downloads"]
    return {
        "instances": {k: instance(v) for k, v in instances.items()} if isinstance(instances, dict) else instances,
        "runners": {k: moved(v, ("since",)) for k, v in runners.items()} if isinstance(runners, dict) else runners,
        "downloads": [download(d) for d in downloads] if isinstance(downloads, list) else downloads,
    }


def _optional_time(value: object, where: str) -> float | None:
    if value is None:
        return None
    if as_finite_float(value) is None or value < 0:  # type: ignore[operator]
        raise SnapshotError(f"{where}: expected a finite number >= 0 or nothing, got {show(value)}")
    return float(value)  # type: ignore[arg-type]


def _check_keep_alive(keep_alive: float | None) -> None:
    if keep_alive is not None and (as_finite_float(keep_alive) is None or keep_alive < 0):
        raise InvalidConfig(f"keep_alive must be finite seconds >= 0, or None (forever); got {keep_alive!r}")


def _restore_runners(value: object, placements: dict[str, _Placement]) -> dict[str, RunnerEntry]:
    runners: dict[str, RunnerEntry] = {}
    for rid, raw in _mapping(value, "runners").items():
        where = f"runners.{rid}"
        r = _fields(
            raw, where, ("instance_id", "node_id", "machine"), ignored=("endpoint", "since", "killed", "handle")
        )
        handle = None
        if "handle" in raw:
            try:
                handle = converter.structure(raw["handle"], Handle)
            except (cattrs.BaseValidationError, ValueError, TypeError) as exc:
                why = describe_structure_error(exc) if isinstance(exc, cattrs.BaseValidationError) else str(exc)
                raise SnapshotError(f"{where}.handle: {why}") from exc
        endpoint, since, killed = raw.get("endpoint"), raw.get("since"), raw.get("killed", False)
        if endpoint is not None and not isinstance(endpoint, str):
            raise SnapshotError(f"{where}.endpoint: expected a str, got {show(endpoint)}")
        if since is not None and (isinstance(since, bool) or not isinstance(since, (int, float))):
            raise SnapshotError(f"{where}.since: expected a number, got {show(since)}")
        if not isinstance(killed, bool):
            raise SnapshotError(f"{where}.killed: expected a bool, got {show(killed)}")
        for key in ("instance_id", "node_id"):
            if not isinstance(r[key], str):
                raise SnapshotError(f"{where}.{key}: expected a str, got {show(r[key])}")
        placement = placements.get(r["instance_id"])
        if placement is None:
            raise SnapshotError(f"{where}.instance_id: no instance {r['instance_id']!r}")
        slot = slot_of(placement.slots, rid)
        if slot is None:
            raise SnapshotError(f"{where}: {rid!r} is in no slot of instance {r['instance_id']!r}")
        if r["node_id"] != slot.node_id:
            raise SnapshotError(f"{where}.node_id: {r['node_id']!r}, but its slot is on {slot.node_id!r}")
        machine = _machine(rn.RunnerLifecycle, r["machine"], f"{where}.machine")
        replica = placement.machine.one_for_one  # each process a world of its own
        for key, got, want in (
            ("runner_id", machine.runner_id, rid),
            ("rank", machine.rank, 0 if replica else slot.rank),
            ("world_size", machine.world_size, 1 if replica else placement.machine.world_size),
        ):
            if got != want:
                raise SnapshotError(f"{where}.machine.{key}: {got!r}, but its placement says {want!r}")
        if machine.incarnation > placement.machine.generation:
            raise SnapshotError(
                f"{where}.machine.incarnation: {machine.incarnation} is beyond its instance's "
                f"generation {placement.machine.generation}"
            )
        runners[rid] = RunnerEntry(
            machine, r["instance_id"], r["node_id"], endpoint, None if since is None else float(since), killed, handle
        )
    return runners


def _restore_downloads(value: object) -> dict[tuple[str, str], dl.DownloadLifecycle]:
    if not isinstance(value, list):
        raise SnapshotError(f"downloads: expected a list, got {type(value).__name__}")
    downloads: dict[tuple[str, str], dl.DownloadLifecycle] = {}
    for index, raw in enumerate(value):
        where = f"downloads[{index}]"
        d = _fields(raw, where, ("node_id", "machine"))
        if not isinstance(d["node_id"], str):
            raise SnapshotError(f"{where}.node_id: expected a str, got {show(d['node_id'])}")
        machine = _machine(dl.DownloadLifecycle, d["machine"], f"{where}.machine")
        key = (d["node_id"], machine.model_id)
        if key in downloads:
            raise SnapshotError(f"{where}: a second download of {key[1]!r} on {key[0]!r}")
        downloads[key] = machine
    return downloads


def _fields(value: object, where: str, keys: tuple[str, ...], ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """``value`` as a dict with exactly ``keys`` (plus any of ``ignored``, dropped)."""
    label = f"{where}: " if where else ""
    if not isinstance(value, dict):
        raise SnapshotError(f"{label}expected a dict, got {type(value).__name__}")
    if missing := [k for k in keys if k not in value]:
        raise SnapshotError(f"{label}missing keys {missing}" if where else f"{', '.join(missing)}: missing")
    if unknown := sorted(str(k) for k in value if k not in keys and k not in ignored):
        raise SnapshotError(f"{label}unknown keys {unknown}")
    return {k: value[k] for k in keys}


def _mapping(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise SnapshotError(f"{where}: expected a dict keyed by id, got {type(value).__name__}")
    return value


def _slots(value: object, where: str) -> tuple[Slot, ...]:
    if not isinstance(value, list):
        raise SnapshotError(f"{where}: expected a list, got {type(value).__name__}")
    try:
        slots = tuple(converter.structure(s, Slot) for s in value)
        return InstanceView("", "", slots).slots  # the placement's own rule: ranks 0..N-1, one runner id each
    except (cattrs.BaseValidationError, ValueError, TypeError) as exc:
        reason = describe_structure_error(exc) if isinstance(exc, cattrs.BaseValidationError) else str(exc)
        raise SnapshotError(f"{where}: {reason}") from exc


def _machine(cls: type[M], value: object, where: str) -> M:
    try:
        return cls.from_dict(value)  # type: ignore[arg-type]
    except SnapshotError as exc:
        raise SnapshotError(f"{where}: {exc}") from exc
