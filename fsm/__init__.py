"""Explicit lifecycles for LLM inference runners: machines, policies and a pure planner.

Pure: no I/O, no clock reads. Time is always a parameter (``now``); the caller
feeds events to the machines and executes what `plan` returns.
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
    ForwardRequest,
    KillRunner,
    LoadModel,
    StartDownload,
    StartGeneration,
    StopReason,
    StopRunner,
    WarmUp,
)
from fsm.admit import Admission, Limits, ModelFacts, Refusal, UnknownModel, admit, place_again
from fsm.backoff import Backoff, KeyedBackoff
from fsm.clock import Clock, ClockKind
from fsm.cluster import Cluster, Handle
from fsm.desired import to_place
from fsm.download import DEFAULT_DOWNLOAD_BACKOFF, DownloadLifecycle, DownloadState
from fsm.driver import Adapter, Driver, Round, Skipped
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
from fsm.instance import DeleteReason, InstanceRetry, InstanceState, RetryPolicy, budget_exhausted
from fsm.log import LogEntry
from fsm.owed import Owed, Report, owed, owed_after
from fsm.placement import NodeRoom, NoFit, place
from fsm.plan import next_deadline, plan
from fsm.runner import RunnerLifecycle, RunnerPhase, RunnerState
from fsm.view import ClusterView, DownloadStatus, InstanceView, PendingRequest, RetryStatus, RunnerStatus, Slot
from fsm.watchdog import PhaseLimits

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
    "Failure",
    "FailureKind",
    "ForwardRequest",
    "FsmError",
    "Handle",
    "IllegalTransition",
    "IncarnationMismatch",
    "InstanceRetry",
    "InstanceState",
    "InstanceView",
    "InvalidConfig",
    "InvalidEvent",
    "KeyedBackoff",
    "KillRunner",
    "Limits",
    "LoadModel",
    "LogEntry",
    "ModelFacts",
    "NoFit",
    "NodeRoom",
    "Outcome",
    "Owed",
    "PendingRequest",
    "PhaseLimits",
    "Refusal",
    "Report",
    "RetryPolicy",
    "RetryStatus",
    "Round",
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
    "WarmUp",
    "__version__",
    "admit",
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
