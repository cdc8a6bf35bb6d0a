"""The planner: the state-triggered half of the system.

``plan(view, node_id, now)`` looks at a snapshot of the whole cluster and
returns every action this node should take now, in priority order::

    cancel requests → stop runners → watch phases and heartbeats → park idle instances → give up at the cap
    → unpark wanted instances → start generations → restart ranks → downloads → create runners → connect → load
    → warm up → forward requests

Each rule is one function, named after the rule, that reads the view and
yields actions; none of them sees the others' output. Returning all enabled
actions (exo returns one per tick) means a blocked rule never starves the
rest. The function is pure: same view, node and ``now`` → same list.

The rules carried over from exo's two fixes, by function:

* ``_stop_runners`` — a Failed runner is stopped (never revived); a runner is
  stopped when a sibling of its generation failed; runners of deleted
  instances, of stale generations and of recovering instances are stopped.
* ``_give_up_at_cap`` — at the retry cap the action is DeleteInstance, not a
  creation.
* ``_create_runners`` — no runner is created before its model is on its node
  (exo's order: a process is never started for a model that may never come);
  nor while a sibling is Failed unless ours failed too (both-failed proceeds:
  neither waits for the other); nor before the backoff deadline; nor while any
  runner of an older generation is still alive.
* ``_restart_ranks`` — one_for_one: a failed rank is started again alone, once
  its process is reaped and its own backoff has elapsed; its siblings are
  neither stopped nor waited for (``_stop_runners`` stops the failed one only,
  ``_forward_requests`` sends each request to one Ready replica).
* ``_download_models`` — a failed download is retried once its per-model
  backoff has elapsed; a local placement (its files on its nodes already)
  downloads nothing.

And the residency rules (`fsm.instance`, "Residency"):

* ``_park_idle`` — a Ready instance nobody used for its keep-alive is parked,
  never one with a request in flight or waiting for it.
* ``_unpark_wanted`` — a parked instance with a request waiting is unparked
  (the caller may hold it back until `fsm.admit_unpark` finds it memory).
* ``_create_runners`` — no runner starts on a node where an instance is
  still parking, or deleted with a process still alive: the memory it frees
  is not free until its processes are gone.
"""

from __future__ import annotations

from collections.abc import Iterator

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
from fsm.download import DownloadState
from fsm.instance import DeleteReason, InstanceState, budget_exhausted
from fsm.runner import RunnerPhase, RunnerState
from fsm.view import ClusterView, InstanceView, RunnerStatus, slot_of

_TEARDOWN = (InstanceState.RECOVERING, InstanceState.BACKING_OFF)
_PARKED = (InstanceState.PARKING, InstanceState.PARKED)


def plan(view: ClusterView, node_id: str, now: float) -> list[Action]:
    """Every action ``node_id`` should take at ``now``, highest priority first.

    Nothing to do and no `next_deadline` means the cluster waits on its caller: a report owed for work an
    action started (`fsm.owed`, `Cluster.owed`), a placement, or a request. Each action's docstring says what
    executing it owes.
    """
    return [
        *_cancel_requests(view, node_id),
        *_stop_runners(view, node_id),
        *_watch_phases(view, node_id, now),
        *_park_idle(view, node_id, now),
        *_give_up_at_cap(view, node_id),
        *_unpark_wanted(view, node_id),
        *_start_generations(view, node_id, now),
        *_restart_ranks(view, node_id, now),
        *_download_models(view, node_id, now),
        *_create_runners(view, node_id, now),
        *_connect_runners(view, node_id),
        *_load_models(view, node_id),
        *_warm_up_runners(view, node_id),
        *_forward_requests(view, node_id),
    ]


def next_deadline(view: ClusterView, node_id: str, now: float) -> float | None:
    """The earliest time after ``now`` at which time alone changes something: ``plan``'s answer, or a budget
    reset coming due (so that it is observed, and shown, when it happens rather than at the next event)."""
    times = [
        inst.retry.deadline
        for inst in view.instances.values()
        if inst.retry.state in (InstanceState.BACKING_OFF, InstanceState.STARTING) and node_id in inst.nodes
    ]
    times += [
        deadline
        for inst in view.instances.values()
        if inst.retry.state is InstanceState.DEGRADED and inst.leader == node_id
        for _, deadline in inst.retry.rank_deadlines
    ]
    times += [inst.retry.reset_due for inst in view.instances.values() if node_id in inst.nodes]
    times += [inst.park_at for inst in view.instances.values() if inst.leader == node_id]
    times += [
        d.retry_at for (node, _), d in view.downloads.items() if node == node_id and d.state is DownloadState.FAILED
    ]
    times += [deadline for r in view.runners.values() if r.node_id == node_id and (deadline := _watched(view, r))]
    future = [t for t in times if t is not None and t > now]
    return min(future, default=None)


