"""Planted regressions: each safety mechanism removed, one at a time, from a scratch copy, and the fast tests
named for it run there; a plant they let through (it *survives*) fails the run (`make plants`, issue #47).

    .venv/bin/python tools/plants.py                     # every plant, report in specs/plants.md
    .venv/bin/python tools/plants.py spawn-any-term      # some of them, by name
    .venv/bin/python tools/plants.py --ci                # the short subset tests/test_plants.py runs
    .venv/bin/python tools/plants.py --list              # the plants, their edits and tests; nothing run

A mechanism without a test that fails when it is removed does not count as present: mutation testing
(`tools/mutation.py`) asks that of `fsm/`'s every operator; this asks it of the few edits a distributed-systems
reviewer fears most in the daemon's control plane, each written as the small, exact source edit a real
regression would be.

How a plant runs:

* The working tree as it is now (its tracked files, and untracked ones git does not ignore: others' uncommitted
  work included) is copied to a fresh temporary directory; the checkout itself is never touched.
* The plant's edits are applied there. Each is ``(path, old, new)``, and ``old`` must occur exactly once: a
  plant that matches nowhere (or twice) means the code drifted from it, and is reported as an error, never
  silently skipped.
* Its tests run in the copy with ``PYTHONPATH=<copy>/daemon:<copy>``, so the copy's ``exod`` and ``fsm``
  shadow the editable install, in pytest and in every process it starts (``python -m exod``, the runners):
  checked before the first plant (`check_shadowing`). ``-x``: the first failing test is the catch, and the
  seconds until pytest ended are the time to catch. A named test file that does not exist (yet) is left out
  and said; a plant with none left survives.
* With ``--baseline``, the same tests run first on the unplanted copy; those that fail there (a busy machine,
  a test someone is changing) are deselected from the plants' runs and listed, so a plant is never "caught"
  by a test that fails anyway.

Exit status: 0 when every plant was caught; 1 when one survived, did not apply, or its tests could not run (a
collection error: the report shows pytest's output); 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "specs" / "plants.md"
TIMEOUT_S = 900  # one plant's tests, at most: a plant that makes a test hang is caught, by the clock
PYTEST = ("-x", "-q", "-rf", "-p", "no:cacheprovider", "-p", "no:randomly")


class PlantDoesNotApply(Exception):
    """A plant's ``old`` text is not in its file exactly once: the code drifted, the plant must follow it."""


@attrs.frozen
class Edit:
    """Replace ``old`` by ``new`` in ``path`` (relative to the repository); ``old`` must occur exactly once."""

    path: str
    old: str
    new: str

    def patched(self, root: Path) -> str:
        """The file's text with the edit made (`PlantDoesNotApply` unless ``old`` is in it exactly once)."""
        file = root / self.path
        if not file.is_file():
            raise PlantDoesNotApply(f"{self.path} does not exist")
        text = file.read_text()
        found = text.count(self.old)
        if found != 1:
            first = self.old.strip().splitlines()[0] if self.old.strip() else repr(self.old)
            raise PlantDoesNotApply(f"{self.path}: {first!r} found {found} times, not once: the code drifted")
        return text.replace(self.old, self.new)

    def apply(self, root: Path) -> None:
        (root / self.path).write_text(self.patched(root))


@attrs.frozen
class Plant:
    """One regression: what it breaks (in words, as the report shows it), its edits, and the tests that should
    catch it (files or node ids, relative to the repository)."""

    name: str
    what: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]
    ci: bool = False  # in the short subset tests/test_plants.py runs in `make test`


@attrs.frozen
class Outcome:
    plant: Plant
    verdict: str  # "caught", "survived", "does not apply", "error"
    caught_by: str = ""  # the first failing test's node id (or "timeout")
    seconds: float = 0.0
    missing: tuple[str, ...] = ()  # named test files not in the tree (yet)
    detail: str = ""  # why it does not apply, or the end of pytest's output on an error


AGENT = "daemon/exod/cluster/agent.py"
NODES = "daemon/exod/cluster/nodes.py"
REMOTE = "daemon/exod/cluster/remote.py"
PROCESSES = "daemon/exod/processes.py"
MEMBERSHIP = "daemon/exod/cluster/membership.py"
SUPERVISOR = "daemon/exod/host/supervisor.py"
RULE = "tests/test_agent_generation_rule.py"  # issue #45: the agent's generation rule, with a real etcd
WIRING = "tests/test_wiring.py"  # issue #47's wiring tests: Processes and the controller with a fake fleet

