"""Explicit lifecycles for LLM inference runners: machines, policies and a pure planner.

Pure: no I/O, no clock reads. Time is always a parameter (``now``); the caller
feeds events to the machines and executes what `plan` returns.

Where to start (the rest of this page is the reference, class by class):

* The loop. ``Cluster`` holds the machines of every instance, runner and
  download; ``Cluster.place(...)`` declares an instance on ``Slot`` s. A
  ``Driver(cluster, adapter, clock)`` runs plan → execute → settle:
  ``Driver.reconcile()`` hands each ``Action`` to your ``Adapter`` (spawn a
  process, stop it, fetch a model, ...) and ``Driver.report(event)`` tells it
  what became of them (runner events in ``fsm.runner``, download events in
  ``fsm.download``). Reconcile again at ``Driver.next_wakeup()`` or when
  something happens. Without a driver: ``plan(view, now)`` on
  ``Cluster.view()``, then ``Cluster.execute(action, now)``.
* What you owe. Each action's docstring says what to do and which events to
  feed back; when nothing moves, ``Cluster.owed()`` says what is awaited.
* Policies. ``RetryPolicy`` (backoff, retries, budget reset, ``RestartStrategy``:
  one_for_all for a ring, one_for_one for independent replicas), ``PhaseLimits``
  (watchdogs, a heartbeat's among them: ``Cluster.heard``, ``Cluster.listened``),
  ``Backoff``; ``admit`` and ``place`` decide where an instance fits (``ModelFacts``,
  ``NodeRoom``, ``Limits``).
* Residency. ``Cluster.park`` / ``Cluster.unpark``, or a keep-alive given to
  ``Cluster.place`` and ``Cluster.hold``, by which the plan parks idle instances
  (``ParkInstance``); a request for a parked instance unparks it
  (``UnparkInstance``); ``admit(..., evict=True)`` and ``admit_unpark`` name the
  idle instances to park for memory (``Admission.evict``); ``Residency``.
* Restarts. ``Cluster.to_dict`` / ``Cluster.from_dict(data, now=...)`` (times
  rebased on your clock's reading), ``Cluster.runners()`` /
  ``Cluster.instances()`` (read-only: each runner's ``Handle``, whether it
  is alive), ``Cluster.recover(now, adopt=...)`` (one_for_one adopts each live
  replica and restarts only the missing ones), ``log`` (the transition log as
  JSON lines), ``Clock``: feed a monotonic clock, time.monotonic() (a wall clock
  that steps back is clamped, never refused). The recipe: docs/reattach.rst.
* Errors. ``FsmError`` and its subclasses: a refusal changes nothing.
* Proof. ``fsm.check`` explores every interleaving of a small cluster;
  ``fsm.diagram`` draws the machines (``diagram.mermaid``, ``diagram.transition_table``).

A worked supervisor of plain processes in asyncio: ``examples/supervise_processes.py``;
a tutorial and the rules, each with the exo bug it prevents: the documentation
site (``make docs``).
"""

# Events live in their machine's module, to be imported from there:
#   from fsm import runner, instance, download
#   runner.Connect(...), instance.RankFailed(...), download.Begin(...)
from fsm import diagram, download, instance, log, runner
from fsm._machine import Outcome, Step
from fsm.actions import (
    Action,
    CancelRequest,
    ConnectRunner,
    CreateRunner,
    DeleteInstance,
    FailStalled,
    FailUnresponsive,
    ForwardRequest,
    KillRunner,
    LoadModel,
    ParkInstance,
    ParkReason,
    RestartRank,
    StartDownload,
    StartGeneration,
    StopReason,
    StopRunner,
    UnparkInstance,
    WarmUp,
)
from fsm.admit import Admission, Limits, ModelFacts, Refusal, UnknownModel, admit, admit_unpark, place_again
from fsm.backoff import Backoff, KeyedBackoff
from fsm.clock import Clock, ClockKind
from fsm.cluster import Cluster, Handle, InstanceInfo, RunnerInfo
from fsm.desired import to_place
from fsm.download import DEFAULT_DOWNLOAD_BACKOFF, DownloadLifecycle, DownloadState
from fsm.driver import Adapter, Driver, HandlerFailed, Round, Skipped
from fsm.errors import (
    FsmError,
    IllegalTransition,
    IncarnationMismatch,
    InvalidConfig,
    InvalidEvent,
    SnapshotError,
    UnknownEvent,
)
from fsm.failure import Failure, FailureKind
from fsm.instance import DeleteReason, InstanceRetry, InstanceState, RestartStrategy, RetryPolicy, budget_exhausted
from fsm.log import LogEntry
from fsm.owed import Owed, Report, owed, owed_after
from fsm.placement import NodeRoom, NoFit, place
from fsm.plan import next_deadline, plan
from fsm.runner import RunnerLifecycle, RunnerPhase, RunnerState
from fsm.view import (
    ClusterView,
    DownloadStatus,
    InstanceView,
    PendingRequest,
    Residency,
    RetryStatus,
    RunnerStatus,
    Slot,
)
from fsm.watchdog import Liveness, PhaseLimits

__version__ = "0.1.0"

MACHINES = {
    "runner": RunnerLifecycle,
    "instance": InstanceRetry,
    "download": DownloadLifecycle,
}

__all__ = [
    "DEFAULT_DOWNLOAD_BACKOFF",
    "MACHINES",
    "Action",
    "Adapter",
    "Admission",
    "Backoff",
    "CancelRequest",
    "Clock",
    "ClockKind",
    "Cluster",
    "ClusterView",
    "ConnectRunner",
    "CreateRunner",
    "DeleteInstance",
    "DeleteReason",
    "DownloadLifecycle",
    "DownloadState",
    "DownloadStatus",
    "Driver",
    "FailStalled",
    "FailUnresponsive",
    "Failure",
    "FailureKind",
    "ForwardRequest",
    "FsmError",
    "Handle",
    "HandlerFailed",
    "IllegalTransition",
    "IncarnationMismatch",
    "InstanceInfo",
    "InstanceRetry",
    "InstanceState",
    "InstanceView",
    "InvalidConfig",
    "InvalidEvent",
    "KeyedBackoff",
    "KillRunner",
    "Limits",
    "Liveness",
    "LoadModel",
    "LogEntry",
    "ModelFacts",
    "NoFit",
    "NodeRoom",
    "Outcome",
    "Owed",
    "ParkInstance",
    "ParkReason",
    "PendingRequest",
    "PhaseLimits",
    "Refusal",
    "Report",
    "Residency",
    "RestartRank",
    "RestartStrategy",
    "RetryPolicy",
    "RetryStatus",
    "Round",
    "RunnerInfo",
    "RunnerLifecycle",
    "RunnerPhase",
    "RunnerState",
    "RunnerStatus",
    "Skipped",
    "Slot",
    "SnapshotError",
    "StartDownload",
    "StartGeneration",
    "Step",
    "StopReason",
    "StopRunner",
    "UnknownEvent",
    "UnknownModel",
    "UnparkInstance",
    "WarmUp",
    "__version__",
    "admit",
    "admit_unpark",
    "budget_exhausted",
    "diagram",
    "download",
    "instance",
    "log",
    "next_deadline",
    "owed",
    "owed_after",
    "place",
    "place_again",
    "plan",
    "runner",
    "to_place",
]
