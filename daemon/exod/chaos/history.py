"""What a campaign saw, as an outsider: client operations, runner processes, faults, the state in etcd.

Everything here is observed from outside the daemons (HTTP answers, the process table, etcd's keys), never
taken from what a daemon says of itself, so that a daemon cannot vouch for its own safety. Times are seconds
of one monotonic clock since the campaign began.
"""

from __future__ import annotations

import enum
import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs


class Outcome(enum.Enum):
    OK = "ok"
    REFUSED = "refused"  # an error, in the request's dialect: an answer
    INDETERMINATE = "indeterminate"  # the connection failed or broke: it may or may not have happened
    HUNG = "hung"  # no answer, or no end of the stream, within the bound
    MALFORMED = "malformed"  # an answer that is not in the request's dialect, or a stream that stopped unended


@attrs.frozen
class Operation:
    client: str  # what was asked: chat-openai, chat-anthropic-stream, place, delete, …
    node: str  # the node the client talked to
    start: float
    end: float
    outcome: Outcome
    detail: str = ""
    instance: str = ""  # the instance placed or deleted


@attrs.frozen
class ProcessLife:
    """A runner process, from the first sample that saw it to the last."""

    pid: int
    node: str
    instance: str
    rank: int
    generation: int
    first: float
    last: float
    fault: str = ""  # the PHASE:KIND it was armed with (its command line says)


# Faults after which a node's writes to etcd may not arrive (found by the CI campaign, seed 26: a park sent to
# node-2 was relayed to the controller, node-1, deaf to etcd; its honest answer was "not stored yet").
_SEVERED_FROM_ETCD = frozenset({"network-cut-from-etcd", "network-deaf-to-etcd", "network-cut-off"})
NOT_STORED = "not stored yet"  # how an answer that a change was made, but not yet stored, is recorded


@attrs.frozen
class FaultRecord:
    kind: str  # a `schedule.Kind` value, or ``armed:PHASE:KIND``
    target: str  # what it hit, resolved: node-2, m1, the pid of a rank …
    start: float
    end: float
    nodes: tuple[str, ...] = ()  # the exod nodes it made unreachable or unresponsive while it lasted
    note: str = ""  # why it was not injected, if it was not


@attrs.frozen
class InstanceSample:
    """One instance as etcd's snapshot held it at ``time``."""

    time: float
    instance: str
    state: str
    generation: int
    attempts: int
    uncharged: int
    deleted: bool
    spent: bool  # its retry budget: no more generations will be tried


@attrs.define
class History:
    """Appended to by the campaign's threads; read when they are done."""

    operations: list[Operation] = attrs.Factory(list)
    processes: dict[int, ProcessLife] = attrs.Factory(dict)
    faults: list[FaultRecord] = attrs.Factory(list)
    samples: list[InstanceSample] = attrs.Factory(list)
    events: dict[str, list[dict[str, Any]]] = attrs.Factory(dict)  # reader -> the transitions it was sent
    _lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False)

    def operation(self, op: Operation) -> None:
        with self._lock:
            self.operations.append(op)

    def fault(self, record: FaultRecord) -> None:
        with self._lock:
            self.faults.append(record)

    def sample(self, samples: Iterable[InstanceSample]) -> None:
        with self._lock:
            self.samples.extend(samples)

    def seen(self, pid: int, at: float, life: ProcessLife) -> None:
        """The process ``pid`` is alive at ``at`` (``life``: what it is, if it is new)."""
        with self._lock:
            known = self.processes.get(pid)
            self.processes[pid] = life if known is None else attrs.evolve(known, last=at)

    def event(self, reader: str, doc: dict[str, Any]) -> None:
        with self._lock:
            self.events.setdefault(reader, []).append(doc)

    def faulted(self, node: str, start: float, end: float) -> bool:
        """Whether a fault made ``node`` unreachable or unresponsive at some moment of [start, end]."""
        return any(node in f.nodes and f.start <= end and start <= f.end for f in self.faults if not f.note)

    def store_faulted(self, start: float, end: float) -> bool:
        """Whether a fault held etcd (a member, or all of them), or cut a node off from it, at some moment of
        [start, end]: a write may then outlive the term of the controller that made it, or not reach etcd at
        all, and be answered as neither done nor undone. (The history does not say which node was the
        controller: a node cut from etcd is taken to be it.)"""
        return any(
            (f.kind.startswith("etcd-") or f.kind in _SEVERED_FROM_ETCD) and f.start <= end and start <= f.end
            for f in self.faults
            if not f.note
        )

    def dump(self, path: Path) -> None:
        """The whole history as JSON lines, for reading after a violation."""

        def line(kind: str, record: Any) -> str:
            return json.dumps({"type": kind, **attrs.asdict(record, value_serializer=_plain)}) + "\n"

        with path.open("w") as out:
            out.writelines(line("fault", f) for f in self.faults)
            out.writelines(line("operation", o) for o in self.operations)
            out.writelines(line("process", p) for p in self.processes.values())
            out.writelines(line("sample", s) for s in self.samples)


def _plain(_inst: Any, _field: Any, value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value
