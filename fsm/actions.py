"""What the planner asks a node to do. Plain data: the caller executes them.

Executing an action is two halves: ``Cluster.execute(action, now)`` moves the machines, then the caller
does the work in the world and reports how it ended (each class says which report; `fsm.owed` tabulates
them and lists what is still owed).
"""

from __future__ import annotations

import enum

import attrs

from fsm.instance import DeleteReason


class StopReason(enum.Enum):
    """Why a runner is stopped: for logs and metrics; every reason is stopped the same way."""

    INSTANCE_GONE = "instance_gone"  #: deleted, or no longer in the desired state
    RUNNER_FAILED = "runner_failed"  #: Failed is terminal: stop it, never revive it
    SIBLING_FAILED = "sibling_failed"  #: one_for_all: a rank of the same generation failed
    RECOVERING = "recovering"  #: the instance is tearing the generation down
    STALE_GENERATION = "stale_generation"  #: a newer generation has been started
    PARKED = "parked"  #: the instance is parked on purpose (`ParkInstance`)


class ParkReason(enum.Enum):
    """Why an instance is parked: for logs and metrics; every reason parks it the same way."""

    IDLE = "idle"  #: unused for its keep-alive
    EVICTED = "evicted"  #: another instance needed its memory (`fsm.admit`'s ``evict``)
    REQUESTED = "requested"  #: an operator asked (`Cluster.park`)


@attrs.frozen
class CancelRequest:
    """End the request with an error carrying ``reason`` (its instance is gone). Owes nothing back."""

    request_id: str
    instance_id: str
    reason: str


@attrs.frozen
class StopRunner:
    """End the process of this incarnation (ask, then kill if it lingers); report ``runner.Exited``
    once it is reaped, whoever ended it."""

    runner_id: str
    incarnation: int
    reason: StopReason


@attrs.frozen
class DeleteInstance:
    """Machines only: the instance is Deleted (``reason``). Its runners are stopped by later StopRunner
    actions; drop what the instance held outside the machines (requests are cancelled by CancelRequest)."""

    instance_id: str
    reason: DeleteReason


@attrs.frozen
class StartGeneration:
    """Machines only: generation ``generation`` begins; CreateRunner actions for its ranks follow."""

    instance_id: str
    generation: int


@attrs.frozen
class RestartRank:
    """Machines only (one_for_one): rank ``rank`` alone starts again, as generation ``generation``; a
    CreateRunner for it follows. Its siblings are not touched."""

    instance_id: str
    rank: int
    generation: int


@attrs.frozen
class ParkInstance:
    """Machines only: the instance is parked (``reason``), its placement and budget kept. Its runners are stopped
    by later StopRunner actions (what is owed is their exits); no runner starts for it until it is unparked."""

    instance_id: str
    reason: ParkReason


@attrs.frozen
class UnparkInstance:
    """Machines only: a request waits for a parked instance, whose next generation then starts by the usual
    rules (download first). A caller that accounts for memory takes it only once `fsm.admit_unpark` finds the
    instance room (the driver's ``before`` may hold it back until then: the request waits)."""

    instance_id: str


@attrs.frozen
class CreateRunner:
    """Start the process of rank ``rank`` of ``world_size`` on ``node_id`` (it starts Idle). With two
    ranks or more, report its ring endpoint with ``Cluster.publish``: ConnectRunner waits for every rank's.
    A one_for_one replica is a world of its own, rank 0 of 1: ``runner_id`` names its slot."""

    instance_id: str
    runner_id: str
    node_id: str
    rank: int
    world_size: int
    incarnation: int
    model_id: str


@attrs.frozen
class StartDownload:
    """Fetch ``model_id`` onto ``node_id``; report ``download.Complete`` or ``download.DownloadFailed``
    (a failed one is retried after its backoff by a later StartDownload)."""

    node_id: str
    model_id: str


@attrs.frozen
class ConnectRunner:
    """Tell the runner to join its ring (every rank's endpoint is published); report
    ``runner.Connected`` once it has."""

    runner_id: str
    incarnation: int


@attrs.frozen
class LoadModel:
    """Tell the runner to read ``model_id``'s weights; report ``runner.Progress`` as layers load (a
    watchdog resets on it) and ``runner.WeightsLoaded`` at the end."""

    runner_id: str
    incarnation: int
    model_id: str


@attrs.frozen
class WarmUp:
    """Tell the runner to run its warm-up; report ``runner.Warmed``: the runner is then Ready."""

    runner_id: str
    incarnation: int


@attrs.frozen
class FailStalled:
    """Machines only: the runner sat in ``phase`` past its limit (`fsm.watchdog`), a failure of its own. Its
    process is then stopped like any Failed runner's (a StopRunner follows)."""

    runner_id: str
    incarnation: int
    phase: str
    seconds: float


@attrs.frozen
class FailUnresponsive:
    """Machines only: the runner's process answered no heartbeat for ``seconds`` (`fsm.watchdog`), a stall of its
    own whatever its phase. Its process is then stopped like any Failed runner's (a StopRunner follows)."""

    runner_id: str
    incarnation: int
    seconds: float


@attrs.frozen
class KillRunner:
    """The runner was asked to stop and outlived its grace (`fsm.watchdog`): kill its process (SIGKILL);
    ``runner.Exited`` is still owed, as for the stop."""

    runner_id: str
    incarnation: int


@attrs.frozen
class ForwardRequest:
    """Send the request to this rank (every rank of the instance gets it); report
    ``runner.RequestFinished`` when it ends, however it ends."""

    request_id: str
    runner_id: str
    incarnation: int


Action = (
    CancelRequest
    | StopRunner
    | DeleteInstance
    | ParkInstance
    | UnparkInstance
    | StartGeneration
    | CreateRunner
    | StartDownload
    | ConnectRunner
    | LoadModel
    | WarmUp
    | ForwardRequest
    | FailStalled
    | FailUnresponsive
    | KillRunner
)
