"""The machines as Markdown documents, generated from the code: ``specs/<machine>.md``.

Each document holds, in this order: the machine's theory of operation (its
module docstring), a Mermaid diagram (`fsm.diagram.mermaid`, which GitHub
renders), the transition table (`fsm.diagram.markdown_table`), the invariants
of DESIGN §3.5 that concern the machine, in words, and the policy defaults read
from the code (`RetryPolicy()`, `DEFAULT_DOWNLOAD_BACKOFF`, the runner's
states and sub-phases).

Deterministic: no dates, no versions, no absolute paths. `drifted` compares
files with what the code generates now; a test calls it, and ``make specs``
(``exod specs``) rewrites the files.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import fsm
from fsm import diagram
from fsm.runner import phase_parent

__all__ = ["INVARIANTS", "TITLES", "drifted", "render_spec", "write_specs"]

TITLES = {
    "runner": "Runner lifecycle",
    "instance": "Instance retry policy",
    "download": "Download of a model to a node",
}

# DESIGN §3.5, numbered as there, each written for the machine it concerns.
INVARIANTS: dict[str, tuple[tuple[int, str], ...]] = {
    "runner": (
        (
            1,
            "Shutdown.stopped and Deleted absorb; a failure while stopping on request costs nothing: "
            "`shutdown.stopped` is final, no event moves a reaped runner again, and nothing leads from Shutdown "
            "back to a running state. A runner that fails while stopping (an error, or an exit that beat our "
            "stop: `exited` with `stop_delivered=False`) is recorded as Failed, but its instance treats it as "
            "stopped: no retry charged, never `Deleted(non_retryable)`.",
        ),
        (
            2,
            "Failed is left only to Shutdown: `failed` has no transition back to Idle, Connecting, Loading or "
            "Ready; its only way out is `exited` (the process was reaped) to `shutdown.stopped`. A new process "
            "is a new machine with a higher incarnation.",
        ),
        (
            7,
            "Stale-incarnation events are no-ops: an event naming an older `(runner_id, incarnation)` is "
            "ignored and changes nothing (state, progress, in-flight count, failure).",
        ),
        (9, "Determinism: replaying the same event log gives the same states and the same step log."),
        (
            10,
            "No deadlock: from every reachable state `shutdown.stopped` is reachable (`stop` then `exited`, or "
            "`exited` directly, which passes through Failed when the process was not stopping).",
        ),
    ),
    "instance": (
        (
            1,
            "Shutdown.stopped and Deleted absorb; a failure while stopping on request costs nothing: Deleted is "
            "final, absorbs every later event (late exits, timers, ticks), and nothing starts a runner of a "
            "Deleted instance. A rank that fails while being stopped on our request reaches this machine as "
            "`rank_failed_while_stopping` then `rank_stopped` (`fsm.cluster`): it charges no retry and never "
            "deletes the instance, but it may replace a peer's lost connection as `last_failure`, the cause.",
        ),
        (
            3,
            "Every backoff delay lies in `[min(initial, cap), cap]` (in `[0, cap]` with full jitter); within "
            "one failure streak the delays never decrease.",
        ),
        (4, "Runner creations per failure streak ≤ `max_failures + 1` generations."),
        (5, "No start before its deadline: `start` from Backing off is refused until `now ≥ deadline`."),
        (
            6,
            "one_for_all: never two generations of one instance alive at once (the next generation starts only "
            "after every rank of the previous one was reaped), and never more than N live runners for an "
            "instance of N ranks. Several ranks failing in one generation consume one retry.",
        ),
        (7, "Stale-generation events are no-ops: a rank event naming an older generation changes nothing."),
        (
            8,
            "Reset happens iff the instance was Ready continuously for ≥ `reset_after`: only then does the "
            "retry count return to 0.",
        ),
        (9, "Determinism: the same events, clock and seed give the same states and the same backoff schedule."),
        (
            10,
            "No deadlock: from every reachable state Ready, Parked or Deleted is reachable (`delete` is accepted "
            "from every non-final state), and a request that waits is served: one for a parked instance unparks "
            "it, and is never refused while the instance can start (with other instances on its nodes: once "
            "`fsm.admit_unpark` finds it room, evicting an idle one or when one becomes idle).",
        ),
        (11, "A parked instance has no live process: Parking goes on to Parked only once the last rank is reaped."),
        (
            12,
            "Parking and unparking spend no retry: `attempts` and `uncharged` are what they were, and a rank that "
            "fails while its instance parks charges nothing (the stop was ours).",
        ),
        (13, "An instance is parked only while no request is in flight on its runners (guard `idle`)."),
        (
            14,
            "Eviction parks only idle instances: admission (`fsm.admit` with `evict`, `fsm.admit_unpark`) names "
            "only Ready instances with no request in flight on their runners or waiting for them, and a finite "
            "keep-alive.",
        ),
        (
            15,
            "A node's memory is never over-committed: the ranks admitted on a node (instances placed and not "
            "parked) fit its memory, and so do the ranks of the runners alive there, an evicted or deleted "
            "instance's counted until they are reaped (`fsm.plan` starts nothing on a node before they are).",
        ),
    ),
    "download": (
        (
            3,
            "Every retry delay lies in `[min(initial, cap), cap]` and never decreases within one streak of "
            "failures; the streak (and so the backoff) resets when a runner starts loading the model.",
        ),
        (5, "No retry before its deadline: `retry` from Failed is refused until `now ≥ retry_at`."),
        (9, "Determinism: replaying the same event log gives the same states and deadlines."),
        (
            10,
            "No deadlock: from every reachable state Completed is reachable — a failed download is retried "
            "after its backoff (unlike exo, which never retries one).",
        ),
    ),
}

_HEADER = re.compile(r"^Theory of operation\n-+\n", re.M)


def _module_doc(cls: type) -> str:
    return inspect.cleandoc(sys.modules[cls.__module__].__doc__ or "")


def _rst_to_markdown(text: str) -> str:
    """The docstrings' reStructuredText, as Markdown: ``x`` → `x`, ``::`` blocks → fenced code."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::"):
            lead = line.rstrip()[:-2].rstrip()
            if lead:
                out.append(_inline(lead) + ":")
            i += 1
            while i < len(lines) and not lines[i].strip():
                i += 1
            block: list[str] = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith("    ")):
                block.append(lines[i][4:])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            out.extend(["", "```text", *block, "```", ""])
            continue
        out.append(_inline(line))
        i += 1
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _inline(line: str) -> str:
    return line.replace("``", "`")


