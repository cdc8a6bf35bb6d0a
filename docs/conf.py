"""Sphinx configuration of fsm's documentation (`make docs`): a tutorial, the rules and the seed bug each
prevents, the machines drawn from the code, and the API reference from the docstrings.

Sphinx, as python-statemachine and attrs use: autodoc reads the docstrings the library ships, so the reference
cannot drift from the code, and the graphviz extension draws `fsm.diagram.dot` at build time. Its doctest
extension runs the site's snippets.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fsm  # noqa: E402
from fsm import diagram  # noqa: E402

project = "fsm"
release = fsm.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.graphviz", "sphinx.ext.doctest"]
# `sphinx -b doctest` runs every snippet on the site: the pages' ``.. doctest::`` blocks and any ``>>>`` example
# in a docstring autodoc shows (tests/test_docs_site.py); longer programs are included from tested examples/.
doctest_test_doctest_blocks = "default"
exclude_patterns = ["_build", "*.png"]
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # attrs' generated signatures say the types already
graphviz_output_format = "svg"
html_theme = "alabaster"
nitpicky = False

GENERATED = Path(__file__).resolve().parent / "_generated"


def _code(text: str) -> str:
    return f"``{text}``" if text else ""


def _machine_page(name: str, cls: type) -> str:
    """One machine: its theory of operation, its diagram and its transition table, all from the code."""
    title = f"The {name} machine: ``{cls.__name__}``"
    rows = [
        f"   * - ``{t.source}``\n     - {_code(t.event) or '*(automatic)*'}\n     - {_code(t.guard)}\n"
        f"     - ``{t.target}``"
        for t in diagram.transition_table(cls)
    ]
    dot = diagram.dot(cls).replace("\n", "\n   ")
    return (
        f"{title}\n{'=' * len(title)}\n\n"
        f".. automodule:: {cls.__module__}\n   :no-members:\n   :no-index:\n\n"
        f".. graphviz::\n\n   {dot}\n\n"
        ".. list-table:: Transitions\n   :header-rows: 1\n\n"
        "   * - source\n     - event\n     - guard\n     - target\n" + "\n".join(rows) + "\n"
    )


def _write_machines(app) -> None:
    GENERATED.mkdir(exist_ok=True)
    for name, cls in fsm.MACHINES.items():
        (GENERATED / f"{name}.rst").write_text(_machine_page(name, cls))


def _skip(app, what: str, name: str, obj: object, skip: bool, options: object) -> bool | None:
    """A machine's states and events, and what python-statemachine's base class brings, are the machine pages'
    and python-statemachine's own documentation: the reference lists what fsm adds."""
    from statemachine import State
    from statemachine.event import Event

    if isinstance(obj, State | Event) or (what == "class" and name in _statemachine_names()):
        return True
    return None


def _statemachine_names() -> set[str]:
    """What any machine class has from python-statemachine (its metaclass sets some per class)."""
    from statemachine import State, StateMachine

    class Probe(StateMachine):
        idle = State(initial=True)
        done = State(final=True)
        finish = idle.to(done)

    return set(dir(Probe)) - {"idle", "done", "finish"}


def setup(app) -> None:
    app.connect("builder-inited", _write_machines)
    app.connect("autodoc-skip-member", _skip)