# -- helpers -------------------------------------------------------------------------


def _current(view: ClusterView, inst: InstanceView) -> list[RunnerStatus | None]:
    """The runner of each rank in the rank's current generation (None: not created yet)."""
    gen = inst.retry.rank_generation
    return [r if r is not None and r.incarnation == gen(s.rank) else None for s, r in view.slot_runners(inst)]


def _model_on(view: ClusterView, node_id: str, inst: InstanceView) -> bool:
    if inst.local:
        return True
    download = view.download(node_id, inst.model_id)
    return download is not None and download.state is DownloadState.COMPLETED


def _exhausted(inst: InstanceView) -> bool:
    return budget_exhausted(inst.retry.attempts, inst.retry.max_failures)


def _our_current_runners(view: ClusterView, inst: InstanceView, node_id: str) -> Iterator[RunnerStatus]:
    for slot, runner in zip(inst.slots, _current(view, inst), strict=True):
        if slot.node_id == node_id and runner is not None and runner.alive and not runner.stop_requested:
            yield runner


# -- rules, in priority order ---------------------------------------------------------


def _cancel_requests(view: ClusterView, node_id: str) -> Iterator[Action]:
    """Requests for an instance that is gone end with an error, never a hang: the nodes hosting it end them
    (a request for an instance no node hosts any more is ended by whichever node plans first)."""
    for req in view.requests:
        inst = view.instances.get(req.instance_id)
        if inst is None:
            yield CancelRequest(req.request_id, req.instance_id, "instance does not exist")
        elif inst.retry.state is InstanceState.DELETED and node_id in inst.nodes:
            reason = inst.retry.delete_reason.value if inst.retry.delete_reason else "deleted"
            yield CancelRequest(req.request_id, req.instance_id, f"instance was deleted ({reason})")


def _stop_reason(view: ClusterView, runner: RunnerStatus) -> StopReason | None:
    inst = view.instances.get(runner.instance_id)
    if inst is None or inst.retry.state is InstanceState.DELETED:
        return StopReason.INSTANCE_GONE
    slot = slot_of(inst.slots, runner.runner_id)
    if slot is None:
        return StopReason.INSTANCE_GONE  # in no slot of its instance: nothing would ever stop it otherwise
    if runner.state is RunnerState.FAILED:
        return StopReason.RUNNER_FAILED
    if runner.incarnation < inst.retry.rank_generation(slot.rank):
        return StopReason.STALE_GENERATION
    if inst.retry.state in _PARKED:
        return StopReason.PARKED
    if inst.retry.state in _TEARDOWN:
        return StopReason.RECOVERING
    if inst.retry.one_for_one:
        return None  # replicas: a sibling's failure is none of this runner's business
    for _, sibling in view.slot_runners(inst):
        if (
            sibling is not None
            and sibling.runner_id != runner.runner_id
            and sibling.incarnation == runner.incarnation
            and sibling.failed
        ):
            return StopReason.SIBLING_FAILED
    return None


def _stop_runners(view: ClusterView, node_id: str) -> Iterator[Action]:
    for runner in view.runners.values():
        if runner.node_id != node_id or not runner.alive or runner.stop_requested:
            continue
        reason = _stop_reason(view, runner)
        if reason is not None:
            yield StopRunner(runner.runner_id, runner.incarnation, reason)


def _watched(view: ClusterView, runner: RunnerStatus) -> float | None:
    """When the runner's time in its phase runs out (`fsm.watchdog`); None if it is not watched now."""
    if runner.stop_requested:
        limit = view.limits.stop_grace
    elif runner.state is RunnerState.FAILED:
        return None  # `_stop_runners` stops it now
    else:
        limit = view.limits.for_phase(runner.phase)
    if limit is None or runner.since is None or runner.killed:
        return None
    return runner.since + limit


def _missed(view: ClusterView, runner: RunnerStatus) -> float | None:
    """Seconds the runner's process has been silent, if it missed its heartbeat while its caller listened
    (`fsm.watchdog`; the caller's `Cluster.listened` says when, not time alone); None if it did not, or is not
    watched now: failed, asked to stop (the stop's grace watches it), or no heartbeat answered yet."""
    if not runner.alive or runner.failed or runner.stop_requested:
        return None
    return view.limits.missed(runner.phase, runner.liveness, runner.since)