SPAWN_SKIPS_TERM = Edit(
    AGENT,
    "        self._check_term(term)\n        key = (request.runner_id, request.incarnation)\n",
    "        key = (request.runner_id, request.incarnation)\n",
)
CLAIM_IGNORES_TERM = Edit(
    AGENT,
    'guard = [Compare(election, "CREATE", "EQUAL", term), unchanged_since(runners, revision)]',
    "guard = [unchanged_since(runners, revision)]",
)

# The nine regressions issue #47 planted by hand, then the ones found more likely since (the agent's generation
# rule in its etcd transaction, #45; the forward's one hop; the heartbeat; the agent's fence).
PLANTS: tuple[Plant, ...] = (
    Plant(
        "term-outlives-clock",
        "the controller's term no longer ends by its own clock (`Membership._until_deposed`)",
        (
            Edit(
                MEMBERSHIP,
                "            await self.presence.authority_lost()\n",
                "            await trio.sleep_forever()\n",
            ),
        ),
        ("tests/test_election.py",),
    ),
    Plant(
        "spawn-any-term",
        "the agent accepts a spawn of any term (no term check in `Agent.spawn`, none in its claim's transaction)",
        (SPAWN_SKIPS_TERM, CLAIM_IGNORES_TERM),
        ("tests/test_agent.py",),
        ci=True,
    ),
    Plant(
        "deadline-10x",
        "the runner's deadline pushed 10× further (the supervisor's deadline pipe)",
        (
            Edit(
                SUPERVISOR,
                "monotonic = time.monotonic() + (self.deadline - trio.current_time())",
                "monotonic = time.monotonic() + 10 * (self.deadline - trio.current_time())",
            ),
        ),
        (WIRING, "tests/test_supervisor.py"),
    ),
    Plant(
        "earlier-gone-at-once",
        "`Fleet.earlier_gone` returns at once",
        (
            Edit(
                REMOTE,
                "        said = None\n        while True:\n            try:\n",
                "        return\n        said = None\n        while True:\n            try:\n",
            ),
        ),
        ("tests/test_remote.py",),
        ci=True,
    ),
    Plant(
        "no-tombstone",
        "the tombstone check removed (a spawn that a stop overtook runs all the same)",
        (Edit(AGENT, "        if key in self._stopped:\n", "        if False:\n"),),
        ("tests/test_agent.py",),
    ),
    Plant(
        "start-skips-earlier-gone",
        "the call to `earlier_gone` dropped in `Processes.start`",
        (
            Edit(
                PROCESSES,
                "                await fleet.earlier_gone(action.instance_id, gen)\n",
                "                pass\n",
            ),
        ),
        (WIRING, "tests/test_remote.py"),
    ),
    Plant(
        "local-ranks-direct",
        "the controller spawns its own node's ranks directly (no agent, no claim)",
        (
            Edit(
                PROCESSES,
                "        if self.fleet is not None:\n            across = self._ring(",
                "        if self.fleet is not None and action.node_id != self.fleet.local:\n"
                "            across = self._ring(",
            ),
        ),
        (WIRING,),
    ),
    Plant(
        "spawn-before-recorded",
        "the spawn no longer waits for etcd to hold the generation's term-guarded write (`recorded()`)",
        (Edit(PROCESSES, "                    await recorded()\n", "                    pass\n"),),
        (WIRING,),
    ),
    Plant(
        "alive-from-answer",
        "the lease's surely-alive bound taken from when a renewal was answered, not sent (`Presence._renew`)",
        (
            Edit(
                NODES,
                "self.alive_until = max(self.alive_until, asked + self.ttl)",
                "self.alive_until = max(self.alive_until, now + self.ttl)",
            ),
        ),
        (WIRING, "tests/test_election.py"),
    ),
    Plant(
        "claim-ignores-other-claims",
        "the agent's claim no longer compares the runner keys it read (#45: two claims race past the rule)",
        (
            Edit(
                AGENT,
                'guard = [Compare(election, "CREATE", "EQUAL", term), unchanged_since(runners, revision)]',
                'guard = [Compare(election, "CREATE", "EQUAL", term)]',
            ),
        ),
        (
            "tests/test_agent.py",
            f"{RULE}::test_a_claim_is_one_transaction_with_its_check_a_rivals_claim_between_them_is_seen",
        ),
    ),
    Plant(
        "claim-ignores-term",
        "the agent's claim no longer compares the election key with the spawn's term in etcd (its own check stays)",
        (CLAIM_IGNORES_TERM,),
        (
            "tests/test_agent.py",
            f"{RULE}::test_a_spawn_names_the_term_etcd_holds_at_the_claim_not_the_one_the_agent_last_saw",
        ),
    ),
    Plant(
        "spawn-skips-term-check",
        "`Agent.spawn` no longer checks the term against its stream's (the claim's transaction still does)",
        (SPAWN_SKIPS_TERM,),
        ("tests/test_agent.py",),
    ),
    Plant(
        "claim-skips-generation-rule",
        "the agent claims without checking the generation rule on the keys it read",
        (Edit(AGENT, "                self._check_generation(request, alive)\n", "                pass\n"),),
        (
            "tests/test_agent.py",
            f"{RULE}::test_a_claim_is_one_transaction_with_its_check_a_rivals_claim_between_them_is_seen",
            f"{RULE}::test_a_replayed_spawn_of_another_generation_is_refused_by_the_agent_and_never_runs",
        ),
    ),
    Plant(
        "fence-never-kills",
        "the agent's fence no longer kills its runners once its lease may have expired",
        (
            Edit(
                AGENT,
                "                self._end_session(\"this node's lease may have expired "
                '(etcd out of reach)", kill=True)',
                "                pass",
            ),
        ),
        ("tests/test_agent.py",),
    ),
    Plant(
        "forward-many-hops",
        "a forwarded request is forwarded again (the one-hop check removed): a loop mid-election",
        (
            Edit(
                "daemon/exod/api/forward.py",
                "        if any(k.lower() == FORWARDED for k, _ in headers):",
                "        if False:",
            ),
        ),
        (
            "tests/test_forward.py",
            "tests/test_cluster_failover_clients.py::"
            "test_the_cluster_token_is_the_clusters_at_every_node_a_forward_it_cannot_serve_is_503_never_401",
        ),
    ),
    Plant(
        "heartbeat-never-fails",
        "the heartbeat never fails a runner: every missed answer is excused as the daemon's own pause",
        (
            Edit(
                "daemon/exod/host/heartbeats.py",
                "                    self._listened(late or self._unheard())\n",
                "                    self._listened(True)\n",
            ),
        ),
        (
            "tests/test_heartbeat.py",
            "tests/test_runner_liveness.py::test_a_stopped_runner_misses_its_heartbeat_and_a_new_generation_serves",
        ),
    ),
)


