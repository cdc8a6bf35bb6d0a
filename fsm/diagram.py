"""Deterministic diagrams and transition tables of the lifecycle machines.

Pure: these functions read a python-statemachine class (never a file, a
process or the clock) and return text. They walk the class's states and
transitions themselves instead of using ``statemachine.contrib.diagram``,
whose DOT output embeds ``id()`` values and so changes from run to run.

Byte-for-byte determinism rests on a fixed order:

* states: declaration order, children nested under their compound parent
  (``cls.states_map`` keeps it);
* transitions: sorted by ``(source id, event id, target id)``; ties (one event
  with two guarded edges between the same states) keep declaration order.
  An eventless transition has event ``""`` and so sorts first for its source.

What the walk keeps and leaves out:

* the implicit initial transition of a compound state (``Transition.initial``)
  is not an event row: it is drawn as ``[*] --> child`` (Mermaid) or from a
  point node (DOT);
* guards are the transition's ``cond`` names, with ``unless`` names as
  ``!name``, joined by ``", "``; convention callbacks (``on_<event>``,
  ``on_transition``) are not actions, only the ``on=`` callbacks are;
* a transition that answers several events gives one row per event; a
  targetless transition (a compound's ``to(None)``) is shown as an internal
  self-transition.

Labels read ``event [guard] / action``, with the leading underscore of an
action's method name stripped (``_record_progress`` → ``record_progress``).

What the drawings leave to the table, so that a person can take them in:

* self-transitions (source == target, internal or not) are not drawn: they
  change no state, and the table lists them;
* the rows from one state to another (in one scope) are one edge, its label
  the rows' labels stacked in table order. In DOT every row starts a line,
  left-justified, and its ``/ action`` follows indented on the next, which
  keeps the wide fans of edges (into Deleted, into Failed) narrow; in Mermaid
  the rows are joined with ``<br/>``.

Ids in the SVG: each DOT node carries ``id="state_<state id>"`` and each
compound's cluster ``id="cluster_<state id>"``; Graphviz writes them as the id
of the node's or the cluster's ``<g>`` (``<g id="state_ready" class="node">``,
``<g id="cluster_running" class="cluster">``), so a page can find a state in
the SVG and highlight it. The ids repeat across machines (both the runner and
the instance have ``ready``): a page that shows two diagrams looks a state up
within one ``<svg>``, not in the whole document.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import attrs
from statemachine import State, StateMachine
from statemachine.callbacks import CallbackSpec

from fsm.errors import InvalidConfig

__all__ = ["Transition", "dot", "markdown_table", "mermaid", "transition_table"]

_HIGHLIGHT_FILL = "#40E0D0"
_HIGHLIGHT_STROKE = "#333"


@attrs.frozen
class Transition:
    """One row of a machine's event table.

    ``event`` is ``""`` for an eventless transition (taken as soon as its guard
    holds); ``guard`` and ``action`` are ``""`` when there are none. ``action``
    holds the method names as written (``"_record_progress"``).
    """

    source: str
    event: str
    guard: str
    target: str
    action: str
    internal: bool

    @property
    def trigger(self) -> str:
        """``event [guard]``, each part only when present."""
        return " ".join(part for part in (self.event, f"[{self.guard}]" if self.guard else "") if part)

    @property
    def effect(self) -> str:
        """``/ action``, or ``""`` when there is none."""
        return "/ " + ", ".join(name.removeprefix("_") for name in self.action.split(", ")) if self.action else ""

    @property
    def label(self) -> str:
        """``event [guard] / action``, each part only when present."""
        return " ".join(part for part in (self.trigger, self.effect) if part)


# -- walking the class ----------------------------------------------------------------


def _machine_class(machine: type[StateMachine] | StateMachine) -> type[StateMachine]:
    if isinstance(machine, StateMachine):
        return type(machine)
    if isinstance(machine, type) and issubclass(machine, StateMachine):
        return machine
    raise InvalidConfig(f"expected a StateMachine class or instance, got {type(machine).__name__}")


def _all_states(cls: type[StateMachine]) -> list[State]:
    """Every state, in declaration order (parents before their children)."""
    return list(cls.states_map.values())


def _top_states(cls: type[StateMachine]) -> list[State]:
    return [s for s in _all_states(cls) if s.parent is None]


def _leaf_ids(cls: type[StateMachine]) -> list[str]:
    return [s.id for s in _all_states(cls) if not s.states]


def _spec_name(spec: CallbackSpec) -> str:
    return str(spec)  # attr_name, prefixed with "!" for an ``unless`` spec


def _explicit(specs: Iterable[CallbackSpec]) -> list[str]:
    return [_spec_name(spec) for spec in specs if not spec.is_convention]


def _event_ids(transition) -> list[str]:
    return [getattr(event, "id", None) or str(event) for event in transition.events]


def transition_table(machine: type[StateMachine] | StateMachine) -> list[Transition]:
    """Every transition of the machine's class, compound initial transitions excluded, in the fixed order."""
    cls = _machine_class(machine)
    rows: list[Transition] = []
    for state in _all_states(cls):
        for t in state.transitions:
            if t.initial:
                continue
            targets = [target.id for target in t.targets] or [state.id]
            internal = bool(t.internal) or not t.targets
            guard = ", ".join(_explicit(t.cond))
            action = ", ".join(_explicit(t.on))
            for event in _event_ids(t) or [""]:
                for target in targets:
                    rows.append(Transition(state.id, event, guard, target, action, internal))
    return sorted(rows, key=lambda row: (row.source, row.event, row.target))  # stable: ties keep declaration order