def _watch_phases(view: ClusterView, node_id: str, now: float) -> Iterator[Action]:
    """A runner silent in its phase past the limit fails as stalled, and so does one whose process answers no
    heartbeat; one outliving its stop's grace is killed."""
    for runner in view.runners.values():
        if runner.node_id != node_id or not runner.alive:
            continue
        silent = _missed(view, runner)
        if silent is not None:
            yield FailUnresponsive(runner.runner_id, runner.incarnation, silent)
            continue
        deadline = _watched(view, runner)
        if deadline is None or now < deadline:
            continue
        assert runner.since is not None
        if runner.stop_requested:
            yield KillRunner(runner.runner_id, runner.incarnation)
        else:
            assert runner.phase is not None
            yield FailStalled(runner.runner_id, runner.incarnation, runner.phase.value, deadline - runner.since)


def _give_up_at_cap(view: ClusterView, node_id: str) -> Iterator[Action]:
    """At the cap the instance is deleted instead of started again (by any node hosting it)."""
    waiting = (InstanceState.PENDING, InstanceState.STARTING, InstanceState.BACKING_OFF, InstanceState.DEGRADED)
    for inst in view.instances.values():
        if node_id in inst.nodes and inst.retry.state in waiting and _exhausted(inst):
            yield DeleteInstance(inst.instance_id, DeleteReason.RETRIES_EXHAUSTED)


def _busy(view: ClusterView, inst: InstanceView) -> bool:
    """A request is in flight on the instance's runners, or waits for it."""
    in_flight = any(r is not None and r.alive and r.in_flight for _, r in view.slot_runners(inst))
    return in_flight or any(req.instance_id == inst.instance_id for req in view.requests)


def _park_idle(view: ClusterView, node_id: str, now: float) -> Iterator[Action]:
    """The leader parks a Ready instance nobody used for its keep-alive (never one with a request)."""
    for inst in view.instances.values():
        park_at = inst.park_at
        if inst.leader == node_id and park_at is not None and now >= park_at and not _busy(view, inst):
            yield ParkInstance(inst.instance_id, ParkReason.IDLE)


def _unpark_wanted(view: ClusterView, node_id: str) -> Iterator[Action]:
    """The leader unparks a parked instance a request waits for."""
    wanted = {req.instance_id for req in view.requests}
    for inst in view.instances.values():
        if inst.leader == node_id and inst.retry.state is InstanceState.PARKED and inst.instance_id in wanted:
            yield UnparkInstance(inst.instance_id)


def _start_generations(view: ClusterView, node_id: str, now: float) -> Iterator[Action]:
    """The leader starts generation 1, and each later one once its backoff deadline has passed."""
    for inst in view.instances.values():
        if inst.leader != node_id or _exhausted(inst):
            continue
        retry = inst.retry
        backoff_over = (
            retry.state is InstanceState.BACKING_OFF
            and (retry.deadline is None or now >= retry.deadline)
            and not any(r is not None and r.alive for _, r in view.slot_runners(inst))
        )
        if retry.state is InstanceState.PENDING or backoff_over:
            yield StartGeneration(inst.instance_id, retry.generation + 1)


def _restart_ranks(view: ClusterView, node_id: str, now: float) -> Iterator[Action]:
    """one_for_one: the leader starts a failed rank again once its process is reaped and its backoff is over;
    one a round, for each takes the instance's next generation number."""
    for inst in view.instances.values():
        if inst.leader != node_id or inst.retry.state is not InstanceState.DEGRADED or _exhausted(inst):
            continue
        statuses, deadlines = dict(view.slot_runners(inst)), dict(inst.retry.rank_deadlines)
        for slot in inst.slots:
            deadline, runner = deadlines.get(slot.rank), statuses[slot]
            if deadline is not None and now >= deadline and (runner is None or not runner.alive):
                yield RestartRank(inst.instance_id, slot.rank, inst.retry.generation + 1)
                break


def _freeing(view: ClusterView, inst: InstanceView, node_id: str) -> bool:
    """Whether ``inst`` holds memory on ``node_id`` that admission counts as free already: it is parking there,
    or it is deleted with a process still alive there."""
    if inst.retry.state is InstanceState.PARKING:
        return node_id in inst.nodes
    deleted = inst.retry.state is InstanceState.DELETED
    return deleted and any(r is not None and r.alive and r.node_id == node_id for _, r in view.slot_runners(inst))


