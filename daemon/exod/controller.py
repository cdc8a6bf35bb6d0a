"""The controller: the imperative shell around `fsm.cluster.Cluster`.

It owns every machine (through the cluster), runs `fsm.plan` whenever anything
changes — a report from a runner, a process exit, a download, a placement, a
request — and at the next deadline `fsm.next_deadline` names; never on a fixed
tick. Each action is applied to the machines first (`Cluster.execute`) and is
carried out only if they accepted it: a supervisor spawned, a command posted,
a download started. What the world answers comes back as events
(`exod.reports`), and requests live in their own book (`exod.requests`).

Every change of the machines is handed to the journal (`exod.state.journal`) with its log
entries, which writes them to the state store (`exod.state.store`: SQLite on one host, etcd
in a cluster) in order; a placement is acknowledged once it is stored.

Time is trio's clock (`trio.current_time`), so `trio.testing.MockClock` drives
the controller in tests; it is mapped to wall time once, because deadlines are
stored and must mean the same after a restart.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

import fsm
from exod.cluster.election import Deposed
from exod.cluster.remote import Fleet
from exod.config import DEFAULT, DaemonConfig, Default
from exod.downloads import Downloads
from exod.executor import Executor
from exod.host.models import ModelCard, ModelFiles
from exod.host.orphans import reap_orphans, start_ticks
from exod.host.supervisor import RunnerSpec, Spawn, Supervisor
from exod.narrate import narrate
from exod.placer import Placer
from exod.processes import Processes
from exod.reports import Reports
from exod.requests import InstanceNotFound, RequestBook
from exod.state import retention
from exod.state.journal import WRITE_RETRY, Journal
from exod.state.journal import NotStoredYet as NotStoredYet  # the front ends hear of the store from here
from exod.state.journal import StoreUnavailable as StoreUnavailable
from exod.state.sqlite import ProcessRecord, Store
from exod.state.store import SqliteState, StateStore
from exod.status import NODE, status_of
from fsm import download as dl
from fsm import runner as rn
from fsm.cluster import Cluster, LogEntry

log = logging.getLogger("exod.controller")

SHUTDOWN_WRITE_S = 5.0  # how long a stopping daemon tries to write its last state
MAX_PLAN_ROUNDS = 64  # one change rarely needs more than a handful of plan → execute rounds
KEEP_DELETED = 32  # deleted instances kept for `status` before they are forgotten
RETRY_AFTER = WRITE_RETRY  # seconds: a degraded daemon tries to write its state again this often
_A_REQUEST = frozenset({rn.RequestStarted.name, rn.RequestFinished.name})  # what no restart needs written at once


class Controller:
    def __init__(
        self,
        config: DaemonConfig,
        store: Store,
        *,
        state: StateStore | None = None,
        fleet: Fleet | None = None,
        spawn: Spawn = Supervisor,
        models: ModelFiles | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config, self.store = config, store
        c = config
        self.models = models or ModelFiles(hf_home=c.hf_home, offline=c.offline, timeout=c.download_timeout)
        self._wall_offset = wall() - trio.current_time()  # trio time + offset = wall time, for what is stored
        self.cluster = self._new_cluster()
        self._reports = Reports(self, self._changed)
        self.fleet = fleet  # in a cluster: the other nodes, their agents running the ranks placed there
        self.node_id = NODE if fleet is None else fleet.local
        recorded = lambda: self.journal.recorded()  # noqa: E731 — this term's: `take_over` replaces the journal
        self.processes = Processes(config, spawn, self._reports, fleet, self._published, recorded)  # on their nodes
        self.requests = self._new_book()
        self._downloads = Downloads(self.models, fleet, lambda: self.cluster, self.now, self._changed)
        self._placer = Placer(lambda: self.cluster, self.models, config, fleet, lambda: self.requests.pending())
        self._executor = Executor(
            lambda: self.cluster,
            lambda: self.requests,
            self._running_nursery,
            self.now,
            processes=self.processes,
            downloads=self._downloads,
            models=self.models,
            placer=self._placer,
            node_id=self.node_id,
        )
        self._wake = trio.Event()
        self._stopping = False
        self._nursery: trio.Nursery | None = None
        self.reaped_orphans: list[ProcessRecord] = []
        self.failure_counts: collections.Counter[str] = collections.Counter()  # by FailureKind value
        self.residency_counts: collections.Counter[tuple[str, str]] = collections.Counter()  # (park|unpark, reason)
        # the cluster's state: SQLite (this host's store) unless a cluster's store is given
        self.journal = Journal(state or SqliteState(store), store)  # degraded while it refuses writes

    def now(self) -> float:
        """Wall time, read from trio's clock."""
        return trio.current_time() + self._wall_offset

    def _new_cluster(self, snapshot: dict[str, Any] | None = None) -> Cluster:
        """The machines, empty or as ``snapshot`` held them, watched by the phase limits of the configuration:
        a runner silent while joining, loading or warming up is failed by the plan (`fsm.PhaseLimits`); the
        supervisors keep only what needs the process (a generation's silence, a stop's signals)."""
        t, policy = self.config.timeouts, self.config.download_policy
        limits = fsm.PhaseLimits(t.connect, t.load_progress, t.warm_up, heartbeat=t.heartbeat)
        if snapshot is None:
            return Cluster(download_policy=policy, limits=limits)
        return Cluster.from_dict(snapshot, download_policy=policy, limits=limits)

    def _new_book(self) -> RequestBook:
        c = self.config
        return RequestBook(
            self.cluster,
            wake=self._request_came,
            now=self.now,
            max_per_instance=c.max_requests_per_instance,
            queue_timeout=c.queue_timeout,
            post=self.processes.post,
            place=(lambda model_id: self.place(model_id, c.models.default_ranks)) if c.models.on_demand else None,
        )

    # -- lifecycle of the controller --------------------------------------------------------

    async def restore(self) -> None:
        """Load the last state, kill the runners a previous daemon left, and make the machines say so.

        `fsm.SnapshotError` if the stored snapshot does not restore (the state store's `snapshot_error` says
        it to the operator)."""
        snapshot = await self.journal.state.load()
        if snapshot is not None:
            self.cluster = self._new_cluster(snapshot)
            self.requests = self._new_book()  # callers of the previous daemon are gone
        self.reaped_orphans = reap_orphans(self.store.processes())
        for record in self.store.processes():
            self.journal.forget_process(record.runner_id, record.incarnation)
        self.cluster.recover(now := self.now())
        if self.fleet is not None:  # what resumes, resumes on live nodes
            await self.fleet.refresh()
            for instance_id in self.cluster.instances:
                self._placer.place_again(instance_id)
        for (node, model_id), machine in self.cluster.downloads.items():
            if machine.download_state is fsm.DownloadState.ONGOING:
                self.cluster.download_event(node, dl.DownloadFailed(model_id, now, "interrupted by a daemon restart"))
        self._commit()
        await self.journal.durable()

    async def take_over(self, state: StateStore) -> None:
        """Become the controller of the cluster whose state is in ``state`` (a new term): forget what an earlier
        term left in memory, once its last write has ended; `restore` then reads what is stored."""
        await self.journal.retire("this node's earlier term as the controller is over")
        self.journal = Journal(state, self.store)
        self.cluster = self._new_cluster()
        self.requests = self._new_book()
        self._stopping = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Plan and act until cancelled; cancelling stops and reaps every runner."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                await nursery.start(self.journal.run)
                if self.fleet is not None:
                    await nursery.start(self.fleet.run)
                task_status.started()
                while True:
                    self._act()
                    deadline = self._driver().next_wakeup()
                    with trio.move_on_at(math.inf if deadline is None else deadline - self._wall_offset):
                        await self._wake.wait()
                    self._wake = trio.Event()
                    await trio.sleep(0)  # what woke with it goes first: a request planned inline is on its way
            finally:
                self._nursery = None  # a term ended (deposed): nothing is planned outside `run` (`_request_came`)

    async def shutdown(self) -> None:
        """Stop every runner the graceful way (ask → grace → SIGTERM → SIGKILL), wait for them all, and log it.

        Then the machines say what happened, in the words `restore` uses after a crash (`Cluster.recover`):
        each live instance resumes with a fresh generation, charging no retry (the daemon ended it, not the
        model), and each runner is stopped and reaped. The transition log records it when it happened.
        """
        self._stopping = True  # from here the runners' own reports are not heard: `recover` says it all
        t = self.config.timeouts
        await self.processes.stop_all(within=t.stop_grace + t.term_grace + 2.0)
        self.cluster.recover(self.now())
        self._commit()
        with trio.move_on_after(SHUTDOWN_WRITE_S):
            try:
                await self.journal.durable()
            except Deposed as exc:  # found by the fault campaign (#26): a SIGTERM that came after a step-down
                log.info("%s: what this node would write is the new controller's to say", exc)

    # -- the public surface of the daemon's front ends ---------------------------------------

    async def place(
        self,
        model_id: str,
        ranks: int,
        *,
        policy: fsm.RetryPolicy | None = None,
        nodes: list[str] | None = None,
        keep_alive: float | Default | None = DEFAULT,
    ) -> str:
        """Place ``model_id`` on ``ranks`` ranks (on ``nodes`` only, if given) if `fsm.admit` admits it, parking
        the idle instances it names to make room; returns the instance id once it is stored. Raises
        `PlacementRefused` (and stores nothing) if not. ``keep_alive``: seconds it stays loaded unused (None:
        forever; by default ``[models] keep_alive``)."""
        if not self.models.placeable(model_id):
            only = "are placed from the config file or `exod serve --place` only"
            raise fsm.InvalidConfig(f"{model_id}: local model directories {only}")
        self.journal.writable("new placements")  # the caller would be told of a placement a crash could lose
        if self.fleet is not None:
            await self.fleet.refresh()
        kept = self.config.models.keep_alive if keep_alive is DEFAULT else keep_alive
        instance_id = self._placer.place(model_id, ranks, self.now(), policy or self.config.policy, nodes, kept)
        self._changed()
        await self.journal.stored(f"instance {instance_id} is placed")
        return instance_id

    async def park(self, instance_id: str) -> None:
        """Park the instance now (`exod.placer.Placer.park`; `InstanceBusy` if it cannot be now)."""
        self.instance(instance_id)
        await self._change("parks", lambda: self._placer.park(instance_id, self.now()), f"{instance_id} is parked")

    async def unpark(self, instance_id: str) -> None:
        """Bring a parked instance back now (`exod.placer.Placer.unpark`: `PlacementRefused`, `InstanceBusy`)."""
        self.instance(instance_id)
        await self._change("unparks", lambda: self._placer.unpark(instance_id, self.now()), f"{instance_id} is back")

    def hold(self, instance_id: str, keep_alive: float | None) -> None:
        """Keep it loaded ``keep_alive`` seconds from now until its next request (`fsm.Cluster.hold`)."""
        self.cluster.hold(self.instance(instance_id).instance_id, keep_alive, self.now())
        self._changed()

    def residency(self, instance_id: str) -> fsm.Residency:
        return self._view().instances[self.instance(instance_id).instance_id].residency

    def register_local_model(self, directory: Path) -> str:
        """Name a local model directory ``local/NAME`` so it can be placed; never reachable from the API."""
        try:
            return self.models.register_local(directory)
        except ValueError as exc:
            raise fsm.InvalidConfig(str(exc)) from exc

    async def delete(self, instance_id: str) -> None:
        self.instance(instance_id)
        await self._change("deletes", lambda: self.cluster.delete(instance_id, self.now()), f"{instance_id} is deleted")

    async def _change(self, what: str, change: Callable[[], object], done: str) -> None:
        """Make a change the caller is told of once it is stored (refused at once while ``what`` cannot be)."""
        self.journal.writable(what)
        change()
        self._changed()
        await self.journal.stored(f"instance {done}")

    def status(self) -> dict[str, Any]:
        return {**status_of(self.cluster, self._reports.batching), "degraded": self.journal.degraded}

    def model_card(self, model_id: str) -> ModelCard:
        """What the API tells of a model (its context, architecture, size), from this node's files."""
        return self.models.card(model_id)

    def placed_models(self, *, ready: bool = False) -> list[str]:
        """Models with a live (not deleted) instance, sorted; ``ready``: with a Ready one."""
        live = [pl for pl in self.cluster.instances.values() if not pl.machine.is_deleted]
        return sorted({pl.model_id for pl in live if not ready or pl.machine.instance_state is fsm.InstanceState.READY})

    def instance(self, instance_id: str) -> fsm.InstanceRetry:
        """The instance's retry machine (read it; only the controller feeds it events)."""
        placement = self.cluster.instances.get(instance_id)
        if placement is None:
            raise InstanceNotFound(f"no instance {instance_id!r}; `exod status` lists them")
        return placement.machine

    async def transitions(self, after: int = 0, limit: int | None = None) -> list[tuple[int, LogEntry]]:
        """The durable transition log after sequence number ``after``; `log_written` is set when it grows."""
        return await self.journal.read(self.journal.state.transitions(after=after, limit=limit))

    async def log_start(self) -> int:
        """The first sequence number the log still holds: the entries before it were pruned (`exod.state.retention`)."""
        return await self.journal.read(self.journal.state.log_start())

    async def log_grew(self, after: int) -> None:
        """Return once the durable log holds an entry past ``after``."""
        await self.journal.read(self.journal.state.changed(after))

    @property
    def running(self) -> bool:
        """`run` runs: in a cluster, its term is taken over and restored (`exod.api.forward.controlling`)."""
        return self._nursery is not None

    @property
    def log_written(self) -> trio.Event:
        """Set (and replaced) at every write of the state by this controller."""
        return self.journal.written

    # -- plan → execute ------------------------------------------------------------------

    def _view(self) -> fsm.ClusterView:
        return self.cluster.view(self.requests.pending())

    def _request_came(self) -> None:
        """Planned in the caller's task, not at the controller's turn (0.2 ms, #30); it wakes for the deadlines."""
        if self.running:  # the event is the moment's: `run` replaces it
            self._act()
        self._wake.set()

    def _changed(self) -> None:
        self._commit()
        self._wake.set()

    def _commit(self) -> None:
        """Hand what changed to the journal, which writes it in order (and keeps it while the store refuses)."""
        if self.cluster.log:
            for entry in self.cluster.log:
                narrate(entry)
                if entry.machine == "instance" and entry.event in ("park", "unpark"):
                    self.residency_counts[(entry.event, entry.cause)] += 1
            lazy = all(entry.event in _A_REQUEST for entry in self.cluster.log)
            self.journal.save(self.cluster.to_dict, self.cluster.log, self.now(), lazy=lazy)
            self.cluster.log.clear()

    def _driver(self) -> fsm.Driver:
        """The library's loop over this term's cluster, planning for this node and every node a rank is on."""
        return fsm.Driver(
            self.cluster,
            self._executor,
            self.now,
            nodes=self._nodes,
            before=self._executor.before,
            requests=self.requests.pending,
            max_rounds=MAX_PLAN_ROUNDS,
        )

    def _act(self) -> None:
        if self._stopping:
            return
        done = self._driver().reconcile()
        for skipped in (s for s in done.skipped if s.error is not None):  # the view moved under a later action
            log.warning("action %s not taken: %s", skipped.action, skipped.reason)
        if not done.settled:
            log.error("plan did not settle after %d rounds; will retry on the next change", MAX_PLAN_ROUNDS)
        self.requests.fail_orphaned()
        retention.forget_deleted(self.cluster, self.config.state_dir, done.now, KEEP_DELETED)
        self._commit()

    def _running_nursery(self) -> trio.Nursery:
        assert self._nursery is not None, "actions are executed only while the controller runs"
        return self._nursery

    def _published(self, runner_id: str, incarnation: int, endpoint: str) -> None:
        if self.cluster.publish(runner_id, incarnation, endpoint):
            self._changed()

    def _nodes(self) -> list[str]:
        """The nodes to plan for: this one, and every node a rank is placed on."""
        slots = {slot.node_id for pl in self.cluster.instances.values() for slot in pl.slots}
        return sorted(slots | {self.node_id})

    # -- exod.reports.Sink: what the runners' reports became ------------------------------------

    def runner_event(self, event: rn.RunnerEvent) -> None:
        if self._stopping:  # the machines keep their state as of the shutdown; `restore` takes it from there
            return
        entry = self.cluster.runners.get(event.runner_id)
        if isinstance(event, rn.Fail) and entry is not None and entry.instance_id in self.cluster.instances:
            event = self._downloads.unless_lost(
                event, self.cluster.instances[entry.instance_id].model_id, entry.node_id
            )
        failed_before = entry is not None and entry.machine.failure is not None
        try:
            self.cluster.runner_event(event, self.now())
            if entry is not None and entry.machine.failure is not None and not failed_before:
                self.failure_counts[entry.machine.failure.kind.value] += 1
        except fsm.FsmError as exc:
            log.warning("runner event %s refused: %s", event, exc)
        self.requests.fail_orphaned()
        self._changed()

    def process_started(self, spec: RunnerSpec, pid: int) -> None:
        self.journal.record_process(ProcessRecord(spec.runner_id, spec.incarnation, pid, start_ticks(pid) or 0))

    def process_ended(self, spec: RunnerSpec) -> None:
        self.journal.forget_process(spec.runner_id, spec.incarnation)