def markdown_table(machine: type[StateMachine] | StateMachine) -> str:
    """The event table as GitHub Markdown: source | event | guard | target | action.

    Eventless rows show *(eventless)*; an internal transition's action is marked
    *(internal)*. The table is the complete reference: the drawings leave out
    self-transitions and merge the rows between two states into one edge.
    """

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| source | event | guard | target | action |", "| --- | --- | --- | --- | --- |"]
    for row in transition_table(machine):
        event = f"`{row.event}`" if row.event else "*(eventless)*"
        guard = f"`{row.guard}`" if row.guard else ""
        action = ", ".join(f"`{name.removeprefix('_')}`" for name in row.action.split(", ")) if row.action else ""
        if row.internal:
            action = f"{action} *(internal)*" if action else "*(internal)*"
        cells = [f"`{row.source}`", event, guard, f"`{row.target}`", action]
        lines.append(("| " + " | ".join(cell(c) for c in cells) + " |").replace("|  |", "| |"))
    return "\n".join(lines) + "\n"


# -- highlight -----------------------------------------------------------------------


def _highlighted(machine: type[StateMachine] | StateMachine, highlight: str | None) -> set[str]:
    cls = _machine_class(machine)
    leaves = _leaf_ids(cls)
    if highlight is not None:
        if not isinstance(highlight, str) or highlight not in leaves:
            raise InvalidConfig(f"{cls.__name__} has no leaf state {highlight!r}; valid leaf ids: {leaves}")
        return {highlight}
    if isinstance(machine, StateMachine):
        return {s.id for s in machine.configuration if not s.states}
    return set()


# -- scopes: which compound block a transition is drawn in ---------------------------------


def _ancestors(state: State) -> list[State]:
    """Strict ancestors, innermost first."""
    out = []
    parent = state.parent
    while parent is not None:
        out.append(parent)
        parent = parent.parent
    return out


def _scope(cls: type[StateMachine], row: Transition) -> str | None:
    """The innermost compound holding both ends strictly inside it, or None for the top level."""
    source, target = cls.states_map[row.source], cls.states_map[row.target]
    target_ancestors = {s.id for s in _ancestors(target)}
    for ancestor in _ancestors(source):
        if ancestor.id in target_ancestors:
            return ancestor.id
    return None


@attrs.frozen
class _Edge:
    """What is drawn from one state to another: every row between them, in table order."""

    source: str
    target: str
    rows: tuple[Transition, ...]


def _edges_by_scope(cls: type[StateMachine]) -> dict[str | None, list[_Edge]]:
    """The drawn edges of each scope: self-transitions left out, parallel rows merged into one edge.

    Edges come in the order of their first row in the table, so a drawing is as deterministic as the table.
    """
    grouped: dict[str | None, dict[tuple[str, str], list[Transition]]] = {}
    for row in transition_table(cls):
        if row.source == row.target:  # changes no state; the table lists it
            continue
        grouped.setdefault(_scope(cls, row), {}).setdefault((row.source, row.target), []).append(row)
    return {
        scope: [_Edge(source, target, tuple(rows)) for (source, target), rows in edges.items()]
        for scope, edges in grouped.items()
    }


# -- Mermaid -------------------------------------------------------------------------


def _mermaid_text(text: str) -> str:
    return text.replace('"', "#quot;")


def mermaid(machine: type[StateMachine] | StateMachine, *, highlight: str | None = None) -> str:
    """A Mermaid ``stateDiagram-v2`` of the machine, as GitHub renders it.

    ``highlight`` names a leaf state to style as ``current``; with an instance
    and no ``highlight``, its active leaf is styled. An unknown id raises
    `InvalidConfig` listing the valid leaf ids.
    """
    cls = _machine_class(machine)
    current = _highlighted(machine, highlight)
    scopes = _edges_by_scope(cls)
    lines = ["stateDiagram-v2"]

    def edges(scope: str | None, pad: str) -> Iterator[str]:
        for edge in scopes.get(scope, []):
            label = "<br/>".join(_mermaid_text(row.label) for row in edge.rows if row.label)
            yield f"{pad}{edge.source} --> {edge.target}" + (f" : {label}" if label else "")

    def block(states: list[State], depth: int) -> None:
        pad = "    " * depth
        initial = next((s for s in states if s.initial), None)
        if initial is not None:
            lines.append(f"{pad}[*] --> {initial.id}")
        for state in states:
            head = f'state "{_mermaid_text(state.name)}" as {state.id}'
            if state.states:
                lines.append(f"{pad}{head} {{")
                block(list(state.states), depth + 1)
                lines.extend(edges(state.id, pad + "    "))
                lines.append(f"{pad}}}")
            else:
                lines.append(f"{pad}{head}")
        for state in states:
            if state.final:
                lines.append(f"{pad}{state.id} --> [*]")

    block(_top_states(cls), 1)
    lines.extend(edges(None, "    "))
    if current:
        lines.append(f"    classDef current fill:{_HIGHLIGHT_FILL},stroke:{_HIGHLIGHT_STROKE},stroke-width:2px")
        lines.extend(f"    class {sid} current" for sid in _leaf_ids(cls) if sid in current)
    return "\n".join(lines) + "\n"