def _create_runners(view: ClusterView, node_id: str, now: float) -> Iterator[Action]:
    for inst in view.instances.values():
        if inst.retry.one_for_one:
            yield from _create_replicas(view, node_id, inst)
            continue
        retry = inst.retry
        if retry.state is not InstanceState.STARTING or _exhausted(inst):
            continue
        if retry.deadline is not None and now < retry.deadline:
            continue  # gated by the backoff
        statuses = dict(view.slot_runners(inst))
        if any(r is not None and r.alive and r.incarnation < retry.generation for r in statuses.values()):
            continue  # never two generations alive at once
        if not _model_on(view, node_id, inst):
            continue  # the instance waits for its download; `_download_models` is fetching it
        if any(_freeing(view, o, node_id) for o in view.instances.values()):
            continue  # the memory a parking (or deleted) instance frees here is free once its processes are gone
        for slot, ours in statuses.items():
            if slot.node_id != node_id or (ours is not None and ours.incarnation >= retry.generation):
                continue
            sibling_failed = any(
                r is not None and r.failed for s, r in statuses.items() if s.runner_id != slot.runner_id
            )
            we_failed_before = ours is not None and ours.failed
            if sibling_failed and not we_failed_before:
                continue  # wait for the failed sibling to come back first
            yield CreateRunner(
                instance_id=inst.instance_id,
                runner_id=slot.runner_id,
                node_id=node_id,
                rank=slot.rank,
                world_size=inst.world_size,
                incarnation=retry.generation,
                model_id=inst.model_id,
            )


def _create_replicas(view: ClusterView, node_id: str, inst: InstanceView) -> Iterator[Action]:
    """one_for_one: each slot of ours without a process of its rank's generation gets one, a world of its own,
    once no older process of that slot is alive (two of one rank never run at once). No backoff gate here:
    a rank restarts only past its deadline (`_restart_ranks`), and a whole generation only past the
    instance's (`_start_generations`)."""
    if inst.retry.state not in (InstanceState.STARTING, InstanceState.DEGRADED) or _exhausted(inst):
        return
    if not _model_on(view, node_id, inst):
        return
    if any(_freeing(view, o, node_id) for o in view.instances.values()):
        return  # the memory a parking (or deleted) instance frees here is free once its processes are gone
    for slot, ours in view.slot_runners(inst):
        generation = inst.retry.rank_generation(slot.rank)
        if slot.node_id != node_id or (ours is not None and (ours.incarnation >= generation or ours.alive)):
            continue
        yield CreateRunner(
            instance_id=inst.instance_id,
            runner_id=slot.runner_id,
            node_id=node_id,
            rank=0,
            world_size=1,
            incarnation=generation,
            model_id=inst.model_id,
        )


def _download_models(view: ClusterView, node_id: str, now: float) -> Iterator[Action]:
    wanted = sorted(
        {
            inst.model_id
            for inst in view.instances.values()
            if node_id in inst.nodes and inst.retry.state not in (InstanceState.DELETED, *_PARKED) and not inst.local
        }
    )
    for model_id in wanted:
        status = view.download(node_id, model_id)
        never_started = status is None or status.state is DownloadState.PENDING
        retry_due = (
            status is not None
            and status.state is DownloadState.FAILED
            and (status.retry_at is None or now >= status.retry_at)
        )
        if never_started or retry_due:
            yield StartDownload(node_id, model_id)


def _connect_runners(view: ClusterView, node_id: str) -> Iterator[Action]:
    """Ranks below the last join first; the last rank joins once all others are connecting."""
    for inst in view.instances.values():
        if inst.retry.state is not InstanceState.STARTING or inst.world_size == 1 or inst.retry.one_for_one:
            continue
        current = _current(view, inst)
        if any(r is None or r.state not in (RunnerState.IDLE, RunnerState.CONNECTING) for r in current):
            continue
        if any(r is not None and r.endpoint is None for r in current):  # the ring is not known to every rank yet
            continue
        last = inst.world_size - 1
        for runner in _our_current_runners(view, inst, node_id):
            if runner.state is not RunnerState.IDLE:
                continue
            others_connecting = all(
                r is not None and r.state is RunnerState.CONNECTING for r in current if r.rank != runner.rank
            )
            if runner.rank < last or others_connecting:
                yield ConnectRunner(runner.runner_id, runner.incarnation)


