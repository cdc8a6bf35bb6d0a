"""The runner processes this host started, as its SQLite file records them (a pid means something on one
host only): what a restarted daemon reaps (`exod.host.orphans`).

A write the file refuses (a full disk, an I/O error) is kept, in order, and written at the next one or
the next `retry`; meanwhile `error` says why, and the daemon is degraded — never ended: supervising the
runners matters more than the record of them.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from functools import partial
from typing import Any

from exod.state.sqlite import ProcessRecord, Store

log = logging.getLogger("exod.journal")

LOCAL_ERRORS = (sqlite3.Error, OSError)  # a full disk, an I/O error, a locked or vanished file


class ProcessBook:
    def __init__(self, store: Store, refused: Callable[[], None] = lambda: None) -> None:
        """``refused``: called when a write is first refused (whoever retries may want to know)."""
        self.store, self._refused = store, refused
        self.error: str | None = None  # why the file takes no write now
        self._unwritten: list[Callable[[], Any]] = []

    def record(self, record: ProcessRecord) -> None:
        self._write(partial(self.store.record_process, record))

    def forget(self, runner_id: str, incarnation: int) -> None:
        self._write(partial(self.store.forget_process, runner_id, incarnation))

    def retry(self) -> bool:
        """Write what waits; True once nothing does."""
        self._write(None)
        return self.error is None

    def _write(self, operation: Callable[[], Any] | None) -> None:
        if operation is not None:
            self._unwritten.append(operation)
        try:
            while self._unwritten:
                self._unwritten[0]()
                self._unwritten.pop(0)
        except LOCAL_ERRORS as exc:
            if self.error is None:
                log.error("cannot write to %s (%s): degraded until it can", self.store.path, exc)
                self._refused()
            self.error = f"cannot write the state to {self.store.path}: {exc}"
            return
        if self.error is not None:
            log.warning("the state is written to %s again", self.store.path)
            self.error = None