# -- Graphviz DOT ----------------------------------------------------------------------


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _q(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + _escape(text) + '"'


def _edge_label(rows: Iterable[Transition]) -> str:
    """The stacked label of an edge as a DOT string: a left-justified line (``\\l``) per row, its action below."""
    lines = []
    for row in rows:
        if row.trigger:
            lines.append(row.trigger)
        if row.effect:
            lines.append(f"    {row.effect}" if row.trigger else row.effect)
    return '"' + "".join(_escape(line) + "\\l" for line in lines) + '"'


def _initial_node(scope: str | None) -> str:
    return "__initial__" if scope is None else f"__initial__{scope}"


def dot(machine: type[StateMachine] | StateMachine, *, highlight: str | None = None) -> str:
    """A Graphviz DOT digraph of the machine, deterministic like `mermaid`.

    Compound states are ``subgraph cluster_<id>``; each scope's initial
    pseudo-state is a point node; final states are double circles; the
    highlighted leaf is filled. An edge to (from) a compound state is drawn to
    (from) its initial point node, clipped at the cluster border with
    ``lhead`` (``ltail``). Self-transitions are left out and parallel rows
    share an edge; nodes and clusters carry the SVG ids of the module
    docstring (``state_<id>``, ``cluster_<id>``).
    """
    cls = _machine_class(machine)
    current = _highlighted(machine, highlight)
    scopes = _edges_by_scope(cls)
    lines = [
        f"digraph {_q(cls.__name__)} {{",
        "    compound=true;",
        "    rankdir=TB;",
        "    nodesep=0.15;",  # Graphviz's 0.25 in; the fans of labelled edges into Deleted and Failed set the width
        '    graph [fontname="Helvetica", fontsize=12];',
        '    node [shape=box, style=rounded, fontname="Helvetica", fontsize=11];',
        '    edge [fontname="Helvetica", fontsize=9];',
    ]

    def node(state: State, pad: str) -> str:
        attrs_: list[str] = [f"id={_q('state_' + state.id)}", f"label={_q(state.name)}"]
        if state.final:
            attrs_.append("shape=doublecircle")
        if state.id in current:
            attrs_.append('style="rounded,filled"' if not state.final else "style=filled")
            attrs_.append(f"fillcolor={_q(_HIGHLIGHT_FILL)}")
            attrs_.append("penwidth=2")
        return f"{pad}{_q(state.id)} [{', '.join(attrs_)}];"

    def endpoint(state_id: str) -> tuple[str, str | None]:
        """The node an edge attaches to, and the cluster to clip at (for a compound state)."""
        if cls.states_map[state_id].states:
            return _initial_node(state_id), f"cluster_{state_id}"
        return state_id, None

    def edges(scope: str | None, pad: str) -> Iterator[str]:
        for edge in scopes.get(scope, []):
            tail, ltail = endpoint(edge.source)
            head, lhead = endpoint(edge.target)
            attrs_ = [f"label={_edge_label(edge.rows)}"] if any(row.label for row in edge.rows) else []
            if ltail:
                attrs_.append(f"ltail={_q(ltail)}")
            if lhead:
                attrs_.append(f"lhead={_q(lhead)}")
            suffix = f" [{', '.join(attrs_)}]" if attrs_ else ""
            yield f"{pad}{_q(tail)} -> {_q(head)}{suffix};"

    def block(states: list[State], scope: str | None, depth: int) -> None:
        pad = "    " * depth
        initial = next((s for s in states if s.initial), None)
        if initial is not None:
            start = _initial_node(scope)
            lines.append(f'{pad}{_q(start)} [shape=point, width=0.15, label=""];')
            head, lhead = endpoint(initial.id)
            clip = f" [lhead={_q(lhead)}]" if lhead else ""
            lines.append(f"{pad}{_q(start)} -> {_q(head)}{clip};")
        for state in states:
            if state.states:
                lines.append(f"{pad}subgraph {_q('cluster_' + state.id)} {{")
                lines.append(f"{pad}    id={_q('cluster_' + state.id)};")
                lines.append(f"{pad}    label={_q(state.name)};")
                lines.append(f"{pad}    style=rounded;")
                block(list(state.states), state.id, depth + 1)
                lines.extend(edges(state.id, pad + "    "))
                lines.append(f"{pad}}}")
            else:
                lines.append(node(state, pad))

    block(_top_states(cls), None, 1)
    lines.extend(edges(None, "    "))
    lines.append("}")
    return "\n".join(lines) + "\n"