# -- the scratch copy -------------------------------------------------------------------------------------------


def tree_files(root: Path = ROOT) -> list[str]:
    """The files of the working tree as git sees them now: tracked ones, and untracked ones it does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    return sorted({name for name in listed.decode().split("\0") if name and (root / name).is_file()})


def copy_tree(dest: Path, files: Iterable[str], root: Path = ROOT) -> None:
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target, follow_symlinks=False)


def environment(copy: Path) -> dict[str, str]:
    """The copy's ``exod`` and ``fsm`` first on every path, for pytest and every process it starts."""
    # A test session of its own (tests/daemon_harness.py's tag): its leftover checks see its processes only, and
    # a session that runs this (tests/test_plants.py) never takes the copy's runners for its own.
    dropped = ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST", "EXOD_TEST_SESSION")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["PYTHONPATH"] = os.pathsep.join([str(copy / "daemon"), str(copy)])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


SHADOW_PROBE = """
import subprocess, sys
import exod, fsm
child = subprocess.run([sys.executable, "-c", "import exod, fsm; print(exod.__file__); print(fsm.__file__)"],
                       capture_output=True, text=True, check=True).stdout.split()
print(exod.__file__); print(fsm.__file__); print(*child, sep="\\n")
"""


def check_shadowing(copy: Path) -> None:
    """Raise unless the copy's packages are what pytest, and a process it starts, import."""
    out = subprocess.run(
        [sys.executable, "-c", SHADOW_PROBE], cwd=copy, env=environment(copy), capture_output=True, text=True
    )
    paths = out.stdout.split()
    if (
        out.returncode != 0
        or len(paths) != 4
        or not all(Path(p).resolve().is_relative_to(copy.resolve()) for p in paths)
    ):
        raise RuntimeError(f"the scratch copy does not shadow the installed exod/fsm: {out.stdout}{out.stderr}")


