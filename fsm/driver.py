"""The loop every supervisor of these machines writes, written once: plan → execute → hand over → take reports.

A `Driver` owns a `Cluster` and runs its loop with no I/O and no event loop of
its own, so that asyncio, trio and threads use it alike. `reconcile` reads the
caller's clock, lets time reach the machines, plans for its nodes, moves the
machines for each action (`Cluster.execute`) and then calls the matching handler
of the caller's `Adapter`, which *starts* the work (spawns a task, sends a
message, submits to a pool) and returns at once. How the work ends comes back
as reports, through the driver's methods (`report`, `published`, `downloaded`):
the contract of `fsm.owed`, which `owed` lists while it is outstanding.

A handler may return an awaitable (an ``async def`` handler): `reconcile` hands
those back in `Round.work` for the caller to await or schedule. asyncio takes the
awaitable itself (``asyncio.create_task(work)``); trio takes an async *function*,
never a coroutine object, so wrap it: ``nursery.start_soon(_await, work)`` with
``async def _await(w): await w``. Anything else a handler returns is ignored, but
for `Adapter.create_runner`, whose string return is the rank's ring endpoint.

A handler that raises does not end the loop: the action is reported failed
(`Round.failed` keeps the exception) and the machines hear of it as the world
would tell them: a runner's action fails that runner (``runner.Fail`` with the
exception as cause, charged like a crash: the plan stops it and its instance
retries), a download's fails the download (retried after its backoff); a
cancel or a kill that raised moves nothing (a kill is asked again while the
process lingers). An awaitable that raises later is the caller's to catch: the
driver never sees it run.

The caller calls `reconcile` after every report and at `next_wakeup`, and never
from two threads at once (the driver is not locked: one owner, like the machines).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

import attrs

from fsm import actions as act
from fsm import download as dl
from fsm import instance as inst
from fsm import runner as rn
from fsm._machine import Outcome
from fsm.cluster import Cluster
from fsm.errors import FsmError
from fsm.failure import Failure
from fsm.owed import Owed
from fsm.plan import next_deadline
from fsm.plan import plan as default_plan
from fsm.view import ClusterView, PendingRequest

Planner = Callable[[ClusterView, str, float], list[act.Action]]


class Adapter(Protocol):
    """The caller's side: one handler per action that starts work in the world. Each returns at once (or an
    awaitable); what it owes back is in the action's docstring and `fsm.owed`."""

    def create_runner(self, action: act.CreateRunner) -> str | Awaitable[Any] | None:
        """Start the process; return its ring endpoint if it is known at once (else report it by
        `Driver.published`)."""

    def stop_runner(self, action: act.StopRunner) -> Awaitable[Any] | None:
        """Ask the process to end (escalate if it lingers); `Driver.report` ``runner.Exited`` once it is reaped."""

    def start_download(self, action: act.StartDownload) -> Awaitable[Any] | None:
        """Fetch the model onto the node; `Driver.downloaded` when it ends, with ``error`` if it failed."""

    def connect_runner(self, action: act.ConnectRunner) -> Awaitable[Any] | None:
        """Tell the rank to join its ring (every endpoint is published); report ``runner.Connected`` once it has."""

    def load_model(self, action: act.LoadModel) -> Awaitable[Any] | None:
        """Tell the runner to read the weights; report ``runner.Progress`` as layers load (it feeds the
        watchdog) and ``runner.WeightsLoaded`` at the end."""

    def warm_up(self, action: act.WarmUp) -> Awaitable[Any] | None:
        """Tell the runner to run its warm-up; report ``runner.Warmed``, which makes it Ready."""

    def forward_request(self, action: act.ForwardRequest) -> Awaitable[Any] | None:
        """Send the request to this rank; report ``runner.RequestFinished`` when it ends, however it ends (the
        runner stays busy until then)."""

    def cancel_request(self, action: act.CancelRequest) -> Awaitable[Any] | None:
        """End the waiting request with an error carrying ``reason`` (its instance is gone); nothing is owed
        back, but your request book must drop it or it is planned again."""

    def kill_runner(self, action: act.KillRunner) -> Awaitable[Any] | None:
        """Only with a ``stop_grace`` limit (`fsm.watchdog`): SIGKILL the process a stop did not end."""


