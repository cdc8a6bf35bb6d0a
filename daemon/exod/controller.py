"""The controller: the imperative shell around `fsm.cluster.Cluster`.

It owns every machine (through the cluster), runs `fsm.plan` whenever anything
changes — a report from a runner, a process exit, a download, a placement —
and at the next deadline `fsm.next_deadline` names; never on a fixed tick.
Each action is applied to the machines first (`Cluster.execute`) and then
carried out: a supervisor spawned, a command posted, a download started. What
the world answers comes back as events through the `Listener` callbacks.

Every change of the machines is written to the store, with its log entries,
before the controller waits again: what a caller was told is on disk.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio

import fsm
from exod import protocol as p
from exod.faults import FaultSpec
from exod.models import ModelNotFound, resolve_local_dir, resolve_model, validate_model_id
from exod.orphans import reap_orphans, start_ticks
from exod.store import ProcessRecord, Store
from exod.supervisor import RunnerSpec, Supervisor, Timeouts
from fsm import download as dl
from fsm import runner as rn
from fsm.cluster import Cluster

log = logging.getLogger("exod.controller")

NODE = "local"  # every rank of an instance runs on this machine, over loopback
MAX_PLAN_ROUNDS = 64  # one change rarely needs more than a handful of plan → execute rounds
KEEP_DELETED = 32  # deleted instances kept for `status` before they are forgotten


class InstanceNotFound(LookupError):
    """No such instance (or it was deleted)."""


class RequestFailed(Exception):
    """A generation request ended with an error (runner failed, instance deleted, bad request)."""


class InvalidRequest(ValueError):
    """A request the runner could not decode (caught before it is sent)."""


class QueueTimeout(RequestFailed):
    """No Ready runner took the request in time (HTTP 503)."""


class Overloaded(Exception):
    """The instance's request queue is full."""


class ModelNotReady(Exception):
    """The model is placed but no instance of it is Ready yet."""

    def __init__(self, model_id: str, retry_after: int) -> None:
        self.model_id = model_id
        self.retry_after = retry_after
        super().__init__(f"model {model_id!r} has no Ready instance yet; retry in {retry_after} s")


@attrs.frozen
class DaemonConfig:
    state_dir: Path
    hf_home: Path | None = None
    offline: bool | None = None  # None: HF_HUB_OFFLINE decides; the hub is tried and fails fast otherwise
    timeouts: Timeouts = attrs.Factory(Timeouts)
    policy: fsm.RetryPolicy = attrs.Factory(fsm.RetryPolicy)
    download_policy: fsm.Backoff = fsm.DEFAULT_DOWNLOAD_BACKOFF
    download_timeout: float = 30.0  # seconds without a byte before a download is given up (and retried)
    max_requests_per_instance: int = 16  # in flight + queued; beyond it: Overloaded (HTTP 429)
    queue_timeout: float = 30.0  # a request no Ready runner took by then fails instead of waiting on
    faults: tuple[FaultSpec, ...] = ()  # injected faults, for tests (exod.faults); empty in production

    @property
    def db_path(self) -> Path:
        return self.state_dir / "state.db"


@attrs.define
class _Request:
    instance_id: str
    command: p.Generate
    channel: trio.MemorySendChannel[Any]
    leader: str = ""  # runner id of rank 0 once forwarded
    incarnation: int = -1
    forwarded: trio.Event = attrs.Factory(trio.Event)
    abandoned: bool = False  # the caller went away; still counted until the runners are done with it


