"""Models fetched onto nodes: into this node's cache (huggingface-hub), or another's through its agent.

Each outcome is an event of the download machine of (node, model) — progress, complete, failed — which
the controller's machines turn into retries with backoff (`fsm.download`); nothing here decides.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import attrs

import fsm
from exod.cluster.remote import AgentUnavailable, Fleet
from exod.host.models import MISSING, ModelFiles, ModelNotFound
from fsm import download as dl
from fsm import runner as rn
from fsm.cluster import Cluster

log = logging.getLogger("exod.downloads")


class Downloads:
    def __init__(
        self,
        models: ModelFiles,
        fleet: Fleet | None,
        cluster: Callable[[], Cluster],
        now: Callable[[], float],
        changed: Callable[[], None],
    ) -> None:
        self.models, self.fleet = models, fleet
        self._cluster, self._now, self._changed = cluster, now, changed

    async def fetch(self, node_id: str, model_id: str) -> None:
        """Fetch ``model_id`` onto ``node_id``, and say how it went (`StartDownload` was accepted)."""
        try:
            if self.fleet is None or node_id == self.fleet.local:
                progress = lambda done, total: self._bytes(node_id, model_id, done, total)  # noqa: E731
                await self.models.fetch(model_id, progress=progress)
            else:
                await self.fleet.link(node_id).client.fetch(model_id)
        except Exception as exc:  # ModelNotFound, AgentUnavailable, what the hub client raised: retried
            known = isinstance(exc, ModelNotFound | AgentUnavailable)
            reason = str(exc) if known else f"{type(exc).__name__}: {exc}"
            self._cluster().download_event(node_id, dl.DownloadFailed(model_id, self._now(), reason))
        else:
            self._cluster().download_event(node_id, dl.Complete(model_id, self._now()))
        self._changed()

    def unless_lost(self, event: rn.Fail, model_id: str, node_id: str) -> rn.Fail:
        """A runner that cannot find its model's files: the host's failure (uncharged), and the model fetched
        again on that node, if the files were there once (`ModelFiles.lost`); the model's defect otherwise. A
        node's agent judges its own files, and says so with a host's failure naming what was missing."""
        failure = event.failure
        if self.fleet is not None and node_id != self.fleet.local:
            if failure.kind is fsm.FailureKind.HOST and failure.exception_type in MISSING:
                self._invalidate(node_id, model_id)
            return event
        if not self.models.lost(model_id, failure.exception_type, failure.message):
            return event
        log.warning("the files of %s went missing while it ran: fetching it again", model_id)
        self.models.forget(model_id)
        self._invalidate(node_id, model_id)
        message = f"{failure.message} (the model's files went missing from this node's cache: fetching it again)"
        return attrs.evolve(
            event, failure=fsm.Failure.host(message, detail=failure.detail, exception_type=failure.exception_type)
        )

    def _invalidate(self, node_id: str, model_id: str) -> None:
        with contextlib.suppress(fsm.FsmError):  # already being fetched again
            self._cluster().download_event(node_id, dl.Invalidate(model_id, self._now()))

    def _bytes(self, node_id: str, model_id: str, done: int, total: int | None) -> None:
        try:
            self._cluster().download_event(node_id, dl.BytesProgress(model_id, self._now(), done, total))
        except fsm.FsmError as exc:  # e.g. a late callback after the download ended
            log.debug("download progress for %s ignored: %s", model_id, exc)
