"""A simulated world around `fsm.cluster.Cluster`: the plan → execute → settle loop, once.

An action that starts real work (connect, load, warm-up, stop, a download, a
request) leaves an `fsm.owed.Owed` report; whoever drives the simulation decides
when it completes — at once (a demo, `World.settle`), in a random order
(Hypothesis), or in every order (the model checker). All three use `World`.

The invariants that must hold *at the moment an action is taken* (numbered as in `fsm.check`:
1, 5 and 6) are checked here, in `check_action`, for every driver alike. Pure,
like the rest of `fsm`.
"""

from __future__ import annotations

from collections.abc import Callable

from fsm import actions as act
from fsm import download as dl
from fsm import instance as inst
from fsm import runner as rn
from fsm.cluster import Cluster
from fsm.download import DownloadState
from fsm.driver import Driver, Planner
from fsm.owed import Owed, Report, owed_after
from fsm.plan import next_deadline
from fsm.plan import plan as default_plan
from fsm.runner import RunnerPhase, RunnerState
from fsm.view import ClusterView, PendingRequest, slot_of

# The phase a runner must still be in for its completion to mean something.
_EXPECTED_PHASE = {
    Report.CONNECTED: RunnerPhase.JOINING,
    Report.LOADED: RunnerPhase.WEIGHTS,
    Report.WARMED: RunnerPhase.WARMING_UP,
    Report.FINISHED: RunnerPhase.BUSY,
}


def applies(cluster: Cluster, op: Owed) -> bool:
    """Whether ``op`` still means something (its runner may have moved on or died meanwhile)."""
    if op.report is Report.DOWNLOAD:
        machine = cluster.downloads.get((op.key, op.model_id))
        return machine is not None and machine.download_state is DownloadState.ONGOING
    entry = cluster.runners.get(op.key)
    if entry is None or entry.machine.incarnation != op.incarnation or not entry.machine.alive:
        return False
    if op.report is Report.PUBLISHED:
        return entry.endpoint is None
    return op.report is Report.EXITED or entry.machine.phase is _EXPECTED_PHASE[op.report]


def complete(cluster: Cluster, op: Owed, now: float, *, ok: bool = True) -> bool:
    """Deliver ``op`` (a download may fail with ``ok=False``); False if it no longer applies."""
    if not applies(cluster, op):
        return False
    if op.report is Report.DOWNLOAD:
        event = dl.Complete(op.model_id, now) if ok else dl.DownloadFailed(op.model_id, now, "offline")
        cluster.download_event(op.key, event)
        return True
    rid, inc = op.key, op.incarnation
    match op.report:
        case Report.PUBLISHED:
            entry = cluster.runners[rid]
            cluster.publish(rid, inc, f"{entry.node_id}:{entry.machine.rank}")
        case Report.EXITED:
            cluster.runner_event(rn.Exited(rid, inc, exit_code=0), now)
        case Report.CONNECTED:
            cluster.runner_event(rn.Connected(rid, inc), now)
        case Report.LOADED:
            cluster.runner_event(rn.Progress(rid, inc, layers_loaded=2, layers_total=4), now)
            cluster.runner_event(rn.WeightsLoaded(rid, inc), now)
        case Report.WARMED:
            cluster.runner_event(rn.Warmed(rid, inc), now)
        case Report.FINISHED:
            cluster.runner_event(rn.RequestFinished(rid, inc), now)
    return True


# -- invariants at the moment an action is taken --------------------------------------------


class InvariantViolated(AssertionError):
    """An invariant of `fsm.check`'s list does not hold; ``invariant`` names it as the specs do."""

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant
        self.message = message


def check_action(cluster: Cluster, action: act.Action, now: float) -> None:
    """Invariants 1, 5 and 6, and the request rules, checked just before ``action`` is executed."""
    match action:
        case act.StartGeneration(instance_id, _):
            deadline = cluster.instance(instance_id).deadline
            if deadline is not None and now < deadline:
                raise InvariantViolated(
                    "5 no start before its deadline", f"generation started at t={now:g} < deadline {deadline:g}"
                )
        case act.RestartRank(instance_id, rank, _):
            deadline = cluster.instance(instance_id).rank_deadlines.get(rank)
            if deadline is None or now < deadline:
                raise InvariantViolated(
                    "5 no start before its deadline", f"rank {rank} restarted at t={now:g}, its deadline {deadline}"
                )
        case act.CreateRunner(instance_id, runner_id, _, _, _, incarnation, _):
            machine = cluster.instance(instance_id)
            if machine.is_deleted:
                raise InvariantViolated("1 absorbing Deleted", f"{action} for a Deleted instance")
            # one_for_all: no process of another generation of the instance; one_for_one: none of its own rank's
            alone = machine.one_for_one
            older = [
                e.machine
                for rid, e in cluster.runners.items()
                if e.instance_id == instance_id
                and e.machine.alive
                and e.machine.incarnation != incarnation
                and (rid == runner_id or not alone)
            ]
            if older:
                raise InvariantViolated("6 one generation at a time", f"{action} while {older[0].runner_id} is alive")
            download = cluster.downloads.get((action.node_id, action.model_id))
            local = cluster.instances[instance_id].local
            if not local and (download is None or download.download_state is not DownloadState.COMPLETED):
                state = "never started" if download is None else download.leaf
                raise InvariantViolated(
                    "runners only for a model on their node", f"{action} while its download is {state}"
                )
        case act.ConnectRunner(runner_id, incarnation):
            instance_id = cluster.runners[runner_id].instance_id
            unknown = [
                e.machine.runner_id
                for e in cluster.runners.values()
                if e.instance_id == instance_id and e.machine.incarnation == incarnation and e.endpoint is None
            ]
            if unknown:
                raise InvariantViolated(
                    "connect only once every rank's endpoint is published", f"{action} while {unknown[0]}'s is not"
                )
        case act.ForwardRequest(_, runner_id, incarnation):
            runner = cluster.runner(runner_id)
            placement = cluster.instances[cluster.runners[runner_id].instance_id]
            slot = slot_of(placement.slots, runner_id)
            current = slot is not None and incarnation == placement.machine.rank_generations[slot.rank]
            if runner.runner_state is not RunnerState.READY or not current:
                raise InvariantViolated("requests go to Ready runners", f"{action} while the runner is {runner.path}")
        case act.CancelRequest(_, instance_id, _) if instance_id in cluster.instances:
            machine = cluster.instance(instance_id)
            if not machine.is_deleted:
                raise InvariantViolated(
                    "requests are cancelled only with their instance", f"{action} while {machine.leaf}"
                )