class RequestStream:
    """The tokens of one request, then its `Done`; raises `RequestFailed` if it cannot finish."""

    def __init__(self, controller: Controller, request_id: str, request: _Request, receive: Any) -> None:
        self.controller = controller
        self.request_id = request_id
        self._request = request
        self._receive = receive
        self._done = False
        self._last: Any = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> p.Token | p.Done:
        if self._done:
            raise StopAsyncIteration
        await self.wait_forwarded()
        item = await self._receive.receive()
        self._last = item
        if isinstance(item, Exception):
            self._done = True
            raise item
        if isinstance(item, p.Done):
            self._done = True
        return item

    def close(self) -> None:
        """The caller is done. A request the runners are still working on stays counted until they finish:
        ranks generate in lockstep and cannot drop it one-sidedly, and the queue bound must hold."""
        finished = self._done and not isinstance(self._last, Exception)
        self._done = True
        if self._request.forwarded.is_set() and not finished and self._request.leader:
            self._request.abandoned = True
        else:
            self.controller._forget_request(self.request_id)

    async def wait_forwarded(self) -> None:
        """Until a Ready runner took the request; `QueueTimeout` after the configured wait."""
        if self._request.forwarded.is_set():
            return
        limit = self.controller.config.queue_timeout
        with trio.move_on_after(limit):
            await self._request.forwarded.wait()
        if not self._request.forwarded.is_set():
            self._done = True
            raise QueueTimeout(f"no Ready runner took the request within {limit:g} s; retry later")


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Controller:
    def __init__(self, config: DaemonConfig, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.store = store
        self.clock = clock  # wall time: deadlines are persisted and must mean the same after a restart
        self.cluster = Cluster(download_policy=config.download_policy)
        self._supervisors: dict[tuple[str, int], Supervisor] = {}
        self._requests: dict[str, _Request] = {}
        self._model_paths: dict[str, Path] = {}
        self.local_models: dict[str, Path] = {}  # "local/NAME" -> directory, from the config or CLI only
        self._wake = trio.Event()
        self._stopping = False
        self._all_stopped = trio.Event()
        self.log_written = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.reaped_orphans: list[ProcessRecord] = []
        self.failure_counts: collections.Counter[str] = collections.Counter()  # by FailureKind value

    # -- lifecycle of the controller --------------------------------------------------------

    def restore(self) -> None:
        """Load the last state, kill the runners a previous daemon left, and make the machines say so."""
        snapshot = self.store.load()
        if snapshot is not None:
            self.cluster = Cluster.from_dict(snapshot, download_policy=self.config.download_policy)
        self.reaped_orphans = reap_orphans(self.store.processes())
        for record in self.store.processes():
            self.store.forget_process(record.runner_id, record.incarnation)
        now = self.clock()
        self.cluster.recover(now)
        for (node, model_id), machine in self.cluster.downloads.items():
            if machine.download_state is fsm.DownloadState.ONGOING:
                self.cluster.download_event(node, dl.DownloadFailed(model_id, now, "interrupted by a daemon restart"))
        self._commit()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Plan and act until cancelled; cancelling stops and reaps every runner."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                self._act()
                now = self.clock()
                deadline = self._next_wake(now)
                with trio.move_on_after(math.inf if deadline is None else max(0.0, deadline - now)):
                    await self._wake.wait()
                self._wake = trio.Event()

    def _next_wake(self, now: float) -> float | None:
        """The planner's next deadline, or a budget reset coming due (so `status` shows it when it happens)."""
        times = [fsm.next_deadline(self.cluster.view(), NODE, now)]
        for placement in self.cluster.instances.values():
            m = placement.machine
            if m.instance_state is fsm.InstanceState.READY and m.attempts and m.ready_since is not None:
                times.append(m.ready_since + m.policy.reset_after)
        future = [t for t in times if t is not None and t > now]
        return min(future, default=None)

    async def shutdown(self) -> None:
        """Stop every runner the graceful way (ask → grace → SIGTERM → SIGKILL) and wait for them all.

        The machines are left as they were: at the next start, `restore` resumes each live instance with a
        fresh generation, charging no retry, exactly as after a crash.
        """
        self._stopping = True
        if not self._supervisors:
            return
        for supervisor in list(self._supervisors.values()):
            supervisor.stop()
        t = self.config.timeouts
        with trio.move_on_after(t.stop_grace + t.term_grace + 2.0):
            await self._all_stopped.wait()

    def _changed(self) -> None:
        self._commit()
        self._wake.set()

    def _commit(self) -> None:
        if self.cluster.log:
            self.store.save(self.cluster.to_dict(), self.cluster.log, self.clock())
            self.cluster.log.clear()
            self.log_written.set()  # wakes the event streams; each waits on a fresh Event next time
            self.log_written = trio.Event()

    # -- the API the daemon's front ends use ----------------------------------------------------

    def place(self, model_id: str, ranks: int, *, policy: fsm.RetryPolicy | None = None) -> str:
        """Place ``model_id`` on ``ranks`` local ranks; returns the instance id once it is on disk."""
        validate_model_id(model_id)
        if model_id.startswith("local/") and model_id not in self.local_models:
            raise fsm.InvalidConfig(
                f"{model_id}: local model directories are placed from the config file or `exod serve --place` only"
            )
        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 64:
            raise fsm.InvalidConfig(f"ranks must be an int between 1 and 64, got {ranks!r}")
        instance_id = f"{model_id.split('/')[-1]}-{secrets.token_hex(3)}"
        slots = [fsm.Slot(rank, NODE, f"{instance_id}/{rank}") for rank in range(ranks)]
        self.cluster.place(instance_id, model_id, slots, policy=policy or self.config.policy)
        self.cluster.log.append(fsm.cluster.LogEntry(self.clock(), "instance", instance_id, "place", "", "pending"))
        self._changed()
        return instance_id

    def register_local_model(self, directory: Path) -> str:
        """Name a local model directory ``local/NAME`` so it can be placed; never reachable from the API."""
        path = resolve_local_dir(directory)
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", path.name).strip(".-") or "model"
        model_id = f"local/{name}"
        if self.local_models.get(model_id, path) != path:
            raise fsm.InvalidConfig(f"two local model directories are both named {name!r}: rename one")
        self.local_models[model_id] = path
        return model_id

    def delete(self, instance_id: str) -> None:
        if instance_id not in self.cluster.instances:
            raise InstanceNotFound(f"no instance {instance_id!r}; `exod status` lists them")
        self.cluster.delete(instance_id, self.clock())
        self._changed()

    def pick_instance(self, model_id: str) -> str:
        """The Ready instance of ``model_id`` with the fewest requests; `ModelNotReady` says when to retry."""
        live = [
            (iid, pl)
            for iid, pl in self.cluster.instances.items()
            if pl.model_id == model_id and not pl.machine.is_deleted
        ]
        if not live:
            raise InstanceNotFound(f"model {model_id!r} is not placed; place it with `exod place {model_id}`")
        ready = [iid for iid, pl in live if pl.machine.instance_state is fsm.InstanceState.READY]
        if ready:
            return min(ready, key=lambda iid: (self._load(iid), iid))
        now = self.clock()
        waits = [pl.machine.deadline - now for _, pl in live if pl.machine.deadline is not None]
        raise ModelNotReady(model_id, max(1, math.ceil(min(waits, default=1.0))))

    def _load(self, instance_id: str) -> int:
        return sum(1 for r in self._requests.values() if r.instance_id == instance_id)

    def submit(
        self,
        instance_id: str,
        messages: list[dict[str, str]],
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | None = None,
    ) -> RequestStream:
        """Queue a chat completion on an instance; refuses at once (not later) when it cannot take it."""
        placement = self.cluster.instances.get(instance_id)
        if placement is None or placement.machine.is_deleted:
            raise InstanceNotFound(f"no live instance {instance_id!r}")
        if self._load(instance_id) >= self.config.max_requests_per_instance:
            raise Overloaded(
                f"instance {instance_id} already has {self.config.max_requests_per_instance} requests queued; "
                "retry shortly"
            )
        request_id = f"req-{secrets.token_hex(6)}"
        command = p.Generate(
            request_id=request_id,
            prompt_messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop or [],
        )
        try:
            p.from_json(command.to_line())  # what the runner will decode: refuse it here, not there
        except p.ProtocolError as exc:
            raise InvalidRequest(f"invalid request: {exc}") from exc
        send, receive = trio.open_memory_channel[Any](math.inf)
        request = _Request(instance_id, command, send)
        self._requests[request_id] = request
        self.cluster.add_request(request_id, instance_id)
        self._changed()
        return RequestStream(self, request_id, request, receive)

    async def generate(self, instance_id: str, messages: list[dict[str, str]], **params: Any) -> AsyncIterator[Any]:
        """`submit`, then iterate: tokens, then one `Done`; `RequestFailed` on error."""
        stream = self.submit(instance_id, messages, **params)
        try:
            async for item in stream:
                yield item
        finally:
            stream.close()

    def _forget_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self.cluster.requests.pop(request_id, None)

    def status(self) -> dict[str, Any]:
        return status_of(self.cluster)

    # -- plan → execute ------------------------------------------------------------------

    def _act(self) -> None:
        if self._stopping:
            return
        now = self.clock()
        for iid in list(self.cluster.instances):
            self.cluster.instance_event(fsm.instance.Tick(iid, now))
        for _ in range(MAX_PLAN_ROUNDS):
            actions = fsm.plan(self.cluster.view(), NODE, now)
            if not actions:
                break
            for action in actions:
                try:
                    self._execute(action, now)
                except fsm.FsmError as exc:  # the view moved under a later action of the same batch
                    log.warning("action %s not taken: %s", action, exc)
        else:
            log.error("plan did not settle after %d rounds; will retry on the next change", MAX_PLAN_ROUNDS)
        self._fail_orphaned_requests()
        self._forget_old_deleted(now)
        self._commit()

    def _forget_old_deleted(self, now: float) -> None:
        """Keep the newest `KEEP_DELETED` deleted instances (for `status`: why did it go?); drop older ones."""
        done = [
            iid
            for iid, pl in self.cluster.instances.items()
            if pl.machine.is_deleted and not self.cluster.has_live_runners(iid)
        ]
        for iid in done[: max(0, len(done) - KEEP_DELETED)]:
            self.cluster.forget(iid)
            self.cluster.log.append(fsm.cluster.LogEntry(now, "instance", iid, "forget", "deleted", ""))

    def _execute(self, action: fsm.Action, now: float) -> None:
        assert self._nursery is not None
        if isinstance(action, fsm.LoadModel):  # the I/O that can fail comes before the machines move
            try:
                model_path = self._model_path(action.model_id)
            except ModelNotFound as exc:  # gone from the cache since it was downloaded: fetch it again
                log.warning("model %s vanished from the cache: %s", action.model_id, exc)
                self._model_paths.pop(action.model_id, None)
                self.cluster.download_event(NODE, dl.Invalidate(action.model_id, now))
                return
        self.cluster.execute(action, now)
        match action:
            case fsm.CancelRequest(request_id, _, reason):
                self._fail_request(request_id, reason)
            case fsm.StopRunner(runner_id, incarnation, _):
                supervisor = self._supervisors.get((runner_id, incarnation))
                if supervisor is not None:
                    supervisor.stop()
            case fsm.CreateRunner(instance_id, runner_id, _, rank, world_size, incarnation, _):
                spec = RunnerSpec(
                    runner_id=runner_id,
                    incarnation=incarnation,
                    rank=rank,
                    world_size=world_size,
                    hostfile=self._hostfile(instance_id, incarnation, world_size),
                    log_path=self.config.state_dir / "logs" / instance_id / f"rank{rank}-gen{incarnation}.log",
                    fault=next((str(f.fault) for f in self.config.faults if f.applies(rank, incarnation)), None),
                )
                supervisor = Supervisor(spec, self, self.config.timeouts)
                self._supervisors[(runner_id, incarnation)] = supervisor
                self._nursery.start_soon(self._supervise, supervisor)
            case fsm.StartDownload(_, model_id):
                self._nursery.start_soon(self._download, model_id)
            case fsm.ConnectRunner(runner_id, incarnation):
                self._post(runner_id, incarnation, p.Connect())
            case fsm.LoadModel(runner_id, incarnation, model_id):
                self._post(runner_id, incarnation, p.Load(str(model_path)))
            case fsm.WarmUp(runner_id, incarnation):
                self._post(runner_id, incarnation, p.WarmUp())
            case fsm.ForwardRequest(request_id, runner_id, incarnation):
                request = self._requests.get(request_id)
                if request is not None:
                    if self.cluster.runner(runner_id).rank == 0:
                        request.leader, request.incarnation = runner_id, incarnation
                        request.forwarded.set()
                    self._post(runner_id, incarnation, request.command)

    def _post(self, runner_id: str, incarnation: int, command: p.Command) -> None:
        supervisor = self._supervisors.get((runner_id, incarnation))
        if supervisor is not None:
            supervisor.post(command)

    def _hostfile(self, instance_id: str, generation: int, world_size: int) -> Path | None:
        if world_size == 1:
            return None
        path = self.config.state_dir / "run" / instance_id / f"gen{generation}.hostfile.json"
        if not path.exists():  # every rank of a generation shares one hostfile
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(world_size)]))
        return path

    def _model_path(self, model_id: str) -> Path:
        if model_id in self.local_models:
            return self.local_models[model_id]
        if model_id not in self._model_paths:  # completed before a restart: it is in the local cache
            self._model_paths[model_id] = resolve_model(model_id, hf_home=self.config.hf_home, offline=True)
        return self._model_paths[model_id]

    async def _download(self, model_id: str) -> None:
        token = trio.lowlevel.current_trio_token()

        def progress(done: int, total: int | None) -> None:  # called in huggingface_hub's worker threads
            token.run_sync_soon(self._bytes_progress, model_id, done, total)

        if model_id.startswith("local/"):
            resolve = partial(self._local_model, model_id)
        else:
            resolve = partial(
                resolve_model,
                model_id,
                hf_home=self.config.hf_home,
                offline=self.config.offline,
                timeout=self.config.download_timeout,
                progress=progress,
            )
        try:
            path = await trio.to_thread.run_sync(resolve, abandon_on_cancel=True)
        except Exception as exc:  # ModelNotFound, or anything the hub client raised: retried with backoff
            reason = str(exc) if isinstance(exc, ModelNotFound) else f"{type(exc).__name__}: {exc}"
            self.cluster.download_event(NODE, dl.DownloadFailed(model_id, self.clock(), reason))
        else:
            self._model_paths[model_id] = path
            self.cluster.download_event(NODE, dl.Complete(model_id, self.clock()))
        self._changed()

    def _local_model(self, model_id: str) -> Path:
        if model_id not in self.local_models:
            raise ModelNotFound(f"{model_id} names a local directory that is no longer in the configuration")
        return resolve_local_dir(self.local_models[model_id])

    def _bytes_progress(self, model_id: str, done: int, total: int | None) -> None:
        try:
            self.cluster.download_event(NODE, dl.BytesProgress(model_id, self.clock(), done, total))
        except fsm.FsmError as exc:  # e.g. a late callback after the download ended
            log.debug("download progress for %s ignored: %s", model_id, exc)

    async def _supervise(self, supervisor: Supervisor) -> None:
        spec = supervisor.spec
        try:
            await supervisor.run()
        except Exception as exc:  # the runner's failure, never the daemon's: spawn errors, I/O errors
            log.exception("supervisor of %s/%d failed", spec.runner_id, spec.incarnation)
            kind = fsm.FailureKind.SPAWN if supervisor.pid is None else fsm.FailureKind.EXCEPTION
            what = "cannot start runner" if supervisor.pid is None else "supervisor error"
            failure = fsm.Failure(kind, f"{what}: {type(exc).__name__}: {exc}")  # retryable: usually transient
            self._runner_event(rn.Fail(spec.runner_id, spec.incarnation, failure=failure))
            self._runner_event(rn.Exited(spec.runner_id, spec.incarnation, exit_code=1))
        finally:
            self._supervisors.pop((supervisor.spec.runner_id, supervisor.spec.incarnation), None)
            if self._stopping and not self._supervisors:
                self._all_stopped.set()

    # -- requests --------------------------------------------------------------------------

    def _fail_request(self, request_id: str, reason: str) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.abandoned:
            self._forget_request(request_id)
        else:
            request.channel.send_nowait(RequestFailed(reason))

    def _fail_orphaned_requests(self) -> None:
        """A forwarded request whose rank 0 is no longer Ready will never finish: end it now, never hang."""
        for request_id, request in list(self._requests.items()):
            if not request.leader:
                continue
            entry = self.cluster.runners.get(request.leader)
            machine = None if entry is None else entry.machine
            if (
                machine is None
                or machine.incarnation != request.incarnation
                or not machine.alive
                or (machine.runner_state is not fsm.RunnerState.READY)
            ):
                cause = machine.failure.message if machine is not None and machine.failure else "runner stopped"
                self._fail_request(request_id, f"the runner serving this request failed: {cause}")
                request.leader = ""

    # -- Listener: what supervisors report ----------------------------------------------------

    def _runner_event(self, event: rn.RunnerEvent) -> None:
        if self._stopping:  # the machines keep their state as of the shutdown; `restore` takes it from there
            return
        entry = self.cluster.runners.get(event.runner_id)
        machine = None if entry is None else entry.machine
        failed_before = machine is not None and machine.failure is not None
        try:
            self.cluster.runner_event(event, self.clock())
            if machine is not None and machine.failure is not None and not failed_before:
                self.failure_counts[machine.failure.kind.value] += 1
        except fsm.FsmError as exc:
            log.warning("runner event %s refused: %s", event, exc)
        self._fail_orphaned_requests()
        self._changed()

    def on_spawned(self, spec: RunnerSpec, pid: int) -> None:
        self.store.record_process(ProcessRecord(spec.runner_id, spec.incarnation, pid, start_ticks(pid) or 0))

    def on_report(self, spec: RunnerSpec, report: p.Report) -> None:
        try:
            self._on_report(spec, report)
        except fsm.FsmError as exc:  # e.g. progress beyond the total: the report is wrong, the daemon goes on
            log.warning("report %s from %s/%d refused: %s", report, spec.runner_id, spec.incarnation, exc)

    def _on_report(self, spec: RunnerSpec, report: p.Report) -> None:
        rid, inc = spec.runner_id, spec.incarnation
        match report:
            case p.Status(phase=p.Phase.JOINED):
                self._runner_event(rn.Connected(rid, inc))
            case p.Status(phase=p.Phase.LOADED):
                self._runner_event(rn.WeightsLoaded(rid, inc))
            case p.Status(phase=p.Phase.READY):
                self._runner_event(rn.Warmed(rid, inc))
            case p.Progress(layers_loaded=done, layers_total=total) if total > 0:
                self._runner_event(rn.Progress(rid, inc, layers_loaded=done, layers_total=total))
            case p.Failed():
                failure = fsm.Failure.exception(
                    report.exception_type, report.message, retryable=report.retryable, detail=report.traceback
                )
                self._runner_event(rn.Fail(rid, inc, failure=failure))
            case p.Token(request_id=request_id) | p.Done(request_id=request_id):
                request = self._requests.get(request_id)
                if request is not None and request.leader == rid:  # rank 0 speaks for the request
                    if request.abandoned and isinstance(report, p.Done):
                        self._forget_request(request_id)
                    elif not request.abandoned:
                        request.channel.send_nowait(report)
                if isinstance(report, p.Done):
                    self._runner_event(rn.RequestFinished(rid, inc))
            case p.RequestError(request_id=request_id, message=message):
                self._fail_request(request_id, message)
                self._runner_event(rn.RequestFinished(rid, inc))

    def on_stall(self, spec: RunnerSpec, phase: str, seconds: float) -> None:
        failure = fsm.Failure.stalled(phase, seconds)
        self._runner_event(rn.Fail(spec.runner_id, spec.incarnation, failure=failure))

    def on_exit(self, spec: RunnerSpec, exit_code: int, stderr_tail: str, stopped: bool) -> None:
        self.store.forget_process(spec.runner_id, spec.incarnation)
        event = rn.Exited(
            spec.runner_id, spec.incarnation, exit_code=exit_code, detail=stderr_tail, stop_delivered=stopped
        )
        self._runner_event(event)


