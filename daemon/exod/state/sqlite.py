"""Durable state of the daemon in SQLite (WAL): desired state, machine snapshots, the transition log.

Why one snapshot row plus an append-only log: the machines' state is small and
changes together (a runner failure moves a runner and its instance in one
step), so it is written whole, in the same transaction as the log entries that
led to it. A reader of the log never sees a transition whose state was lost,
and a restarted daemon resumes from exactly what was acknowledged.

The log is bounded (`exod.state.retention.Retention`): each save prunes its oldest rows once there are more
than ``max_log_rows`` or the oldest is older than ``max_log_age_days``, down to nine tenths of the bound
so that pruning runs now and then, not at every save. Only a prefix is ever deleted, so what remains is
the log from `log_start` on, without gaps; the meta key ``log_start`` records where that is.

The store never repairs or overwrites a file it cannot read: a corrupt
database, or a snapshot that does not restore, is an operator's decision, so
`open` and `load` refuse it with `StoreError` (and the daemon, whose machines
find a snapshot of the wrong shape, says it with `snapshot_error`). The files
are 0600, like everything in the state directory (`exod.state.statedir`).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

from exod.state.retention import Retention
from exod.state.statedir import PRIVATE_FILE, private_dir
from fsm.cluster import LogEntry

log = logging.getLogger("exod.store")

SCHEMA_VERSION = 1
DEFAULT_RETENTION = Retention()
PRUNE_TO = 0.9  # a bound passed, the log is pruned to this fraction of it (a tenth of the rows, or of the age)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS snapshot (id INTEGER PRIMARY KEY CHECK (id = 1), body TEXT NOT NULL, saved_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS transitions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL, machine TEXT NOT NULL, key TEXT NOT NULL,
    event TEXT NOT NULL, source TEXT NOT NULL, target TEXT NOT NULL, cause TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS processes (
    runner_id TEXT NOT NULL, incarnation INTEGER NOT NULL, pid INTEGER NOT NULL, start_ticks INTEGER NOT NULL,
    PRIMARY KEY (runner_id, incarnation)
);
"""


class StoreError(Exception):
    """The state database cannot be used; the message says which file and what to do."""


@attrs.frozen
class ProcessRecord:
    """A runner process we started: pid plus its kernel start time, so a recycled pid is never mistaken for it."""

    runner_id: str
    incarnation: int
    pid: int
    start_ticks: int


