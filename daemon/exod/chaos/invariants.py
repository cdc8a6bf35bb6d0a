"""The seven promises a campaign holds the cluster to, each a pure function of what it recorded.

Numbered as in issue #26; each returns the violations it found (none: kept). They read only the history an
outsider recorded (`exod.chaos.history`), the transition log as etcd holds it, and what was left behind.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

import fsm
from exod.chaos.history import NOT_STORED, FaultRecord, History, InstanceSample, Operation, Outcome, ProcessLife

READY = fsm.InstanceState.READY.value


@attrs.frozen
class Violation:
    invariant: int
    time: float
    text: str

    def line(self) -> str:
        return f"invariant {self.invariant} at t+{self.time:.2f}s: {self.text}"


@attrs.frozen
class Bounds:
    """The stated bounds: a request's answer, and Ready again after the last heal."""

    request_s: float
    recovery_s: float


def one_generation_at_a_time(processes: Iterable[ProcessLife]) -> list[Violation]:
    """1. Never two generations of one instance with processes alive at the same moment, and never two processes
    of one rank, whatever their generations (seen in one sample): a rank spawned twice in one generation is as
    much a split brain as two generations (of two generations, one violation says both)."""
    found = []
    by_instance: dict[str, list[ProcessLife]] = defaultdict(list)
    for life in processes:
        by_instance[life.instance].append(life)
    for iid, lives in sorted(by_instance.items()):
        told = set()  # one violation per pair of generations, or rank: the first moment they were seen together
        for a, b in itertools.combinations(sorted(lives, key=lambda p: p.first), 2):
            if max(a.first, b.first) > min(a.last, b.last):
                continue
            together = f"from t+{max(a.first, b.first):.2f}s to t+{min(a.last, b.last):.2f}s"
            pair = ("generations", *sorted((a.generation, b.generation)))
            if a.generation != b.generation and pair not in told:
                told.add(pair)
                twice = f", both rank {a.rank}" if a.rank == b.rank else ""
                found.append(
                    Violation(
                        1,
                        max(a.first, b.first),
                        f"{iid}: generation {a.generation} (pid {a.pid} on {a.node}) and generation {b.generation} "
                        f"(pid {b.pid} on {b.node}){twice} alive together {together}",
                    )
                )
            elif a.generation == b.generation and a.rank == b.rank and ("rank", a.rank) not in told:
                told.add(("rank", a.rank))
                found.append(
                    Violation(
                        1,
                        max(a.first, b.first),
                        f"{iid}: two processes of rank {a.rank}, pid {a.pid} on {a.node} (generation {a.generation}) "
                        f"and pid {b.pid} on {b.node} (generation {b.generation}), alive together {together}",
                    )
                )
    return found


def nothing_lost(operations: Sequence[Operation], log: Sequence[Mapping[str, Any]], kept: set[str]) -> list[Violation]:
    """2. Every acknowledged placement is still there (``kept``: the instances etcd holds) or was deleted by a
    client: its deletion in the log is a delete some client asked for, or the end of its retry budget."""
    asked_to_delete = {op.instance for op in operations if op.client == "delete" and op.outcome is not Outcome.REFUSED}
    ended = {
        e["id"]: e["event"] for e in log if e["machine"] == "instance" and e["to"] == fsm.InstanceState.DELETED.value
    }
    found = []
    for op in operations:
        if op.client != "place" or op.outcome is not Outcome.OK:
            continue
        how = ended.get(op.instance)
        if how is None and op.instance not in kept:
            found.append(
                Violation(
                    2,
                    op.end,
                    f"placement {op.instance} was acknowledged, then lost: no delete, "
                    "no end of its budget, and not in etcd",
                )
            )
        elif how == "delete" and op.instance not in asked_to_delete:
            found.append(Violation(2, op.end, f"placement {op.instance} was deleted, but no client asked for it"))
    return found