def status_of(cluster: Cluster) -> dict[str, Any]:
    """Everything an operator asks first: states, attempts, next retry, last cause, per runner."""
    view = cluster.view()
    instances = []
    for iid, placement in cluster.instances.items():
        m = placement.machine
        runners = []
        for slot, r in view.slot_runners(view.instances[iid]):
            runners.append(
                {
                    "runner_id": slot.runner_id,
                    "rank": slot.rank,
                    "incarnation": None if r is None else r.incarnation,
                    "state": None if r is None else r.state.value,
                    "phase": None if r is None or r.phase is None else r.phase.value,
                    "layers": None if r is None else [r.layers_loaded, r.layers_total],
                    "failure": None if r is None or r.failure is None else r.failure.message,
                }
            )
        download = cluster.downloads.get((NODE, placement.model_id))
        instances.append(
            {
                "instance_id": iid,
                "model_id": placement.model_id,
                "ranks": len(placement.slots),
                "state": m.instance_state.value,
                "generation": m.generation,
                "attempts": m.attempts,
                "max_retries": m.policy.max_retries,
                "next_retry_at": m.deadline,
                "delete_reason": None if m.delete_reason is None else m.delete_reason.value,
                "last_failure": None if m.last_failure is None else m.last_failure.message,
                "download": None
                if download is None
                else {
                    "state": download.download_state.value,
                    "attempts": download.attempts,
                    "retry_at": download.retry_at,
                    "last_error": download.last_error,
                    "bytes": [download.bytes_done, download.bytes_total],
                },
                "runners": runners,
            }
        )
    return {"instances": instances}
