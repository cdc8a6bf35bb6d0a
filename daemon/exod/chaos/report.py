"""A campaign's report: what was injected, what the clients saw, how soon the cluster recovered, which
transitions of the machines real processes took, and the violations — a markdown section of
specs/reliability.md (`write_section`, shared with the test suite's sections) and lines for the terminal."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import fsm
from exod.chaos.history import FaultRecord, InstanceSample
from exod.chaos.schedule import Kind, fault_window
from fsm.conformance import MachineCoverage

TITLE = "# Reliability\n\nWritten by `make reliability` from what the test run observed, not by hand.\n"
Row = tuple[str, str, str, str]  # machine, source, event, target: a transition of a machine's table
# Transitions of the machines that the daemon's real processes cannot take, and why: the coverage goal leaves
# them out, and the report names them with the reason (the machines' own tests take every one).
UNREACHABLE: dict[Row, str] = {
    ("instance", "running", "rank_stopped", "recovering"): (
        "a rank reaped without having failed while its instance runs: the planner never stops a running "
        "generation's ranks unasked (a process that ends on its own is Failed first, and reported as such)"
    ),
    ("instance", "running", "rank_stopped", "deleted"): "the same, on the last retry of the budget",
    ("instance", "recovering", "rank_failed", "deleted"): (
        "a non-retryable failure (a defect of the model) during a recovery: the campaign and the fault matrix "
        "place sound models only, and since #26 files that go missing are the host's, not the model's"
    ),
}

_ONE_FOR_ONE = (
    "one_for_one only (`fsm.RestartStrategy.ONE_FOR_ONE`: replicas, a failed one restarted alone): the daemon "
    "runs an instance's ranks as one pipeline ring, which restarts together (one_for_all)"
)
UNREACHABLE.update(
    {
        ("instance", row.source, row.event or "auto", row.target): _ONE_FOR_ONE
        for row in fsm.diagram.transition_table(fsm.InstanceRetry)
        if fsm.InstanceState.DEGRADED.value in (row.source, row.target) and row.source != row.target
    }
)

# Transitions real processes can take but that a campaign seldom meets, and why: they stay in the goal, and a
# report that missed one says what it takes.
SELDOM: dict[Row, str] = {
    ("instance", "alive", "give_up", "deleted"): (
        "the planner gives up only where it would start runners with the budget spent: the last retry's first "
        "report must be a consequence (a rank that lost its peer), which spends the retry without giving up; the "
        "cause's own report, when it comes first, deletes the instance at once (rank_failed)"
    ),
}


def recoveries(
    samples: Sequence[InstanceSample], faults: Iterable[FaultRecord], standing: Iterable[str]
) -> list[float]:
    """For each fault injected: seconds from its end until etcd next held every ``standing`` instance (the ones
    placed before the faults began, not the workload's, which come and go) that was not given up as Ready."""
    watched = set(standing)
    at: dict[float, list[InstanceSample]] = {}
    for s in samples:
        if s.instance in watched:
            at.setdefault(s.time, []).append(s)
    ready = fsm.InstanceState.READY.value
    settled = sorted(t for t, now in at.items() if all(s.state == ready for s in now if not s.deleted and not s.spent))
    found = []
    for fault in faults:
        if fault.note:
            continue
        after = next((t for t in settled if t >= fault.end), None)
        if after is not None:
            found.append(after - fault.end)
    return found


def rows_of(coverage: Mapping[str, MachineCoverage]) -> tuple[set[Row], set[Row], set[Row]]:
    """(every transition of the machines, those the log took, those no log can show), as rows. An internal
    transition enters no state, so it writes no entry: its effect is on the machine's counters alone."""
    every, seen, silent = set(), set(), set()
    for machine, cov in coverage.items():
        every |= {(machine, t.source, t.event or "auto", t.target) for t in cov.transitions_all}
        seen |= {(machine, t.source, t.event or "auto", t.target) for t in cov.transitions_seen}
        silent |= {(machine, t.source, t.event or "auto", t.target) for t in cov.transitions_all if t.internal}
    return every, seen, silent


def read_rows(path: Path) -> set[Row]:
    """Transitions another run recorded (the fault matrix's), if it did."""
    if not path.exists():
        return set()
    return {tuple(row) for row in json.loads(path.read_text())}  # type: ignore[misc]


def write_rows(path: Path, rows: Iterable[Row]) -> None:
    path.write_text("[\n" + ",\n".join(json.dumps(list(row)) for row in sorted(rows)) + "\n]\n")


def not_reached(missed: Iterable[Row]) -> str:
    """The report's list of what real processes did not take: the goal's misses (with what one takes, where it is
    seldom met), then what they cannot take, with the reason."""

    def line(row: Row, why: str | None) -> str:
        machine, source, event, target = row
        return f"\n- {machine}: {source} → {target} on `{event}`" + (f": {why}" if why else "")

    goal = "".join(line(row, SELDOM.get(row)) for row in sorted(missed)) or "\n- none"
    return goal + "".join(line(row, why) for row, why in UNREACHABLE.items())


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank, ``q`` in [0, 1]: with fewer than 100 values, p99 is the worst."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def section(result, matrix: set[Row]) -> str:  # result: exod.chaos.campaign.Result
    """The campaign's section of specs/reliability.md."""
    s, history = result.settings, result.history
    injected = Counter(
        f.kind.partition(":")[0] if f.kind.startswith("armed") else f.kind for f in history.faults if not f.note
    )
    skipped = Counter(f.kind for f in history.faults if f.note)
    faults = [
        "| fault | injected | not injected (its target held by another fault, or none alive) |",
        "|---|---:|---:|",
    ]
    for kind in Kind:
        why = result.abilities.why_not(kind)
        faults.append(
            f"| {kind.value} | {injected[kind.value] if why is None else '—: ' + why} | {skipped[kind.value]} |"
        )
    armed = Counter(f.kind for f in history.faults if f.kind.startswith("armed"))
    faults += [f"| {kind} (a runner's `[[fault]]`) | {n} | 0 |" for kind, n in sorted(armed.items())]
    by_client = Counter((op.client, op.outcome.value) for op in history.operations)
    clients = sorted({c for c, _ in by_client})
    outcomes = ["ok", "refused", "indeterminate", "hung", "malformed"]
    ops = ["| operation | " + " | ".join(outcomes) + " |", "|---|" + "---:|" * len(outcomes)]
    ops += [f"| {c} | " + " | ".join(str(by_client[(c, o)]) for o in outcomes) + " |" for c in clients]
    times = recoveries(history.samples, history.faults, result.standing)
    recovery = (
        f"{len(times)} recoveries: p50 {percentile(times, 0.5):.1f} s, p99 {percentile(times, 0.99):.1f} s, "
        f"worst {max(times):.1f} s (bound {result.bounds.recovery_s:.0f} s)"
        if times
        else "no recovery measured"
    )
    every, seen, silent = rows_of(result.coverage)
    both = (seen | matrix) & every
    goal = every - silent - set(UNREACHABLE)
    cover = ["| machine | transitions that write a log entry | campaign | fault matrix | together |"]
    cover.append("|---|---:|---:|---:|---:|")
    for machine in sorted({r[0] for r in every}):
        mine = {r for r in goal if r[0] == machine}
        took = len(both & mine)
        share = f"{took} ({100 * took / max(1, len(mine)):.0f}%)"
        cover.append(f"| {machine} | {len(mine)} | {len(seen & mine)} | {len(matrix & mine)} | {share} |")
    missed = not_reached(goal - both)
    violations = "".join(f"\n- {v.line()}" for v in result.violations)
    window = fault_window(s.duration)
    where = "in a network namespace" if result.abilities.namespaces else "on loopback: no namespace here"
    return (
        "## Fault campaign\n\n"
        f"`exod chaos --seed {s.seed} --duration {s.duration:g}` (`make reliability`): a {s.members}-member etcd, "
        f"{s.nodes} nodes (node-1 {where}), "
        f"lease TTL {s.ttl} s, {len(result.schedule)} faults drawn from the seed over its first {window:.0f} s, "
        "a client workload throughout (chats in both dialects, streamed and not; placements and deletes; two "
        "`/events` readers resuming with `Last-Event-ID`), runner processes read from the process table every "
        f"30 ms and the state from etcd every 250 ms. Cold start {result.cold_start:.1f} s; bounds: a request "
        f"{result.bounds.request_s:.0f} s, Ready after the last heal {result.bounds.recovery_s:.0f} s.\n\n"
        f"**Violations: {len(result.violations) or 'none'}**{violations}"
        + ("; the rig failed: " + "; ".join(result.errors) if result.errors else "")
        + "\n\n### Faults\n\n"
        + "\n".join(faults)
        + "\n\n### Operations\n\n"
        + "\n".join(ops)
        + f"\n\n### Recovery\n\nFrom each fault's end until the standing instances are "
        f"Ready again, as etcd holds them (faults that overlap count each): {recovery}.\n\n"
        "### Transitions taken by real processes\n\n"
        "Counted from the transition logs as `exod replay` replays them: the campaign's (the cluster's log in "
        "etcd) and the fault matrix's (tests/test_fault_matrix.py, one host). Goal: every transition, 100%.\n\n"
        + "\n".join(cover)
        + f"\n\nTogether: {len(both & goal)} of the {len(goal)}. Not reached:\n"
        + missed
        + f"\n\nLeft out of the count: the {len(silent)} internal transitions (a rank created or Ready while its "
        "generation starts, a request started while busy, a tick …), which enter no state and so write no log entry; "
        "the machines' own tests (tests/test_runner.py, tests/test_instance.py, tests/test_download.py) take them.\n"
    )


def write_section(spec: Path, name: str, body: str) -> None:
    """Replace section ``name`` of ``spec`` (``<!-- NAME -->`` … ``<!-- /NAME -->``), keeping the others."""
    text = spec.read_text() if spec.exists() else TITLE
    block = f"<!-- {name} -->\n{body.strip()}\n<!-- /{name} -->"
    pattern = re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    if not text.startswith(TITLE):
        text = TITLE + "\n" + text[text.index("<!--") :]
    spec.write_text(text)
