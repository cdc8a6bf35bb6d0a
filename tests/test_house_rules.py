"""Rules of the house that a reader would otherwise have to enforce by hand."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fsm

ROOT = Path(__file__).resolve().parent.parent
# The machines may name their own states: that is where the names are declared.
MACHINE_MODULES = {"fsm/runner.py", "fsm/instance.py", "fsm/download.py", "fsm/_machine.py"}
STATE_NAMES = frozenset(
    {state.id for cls in fsm.MACHINES.values() for state in cls.states_map.values()}
    | {
        member.value
        for enum in (fsm.RunnerState, fsm.RunnerPhase, fsm.InstanceState, fsm.DownloadState)
        for member in enum
    }
)


def _state_literals(node: ast.expr) -> list[str]:
    """The state names ``node`` spells as string literals (a literal, or a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value in STATE_NAMES else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [name for element in node.elts for name in _state_literals(element)]
    return []


def string_state_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, name) for every comparison of something with a state name written as a string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [(node.lineno, name) for name in _state_literals(operand)]
    return found


def _modules() -> list[Path]:
    paths = sorted((ROOT / "fsm").glob("*.py")) + sorted((ROOT / "daemon" / "exod").rglob("*.py"))
    return [p for p in paths if p.relative_to(ROOT).as_posix() not in MACHINE_MODULES]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_state_name_is_compared_as_a_string_outside_the_machines(path: Path):
    hits = string_state_comparisons(path.read_text())
    assert not hits, f"compare with the enums or the machines' states, not strings: {hits}"


def test_the_detector_sees_the_shapes_it_forbids():
    bad = 'a.leaf == "stopping"\nb in ("available", "busy")\n"ready" != c\nd.kind == "download"\ne == "auto"\n'
    assert string_state_comparisons(bad) == [(1, "stopping"), (2, "available"), (2, "busy"), (3, "ready")]
    assert string_state_comparisons("x is RunnerPhase.STOPPED\ny == RunnerState.READY.value\n") == []


FRONT_ENDS = ("api/app.py", "api/chat.py", "serve.py", "api/metrics.py", "cli/__init__.py")
CONTROLLER_INSIDES = {"cluster", "store", "models", "journal", "processes"}


def insides_touched(source: str) -> list[tuple[int, str]]:
    """(line, attribute) for ``controller.cluster`` / ``controller.store`` / ``controller._private`` and alike."""
    found = []
    for node in ast.walk(ast.parse(source)):
        on_controller = (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "controller"
        )
        if on_controller and (node.attr in CONTROLLER_INSIDES or node.attr.startswith("_")):
            found.append((node.lineno, node.attr))
    return sorted(found)


@pytest.mark.parametrize("name", FRONT_ENDS)
def test_front_ends_use_only_the_controllers_public_surface(name: str):
    hits = insides_touched((ROOT / "daemon" / "exod" / name).read_text())
    assert not hits, f"{name} reaches into the controller: {hits}"


def test_the_surface_detector_sees_what_it_forbids():
    source = "controller.cluster.instances\ncontroller.store.load()\ncontroller._act()\ncontroller.status()\n"
    assert insides_touched(source) == [(1, "cluster"), (2, "store"), (3, "_act")]


def test_the_controller_stays_one_room_not_a_house():
    """It keeps restore, the plan → execute → feed-back loop and the hand-over to the journal; a new job
    gets its own module (as requests, processes, status and the journal did)."""
    lines = (ROOT / "daemon" / "exod" / "controller.py").read_text().count("\n")
    assert lines < 400, f"daemon/exod/controller.py has {lines} lines: move a job out into its own module"
