"""A fake world around `fsm.cluster.Cluster`: what processes and downloads would report.

Actions from the planner are executed on the cluster; each one that starts
real work (connect, load, warm-up, stop, download, a request) leaves a
*pending completion* that a test delivers when it chooses, so that Hypothesis
explores every interleaving of completions, failures and clock jumps.
"""

from __future__ import annotations

import attrs

import fsm
from fsm import download, runner
from fsm.cluster import Cluster


@attrs.frozen
class Pending:
    kind: str  # connected | loaded | warmed | exited | finished | download
    key: str  # runner id, or node id for downloads
    incarnation: int = 0
    model_id: str = ""


_EXPECTED_LEAF = {"connected": "joining", "loaded": "weights", "warmed": "warming_up", "finished": "busy"}


class FakeWorld:
    def __init__(self, cluster: Cluster, nodes: list[str], now: float = 0.0) -> None:
        self.cluster = cluster
        self.nodes = nodes
        self.now = now
        self.pending: list[Pending] = []
        self.executed: list[tuple[float, fsm.Action]] = []

    # -- the planner, executed -------------------------------------------------

    def step(self, node_id: str) -> list[fsm.Action]:
        actions = fsm.plan(self.cluster.view(), node_id, self.now)
        for action in actions:
            self.before_execute(action)
            self.cluster.execute(action, self.now)
            self.executed.append((self.now, action))
            self._schedule(action)
        return actions

    def before_execute(self, action: fsm.Action) -> None:
        """A hook for invariants that must hold at the moment an action is taken."""

    def _schedule(self, action: fsm.Action) -> None:
        match action:
            case fsm.ConnectRunner(rid, inc):
                self.pending.append(Pending("connected", rid, inc))
            case fsm.LoadModel(rid, inc, _):
                self.pending.append(Pending("loaded", rid, inc))
            case fsm.WarmUp(rid, inc):
                self.pending.append(Pending("warmed", rid, inc))
            case fsm.StopRunner(rid, inc, _):
                self.pending.append(Pending("exited", rid, inc))
            case fsm.ForwardRequest(_, rid, inc):
                self.pending.append(Pending("finished", rid, inc))
            case fsm.StartDownload(node, model):
                self.pending.append(Pending("download", node, model_id=model))

    # -- completions -----------------------------------------------------------

    def deliver(self, index: int, *, ok: bool = True) -> bool:
        """Deliver pending completion ``index``; False if it no longer applies (its runner moved on)."""
        op = self.pending.pop(index)
        now = self.now
        if op.kind == "download":
            machine = self.cluster.downloads.get((op.key, op.model_id))
            if machine is None or machine.download_state is not fsm.DownloadState.ONGOING:
                return False
            event = download.Complete(op.model_id, now) if ok else download.DownloadFailed(op.model_id, now, "offline")
            self.cluster.download_event(op.key, event)
            return True
        machine = self.cluster.runners.get(op.key, (None,))[0]
        if machine is None or machine.incarnation != op.incarnation or not machine.alive:
            return False
        if op.kind == "exited":
            self.cluster.runner_event(runner.Exited(op.key, op.incarnation, exit_code=0), now)
            return True
        if machine.leaf != _EXPECTED_LEAF[op.kind]:
            return False
        if op.kind == "connected":
            self.cluster.runner_event(runner.Connected(op.key, op.incarnation), now)
        elif op.kind == "loaded":
            self.cluster.runner_event(runner.Progress(op.key, op.incarnation, layers_loaded=2, layers_total=4), now)
            self.cluster.runner_event(runner.WeightsLoaded(op.key, op.incarnation), now)
        elif op.kind == "warmed":
            self.cluster.runner_event(runner.Warmed(op.key, op.incarnation), now)
        elif op.kind == "finished":
            self.cluster.runner_event(runner.RequestFinished(op.key, op.incarnation), now)
        return True

    # -- a benign world ------------------------------------------------------

    def settle(self, max_rounds: int = 400) -> int:
        """Plan, execute and complete everything, advancing time to deadlines, until nothing is left.

        Returns the rounds used; raises AssertionError if the system is still busy after ``max_rounds``.
        """
        for rounds in range(max_rounds):
            acted = any([self.step(node) for node in self.nodes])
            delivered = False
            while self.pending:
                delivered = self.deliver(0) or delivered
            if acted or delivered:
                continue
            deadlines = [fsm.next_deadline(self.cluster.view(), n, self.now) for n in self.nodes]
            future = [d for d in deadlines if d is not None]
            if not future:
                return rounds
            self.now = min(future)
        raise AssertionError(f"no quiescence after {max_rounds} rounds: {self.cluster.view()}")
