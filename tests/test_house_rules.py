"""Rules of the house that a reader would otherwise have to enforce by hand."""

from __future__ import annotations

import ast
import enum
import inspect
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


_DAEMON = ROOT / "daemon" / "exod"
FRONT_ENDS = sorted(  # the HTTP front end, the command line and the task tree that starts them
    p.relative_to(_DAEMON).as_posix()
    for p in [*_DAEMON.glob("api/*.py"), *_DAEMON.glob("cli/*.py"), _DAEMON / "serve.py"]
)
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


# -- the daemon's rooms: which package may import which (exod/__init__.py says why) -----------------------

EXOD = _DAEMON
# Bottom to top: a package imports only its own layer and those below it.
LAYERS = ("runner", "state", "host", "cluster", "core", "api", "shell")
SHELL = {"exod", "exod.__main__", "exod.serve", "exod.cli"}


def module_name(path: Path) -> str:
    parts = path.relative_to(EXOD.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """The layer of ``exod.x.y``: its package, the shell, or the core (the daemon's other top-level modules)."""
    parts = module.split(".")
    if module in SHELL or parts[:2] in (["exod", "cli"], ["exod", "chaos"]):
        return "shell"
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "core"


def exod_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) for every import of an exod module, at the top or inside a function."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "exod"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level or base.split(".")[0] != "exod":  # the house imports absolutely (ruff's TID252)
                continue
            for alias in node.names:  # `from exod.api import chat` names a module; `from exod.api.chat import X` not
                candidate = f"{base}.{alias.name}"
                is_module = (EXOD.parent / candidate.replace(".", "/")).with_suffix(".py").exists() or (
                    EXOD.parent / candidate.replace(".", "/") / "__init__.py"
                ).exists()
                found.append((node.lineno, candidate if is_module else base))
    return found


def _daemon_modules() -> list[Path]:
    return sorted(EXOD.rglob("*.py"))


def refused_imports(path: Path) -> list[str]:
    name = module_name(path)
    here = layer_of(name)
    refused = []
    for line, target in exod_imports(path.read_text()):
        there = layer_of(target)
        if LAYERS.index(there) > LAYERS.index(here):
            refused.append(f"{line}: {name} ({here}) imports {target} ({there}), a layer above it")
        elif here == "api" and there in ("state", "runner"):
            refused.append(f"{line}: {name} imports {target}: the front end asks the controller, not the {there}")
    return refused


@pytest.mark.parametrize("path", _daemon_modules(), ids=lambda p: p.relative_to(EXOD).as_posix())
def test_no_package_imports_one_above_it(path: Path):
    assert not refused_imports(path), "\n".join(refused_imports(path))


def test_the_import_rules_see_what_they_forbid(tmp_path, monkeypatch):
    assert [layer_of(m) for m in ("exod.runner.batch", "exod.state.sqlite", "exod.host.ring")] == [
        "runner",
        "state",
        "host",
    ]
    assert [layer_of(m) for m in ("exod.cluster.agent", "exod.controller", "exod.api.chat", "exod.cli.serve")] == [
        "cluster",
        "core",
        "api",
        "shell",
    ]
    assert layer_of("exod.serve") == layer_of("exod") == "shell"
    up = "from exod.config import DaemonConfig\n\ndef f():\n    from exod.api.errors import ApiError\n"
    assert exod_imports(up) == [(1, "exod.config"), (4, "exod.api.errors")]
    assert exod_imports("from exod.api import chat\nfrom exod import generated as g\n") == [
        (1, "exod.api.chat"),
        (2, "exod.generated"),
    ]
    fake = EXOD / "cluster" / "agent.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: up if self == fake else "")
    assert refused_imports(fake) == [
        "1: exod.cluster.agent (cluster) imports exod.config (core), a layer above it",
        "4: exod.cluster.agent (cluster) imports exod.api.errors (api), a layer above it",
    ]
    wire = EXOD / "api" / "chat.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "from exod.runner import protocol as p\n")
    assert refused_imports(wire) == [
        "1: exod.api.chat imports exod.runner.protocol: the front end asks the controller, not the runner"
    ]


def test_the_daemons_top_level_stays_a_short_list():
    """The packages are the map; a new top-level module is a decision, not a default."""
    top = sorted(p.name for p in EXOD.glob("*.py"))
    assert len(top) <= 15, f"daemon/exod/ has {len(top)} modules at its top level: {top}"


def _public_classes_of_fsm() -> list[type]:
    """The classes a library user reaches: those in ``fsm.__all__``, and those of the public modules it names
    (``fsm.runner``'s events, ``fsm.log.LogEntry`` …)."""
    found = {getattr(fsm, name) for name in fsm.__all__ if inspect.isclass(getattr(fsm, name))}
    for name in fsm.__all__:
        module = getattr(fsm, name)
        if inspect.ismodule(module):
            found |= {
                value
                for key, value in vars(module).items()
                if inspect.isclass(value) and not key.startswith("_") and value.__module__ == module.__name__
            }
    return sorted(found, key=lambda cls: (cls.__module__, cls.__qualname__))


