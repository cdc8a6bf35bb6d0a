"""The transition log: every step a machine took, in order — what a supervisor persists, ships and replays.

`Cluster` appends a `LogEntry` per accepted step to ``Cluster.log`` (and an ``ignored`` entry per report it
ignored: a duplicate ``Exited``, news of an older incarnation; ``cause`` says which and why); the caller
takes them from there (and clears it) to keep them. JSON lines are the exchange
shape (``exod replay --jsonl`` reads them, `fsm.conformance.replay` checks them
against the machines): `dumps` and `loads` here, so that a caller keeps no
serialiser of its own. Pure: text in, text out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import attrs

from fsm.errors import SnapshotError

IGNORED = "ignored"  # the event of an entry that moved nothing: a duplicate or late report (source == target)


@attrs.frozen
class LogEntry:
    """One transition: ``machine`` is runner/instance/download, ``key`` its id; ``cause`` a failure's message."""

    time: float
    machine: str
    key: str
    event: str
    source: str
    target: str
    cause: str = ""

    def as_record(self) -> dict[str, Any]:
        """The public shape (event stream, JSONL export): ``id``, ``from``, ``to`` for key, source, target."""
        return {
            "time": self.time,
            "machine": self.machine,
            "id": self.key,
            "event": self.event,
            "from": self.source,
            "to": self.target,
            "cause": self.cause,
        }

    @classmethod
    def from_record(cls, record: Any) -> LogEntry:
        """Read `as_record`'s shape; `SnapshotError` naming what is wrong with it."""
        if not isinstance(record, dict):
            raise SnapshotError(f"a log entry is a JSON object, not {type(record).__name__}")
        if missing := [k for k in ("time", "machine", "id", "event", "from", "to") if k not in record]:
            raise SnapshotError(f"a log entry lacks {missing}")
        time = record["time"]
        if isinstance(time, bool) or not isinstance(time, (int, float)):
            raise SnapshotError(f"time: expected a number, got {time!r}")
        text = {k: record.get(k, "") for k in ("machine", "id", "event", "from", "to", "cause")}
        if wrong := [k for k, v in text.items() if not isinstance(v, str)]:
            raise SnapshotError(f"{', '.join(wrong)}: expected a string")
        return cls(float(time), text["machine"], text["id"], text["event"], text["from"], text["to"], text["cause"])


def dumps(entries: Iterable[LogEntry]) -> str:
    """The entries as JSON lines, one per entry, each ending in a newline."""
    return "".join(json.dumps(e.as_record()) + "\n" for e in entries)


def loads(text: str) -> list[LogEntry]:
    """Read what `dumps` wrote (blank lines skipped); `SnapshotError` naming the first bad line."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entries.append(LogEntry.from_record(json.loads(line)))
        except (ValueError, SnapshotError) as exc:
            raise SnapshotError(f"line {number}: {exc}") from None
    return entries
