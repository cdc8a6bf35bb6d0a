"""What runner processes say, as machine events: the supervisors' `Listener`.

Each report of a runner becomes a `fsm.runner` event, or a token for the
request book; a stall and an exit become events too. A heartbeat's answer
(`Pong`) is told to the cluster (`fsm.Cluster.heard`), and so is that the
controller listened (`listened`): its plan fails a runner that stops
answering. Nothing here decides: whether an exit was a failure is the runner
machine's rule (``Exited.stop_delivered``), and what a failure costs is the
instance's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import fsm
from exod.host.supervisor import RunnerSpec
from exod.requests import RequestBook
from exod.runner import protocol as p
from fsm import runner as rn
from fsm.cluster import Cluster

log = logging.getLogger("exod.reports")


class Sink(Protocol):
    """Where the events go: the controller."""

    requests: RequestBook
    cluster: Cluster

    def now(self) -> float: ...
    def runner_event(self, event: rn.RunnerEvent) -> None: ...
    def process_started(self, spec: RunnerSpec, pid: int) -> None: ...
    def process_ended(self, spec: RunnerSpec) -> None: ...


class Reports:
    """The `exod.host.supervisor.Listener` of every runner: reports in, events out."""

    def __init__(self, sink: Sink, wake: Callable[[], None] = lambda: None) -> None:
        """``wake``: the sink plans again (a runner missed its heartbeat)."""
        self.sink = sink
        self._wake = wake
        self.batching: dict[str, tuple[int, str]] = {}  # by runner id: what it decodes at once, and why

    def on_spawned(self, spec: RunnerSpec, pid: int) -> None:
        self.sink.process_started(spec, pid)

    def on_not_started(self, runner_id: str, incarnation: int, exc: Exception, *, host: bool = False) -> None:
        """A runner whose process could not be started: Failed, then gone. Out of fds or disk, or a node out of
        reach (``host``), is the host's failure (uncharged); anything else is charged like any spawn failure."""
        what = f"cannot start runner: {type(exc).__name__}: {exc}"
        host = host or (isinstance(exc, OSError) and exc.errno in p.HOST_ERRNOS)
        failure = fsm.Failure.host(what) if host else fsm.Failure(fsm.FailureKind.SPAWN, what)
        self.sink.runner_event(rn.Fail(runner_id, incarnation, failure=failure))
        self.sink.runner_event(rn.Exited(runner_id, incarnation, exit_code=1))

    def on_supervisor_error(self, spec: RunnerSpec, exc: Exception) -> None:
        """The supervisor of a started process failed (an I/O error): the runner's failure, never the daemon's."""
        failure = fsm.Failure(fsm.FailureKind.EXCEPTION, f"supervisor error: {type(exc).__name__}: {exc}")
        self.sink.runner_event(rn.Fail(spec.runner_id, spec.incarnation, failure=failure))
        self.sink.runner_event(rn.Exited(spec.runner_id, spec.incarnation, exit_code=1))

    def on_report(self, spec: RunnerSpec, report: p.Report) -> None:
        try:
            self._on_report(spec, report)
        except fsm.FsmError as exc:  # e.g. progress beyond the total: the report is wrong, the daemon goes on
            log.warning("report %s from %s/%d refused: %s", report, spec.runner_id, spec.incarnation, exc)

    def _on_report(self, spec: RunnerSpec, report: p.Report) -> None:
        rid, inc, event = spec.runner_id, spec.incarnation, self.sink.runner_event
        match report:
            case p.Batching(max_sequences=sequences, why=why):
                self.batching[rid] = (sequences, why)
                self.sink.requests.learned(rid, report.vocabulary)
            case p.Status(phase=p.Phase.JOINED):
                event(rn.Connected(rid, inc))
            case p.Status(phase=p.Phase.LOADED):
                event(rn.WeightsLoaded(rid, inc))
            case p.Status(phase=p.Phase.READY):
                event(rn.Warmed(rid, inc))
            case p.Progress(layers_loaded=done, layers_total=total) if total > 0:
                event(rn.Progress(rid, inc, layers_loaded=done, layers_total=total))
            case p.Failed(host=True):
                message = f"{report.exception_type}: {report.message}"
                failure = fsm.Failure.host(message, detail=report.traceback, exception_type=report.exception_type)
                event(rn.Fail(rid, inc, failure=failure))
            case p.Failed(peer=True):
                message = f"{report.exception_type}: {report.message}"
                failure = fsm.Failure.peer_lost(message, detail=report.traceback)
                event(rn.Fail(rid, inc, failure=self._poisoned(spec, failure)))
            case p.Failed():
                failure = fsm.Failure.exception(
                    report.exception_type, report.message, retryable=report.retryable, detail=report.traceback
                )
                event(rn.Fail(rid, inc, failure=self._poisoned(spec, failure)))
            case p.Pong():
                self.sink.cluster.heard(rid, inc, self.sink.now())
            case p.Token() | p.ToolCall() | p.Done() | p.Prompt() | p.Embedding():
                self.sink.requests.deliver(rid, report)
                if isinstance(report, p.Done):
                    event(rn.RequestFinished(rid, inc))
            case p.RequestError(request_id=request_id, message=message):
                if report.invalid:
                    self.sink.requests.refuse(
                        request_id,
                        message,
                        prompt_tokens=report.prompt_tokens,
                        context=report.context,
                        grammar=report.grammar,
                    )
                else:
                    self.sink.requests.cancel(request_id, message)
                event(rn.RequestFinished(rid, inc))

    def listened(self, spec: RunnerSpec, resumed: bool) -> None:
        """The controller listened to the runner until now (`exod.host.heartbeats`): if it has missed its
        heartbeat meanwhile, the sink plans (and fails it)."""
        if self.sink.cluster.listened(spec.runner_id, spec.incarnation, self.sink.now(), resumed=resumed):
            self._wake()

    def on_stall(self, spec: RunnerSpec, phase: str, seconds: float) -> None:
        failure = self._poisoned(spec, fsm.Failure.stalled(phase, seconds))
        self.sink.runner_event(rn.Fail(spec.runner_id, spec.incarnation, failure=failure))

    def on_exit(self, spec: RunnerSpec, exit_code: int, stderr_tail: str, stop_delivered: bool) -> None:
        self.sink.process_ended(spec)
        if not stop_delivered:  # a death: a poison request in its batch makes it the request's, said first
            failure = fsm.Failure.exited(exit_code, stderr_tail)
            if (poisoned := self._poisoned(spec, failure)) is not failure:
                self.sink.runner_event(rn.Fail(spec.runner_id, spec.incarnation, failure=poisoned))
        self.sink.runner_event(
            rn.Exited(
                spec.runner_id, spec.incarnation, exit_code=exit_code, detail=stderr_tail, stop_delivered=stop_delivered
            )
        )

    def _poisoned(self, spec: RunnerSpec, failure: fsm.Failure) -> fsm.Failure:
        """``failure``, a runner's death; or, when a request in its batch has now been at two deaths of its
        instance (`RequestBook.died`), the poison request's failure: uncharged, and it gives back the first's."""
        why = self.sink.requests.died(spec.runner_id, spec.incarnation)
        if why is None:
            return failure
        log.warning("runner %s/%d: %s: %s", spec.runner_id, spec.incarnation, failure.message, why)
        return fsm.Failure.poisoned(f"{failure.message}; a poison request: {why}", detail=failure.detail)