def _machine_base_names() -> set[str]:
    """What any machine class has from python-statemachine (its metaclass sets some per class): not fsm's to
    document (docs/conf.py leaves the same names out of the reference)."""
    from statemachine import State, StateMachine

    class Probe(StateMachine):
        idle = State(initial=True)
        done = State(final=True)
        finish = idle.to(done)

    return set(dir(Probe)) - {"idle", "done", "finish"}


def undocumented_members(cls: type) -> list[str]:
    """``Owner.name`` for each public method or property of ``cls`` (its own, or one it has from a class of
    fsm's, public or not) with no docstring of its own. attrs' fields and generated dunders are not fsm's to
    document, nor are a machine's states and events (its page draws them) or what python-statemachine brings."""
    import attrs
    from statemachine import State, StateMachine
    from statemachine.event import Event

    fields = {field.name for field in attrs.fields(cls)} if attrs.has(cls) else set()
    inherited = _machine_base_names() if issubclass(cls, StateMachine) else set()
    missing = []
    for owner in cls.__mro__:
        if owner.__module__.split(".")[0] != cls.__module__.split(".")[0]:
            continue  # object, enum.Enum, python-statemachine's classes, typing.Protocol …
        for name, value in vars(owner).items():
            if name.startswith("_") or name in fields or name in inherited or isinstance(value, State | Event):
                continue
            function = value.__func__ if isinstance(value, classmethod | staticmethod) else value
            is_method = isinstance(function, property) or inspect.isfunction(function)
            if is_method and not (function.__doc__ or "").strip():
                missing.append(f"{owner.__name__}.{name}")
    return missing


def undocumented_enum_members(cls: type) -> list[str]:
    """``Enum.MEMBER`` for each member with no Sphinx doc comment (``#:``): a plain ``#`` comment is lost to
    the API reference and to every reader but one with the source open."""
    from sphinx.pycode import ModuleAnalyzer

    documented = ModuleAnalyzer.for_module(cls.__module__).find_attr_docs()
    return [
        f"{cls.__qualname__}.{member}"
        for member in cls.__members__
        if not "".join(documented.get((cls.__qualname__, member), [])).strip()
    ]


def test_every_public_name_of_fsm_says_what_it_is():
    """#27: `help(fsm)` and the API reference are read by newcomers; attrs' generated text is not a docstring.
    Every public class (of ``fsm.__all__`` and of the public modules it names), each of its public methods and
    properties, and each enum member says what it is for."""
    missing = []
    for name in fsm.__all__:
        value = getattr(fsm, name)
        if (inspect.isfunction(value) or inspect.ismodule(value)) and not value.__doc__:
            missing.append(name)
    for cls in _public_classes_of_fsm():
        doc = cls.__dict__.get("__doc__")
        if not doc or doc.startswith(f"{cls.__name__}("):
            missing.append(f"{cls.__module__}.{cls.__qualname__}")
        where = f"(of {cls.__module__}.{cls.__qualname__})"
        missing += [f"{member} {where}" for member in undocumented_members(cls)]
        if issubclass(cls, enum.Enum):
            missing += [f"{member} {where}: no #: comment" for member in undocumented_enum_members(cls)]
    assert not missing, f"public names of fsm without a docstring of their own: {sorted(set(missing))}"


class _Colour(enum.Enum):
    """A colour (for the detector's test)."""

    RED = "red"  #: documented on its line
    #: documented on the line before
    GREEN = "green"
    BLUE = "blue"  # a plain comment: not documentation


def test_the_docstring_detector_sees_what_it_forbids():
    import attrs

    @attrs.frozen
    class Thing:
        """A thing."""

        size: int

        def bare(self) -> None:
            pass

        @property
        def shape(self) -> str:
            return ""

        @classmethod
        def make(cls) -> None:
            """Documented."""

        def _private(self) -> None:
            pass

    class Child(Thing):
        """Inherits ``bare`` and ``shape`` undocumented; its own method is documented."""

        def grow(self) -> None:
            """Documented."""

    assert undocumented_members(Thing) == ["Thing.bare", "Thing.shape"]
    assert undocumented_members(Child) == ["Thing.bare", "Thing.shape"]
    assert undocumented_enum_members(_Colour) == ["_Colour.BLUE"]


def test_the_guide_at_the_top_of_help_fsm_names_only_what_exists():
    """#27: the first screen of `help(fsm)` is a guide to the API; a name it mentions that was renamed would send
    a newcomer looking for nothing."""
    import importlib
    import importlib.util
    import re

    import fsm

    guide = fsm.__doc__ or ""
    assert "Where to start" in guide
    missing = []
    for name in sorted(set(re.findall(r"``([A-Za-z_][\w.]*)(?:\(|``)", guide)) - {"now"}):  # `now`: the parameter
        head, *rest = name.removeprefix("fsm.").split(".")
        owner = getattr(fsm, head, None)
        if owner is None and importlib.util.find_spec(f"fsm.{head}"):  # a submodule imported on demand (fsm.check)
            owner = importlib.import_module(f"fsm.{head}")
        for part in rest:
            owner = getattr(owner, part, None)
        if owner is None:
            missing.append(name)
    assert not missing, f"fsm's guide names what fsm does not have: {missing}"
