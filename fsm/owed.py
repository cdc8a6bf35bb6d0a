"""What the caller owes the machines: the reports that end the work an action started.

`fsm.plan` only decides. Whoever executes its actions starts real work (a
process, a download, a message to a runner) and must report how it ended, as
an event; until then the cluster waits. A cluster that waits only on its caller
plans nothing and has no deadline (``plan`` returns ``[]``, ``next_deadline``
``None``): `owed` names what it waits for, so that a stall is never silent.

========================  ===========================================================
after executing           the caller owes
========================  ===========================================================
`CreateRunner`            start the process; with ≥ 2 ranks, ``Cluster.publish`` its
                          ring endpoint (HOST:PORT), then nothing until ConnectRunner
`ConnectRunner`           ``runner.Connected`` once the rank joined its ring
`LoadModel`               ``runner.Progress`` (optional, any number), then
                          ``runner.WeightsLoaded``
`WarmUp`                  ``runner.Warmed``
`ForwardRequest`          ``runner.RequestFinished`` when the request ends, however
`StopRunner`              end the process (escalating to a kill if it lingers), then
                          ``runner.Exited`` once it is reaped
`StartDownload`           ``download.Complete`` or ``download.DownloadFailed``
`StartGeneration`,        nothing: they move only the machines
`RestartRank`,
`DeleteInstance`,
`CancelRequest`           end the request with an error (the request book is yours)
========================  ===========================================================

At any moment a runner may also report ``runner.Fail`` (with a `Failure`) or
``runner.Exited``: a process that dies is a report the caller owes too, unasked.
"""

from __future__ import annotations

import enum

import attrs

from fsm import actions as act
from fsm.download import DownloadState
from fsm.runner import RunnerPhase, RunnerState
from fsm.view import ClusterView


class Report(enum.Enum):
    """A report the caller owes: the event (or call) that ends the work an action started."""

    PUBLISHED = "published"  #: Cluster.publish(runner, incarnation, "HOST:PORT"): the rank's ring endpoint
    CONNECTED = "connected"  #: runner.Connected
    LOADED = "loaded"  #: runner.WeightsLoaded (runner.Progress on the way)
    WARMED = "warmed"  #: runner.Warmed
    EXITED = "exited"  #: runner.Exited, once the process is reaped
    FINISHED = "finished"  #: runner.RequestFinished
    DOWNLOAD = "download"  #: download.Complete or download.DownloadFailed


_SAYS = {
    Report.PUBLISHED: "its ring endpoint, by Cluster.publish",
    Report.CONNECTED: "runner.Connected, once it joined its ring",
    Report.LOADED: "runner.WeightsLoaded, once its weights are read",
    Report.WARMED: "runner.Warmed, once warm-up ran",
    Report.EXITED: "runner.Exited, once its process is reaped",
    Report.FINISHED: "runner.RequestFinished, for each request forwarded to it",
    Report.DOWNLOAD: "download.Complete or download.DownloadFailed",
}


@attrs.frozen(order=True)
class Owed:
    """One report owed: ``key`` is the runner id (with its ``incarnation``), or the node id of a download."""

    report: Report = attrs.field(order=lambda report: report.value)
    key: str
    incarnation: int = 0
    model_id: str = ""

    def __str__(self) -> str:
        what = f"{self.model_id}@{self.key}" if self.report is Report.DOWNLOAD else f"{self.key}#{self.incarnation}"
        return f"{self.report.value} {what}"

    def explain(self) -> str:
        """What the caller must do, in words."""
        if self.report is Report.DOWNLOAD:
            return f"download of {self.model_id!r} on node {self.key!r}: {_SAYS[self.report]}"
        return f"runner {self.key!r} incarnation {self.incarnation}: {_SAYS[self.report]}"


def owed_after(action: act.Action) -> Owed | None:
    """The report the caller owes once it has executed ``action`` (None: nothing, or only the request book's)."""
    match action:
        case act.CreateRunner(_, rid, _, _, world_size, inc, _) if world_size > 1:
            return Owed(Report.PUBLISHED, rid, inc)
        case act.ConnectRunner(rid, inc):
            return Owed(Report.CONNECTED, rid, inc)
        case act.LoadModel(rid, inc, _):
            return Owed(Report.LOADED, rid, inc)
        case act.WarmUp(rid, inc):
            return Owed(Report.WARMED, rid, inc)
        case act.StopRunner(rid, inc, _):
            return Owed(Report.EXITED, rid, inc)
        case act.ForwardRequest(_, rid, inc):
            return Owed(Report.FINISHED, rid, inc)
        case act.StartDownload(node, model):
            return Owed(Report.DOWNLOAD, node, model_id=model)
    return None


# The phase a runner sits in while a report is owed for it.
_WAITING = {
    RunnerPhase.JOINING: Report.CONNECTED,
    RunnerPhase.WEIGHTS: Report.LOADED,
    RunnerPhase.WARMING_UP: Report.WARMED,
    RunnerPhase.BUSY: Report.FINISHED,
    RunnerPhase.STOPPING: Report.EXITED,
}


def owed(view: ClusterView, node_id: str | None = None) -> list[Owed]:
    """Every report the cluster waits for from its caller (on ``node_id``'s runners and downloads, if given),
    read from the state alone: what was executed and not yet answered."""
    found: set[Owed] = set()
    for r in view.runners.values():
        if (node_id is not None and r.node_id != node_id) or not r.alive:
            continue
        if r.state is RunnerState.FAILED and r.stop_requested:
            found.add(Owed(Report.EXITED, r.runner_id, r.incarnation))
        elif r.phase in _WAITING:
            found.add(Owed(_WAITING[r.phase], r.runner_id, r.incarnation))
        inst = view.instances.get(r.instance_id)
        unready = r.state in (RunnerState.IDLE, RunnerState.CONNECTING)
        ring = inst is not None and inst.world_size > 1 and not inst.retry.one_for_one  # replicas join none
        if ring and r.endpoint is None and unready and not r.stop_requested:
            found.add(Owed(Report.PUBLISHED, r.runner_id, r.incarnation))
    for (node, model_id), d in view.downloads.items():
        if d.state is DownloadState.ONGOING and (node_id is None or node == node_id):
            found.add(Owed(Report.DOWNLOAD, node, model_id=model_id))
    return sorted(found)
