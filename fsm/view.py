"""The planner's input: an immutable snapshot of the cluster as one node sees it.

Every field is plain data (attrs, frozen). The daemon builds a view from its
machines (the ``of`` constructors) or from what other nodes reported; tests
build views by hand. Runner statuses are keyed by runner id and hold the
*latest* incarnation of each slot, failure included: that a runner failed stays
visible after it was reaped, which the sibling rule of `fsm.plan` relies on.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping

import attrs

from fsm.download import DownloadLifecycle, DownloadState
from fsm.errors import InvalidConfig
from fsm.failure import Failure
from fsm.instance import DeleteReason, InstanceRetry, InstanceState, RestartStrategy
from fsm.runner import RunnerLifecycle, RunnerPhase, RunnerState
from fsm.watchdog import UNHEARD, Liveness, PhaseLimits


@attrs.frozen
class RunnerStatus:
    """One runner's latest incarnation as the planner sees it (`of` reads it from its machine)."""

    runner_id: str
    instance_id: str
    node_id: str
    rank: int
    incarnation: int  # the instance generation this process was created for
    state: RunnerState
    phase: RunnerPhase | None = None
    layers_loaded: int = 0
    layers_total: int = 0
    in_flight: int = 0
    stop_requested: bool = False
    failure: Failure | None = None
    endpoint: str | None = None  # HOST:PORT of its ring, once its node published it (one rank: not needed)
    since: float | None = None  # when it entered its phase, or last reported progress (`fsm.watchdog`)
    killed: bool = False  # a kill was asked once its stop's grace ran out
    liveness: Liveness = UNHEARD  # its heartbeat's answers, and its caller's listening (`fsm.watchdog`)

    @property
    def alive(self) -> bool:
        """The process exists (not yet reaped)."""
        return self.phase is not RunnerPhase.STOPPED

    @property
    def failed(self) -> bool:
        """This incarnation failed, whether or not it has been reaped since."""
        return self.failure is not None or self.state is RunnerState.FAILED

    @classmethod
    def of(
        cls,
        machine: RunnerLifecycle,
        *,
        instance_id: str,
        node_id: str,
        endpoint: str | None = None,
        since: float | None = None,
        killed: bool = False,
        liveness: Liveness = UNHEARD,
    ) -> RunnerStatus:
        """Read a runner's machine, with what the cluster keeps beside it (its instance, node, endpoint)."""
        return cls(
            endpoint=endpoint,
            since=since,
            killed=killed,
            liveness=liveness,
            runner_id=machine.runner_id,
            instance_id=instance_id,
            node_id=node_id,
            rank=machine.rank,
            incarnation=machine.incarnation,
            state=machine.runner_state,
            phase=machine.phase,
            layers_loaded=machine.layers_loaded,
            layers_total=machine.layers_total,
            in_flight=machine.in_flight,
            stop_requested=machine.stop_requested,
            failure=machine.failure,
        )


@attrs.frozen
class Slot:
    """Rank ``rank`` of an instance runs as ``runner_id`` on ``node_id``."""

    rank: int
    node_id: str
    runner_id: str


def slot_of(slots: Iterable[Slot], runner_id: str) -> Slot | None:
    """The slot ``runner_id`` runs in: its rank is the instance's (a one_for_one replica's process is rank 0 of
    a world of its own, so the runner's own rank does not say)."""
    return next((s for s in slots if s.runner_id == runner_id), None)


class Residency(enum.Enum):
    """Whether an instance's model is in memory, as users see it (read from its state: `InstanceView.residency`)."""

    LOADING = "loading"  #: placed, its generation on its way to Ready (or retried after a failure)
    LOADED = "loaded"  #: Ready: its runners hold the model
    PARKING = "parking"  #: parked on purpose, its runners being stopped
    PARKED = "parked"  #: no process; a request brings it back
    UNPARKING = "unparking"  #: a request brought it back: on its way to Ready
    DELETED = "deleted"  #: gone for good; its runners are being (or were) stopped


@attrs.frozen
class RetryStatus:
    """An instance's retry state and policy as the planner sees it (`of` reads it from its machine)."""

    state: InstanceState
    generation: int = 0
    attempts: int = 0
    max_failures: int | None = 5  # None: never gives up
    deadline: float | None = None
    delete_reason: DeleteReason | None = None
    ready_since: float | None = None
    reset_after: float | None = 600.0  # None: the budget never refills
    waking: bool = False  # unparked, not Ready yet
    strategy: RestartStrategy = RestartStrategy.ONE_FOR_ALL
    rank_generations: tuple[int, ...] = ()  # each rank's generation; () reads as every rank at ``generation``
    rank_deadlines: tuple[tuple[int, float], ...] = ()  # one_for_one: (rank, when it may restart alone)

    def rank_generation(self, rank: int) -> int:
        """The generation rank ``rank``'s process belongs to: the instance's, unless one_for_one restarted it."""
        return self.rank_generations[rank] if self.rank_generations else self.generation

    @property
    def one_for_one(self) -> bool:
        """Its ranks are independent replicas: each runs, fails and restarts on its own."""
        return self.strategy is RestartStrategy.ONE_FOR_ONE

    @property
    def reset_due(self) -> float | None:
        """When a Ready instance's spent budget returns to 0, if it stays Ready until then."""
        if self.state is not InstanceState.READY or not self.attempts or self.ready_since is None:
            return None
        if self.reset_after is None:
            return None
        return self.ready_since + self.reset_after

    @classmethod
    def of(cls, machine: InstanceRetry) -> RetryStatus:
        """Read an instance's machine and its policy: the planner never touches the machine itself."""
        return cls(
            state=machine.instance_state,
            generation=machine.generation,
            attempts=machine.attempts,
            max_failures=machine.policy.max_failures,
            deadline=machine.deadline,
            delete_reason=machine.delete_reason,
            ready_since=machine.ready_since,
            reset_after=machine.policy.reset_after,
            waking=machine.waking,
            strategy=machine.policy.strategy,
            rank_generations=tuple(machine.rank_generations),
            rank_deadlines=tuple(sorted(machine.rank_deadlines.items())),
        )


