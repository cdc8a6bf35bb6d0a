"""The daemon's hands: what each of the planner's actions does to real processes, downloads and requests.

The controller drives its `fsm.Cluster` with an `fsm.Driver` (the loop every
user of the library runs); this is the driver's `fsm.Adapter` on a daemon. The
machines move first (the driver), the I/O follows only for what they accepted
(here). Each handler starts work and returns: a process is spawned into the
controller's nursery, a command is posted to a runner, a download is fetched in
a task; how it ends comes back as reports (`exod.reports`, `exod.downloads`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import trio

import fsm
from exod.config import DEFAULT
from exod.downloads import Downloads
from exod.host.models import ModelFiles, ModelNotFound
from exod.placer import Placer
from exod.processes import Processes
from exod.requests import RequestBook
from exod.runner import protocol as p
from fsm import download as dl
from fsm.cluster import Cluster

log = logging.getLogger(__name__)


class Executor:
    """`fsm.Adapter` of the daemon; ``before`` is the driver's last look (`fsm.Driver`)."""

    def __init__(
        self,
        cluster: Callable[[], Cluster],
        requests: Callable[[], RequestBook],
        nursery: Callable[[], trio.Nursery],
        now: Callable[[], float],
        *,
        processes: Processes,
        downloads: Downloads,
        models: ModelFiles,
        placer: Placer,
        node_id: str,
    ) -> None:
        self._cluster, self._requests, self._nursery, self._now = cluster, requests, nursery, now
        self.processes, self.downloads, self.models, self.placer = processes, downloads, models, placer
        self.node_id = node_id
        self._paths: dict[tuple[str, int], Path] = {}  # a load's weights, found before the machines moved
        self._held: dict[str, str] = {}  # parked instances a request waits for, and why they cannot come back yet

    def before(self, action: fsm.Action) -> bool:
        """The I/O that can fail comes before the machines move: a model gone from the cache since it was
        downloaded is fetched again instead of loaded; a new generation's ranks leave nodes that are gone; a
        parked instance comes back only once it has room (idle instances parked for it), else its requests
        wait (and fail at their queue timeout, 503)."""
        cluster = self._cluster()
        if isinstance(action, fsm.UnparkInstance):
            answer = self.placer.room_to_unpark(action.instance_id)
            if not answer.admitted:
                if self._held.get(action.instance_id) != answer.message:  # once per reason, not per plan
                    log.info("instance %s stays parked for now: %s", action.instance_id, answer.message)
                self._held[action.instance_id] = answer.message
                return False
            self._held.pop(action.instance_id, None)
            self.placer.evict(answer, self._now())
        if isinstance(action, fsm.LoadModel) and self.processes.is_local(cluster.runners[action.runner_id].node_id):
            try:
                self._paths[(action.runner_id, action.incarnation)] = self.models.path(action.model_id)
            except ModelNotFound as exc:
                log.warning("model %s vanished from the cache: %s", action.model_id, exc)
                self.models.forget(action.model_id)
                with contextlib.suppress(fsm.FsmError):  # another rank's load here invalidated it already
                    cluster.download_event(self.node_id, dl.Invalidate(action.model_id, self._now()))
                return False
        if isinstance(action, fsm.StartGeneration):
            self.placer.place_again(action.instance_id)
        return True

    def create_runner(self, action: fsm.CreateRunner) -> None:
        nodes = [slot.node_id for slot in self._cluster().instances[action.instance_id].slots]
        self.processes.start(self._nursery(), action, nodes)  # its endpoint is published when its node has one

    def stop_runner(self, action: fsm.StopRunner) -> None:
        self.processes.stop(action.runner_id, action.incarnation)

    def start_download(self, action: fsm.StartDownload) -> None:
        self._nursery().start_soon(self.downloads.fetch, action.node_id, action.model_id)

    def connect_runner(self, action: fsm.ConnectRunner) -> None:
        self.processes.post(action.runner_id, action.incarnation, p.Connect())

    def load_model(self, action: fsm.LoadModel) -> None:
        path = self._paths.pop((action.runner_id, action.incarnation), None)
        self.processes.load(action.runner_id, action.incarnation, action.model_id, path)

    def kill_runner(self, action: fsm.KillRunner) -> None:
        """Never asked: the daemon's phase limits leave a stop's grace to its supervisors (no
        `fsm.PhaseLimits.stop_grace`), whose stop escalates to SIGKILL by itself; a stop again is what it takes."""
        self.processes.stop(action.runner_id, action.incarnation)

    def warm_up(self, action: fsm.WarmUp) -> None:
        self.processes.post(action.runner_id, action.incarnation, p.WarmUp())

    def forward_request(self, action: fsm.ForwardRequest) -> None:
        book, cluster = self._requests(), self._cluster()
        command = book.forwarded(action, cluster.runner(action.runner_id).rank)
        if command is not None:
            self.processes.post(action.runner_id, action.incarnation, command)
        if (keep_alive := book.keep_alive(action.request_id)) is not DEFAULT:  # Ollama's, for this request
            cluster.hold(cluster.runners[action.runner_id].instance_id, keep_alive)

    def cancel_request(self, action: fsm.CancelRequest) -> None:
        self._requests().cancel(action.request_id, action.reason)