def _theory(cls: type) -> tuple[str, str]:
    """The docstring's summary line, and its body (the theory of operation) in Markdown."""
    doc = _module_doc(cls)
    summary, _, body = doc.partition("\n")
    body = _HEADER.sub("", body.strip("\n"), count=1)
    return _inline(summary.strip()), _rst_to_markdown(body)


def _num(value: float) -> str:
    return f"{value:g}"


def _backoff_rows(backoff: fsm.Backoff, prefix: str, where: str) -> list[str]:
    return [
        f"| `{prefix}initial` | {_num(backoff.initial)} s | delay before the first retry (never 0) | {where} |",
        f"| `{prefix}factor` | {_num(backoff.factor)} | growth per failed attempt | {where} |",
        f"| `{prefix}cap` | {_num(backoff.cap)} s | longest delay | {where} |",
        f"| `{prefix}jitter` | {backoff.jitter} | full jitter, `uniform(0, delay)` | {where} |",
    ]


def _schedule(backoff: fsm.Backoff, attempts: int) -> str:
    delays = ", ".join(f"{_num(backoff.ceiling(n))} s" for n in range(1, attempts + 1))
    return f"Delays before retries 1–{attempts} (`min(cap, initial · factor^(n−1))`, un-jittered): {delays}."


def _retry_schedule(backoff: fsm.Backoff, max_failures: int | None) -> str:
    """An instance's: failure n (n < max_failures) is retried after delay n; failure max_failures gives up."""
    retries = 5 if max_failures is None else max_failures - 1
    gives_up = "" if max_failures is None else f"; failure {max_failures} gives up (Deleted, `retries_exhausted`)"
    return _schedule(backoff, retries).rstrip(".") + gives_up + "."