class Store:
    def __init__(self, connection: sqlite3.Connection, path: Path, retention: Retention = DEFAULT_RETENTION) -> None:
        self._db = connection
        self.path = path
        self.retention = retention

    @classmethod
    def open(cls, path: Path, *, retention: Retention = DEFAULT_RETENTION) -> Store:
        """Open the database at ``path``, creating it (0600, its directory 0700) if there is none; each save
        prunes the log to ``retention``.

        A 0-byte file is what a database becomes when its first write never happened (a crash between
        creating the file and writing the schema) or when something truncated it; SQLite reads it as an
        empty database. There is nothing in it to keep, so it is used as a new one, with a warning: the
        operator learns that the state they may have expected is not there.
        """
        path = Path(path)
        try:
            private_dir(path.parent)
        except OSError as exc:
            raise StoreError(f"cannot create the state directory {path.parent}: {exc.strerror}") from exc
        existed = path.exists()
        if existed and path.stat().st_size == 0:
            log.warning("%s is empty (0 bytes): starting with no state", path)
        try:
            # SQLite gives the -wal and -shm files the database's mode: create the database 0600 first.
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, PRIVATE_FILE))
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            if existed:
                (check,) = db.execute("PRAGMA quick_check").fetchone()
                if check != "ok":
                    raise sqlite3.DatabaseError(check)
        except (OSError, sqlite3.OperationalError) as exc:
            raise StoreError(f"cannot open {path}: {exc}. Check that the state directory is writable.") from exc
        except sqlite3.DatabaseError as exc:
            raise StoreError(
                f"{path} is not a usable exod state database ({exc}). It was left untouched: "
                "move it aside to start from an empty state, or pass another --state-dir."
            ) from exc
        store = cls(db, path, retention)
        store._check_version()
        return store

    def _check_version(self) -> None:
        try:
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise StoreError(f"{self.path} has schema {row[0]}; this exod reads schema {SCHEMA_VERSION}")
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path} cannot be initialised: {exc}. It was left untouched.") from exc

    def close(self) -> None:
        self._db.close()

    # -- state and log ----------------------------------------------------------------

    def save(self, snapshot: dict[str, Any], entries: Iterable[LogEntry], now: float) -> int:
        """Write the snapshot, append ``entries`` and prune the log (`retention`) atomically; returns the last log
        sequence number."""
        body = json.dumps(snapshot, sort_keys=True)
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "INSERT INTO transitions (time, machine, key, event, source, target, cause) VALUES (?,?,?,?,?,?,?)",
                [(e.time, e.machine, e.key, e.event, e.source, e.target, e.cause) for e in entries],
            )
            self._db.execute(
                "INSERT INTO snapshot (id, body, saved_at) VALUES (1, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET body = excluded.body, saved_at = excluded.saved_at",
                (body, now),
            )
            (seq,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM transitions").fetchone()
            self._prune(seq, now)
        return seq

    def _prune(self, last: int, now: float) -> None:
        """Delete the log's oldest rows if a bound is passed. Cheap when none is: one look at the oldest row."""
        retention = self.retention
        oldest = self._db.execute("SELECT seq, time FROM transitions ORDER BY seq LIMIT 1").fetchone()
        if oldest is None:
            return
        oldest_seq, oldest_time = oldest
        through = 0  # delete the rows with seq <= through
        if oldest_seq <= last - retention.max_log_rows:
            through = last - max(1, int(retention.max_log_rows * PRUNE_TO))
        if oldest_time < now - retention.max_log_age:
            # the first row young enough, scanning from the oldest: time follows seq, so this reads what goes
            young = self._db.execute(
                "SELECT seq FROM transitions WHERE time >= ? ORDER BY seq LIMIT 1",
                (now - retention.max_log_age * PRUNE_TO,),
            ).fetchone()
            through = max(through, last if young is None else young[0] - 1)
        if through < oldest_seq:
            return
        self._db.execute("DELETE FROM transitions WHERE seq <= ?", (through,))
        self._db.execute("INSERT OR REPLACE INTO meta VALUES ('log_start', ?)", (str(through + 1),))
        log.info("transition log pruned: entries before %d deleted (see [retention] in the config)", through + 1)

    def last_seq(self) -> int:
        """The sequence number of the newest log entry (0 if there is none)."""
        (seq,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM transitions").fetchone()
        return seq

    def log_start(self) -> int:
        """The sequence number the log starts at: 1, unless retention pruned the entries before it."""
        row = self._db.execute("SELECT value FROM meta WHERE key = 'log_start'").fetchone()
        return 1 if row is None else int(row[0])

    def load(self) -> dict[str, Any] | None:
        """The last saved snapshot (None if none was ever saved); `StoreError` if it is not a JSON object."""
        row = self._db.execute("SELECT body FROM snapshot WHERE id = 1").fetchone()
        if row is None:
            return None
        try:
            snapshot = json.loads(row[0])
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
            raise self.snapshot_error(f"not JSON: {exc}") from exc
        if not isinstance(snapshot, dict):
            raise self.snapshot_error(f"expected a JSON object, got {type(snapshot).__name__}")
        return snapshot

    def snapshot_error(self, reason: str) -> StoreError:
        """The error for a saved snapshot that cannot be restored (``reason``): what is wrong, what to do."""
        return StoreError(
            f"{self.path} holds a state snapshot that cannot be restored ({reason}). It was left untouched. "
            "To start from an empty state, move it into another directory (where `exod replay --state-dir DIR` "
            "still reads its transition log), or pass another --state-dir."
        )

    def transitions(self, after: int = 0, limit: int | None = None) -> Iterator[tuple[int, LogEntry]]:
        """Log entries with sequence number > ``after``, oldest first (for replay and event-stream resume)."""
        sql = "SELECT seq, time, machine, key, event, source, target, cause FROM transitions WHERE seq > ? ORDER BY seq"
        params: tuple[int, ...] = (after,)
        if limit is not None:
            sql += " LIMIT ?"
            params += (limit,)
        for seq, *fields in self._db.execute(sql, params):
            yield seq, LogEntry(*fields)

    # -- runner processes ------------------------------------------------------------------

    def record_process(self, record: ProcessRecord) -> None:
        with self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO processes VALUES (?, ?, ?, ?)",
                (record.runner_id, record.incarnation, record.pid, record.start_ticks),
            )

    def forget_process(self, runner_id: str, incarnation: int) -> None:
        with self._db:
            self._db.execute("DELETE FROM processes WHERE runner_id = ? AND incarnation = ?", (runner_id, incarnation))

    def processes(self) -> list[ProcessRecord]:
        rows = self._db.execute("SELECT runner_id, incarnation, pid, start_ticks FROM processes ORDER BY runner_id")
        return [ProcessRecord(*row) for row in rows]
