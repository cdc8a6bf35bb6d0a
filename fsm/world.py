"""A simulated world around `fsm.cluster.Cluster`: what processes and downloads would answer.

An action that starts real work (connect, load, warm-up, stop, a download, a
request) leaves a `Pending` completion; whoever drives the simulation decides
when it completes — at once (a demo), in a random order (Hypothesis), or in
every order (the model checker). Pure, like the rest of `fsm`.
"""

from __future__ import annotations

import attrs

from fsm import actions as act
from fsm import download as dl
from fsm import runner as rn
from fsm.cluster import Cluster
from fsm.download import DownloadState


@attrs.frozen(order=True)
class Pending:
    kind: str  # connected | loaded | warmed | exited | finished | download
    key: str  # runner id, or node id for downloads
    incarnation: int = 0
    model_id: str = ""

    def __str__(self) -> str:
        what = f"{self.key}#{self.incarnation}" if self.kind != "download" else f"{self.model_id}@{self.key}"
        return f"{self.kind} {what}"


_EXPECTED_LEAF = {"connected": "joining", "loaded": "weights", "warmed": "warming_up", "finished": "busy"}


def pending_for(action: act.Action) -> Pending | None:
    """The completion the world owes after ``action`` was executed."""
    match action:
        case act.ConnectRunner(rid, inc):
            return Pending("connected", rid, inc)
        case act.LoadModel(rid, inc, _):
            return Pending("loaded", rid, inc)
        case act.WarmUp(rid, inc):
            return Pending("warmed", rid, inc)
        case act.StopRunner(rid, inc, _):
            return Pending("exited", rid, inc)
        case act.ForwardRequest(_, rid, inc):
            return Pending("finished", rid, inc)
        case act.StartDownload(node, model):
            return Pending("download", node, model_id=model)
    return None


def applies(cluster: Cluster, op: Pending) -> bool:
    """Whether ``op`` still means something (its runner may have moved on or died meanwhile)."""
    if op.kind == "download":
        machine = cluster.downloads.get((op.key, op.model_id))
        return machine is not None and machine.download_state is DownloadState.ONGOING
    entry = cluster.runners.get(op.key)
    if entry is None or entry[0].incarnation != op.incarnation or not entry[0].alive:
        return False
    return op.kind == "exited" or entry[0].leaf == _EXPECTED_LEAF[op.kind]


def complete(cluster: Cluster, op: Pending, now: float, *, ok: bool = True) -> bool:
    """Deliver ``op`` (a download may fail with ``ok=False``); False if it no longer applies."""
    if not applies(cluster, op):
        return False
    if op.kind == "download":
        event = dl.Complete(op.model_id, now) if ok else dl.DownloadFailed(op.model_id, now, "offline")
        cluster.download_event(op.key, event)
        return True
    rid, inc = op.key, op.incarnation
    if op.kind == "exited":
        cluster.runner_event(rn.Exited(rid, inc, exit_code=0), now)
    elif op.kind == "connected":
        cluster.runner_event(rn.Connected(rid, inc), now)
    elif op.kind == "loaded":
        cluster.runner_event(rn.Progress(rid, inc, layers_loaded=2, layers_total=4), now)
        cluster.runner_event(rn.WeightsLoaded(rid, inc), now)
    elif op.kind == "warmed":
        cluster.runner_event(rn.Warmed(rid, inc), now)
    elif op.kind == "finished":
        cluster.runner_event(rn.RequestFinished(rid, inc), now)
    return True