def _defaults(name: str) -> str:
    if name == "instance":
        policy = fsm.RetryPolicy()
        where = "`fsm.RetryPolicy()`"
        rows = [
            "| setting | default | meaning | from |",
            "| --- | --- | --- | --- |",
            *_backoff_rows(policy.backoff, "backoff.", where),
            f"| `max_failures` | {policy.max_failures} | charged failed generations (one_for_one: failed "
            f"replicas) before Deleted(`retries_exhausted`): N allows N−1 retries; formerly `max_retries` | {where} |",
            f"| `reset_after` | {_num(policy.reset_after)} s | Ready this long continuously → the retry count "
            f"returns to 0 | {where} |",
        ]
        return "\n".join(rows) + "\n\n" + _retry_schedule(policy.backoff, policy.max_failures) + "\n"
    if name == "download":
        backoff = fsm.DEFAULT_DOWNLOAD_BACKOFF
        where = "`fsm.DEFAULT_DOWNLOAD_BACKOFF`"
        rows = [
            "| setting | default | meaning | from |",
            "| --- | --- | --- | --- |",
            *_backoff_rows(backoff, "", where),
        ]
        return (
            "\n".join(rows)
            + "\n\nNo retry budget: a failed download is retried after each delay, without limit. "
            + _schedule(backoff, 6)
            + "\n"
        )
    # runner: no policy, only its states and sub-phases
    rows = ["| state | sub-phases |", "| --- | --- |"]
    for state in fsm.RunnerState:
        phases = [f"`{p.value}`" for p in fsm.RunnerPhase if phase_parent(p) is state]
        rows.append(f"| `{state.value}` | {', '.join(phases) if phases else '—'} |")
    return (
        "The runner machine has no tunable policy: its timeouts (stall detection) and retries belong to the "
        "daemon and to the instance's retry policy. Its states, from `fsm.RunnerState` and `fsm.RunnerPhase`:\n\n"
        + "\n".join(rows)
        + "\n\nGuards: `connect` needs `world_size > 1` (`multi_rank`); `load` from Idle needs `world_size == 1` "
        "(`single_rank`). A new `RunnerLifecycle` starts at incarnation 0, rank 0, world size 1.\n"
    )


def _machine(name: str) -> type:
    try:
        return fsm.MACHINES[name]
    except KeyError:
        raise fsm.InvalidConfig(f"unknown machine {name!r}; known: {', '.join(sorted(fsm.MACHINES))}") from None


def render_spec(name: str) -> str:
    """The Markdown document of machine ``name`` (a key of `fsm.MACHINES`), from the code alone."""
    cls = _machine(name)
    summary, theory = _theory(cls)
    module = cls.__module__.replace(".", "/") + ".py"
    invariants = "\n".join(f"{n}. {text}" for n, text in INVARIANTS[name])
    parts = [
        f"# {TITLES[name]} — `{cls.__name__}`\n",
        f"<!-- Generated from `{module}` by `exod specs` (`make specs`). Do not edit by hand. -->\n",
        f"{summary}\n",
        f"## Theory of operation\n\n{theory}",
        "## Diagram\n\nSelf-transitions are not drawn, and the transitions from one state to another share one edge; "
        f"the table below lists every transition.\n\n```mermaid\n{diagram.mermaid(cls)}```\n",
        "## Transitions\n\n"
        "Labels read `event [guard] / action`. *(eventless)* rows fire as soon as their guard holds; "
        "*(internal)* rows stay in their state (no exit, no entry).\n\n" + diagram.markdown_table(cls),
        "## Invariants\n\nThe invariants of DESIGN §3.5 that concern this machine, numbered as there.\n\n"
        + invariants
        + "\n",
        f"## Defaults\n\n{_defaults(name)}",
    ]
    return "\n".join(parts)


def write_specs(directory: Path) -> list[Path]:
    """Write ``<machine>.md`` for every machine into ``directory``; return the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in fsm.MACHINES:
        path = directory / f"{name}.md"
        path.write_text(render_spec(name), encoding="utf-8")
        written.append(path)
    return written


def drifted(directory: Path) -> list[str]:
    """The machine names whose ``<machine>.md`` in ``directory`` is missing or differs from the code's."""
    out = []
    for name in fsm.MACHINES:
        path = Path(directory) / f"{name}.md"
        if not path.is_file() or path.read_text(encoding="utf-8") != render_spec(name):
            out.append(name)
    return out
