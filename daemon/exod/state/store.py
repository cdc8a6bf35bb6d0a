"""Where the cluster's state lives: the interface the controller writes through, and SQLite's side of it.

One host keeps its state in SQLite (`exod.state.sqlite.Store`, nothing else to start); a cluster keeps it in
etcd (`exod.cluster.etcd_state.EtcdState`). The controller and its `exod.state.journal.Journal` see only `StateStore`:
a snapshot of every machine written atomically with the transition-log entries that led to it, the log
read back in one global order, and where it starts. The machines and the planner know neither.

The interface is async because etcd is a network away; SQLite's side answers at once.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any, Protocol

import trio

from exod.state.sqlite import Store, StoreError
from fsm.cluster import LogEntry


class StateUnavailable(Exception):
    """The state cannot be read or written now (a full disk, etcd out of reach); the message says where."""


class StateStore(Protocol):
    where: str  # the file or the URL, for messages
    # Why nothing may be restored from the store nor written to it now (a value in it that cannot be restored
    # waits for an operator: `exod.cluster.repair`); None: it may. The journal is degraded, saying it.
    refused: str | None

    async def load(self) -> dict[str, Any] | None:
        """The last snapshot saved (None if none ever was); `StoreError` if it is not a JSON object."""

    async def save(self, snapshot: dict[str, Any], entries: Sequence[LogEntry], now: float) -> int:
        """Write ``snapshot`` and append ``entries`` atomically; returns the last log sequence number. After a
        `StateUnavailable`, the next save carries the failed one's entries first (the journal keeps them queued):
        etcd may have applied that save although its answer was lost, and then writes them only once."""

    async def transitions(self, after: int = 0, limit: int | None = None) -> list[tuple[int, LogEntry]]:
        """Log entries with sequence number > ``after``, oldest first."""

    async def log_start(self) -> int:
        """The first sequence number the log still holds (the entries before it were pruned)."""

    async def changed(self, after: int) -> None:
        """Return once the log holds an entry past ``after`` (at once if it does already), whoever wrote it."""

    def snapshot_error(self, reason: str) -> StoreError:
        """The error for a saved snapshot that cannot be restored: what is wrong, what to do."""


class SqliteState:
    """`StateStore` on the one host's SQLite file."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.where = str(store.path)
        self.refused: str | None = None  # a file that cannot be restored is refused at start (`Store.open`, `load`)
        self._written = trio.Event()  # set (and replaced) at every save: one host, one writer, this one

    async def load(self) -> dict[str, Any] | None:
        return self.store.load()

    async def save(self, snapshot: dict[str, Any], entries: Sequence[LogEntry], now: float) -> int:
        try:
            seq = self.store.save(snapshot, entries, now)
        except (sqlite3.Error, OSError) as exc:  # a full disk, an I/O error, a locked or vanished file
            raise StateUnavailable(f"cannot write the state to {self.where}: {exc}") from exc
        self._written.set()
        self._written = trio.Event()
        return seq

    async def transitions(self, after: int = 0, limit: int | None = None) -> list[tuple[int, LogEntry]]:
        return list(self.store.transitions(after=after, limit=limit))

    async def log_start(self) -> int:
        return self.store.log_start()

    async def changed(self, after: int) -> None:
        written = self._written  # taken before reading: a save in between is not missed
        if self.store.last_seq() <= after:
            await written.wait()

    def snapshot_error(self, reason: str) -> StoreError:
        return self.store.snapshot_error(reason)