def every_request_ends(history: History, bounds: Bounds) -> list[Violation]:
    """3. Every request ends, with a result or an error in its dialect, within the bound; no stream hangs.
    A broken connection is a violation only if nothing was wrong with the node the client talked to; a change
    answered "made, not stored yet" only if nothing was wrong with etcd either (found by a 5-min campaign, seed
    2074194091: a member paused while a placement was written, the controller's term ended before the write)."""
    found = []
    for op in history.operations:
        took = op.end - op.start
        if op.outcome is Outcome.HUNG or took > bounds.request_s:
            found.append(
                Violation(
                    3,
                    op.start,
                    f"{op.client} to {op.node}: no end after {took:.1f}s (bound {bounds.request_s:.0f}s) {op.detail}",
                )
            )
        elif (
            op.outcome in (Outcome.MALFORMED, Outcome.INDETERMINATE)
            and not history.faulted(op.node, op.start, op.end)
            and not (op.detail.startswith(NOT_STORED) and history.store_faulted(op.start, op.end))
        ):
            found.append(
                Violation(
                    3,
                    op.start,
                    f"{op.client} to {op.node}, a node nothing was wrong with: {op.outcome.value}: {op.detail}",
                )
            )
    return found


def retries_charged(
    samples: Sequence[InstanceSample],
    processes: Iterable[ProcessLife],
    hits: Mapping[int, float],
    kills: Mapping[int, float],
    host_faults: Sequence[FaultRecord],
    deletes: Mapping[str, float],
    *,
    settle: float,
) -> list[Violation]:
    """4. A host's fault never spends a retry; a runner's own fault spends exactly one per generation.

    ``hits``: pid → when a runner fault hit it (a signal, or its armed fault); ``kills``: those of them that
    surely ended it (SIGKILL). An instance may be charged at most once per generation a runner fault hit, and
    must be charged once for each generation a kill ended cleanly: every rank alive when it struck, a newer
    generation after it, and no host fault or delete within ``settle`` seconds (which may have ended the
    generation first, uncharged)."""
    lives = list(processes)
    charged = _charges(samples)
    found = []
    for iid in sorted(charged.keys() | {p.instance for p in lives}):
        mine = [p for p in lives if p.instance == iid]
        hit = {p.generation for p in mine if p.pid in hits}
        certain = {
            p.generation
            for p in mine
            if p.pid in kills and _clean(p, kills[p.pid], mine, host_faults, deletes.get(iid), settle)
        }
        times = charged.get(iid, [])
        spent = len(times)
        if spent > len(hit):
            found.append(
                Violation(
                    4,
                    times[len(hit)],
                    f"{iid}: {spent} retries charged, but runner faults hit only "
                    f"{len(hit)} of its generations ({sorted(hit)}): a host's fault was charged",
                )
            )
        elif spent < len(certain):
            found.append(
                Violation(
                    4,
                    min(kills[p.pid] for p in mine if p.generation in certain and p.pid in kills),
                    f"{iid}: kills of runners ended generations {sorted(certain)}, but only "
                    f"{spent} retries were charged",
                )
            )
    return found


def _clean(
    killed: ProcessLife,
    when: float,
    mine: list[ProcessLife],
    host_faults: Sequence[FaultRecord],
    deleted: float | None,
    settle: float,
) -> bool:
    """Whether the kill at ``when`` alone ended ``killed``'s generation."""
    peers = [q for q in mine if q.generation == killed.generation]
    return (
        all(q.last >= when for q in peers)
        and any(q.generation > killed.generation for q in mine)
        and not any(f.start <= when + settle and when - settle <= f.end for f in host_faults)
        and (deleted is None or abs(deleted - when) >= settle)
    )