def check_runners(cluster: Cluster) -> None:
    """Invariant 6 on a state: one generation alive per instance (one_for_one: per rank, which a slot's single
    runner entry holds by construction), never more live runners than ranks."""
    for instance_id, placement in cluster.instances.items():
        alive = [e.machine for e in cluster.runners.values() if e.instance_id == instance_id and e.machine.alive]
        alone = placement.machine.one_for_one
        if not alone and len({m.incarnation for m in alive}) > 1:
            raise InvariantViolated(
                "6 one generation at a time", f"alive incarnations {sorted({m.incarnation for m in alive})}"
            )
        if len(alive) > len(placement.slots):
            raise InvariantViolated(
                "6 at most N live runners", f"{len(alive)} live runners for {len(placement.slots)} ranks"
            )


# -- the loop -------------------------------------------------------------------------------


class _Simulated:
    """The world's side of the driver: every handler notes what its action owes, delivered when the world
    says (`World.deliver`)."""

    def __init__(self, world: World) -> None:
        self.world = world

    def _owe(self, action: act.Action) -> None:
        if (op := owed_after(action)) is not None:
            self.world.pending.append(op)

    def _answer(self, action: act.ForwardRequest | act.CancelRequest) -> None:
        self.world.requests.pop(action.request_id, None)
        self._owe(action)

    create_runner = stop_runner = start_download = connect_runner = load_model = warm_up = kill_runner = _owe
    forward_request = cancel_request = _answer


class World:
    """Plan on a node, execute, and keep what the world owes; deliver it when the driver says so."""

    def __init__(
        self, cluster: Cluster, nodes: list[str] | tuple[str, ...], now: float = 0.0, *, plan: Planner = default_plan
    ) -> None:
        self.cluster = cluster
        self.nodes = list(nodes)
        self.now = now
        self.plan = plan
        self.pending: list[Owed] = []
        self.requests: dict[str, PendingRequest] = {}  # the request book: waiting to be forwarded or cancelled
        self.executed: list[tuple[float, act.Action]] = []
        # what the driver does before an action is executed (the checker's controller: a generation's ranks
        # move off nodes that are gone, as `exod.placer.Placer.place_again` does)
        self.before: Callable[[act.Action], None] | None = None

    def submit(self, request_id: str, instance_id: str) -> None:
        """A chat request arrives."""
        self.requests[request_id] = PendingRequest(request_id, instance_id)

    def view(self) -> ClusterView:
        return self.cluster.view(self.requests.values())

    def step(self, node_id: str) -> list[act.Action]:
        """Plan on ``node_id`` once and execute every action (an `fsm.driver.Driver` of this one node, the
        simulated world its adapter); what each owes becomes pending. A refusal of the machines is raised."""
        driver = Driver(
            self.cluster,
            _Simulated(self),
            lambda: self.now,
            nodes=[node_id],
            plan=self.plan,
            before=self._look,
            requests=self.requests.values,
            max_rounds=1,
        )
        done = driver.reconcile()
        if errors := [s.error for s in done.skipped if s.error is not None]:
            raise errors[0]
        return [*done.taken, *(s.action for s in done.skipped)]

    def _look(self, action: act.Action) -> bool:
        if self.before is not None:
            self.before(action)
        check_action(self.cluster, action, self.now)
        self.executed.append((self.now, action))
        return True

    def deliver(self, index: int, *, ok: bool = True) -> bool:
        return complete(self.cluster, self.pending.pop(index), self.now, ok=ok)

    def deliver_all(self) -> bool:
        """Deliver every pending completion in order; True if any still applied."""
        delivered = False
        while self.pending:
            delivered = self.deliver(0) or delivered
        return delivered

    def next_time(self) -> float | None:
        """The earliest deadline of any node after ``now`` (backoff, download retry, budget reset)."""
        view = self.view()
        times = [t for n in self.nodes if (t := next_deadline(view, n, self.now)) is not None]
        return min(times, default=None)

    def advance(self, now: float) -> None:
        """Time passes: every instance observes it (a budget reset comes due only when observed)."""
        self.now = now
        for instance_id, placement in self.cluster.instances.items():
            if not placement.machine.is_deleted:
                self.cluster.instance_event(inst.Tick(instance_id, now))

    def settle(self, max_rounds: int = 400) -> int:
        """Plan, execute and complete everything, advancing time to deadlines, until nothing is left.

        Returns the rounds used; raises `InvariantViolated` if the system is still busy after ``max_rounds``.
        """
        for rounds in range(max_rounds):
            acted = any([self.step(node) for node in self.nodes])
            if self.deliver_all() or acted:
                continue
            future = self.next_time()
            if future is None:
                return rounds
            self.advance(future)
        raise InvariantViolated("10 no deadlock", f"no quiescence after {max_rounds} rounds: {self.view()}")
