"""Log conformance: replay a transition log against the machines.

A log records what happened — each leaf-to-leaf step of each machine, as the
daemon wrote it — and this module asks whether the machines allow it: every
step must start where the previous step of that machine left it, and must be
a transition the class declares (`fsm.diagram.transition_table`), with
compound sources and targets resolved to their leaves. The first step that is
not is reported with what was expected; everything else becomes coverage:
which states and transitions of each machine the log exercised.

A log may begin mid-way (a daemon prunes the oldest entries of its log), so a
machine is taken to be where its first entry says, and followed from there: a
suffix of a conforming log conforms.

Markers that are not transitions: ``create`` (a runner process was started:
its machine begins again in its initial state), ``place`` (an instance was
placed) and ``forget`` (a deleted instance was dropped); ``ignored`` entries (a report that moved
nothing) are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
from statemachine import State, StateMachine

from fsm.diagram import Transition, transition_table
from fsm.log import IGNORED, LogEntry

MARKERS = ("create", "place", "forget")


@attrs.frozen
class Divergence:
    index: int  # 0-based position in the log
    entry: LogEntry
    expected: str
    reason: str

    def text(self) -> str:
        e = self.entry
        return (
            f"entry {self.index}: {e.machine} {e.key}: {e.source or '·'} → {e.target or '·'} on {e.event}: "
            f"{self.reason} (expected {self.expected})"
        )


@attrs.frozen
class MachineCoverage:
    states_seen: frozenset[str]
    states_all: frozenset[str]
    transitions_seen: frozenset[Transition]
    transitions_all: frozenset[Transition]

    def text(self, name: str) -> str:
        s, t = len(self.states_seen), len(self.transitions_seen)
        missing = sorted(self.states_all - self.states_seen)
        tail = f"; states never reached: {', '.join(missing)}" if missing else ""
        return f"{name}: {s}/{len(self.states_all)} states, {t}/{len(self.transitions_all)} transitions exercised{tail}"


@attrs.frozen
class ConformanceReport:
    entries: int
    divergence: Divergence | None
    coverage: Mapping[str, MachineCoverage]

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def text(self) -> str:
        head = f"{self.entries} log entries: " + ("conform" if self.ok else "DIVERGE")
        lines = [head]
        if self.divergence is not None:
            lines.append("  first divergence: " + self.divergence.text())
        lines += ["  " + cov.text(name) for name, cov in sorted(self.coverage.items())]
        return "\n".join(lines)


class _Model:
    def __init__(self, cls: type[StateMachine]) -> None:
        self.cls = cls
        self.rows = transition_table(cls)
        self.leaves = frozenset(s.id for s in cls.states_map.values() if not s.states)
        self.initial = self.enter(next(s for s in cls.states_map.values() if s.initial and s.parent is None))

    def enter(self, state: State) -> str:
        """The leaf reached by entering ``state`` (compound states enter their initial child)."""
        while state.states:
            state = next(s for s in state.states if s.initial)
        return state.id

    def within(self, leaf: str, state_id: str) -> bool:
        state: State | None = self.cls.states_map[leaf]
        while state is not None:
            if state.id == state_id:
                return True
            state = state.parent
        return False

    def match(self, entry: LogEntry) -> Transition | None:
        event = "" if entry.event == "auto" else entry.event
        for row in self.rows:
            if row.event != event or not self.within(entry.source, row.source):
                continue
            if self.enter(self.cls.states_map[row.target]) == entry.target:
                return row
        return None


def replay(entries: Iterable[LogEntry], machines: Mapping[str, type[StateMachine]] | None = None) -> ConformanceReport:
    """Replay ``entries`` against ``machines`` (default: `fsm.MACHINES`); stops at the first divergence."""
    from fsm import MACHINES

    models = {name: _Model(cls) for name, cls in (machines or MACHINES).items()}
    current: dict[tuple[str, str], str] = {}
    forgotten: set[tuple[str, str]] = set()
    seen_states: dict[str, set[str]] = {name: set() for name in models}
    seen_rows: dict[str, set[Transition]] = {name: set() for name in models}
    divergence = None
    count = 0
    for index, entry in enumerate(entries):
        count = index + 1
        model = models.get(entry.machine)
        if model is None:
            divergence = Divergence(index, entry, f"one of {sorted(models)}", "unknown machine")
            break
        key = (entry.machine, entry.key)
        if entry.event == IGNORED:  # a report that moved nothing (`Cluster.runner_event`)
            continue
        if entry.event in MARKERS:
            problem = _marker_problem(entry, model, current.get(key), key in forgotten)
            if problem:
                divergence = Divergence(index, entry, problem[0], problem[1])
                break
            if entry.event == "forget":
                current.pop(key, None)
                forgotten.add(key)
            else:
                current[key] = entry.target
                forgotten.discard(key)
                seen_states[entry.machine].add(entry.target)
            continue
        if key in forgotten:
            divergence = Divergence(index, entry, "nothing: it was forgotten", "a step of a forgotten machine")
            break
        if entry.source not in model.leaves or entry.target not in model.leaves:
            divergence = Divergence(index, entry, f"states of {entry.machine}", "no such state")
            break
        if key in current and current[key] != entry.source:
            divergence = Divergence(index, entry, f"a step from {current[key]!r}", "the machine was elsewhere")
            break
        row = model.match(entry)
        if row is None:
            allowed = sorted({r.event or "auto" for r in model.rows if model.within(entry.source, r.source)})
            divergence = Divergence(index, entry, f"one of {allowed} from {entry.source!r}", "not a transition")
            break
        current[key] = entry.target
        seen_states[entry.machine] |= {entry.source, entry.target}
        seen_rows[entry.machine].add(row)
    coverage = {
        name: MachineCoverage(
            frozenset(seen_states[name]), model.leaves, frozenset(seen_rows[name]), frozenset(model.rows)
        )
        for name, model in models.items()
    }
    return ConformanceReport(count, divergence, coverage)


def _marker_problem(entry: LogEntry, model: _Model, now: str | None, forgotten: bool) -> tuple[str, str] | None:
    """(expected, reason) if a create/place/forget marker cannot be what the log says."""
    if entry.event == "forget":
        if now is not None and not model.cls.states_map[now].final:
            return "a final state before forget", f"forgot a machine still in {now!r}"
        return None
    if entry.target != model.initial:
        return f"a start in {model.initial!r}", "a machine started elsewhere than its initial state"
    if now is not None and not model.cls.states_map[now].final:
        return f"a stopped predecessor, not {now!r}", "a new incarnation while the previous one was alive"
    return None