# -- running ---------------------------------------------------------------------------------------------------


def present(tests: Iterable[str], root: Path) -> tuple[list[str], list[str]]:
    """The named tests whose file exists in ``root``, and those whose file does not (yet)."""
    here, missing = [], []
    for test in tests:
        (here if (root / test.split("::")[0]).is_file() else missing).append(test)
    return here, missing


NO_TESTS = 5  # pytest's exit status when it collected nothing
FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def run_tests(
    copy: Path, tests: list[str], deselect: Iterable[str] = (), *, stop: bool = True
) -> tuple[int, float, str]:
    """pytest in ``copy`` on ``tests``: its exit status (-1: it ran past `TIMEOUT_S`), seconds, its output."""
    args = [sys.executable, "-m", "pytest", *(PYTEST if stop else PYTEST[1:]), *tests]
    args += [f"--deselect={test}" for test in deselect]
    started = time.monotonic()
    # a session of its own: on a timeout, what the tests started (daemons, etcd, runners) goes with pytest
    with subprocess.Popen(
        args,
        cwd=copy,
        env=environment(copy),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as pytest:
        try:
            output, _ = pytest.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pytest.pid, signal.SIGKILL)
            output, _ = pytest.communicate()
            return -1, time.monotonic() - started, output
    return pytest.returncode, time.monotonic() - started, output


def failures(output: str) -> list[str]:
    return FAILED.findall(output)


def run_plant(plant: Plant, files: list[str], deselect: Iterable[str] = ()) -> Outcome:
    with tempfile.TemporaryDirectory(prefix=f"exod-plant-{plant.name}-") as scratch:
        copy = Path(scratch)
        copy_tree(copy, files)
        try:
            for edit in plant.edits:
                edit.apply(copy)
        except PlantDoesNotApply as exc:
            return Outcome(plant, "does not apply", detail=str(exc))
        tests, missing = present(plant.tests, copy)
        if not tests:
            return Outcome(plant, "survived", missing=tuple(missing), detail="none of its tests exists yet")
        rc, seconds, output = run_tests(copy, tests, deselect)
    if rc == 0:
        return Outcome(plant, "survived", seconds=seconds, missing=tuple(missing))
    if rc == NO_TESTS:  # every one of them deselected: they fail unplanted too
        return Outcome(plant, "survived", seconds=seconds, missing=tuple(missing), detail="its tests fail unplanted")
    if rc == -1:
        return Outcome(plant, "caught", "timeout (a test hung)", seconds, tuple(missing))
    if rc == 1 and (failed := failures(output)):
        return Outcome(plant, "caught", failed[0], seconds, tuple(missing))
    return Outcome(plant, "error", seconds=seconds, missing=tuple(missing), detail=output[-2000:])


def baseline(files: list[str], plants: Iterable[Plant]) -> list[str]:
    """The named tests that fail on the unplanted copy: deselected from the plants' runs."""
    with tempfile.TemporaryDirectory(prefix="exod-plant-baseline-") as scratch:
        copy = Path(scratch)
        copy_tree(copy, files)
        tests, _ = present(dict.fromkeys(t for plant in plants for t in plant.tests), copy)
        rc, _, output = run_tests(copy, tests, stop=False)
    if rc not in (0, 1):
        raise RuntimeError(f"the unplanted tests did not run (pytest exit {rc}):\n{output[-3000:]}")
    return failures(output)


# -- the report ------------------------------------------------------------------------------------------------