def _load_models(view: ClusterView, node_id: str) -> Iterator[Action]:
    """Load once every node of the instance has the model, and every rank has joined."""
    for inst in view.instances.values():
        if inst.retry.one_for_one:
            yield from _load_replicas(view, node_id, inst)
            continue
        if inst.retry.state is not InstanceState.STARTING:
            continue
        if not all(_model_on(view, node, inst) for node in inst.nodes):
            continue
        current = _current(view, inst)
        all_joined = all(
            r is not None and (r.phase is RunnerPhase.JOINED or r.state is RunnerState.LOADING) for r in current
        )
        for runner in _our_current_runners(view, inst, node_id):
            single = inst.world_size == 1 and runner.state is RunnerState.IDLE
            group = inst.world_size > 1 and runner.phase is RunnerPhase.JOINED and all_joined
            if single or group:
                yield LoadModel(runner.runner_id, runner.incarnation, inst.model_id)


def _load_replicas(view: ClusterView, node_id: str, inst: InstanceView) -> Iterator[Action]:
    """one_for_one: a replica loads as soon as it is created, on its own node's copy of the model."""
    if inst.retry.state in (InstanceState.STARTING, InstanceState.DEGRADED) and _model_on(view, node_id, inst):
        for runner in _our_current_runners(view, inst, node_id):
            if runner.state is RunnerState.IDLE:
                yield LoadModel(runner.runner_id, runner.incarnation, inst.model_id)


def _warm_up_runners(view: ClusterView, node_id: str) -> Iterator[Action]:
    """Ranks > 0 warm up when all ranks are loaded or warming; rank 0 when all others are warming.

    Both read "or already past it" (Ready): a rank that finished warming alone must not block the rest.
    """
    loaded_or_warming = (RunnerPhase.LOADED, RunnerPhase.WARMING_UP, RunnerPhase.AVAILABLE, RunnerPhase.BUSY)
    for inst in view.instances.values():
        if inst.retry.one_for_one and inst.retry.state in (InstanceState.STARTING, InstanceState.DEGRADED):
            for runner in _our_current_runners(view, inst, node_id):
                if runner.phase is RunnerPhase.LOADED:
                    yield WarmUp(runner.runner_id, runner.incarnation)  # a replica waits for nobody
            continue
        if inst.retry.state is not InstanceState.STARTING:
            continue
        current = _current(view, inst)
        for runner in _our_current_runners(view, inst, node_id):
            if runner.phase is not RunnerPhase.LOADED:
                continue
            others = [r for r in current if r is None or r.rank != runner.rank]
            if runner.rank == 0:
                ok = all(
                    r is not None and (r.phase is RunnerPhase.WARMING_UP or r.state is RunnerState.READY)
                    for r in others
                )
            else:
                ok = all(r is not None and r.phase in loaded_or_warming for r in current)
            if ok:
                yield WarmUp(runner.runner_id, runner.incarnation)


def _forward_requests(view: ClusterView, node_id: str) -> Iterator[Action]:
    """A request goes to every rank on this node once all ranks of its instance are Ready; to a one_for_one
    instance's, it goes to one Ready replica, the waiting requests spread over them (fewest in flight first),
    while any replica is Ready."""
    replicas = _ready_replicas(view)
    handed: dict[str, int] = {}
    for req in view.requests:
        inst = view.instances.get(req.instance_id)
        if inst is not None and inst.instance_id in replicas:
            ready = replicas[inst.instance_id]
            if ready:
                turn = handed.get(inst.instance_id, 0)
                handed[inst.instance_id] = turn + 1
                runner = ready[turn % len(ready)]
                if runner.node_id == node_id:
                    yield ForwardRequest(req.request_id, runner.runner_id, runner.incarnation)
            continue
        if inst is None or inst.retry.state is not InstanceState.READY:
            continue
        current = _current(view, inst)
        if all(r is not None and r.state is RunnerState.READY for r in current):
            for runner in _our_current_runners(view, inst, node_id):
                yield ForwardRequest(req.request_id, runner.runner_id, runner.incarnation)


def _ready_replicas(view: ClusterView) -> dict[str, list[RunnerStatus]]:
    """Each one_for_one instance that serves (Ready or Degraded) with its Ready replicas, fewest requests in
    flight first (then by rank): every node computes the same order, so each request reaches one replica."""
    serving = (InstanceState.READY, InstanceState.DEGRADED)
    replicas: dict[str, list[RunnerStatus]] = {}
    for inst in view.instances.values():
        if inst.retry.one_for_one and inst.retry.state in serving:
            ready = [
                (r.in_flight, rank, r)
                for rank, r in enumerate(_current(view, inst))
                if r is not None and r.state is RunnerState.READY and r.alive and not r.stop_requested
            ]
            replicas[inst.instance_id] = [r for _, _, r in sorted(ready, key=lambda t: t[:2])]
    return replicas