_HANDLER: dict[type, str] = {
    act.CreateRunner: "create_runner",
    act.StopRunner: "stop_runner",
    act.StartDownload: "start_download",
    act.ConnectRunner: "connect_runner",
    act.LoadModel: "load_model",
    act.WarmUp: "warm_up",
    act.ForwardRequest: "forward_request",
    act.CancelRequest: "cancel_request",
    act.KillRunner: "kill_runner",
}  # StartGeneration, RestartRank, DeleteInstance, ParkInstance, UnparkInstance, Fail*: machines only


@attrs.frozen
class Skipped:
    """An action the machines refused after it was planned (an earlier action of the same round moved them)."""

    action: act.Action
    reason: str
    error: FsmError | None = None  # the refusal, if the machines raised one


@attrs.frozen
class Round:
    """What one `Driver.reconcile` did: the actions taken, those skipped, the handlers' awaitables, whether
    the plan came out empty (False: ``max_rounds`` ran out first; the next call goes on), and the taken
    actions whose handler raised (`HandlerFailed`)."""

    now: float
    taken: tuple[act.Action, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    work: tuple[Awaitable[Any], ...] = ()
    settled: bool = True
    failed: tuple[HandlerFailed, ...] = ()


@attrs.frozen
class HandlerFailed:
    """An action whose handler raised: the loop went on, and ``reported`` is what the machines were told."""

    action: act.Action
    error: Exception
    reported: Outcome | None = None  # the runner's Fail or the download's failure; None: nothing to tell


class Driver:
    """Plan for ``nodes`` (a list, or a function giving them as they are now; every node a slot names, if not
    given) and execute through ``adapter``.

    ``before(action)``, if given, is the caller's last look before the machines move: it may change the
    cluster (move a generation's ranks off a dead node) or return False to skip the action this round.
    ``requests`` gives the requests waiting in the caller's request book (forwarded or cancelled by the plan).
    """

    def __init__(
        self,
        cluster: Cluster,
        adapter: Adapter,
        clock: Callable[[], float],
        *,
        nodes: Sequence[str] | Callable[[], Iterable[str]] | None = None,
        plan: Planner = default_plan,
        before: Callable[[act.Action], bool] | None = None,
        requests: Callable[[], Iterable[PendingRequest]] = tuple,
        max_rounds: int = 16,
    ) -> None:
        self.cluster, self.adapter, self.clock = cluster, adapter, clock
        self._nodes = nodes
        self._plan, self._before, self._requests, self._max_rounds = plan, before, requests, max_rounds

    @property
    def nodes(self) -> list[str]:
        """The nodes this driver plans for, as they are now (``nodes`` given, else every node a slot names)."""
        if callable(self._nodes):
            return list(self._nodes())
        if self._nodes is not None:
            return list(self._nodes)
        return sorted({slot.node_id for p in self.cluster.instances.values() for slot in p.slots})

    def view(self) -> ClusterView:
        """What the planner sees now, with the caller's waiting ``requests``: for a status page or a test."""
        return self.cluster.view(self._requests())

    # -- the loop ------------------------------------------------------------------------

    def reconcile(self) -> Round:
        """Plan and act until the plan is empty (or ``max_rounds`` rounds); see the module docstring."""
        now = self._now()
        for instance_id, placement in list(self.cluster.instances.items()):
            if not placement.machine.is_deleted:  # a backoff's end or a budget reset is seen when it comes
                self.cluster.instance_event(inst.Tick(instance_id, now))
        taken: list[act.Action] = []
        skipped: dict[act.Action, Skipped] = {}  # each once, however many rounds planned it again
        work: list[Awaitable[Any]] = []
        failed: list[HandlerFailed] = []
        stalled: list[act.Action] | None = None  # the last plan, if none of it was taken
        for _ in range(self._max_rounds):
            view = self.view()
            actions = [action for node in self.nodes for action in self._plan(view, node, now)]
            if not actions or actions == stalled:  # done, or nothing taken and nothing changed since
                break
            took = False
            for action in actions:
                try:  # the view may have moved under a later action of the round: the machines refuse it
                    if self._before is not None and not self._before(action):
                        skipped[action] = Skipped(action, "held back by the caller")
                        continue
                    outcome = self.cluster.execute(action, self._now())  # the caller's last look took time
                except FsmError as exc:
                    skipped[action] = Skipped(action, str(exc), exc)
                    continue
                if not outcome.accepted:
                    skipped[action] = Skipped(action, outcome.note or "not accepted")
                    continue
                took = True
                taken.append(action)
                try:
                    done = self._dispatch(action)
                except Exception as exc:  # the adapter's bug or the world's refusal: the loop goes on
                    failed.append(HandlerFailed(action, exc, self._handler_failed(action, exc)))
                    continue
                if done is not None:
                    work.append(done)
            stalled = None if took else actions  # a caller's last look may have changed the cluster: plan again
        else:
            return Round(now, tuple(taken), tuple(skipped.values()), tuple(work), False, tuple(failed))
        return Round(now, tuple(taken), tuple(skipped.values()), tuple(work), True, tuple(failed))

    def _handler_failed(self, action: act.Action, exc: Exception) -> Outcome | None:
        """Tell the machines what a raising handler means (see the module docstring)."""
        if isinstance(action, act.StartDownload):
            return self.downloaded(action.node_id, action.model_id, error=f"{type(exc).__name__}: {exc}")
        if isinstance(action, (act.CancelRequest, act.KillRunner)):
            return None
        runner_id, incarnation = getattr(action, "runner_id", None), getattr(action, "incarnation", None)
        if runner_id is None or incarnation is None:
            return None
        cause = Failure.exception(type(exc).__name__, f"the adapter's {_HANDLER[type(action)]} raised: {exc}")
        return self.report(rn.Fail(runner_id, incarnation, failure=cause))

    def _dispatch(self, action: act.Action) -> Awaitable[Any] | None:
        name = _HANDLER.get(type(action))
        if name is None:
            return None
        result = getattr(self.adapter, name)(action)
        if isinstance(action, act.CreateRunner) and isinstance(result, str):
            self.cluster.publish(action.runner_id, action.incarnation, result)
            return None
        return result if inspect.isawaitable(result) else None

    def next_wakeup(self) -> float | None:
        """When to call `reconcile` again if no report comes first (None: only a report or a placement will)."""
        view = self.view()
        now = self._now()
        return min((t for n in self.nodes if (t := next_deadline(view, n, now)) is not None), default=None)

    def _now(self) -> float:
        """The clock's reading, never earlier than one the cluster has seen: a clock that stepped back stands
        still until it catches up (`fsm.clock`), for the plan as for the machines."""
        now, seen = self.clock(), self.cluster.now_seen
        return now if seen is None or now >= seen else seen

    def owed(self) -> list[Owed]:
        """The reports the cluster waits for (`fsm.owed`)."""
        return self.cluster.owed()

    # -- reports -------------------------------------------------------------------------

    def report(self, event: rn.RunnerEvent) -> Outcome:
        """A runner's report (``runner.Connected``, ``Exited``, ``Fail`` …), at the clock's now."""
        return self.cluster.runner_event(event, self._now())

    def published(self, runner_id: str, incarnation: int, endpoint: str) -> bool:
        """A rank's ring endpoint (HOST:PORT); False if that incarnation is gone."""
        return self.cluster.publish(runner_id, incarnation, endpoint)

    def downloaded(self, node_id: str, model_id: str, *, error: str | None = None) -> Outcome:
        """A download ended: complete, or failed with ``error`` (retried after its backoff)."""
        now = self._now()
        event = dl.Complete(model_id, now) if error is None else dl.DownloadFailed(model_id, now, error)
        return self.cluster.download_event(node_id, event)