def report(outcomes: list[Outcome], flaky: list[str], total_s: float) -> str:
    lines = [
        "# Planted regressions",
        "",
        "Written by `make plants` (`tools/plants.py`): each regression below was applied to a scratch copy of the",
        "tree, and the tests named for it were run there; a plant *survives* when they all pass. Issue #47: a safety",
        "mechanism without a test that fails when it is removed does not count as present.",
        "",
        "| plant | what it breaks | verdict | caught by | seconds |",
        "| --- | --- | --- | --- | ---: |",
    ]
    for o in outcomes:
        verdict = f"**{o.verdict}**" if o.verdict != "caught" else o.verdict
        by = f"`{o.caught_by}`" if o.caught_by.startswith("tests/") else o.caught_by
        if o.verdict != "caught":
            named = ", ".join(f"`{t}`" for t in o.plant.tests)
            by = f"{o.detail} (named: {named})" if o.detail and o.verdict != "error" else f"nothing of {named}"
        if o.missing:
            by += " — not in the tree yet: " + ", ".join(f"`{t}`" for t in o.missing)
        seconds = f"{o.seconds:.1f}" if o.seconds else ""
        lines.append(f"| `{o.plant.name}` | {o.plant.what} | {verdict} | {by} | {seconds} |")
    caught = sum(o.verdict == "caught" for o in outcomes)
    lines += ["", f"{caught} of {len(outcomes)} plants caught, in {total_s:.0f} s in all."]
    if flaky:
        lines += ["", "Failing on the unplanted tree too, so deselected from every plant's run:", ""]
        lines += [f"* `{test}`" for test in flaky]
    errors = [o for o in outcomes if o.verdict == "error"]
    for o in errors:
        lines += ["", f"## `{o.plant.name}`: pytest did not run its tests", "", "```", o.detail.strip(), "```"]
    return "\n".join(lines) + "\n"


def does_not_apply(plant: Plant, root: Path = ROOT) -> str:
    """Why ``plant`` does not apply to the tree at ``root`` ("" if it does); nothing is written."""
    try:
        for edit in plant.edits:
            edit.patched(root)
    except PlantDoesNotApply as exc:
        return str(exc)
    return ""


def describe(plant: Plant) -> str:
    edits = "\n".join(f"    {e.path}:\n      - {e.old.strip()}\n      + {e.new.strip()}" for e in plant.edits)
    ci = " [ci]" if plant.ci else ""
    return f"{plant.name}{ci}: {plant.what}\n{edits}\n    tests: {', '.join(plant.tests)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("names", nargs="*", help="the plants to run (default: all)")
    parser.add_argument("--ci", action="store_true", help="only the short subset that `make test` runs")
    parser.add_argument("--list", action="store_true", help="list the plants; run nothing")
    parser.add_argument("--check", action="store_true", help="only check that each plant applies; run nothing")
    parser.add_argument("--baseline", action="store_true", help="run the tests unplanted first, deselect failures")
    parser.add_argument("--report", type=Path, default=None, help=f"where to write the report (all plants: {REPORT})")
    args = parser.parse_args(argv)
    by_name = {plant.name: plant for plant in PLANTS}
    if unknown := [n for n in args.names if n not in by_name]:
        parser.error(f"no plant {', '.join(unknown)}; there are: {', '.join(by_name)}")
    plants = [by_name[n] for n in args.names] if args.names else [p for p in PLANTS if p.ci or not args.ci]
    if args.list:
        print("\n".join(describe(plant) for plant in plants))
        return 0
    if args.check:
        drifted = [f"{plant.name}: {exc}" for plant in plants if (exc := does_not_apply(plant))]
        print("\n".join(drifted) or f"all {len(plants)} plants apply to the tree")
        return 1 if drifted else 0
    started = time.monotonic()
    files = tree_files()
    with tempfile.TemporaryDirectory(prefix="exod-plant-probe-") as scratch:
        copy_tree(Path(scratch), files)
        check_shadowing(Path(scratch))
    flaky = baseline(files, plants) if args.baseline else []
    if flaky:
        print(f"failing unplanted, deselected: {', '.join(flaky)}", flush=True)
    outcomes = []
    for plant in plants:
        outcome = run_plant(plant, files, flaky)
        outcomes.append(outcome)
        by = f" by {outcome.caught_by}" if outcome.caught_by else f": {outcome.detail[:200]}" if outcome.detail else ""
        print(f"{plant.name}: {outcome.verdict}{by} ({outcome.seconds:.1f} s)", flush=True)
    path = args.report or (REPORT if not args.names and not args.ci else None)
    if path is not None:
        path.write_text(report(outcomes, flaky, time.monotonic() - started))
        print(f"report: {path}")
    return 0 if all(o.verdict == "caught" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