def _charges(samples: Sequence[InstanceSample]) -> dict[str, list[float]]:
    """When each instance was charged a retry, over resets of its budget (a stable instance's count goes to 0);
    a retry given back (its generation was the host's failure after all) takes the last charge back."""
    charged: dict[str, list[float]] = defaultdict(list)
    last: dict[str, int] = {}
    for s in sorted(samples, key=lambda s: s.time):
        before = last.get(s.instance, 0)
        charged[s.instance] += [s.time] * max(0, s.attempts - before)
        if s.attempts < before and s.uncharged > 0:  # given back, not a reset (which clears both counts)
            del charged[s.instance][s.attempts - before :]
        last[s.instance] = s.attempts
    return dict(charged)


def left_parked(operations: Sequence[Operation]) -> set[str]:
    """The instances a client's last word on parked (a park not refused, no unpark after it): not Ready by
    request, not for want of recovery."""
    last: dict[str, Operation] = {}
    for op in sorted(operations, key=lambda op: op.start):
        if op.client in ("park", "unpark") and op.outcome is not Outcome.REFUSED:
            last[op.instance] = op
    return {iid for iid, op in last.items() if op.client == "park"}


def ready_after_the_last_heal(
    samples: Sequence[InstanceSample], healed: float, bounds: Bounds, parked: set[str] = frozenset()
) -> list[Violation]:
    """5. After the last heal, every instance whose budget is not spent is Ready within the bound, and stays;
    but one that a client left ``parked``."""
    latest: dict[str, InstanceSample] = {}
    first_ready: dict[str, float] = {}
    for s in sorted(samples, key=lambda s: s.time):
        latest[s.instance] = s
        if s.time >= healed and s.state == READY:
            first_ready.setdefault(s.instance, s.time)
    last = max((s.time for s in samples), default=0.0)
    found = []
    for iid, s in sorted(latest.items()):
        if s.deleted or s.spent or iid in parked:
            continue
        if s.time < last:  # gone from etcd: deleted and forgotten between two samples (invariant 2 judges how)
            continue
        ready_at = first_ready.get(iid)
        if ready_at is None or ready_at - healed > bounds.recovery_s or s.state != READY:
            when = "never" if ready_at is None else f"after {ready_at - healed:.1f}s"
            found.append(
                Violation(
                    5,
                    healed,
                    f"{iid} Ready {when} (bound {bounds.recovery_s:.0f}s), last seen "
                    f"{s.state} in generation {s.generation}",
                )
            )
    return found


def the_log_replays(
    divergence: str | None,
    events: Mapping[str, Sequence[Mapping[str, Any]]],
    log: Sequence[Mapping[str, Any]],
    start: int,
) -> list[Violation]:
    """6. The cluster's log replays through the machines (``divergence``: `exod replay`'s first, or None), and what
    each `/events` reader was sent is a gap-free prefix of it (``log``: its entries from sequence ``start``)."""
    found = [Violation(6, 0.0, f"the cluster's log diverges: {divergence}")] if divergence else []
    for reader, docs in sorted(events.items()):
        seqs = [int(d["seq"]) for d in docs]
        expected = list(range(start, start + len(seqs)))
        if seqs != expected:
            at = next(i for i, (a, b) in enumerate(zip(seqs, expected, strict=False)) if a != b) if seqs[:1] else 0
            found.append(
                Violation(
                    6, 0.0, f"reader {reader} was sent seq {seqs[at]} where {expected[at]} was due (a gap or a repeat)"
                )
            )
            continue
        for doc in docs:
            entry = log[int(doc["seq"]) - start] if int(doc["seq"]) - start < len(log) else None
            if entry is None or {k: v for k, v in doc.items() if k != "seq"} != dict(entry):
                found.append(
                    Violation(6, 0.0, f"reader {reader} was sent, as seq {doc['seq']}, {doc}; the log holds {entry}")
                )
                break
    return found


def nothing_left_behind(leftovers: Sequence[str]) -> list[Violation]:
    """7. No process, claim key, namespace or mount is left when the campaign ends."""
    return [Violation(7, 0.0, f"left behind: {what}") for what in leftovers]