def _slots(value: object) -> tuple[Slot, ...]:
    slots = tuple(value)  # type: ignore[arg-type]
    if not slots or [s.rank for s in slots] != list(range(len(slots))):
        raise InvalidConfig(f"slots must list ranks 0..N-1 in order, got {[getattr(s, 'rank', s) for s in slots]}")
    if len({s.runner_id for s in slots}) != len(slots):
        raise InvalidConfig("every slot needs its own runner_id")
    return slots


@attrs.frozen
class InstanceView:
    """A placed instance: its model, its ranks' slots (rank 0's node leads it), its retry status."""

    instance_id: str
    model_id: str
    slots: tuple[Slot, ...] = attrs.field(converter=_slots)
    retry: RetryStatus = RetryStatus(InstanceState.PENDING)
    local: bool = False  # its model's files are on each of its nodes already: nothing to download
    keep_alive: float | None = None  # seconds it stays loaded unused (the last request's, or its own); None: forever
    last_used: float | None = None  # when a request last started or ended on it

    @property
    def park_at(self) -> float | None:
        """When a Ready instance left unused is parked: its keep-alive after its last use (or after it became
        Ready, if used since by nobody); None while not Ready or kept forever."""
        if self.retry.state is not InstanceState.READY or self.keep_alive is None:
            return None
        since = [t for t in (self.last_used, self.retry.ready_since) if t is not None]
        return None if not since else max(since) + self.keep_alive

    @property
    def residency(self) -> Residency:
        """Whether the model is in memory, in the words users see (the retry states are the machine's)."""
        state = self.retry.state
        if state in _RESIDENCY:
            return _RESIDENCY[state]
        return Residency.UNPARKING if self.retry.waking else Residency.LOADING

    @property
    def world_size(self) -> int:
        """How many ranks the instance runs on: one slot each."""
        return len(self.slots)

    @property
    def nodes(self) -> frozenset[str]:
        """The nodes its ranks are on, each once: where its model must be downloaded."""
        return frozenset(s.node_id for s in self.slots)

    @property
    def leader(self) -> str:
        """The node of rank 0: the one that issues instance-level actions."""
        return self.slots[0].node_id


_RESIDENCY = {
    InstanceState.READY: Residency.LOADED,
    InstanceState.DEGRADED: Residency.LOADED,  # one_for_one: its other replicas serve while one restarts
    InstanceState.PARKING: Residency.PARKING,
    InstanceState.PARKED: Residency.PARKED,
    InstanceState.DELETED: Residency.DELETED,
}


@attrs.frozen
class DownloadStatus:
    """One model's download on one node as the planner sees it."""

    node_id: str
    model_id: str
    state: DownloadState
    attempts: int = 0
    retry_at: float | None = None

    @classmethod
    def of(cls, machine: DownloadLifecycle, *, node_id: str) -> DownloadStatus:
        """Read a download's machine (which does not know its node: the cluster keys it by one)."""
        return cls(node_id, machine.model_id, machine.download_state, machine.attempts, machine.retry_at)


@attrs.frozen
class PendingRequest:
    """A request waiting in the caller's request book, to be forwarded (or cancelled) by the plan."""

    request_id: str
    instance_id: str


@attrs.frozen
class ClusterView:
    """The planner's whole input: instances, runners, downloads, waiting requests and the watchdogs' limits."""

    instances: Mapping[str, InstanceView] = attrs.field(factory=dict, converter=dict)
    runners: Mapping[str, RunnerStatus] = attrs.field(factory=dict, converter=dict)
    downloads: Mapping[tuple[str, str], DownloadStatus] = attrs.field(factory=dict, converter=dict)
    requests: tuple[PendingRequest, ...] = attrs.field(default=(), converter=tuple)
    limits: PhaseLimits = attrs.field(factory=PhaseLimits)  # the watchdogs the planner keeps (`fsm.watchdog`)

    @classmethod
    def build(
        cls,
        instances: list[InstanceView] | tuple[InstanceView, ...] = (),
        runners: list[RunnerStatus] | tuple[RunnerStatus, ...] = (),
        downloads: list[DownloadStatus] | tuple[DownloadStatus, ...] = (),
        requests: list[PendingRequest] | tuple[PendingRequest, ...] = (),
        limits: PhaseLimits | None = None,
    ) -> ClusterView:
        """Key the lists the way the planner looks them up."""
        return cls(
            {i.instance_id: i for i in instances},
            {r.runner_id: r for r in runners},
            {(d.node_id, d.model_id): d for d in downloads},
            requests,
            limits or PhaseLimits(),
        )

    def slot_runners(self, instance: InstanceView) -> Iterator[tuple[Slot, RunnerStatus | None]]:
        """Each slot with the latest status of its runner (None if never created)."""
        for slot in instance.slots:
            yield slot, self.runners.get(slot.runner_id)

    def download(self, node_id: str, model_id: str) -> DownloadStatus | None:
        """The model's download on the node, or None if none was ever started there."""
        return self.downloads.get((node_id, model_id))
