"""What the controller writes to the store, in order, and what happens when the store refuses a write.

A full disk, an I/O error or a vanished file must not end the daemon: its runners keep serving, and
what could not be written is kept in memory, in order, and written once the store takes it again. Until
then the daemon is *degraded*: `degraded` says why (status, ``/health``, ``/ready``), and new placements
wait, for a caller would be told of an instance that a crash could lose.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from exod.store import ProcessRecord, Store
from fsm.cluster import LogEntry

log = logging.getLogger("exod.journal")

WRITE_ERRORS = (sqlite3.Error, OSError)  # a full disk, an I/O error, a locked or vanished file


class Journal:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.degraded: str | None = None  # why the state cannot be written now; None: it is
        self._unwritten: list[Callable[[], Any]] = []

    def record_process(self, record: ProcessRecord) -> None:
        self._write(partial(self.store.record_process, record))

    def forget_process(self, runner_id: str, incarnation: int) -> None:
        self._write(partial(self.store.forget_process, runner_id, incarnation))

    def save(self, snapshot: Callable[[], dict[str, Any]], entries: Iterable[LogEntry], now: float) -> bool:
        """Write the state with its log entries; False if the store refused (kept to write later: the
        caller keeps ``entries`` until a save returns True)."""
        return self._write(lambda: self.store.save(snapshot(), entries, now), keep=False)

    def flush(self) -> bool:
        """Write what is waiting; True once nothing is."""
        return self._write(None)

    def _write(self, operation: Callable[[], Any] | None, *, keep: bool = True) -> bool:
        if operation is not None and keep:
            self._unwritten.append(operation)
        try:
            while self._unwritten:
                self._unwritten[0]()
                self._unwritten.pop(0)
            if operation is not None and not keep:
                operation()
        except WRITE_ERRORS as exc:
            if self.degraded is None:
                log.error("cannot write the state to %s (%s): degraded until it can", self.store.path, exc)
            self.degraded = f"cannot write the state to {self.store.path}: {exc}"
            return False
        if self.degraded is not None:
            log.warning("the state is written to %s again", self.store.path)
            self.degraded = None
        return True
