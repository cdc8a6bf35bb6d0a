"""fsm.diagram: deterministic Mermaid/DOT documents and the event table of each machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from xml.etree import ElementTree

import pytest

import fsm
from fsm import diagram, runner
from fsm.diagram import Transition

ROOT = Path(__file__).resolve().parent.parent
NAMES = sorted(fsm.MACHINES)

# Transitions per event, counted by hand from the class bodies (fsm/runner.py,
# fsm/instance.py, fsm/download.py); "" counts the eventless transitions.
EXPECTED_COUNTS = {
    "runner": {
        "connect": 1,
        "connected": 1,
        "load": 2,
        "progress": 1,
        "weights_loaded": 1,
        "warm_up": 1,
        "warmed": 1,
        "request_started": 2,
        "request_finished": 2,
        "fail": 2,
        "stop": 2,
        "exited": 4,
    },
    "instance": {
        "start": 2,
        "start_rank": 1,
        "rank_created": 4,
        "rank_ready": 6,
        "": 4,
        "rank_failed": 10,
        "rank_failed_while_stopping": 4,
        "rank_stopped": 9,
        "rank_lost": 3,
        "resume": 3,
        "tick": 1,
        "give_up": 1,
        "delete": 1,
        "park": 2,
        "unpark": 1,
    },
    "download": {
        "begin": 1,
        "progress": 1,
        "complete": 1,
        "fail": 1,
        "retry": 1,
        "load_started": 1,
        "invalidate": 1,
    },
}


def _independent_rows(cls) -> Counter:
    """(source, event, target, guard) of every non-initial transition, read straight from the library's objects."""
    rows: Counter = Counter()
    for state in cls.states_map.values():
        for t in state.transitions:
            if t.initial:
                continue
            guard = ", ".join(str(spec) for spec in t.cond if not spec.is_convention)
            target = state if t.target is None else t.target  # a targetless transition stays where it is
            for event in [str(e) for e in t.events] or [""]:
                rows[(state.id, event, target.id, guard)] += 1
    return rows


# -- determinism ---------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_documents_are_identical_across_calls(name: str) -> None:
    cls = fsm.MACHINES[name]
    assert diagram.mermaid(cls) == diagram.mermaid(cls)
    assert diagram.dot(cls) == diagram.dot(cls)
    assert diagram.markdown_table(cls) == diagram.markdown_table(cls)
    assert diagram.transition_table(cls) == diagram.transition_table(cls)


def test_documents_are_identical_across_interpreters() -> None:
    code = (
        "import json, sys, fsm\n"
        "from fsm import diagram\n"
        "out = {n: [diagram.mermaid(c), diagram.dot(c), diagram.markdown_table(c)] for n, c in fsm.MACHINES.items()}\n"
        "sys.stdout.write(json.dumps(out))\n"
    )
    here = {n: [diagram.mermaid(c), diagram.dot(c), diagram.markdown_table(c)] for n, c in fsm.MACHINES.items()}
    for seed in ("0", "4242"):  # distinct hash seeds: set/dict iteration must not leak into the output
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=60
        )
        assert json.loads(result.stdout) == here


@pytest.mark.parametrize("name", NAMES)
def test_dot_has_no_object_ids(name: str) -> None:
    text = diagram.dot(fsm.MACHINES[name])
    assert "0x" not in text
    assert str(id(fsm.MACHINES[name])) not in text


# -- the table ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_every_transition_appears_exactly_once(name: str) -> None:
    cls = fsm.MACHINES[name]
    table = diagram.transition_table(cls)
    assert Counter(row.event for row in table) == Counter(EXPECTED_COUNTS[name])
    assert Counter((r.source, r.event, r.target, r.guard) for r in table) == _independent_rows(cls)
    assert all(isinstance(row, Transition) for row in table)


@pytest.mark.parametrize("name", NAMES)
def test_table_order_is_source_event_target(name: str) -> None:
    table = diagram.transition_table(fsm.MACHINES[name])
    keys = [(r.source, r.event, r.target) for r in table]
    assert keys == sorted(keys)


def test_runner_rows() -> None:
    table = diagram.transition_table(fsm.RunnerLifecycle)
    assert Transition("idle", "connect", "multi_rank", "connecting", "", False) in table
    assert Transition("idle", "load", "single_rank", "loading", "", False) in table
    assert Transition("joined", "load", "", "loading", "", False) in table
    assert Transition("weights", "progress", "", "weights", "_record_progress", True) in table
    assert Transition("busy", "request_finished", "!last_request", "busy", "_request_out", True) in table
    assert Transition("busy", "request_finished", "last_request", "available", "_request_out", False) in table
    # the compounds' implicit initial transitions are not events
    assert not [r for r in table if r.event == ""]
    assert not [r for r in table if r.target in {"joining", "weights", "available", "stopping"} and r.event == ""]


def test_instance_eventless_rows_and_tie_order() -> None:
    table = diagram.transition_table(fsm.InstanceRetry)
    eventless = [r for r in table if r.event == ""]
    assert eventless == [
        Transition("degraded", "", "all_ranks_ready", "ready", "_mark_ready", False),
        Transition("parking", "", "nothing_alive", "parked", "", False),
        Transition("recovering", "", "nothing_alive", "backing_off", "_arm_timer", False),
        Transition("starting", "", "all_ranks_ready", "ready", "_mark_ready", False),
    ]
    # same (source, event, target) twice: declaration order decides
    ties = [r.guard for r in table if (r.source, r.event, r.target) == ("running", "rank_failed", "deleted")]
    assert ties == ["non_retryable", "last_charged_failure"]
    # a compound's targetless transition is a row that stays in the compound
    assert Transition("alive", "tick", "", "alive", "", True) in table
    assert Transition("running", "rank_failed_while_stopping", "", "running", "", True) in table


def test_markdown_table() -> None:
    text = diagram.markdown_table(fsm.RunnerLifecycle)
    lines = text.splitlines()
    assert lines[0] == "| source | event | guard | target | action |"
    assert lines[1] == "| --- | --- | --- | --- | --- |"
    assert len(lines) == 2 + len(diagram.transition_table(fsm.RunnerLifecycle))
    assert "| `idle` | `connect` | `multi_rank` | `connecting` | |" in lines
    assert all(line.replace("\\|", "").count("|") == 6 for line in lines)  # five columns on every row
    eventless = diagram.markdown_table(fsm.InstanceRetry)
    assert "| `starting` | *(eventless)* | `all_ranks_ready` | `ready` | `mark_ready` |" in eventless.splitlines()


# -- Mermaid -------------------------------------------------------------------------------


def test_runner_mermaid_structure() -> None:
    text = diagram.mermaid(fsm.RunnerLifecycle)
    lines = [line.strip() for line in text.splitlines()]
    assert lines[0] == "stateDiagram-v2"
    assert lines[1] == "[*] --> running"
    assert lines[2] == 'state "Running" as running {'
    for compound, initial in [
        ("Running", "idle"),
        ("Connecting", "joining"),
        ("Loading", "weights"),
        ("Ready", "available"),
        ("Shutdown", "stopping"),
    ]:
        head = f'state "{compound}" as {compound.lower()} {{'
        assert head in lines
        assert lines[lines.index(head) + 1] == f"[*] --> {initial}"
    assert 'state "Warming up" as warming_up' in lines
    assert "stopped --> [*]" in lines
    assert "idle --> connecting : connect [multi_rank]" in lines
    assert "idle --> loading : load [single_rank]" in lines
    assert "running --> shutdown : stop" in lines
    assert "running --> failed : exited / exit_while_running<br/>fail [has_cause]" in lines
    assert not [line for line in lines if line.startswith(("weights --> weights", "busy --> busy"))]  # self-loops
    assert "classDef" not in text  # a class highlights nothing
    # edges inside one compound are drawn in its block: "connected" comes before the block closes
    assert lines.index("joining --> joined : connected") < lines.index('state "Loading" as loading {')


def test_instance_mermaid_eventless_and_final() -> None:
    lines = [line.strip() for line in diagram.mermaid(fsm.InstanceRetry).splitlines()]
    assert "recovering --> backing_off : [nothing_alive] / arm_timer" in lines
    assert "starting --> ready : [all_ranks_ready] / mark_ready" in lines
    assert "deleted --> [*]" in lines
    assert 'state "Backing off" as backing_off' in lines
    assert 'state "Generation running" as running {' in lines
    assert "alive --> deleted : delete / deleted_by_user<br/>give_up [budget_spent] / give_up_exhausted" in lines
    assert "parking --> parked : [nothing_alive]" in lines
    assert not [line for line in lines if " : tick" in line]  # self-transitions are left to the table


@pytest.mark.parametrize("name", NAMES)
def test_mermaid_has_one_edge_per_pair_of_states(name: str) -> None:
    """Every row that changes state is drawn, once, on the one edge between its two states; self-transitions not."""
    cls = fsm.MACHINES[name]
    edges = [
        line.strip()
        for line in diagram.mermaid(cls).splitlines()
        if " --> " in line and "[*]" not in line.split(" : ")[0]
    ]
    table = diagram.transition_table(cls)
    expected: dict[tuple[str, str], list[str]] = {}
    for r in table:
        if r.source != r.target:
            expected.setdefault((r.source, r.target), []).extend([r.label] if r.label else [])
    lines = [f"{s} --> {t}" + (f" : {'<br/>'.join(labels)}" if labels else "") for (s, t), labels in expected.items()]
    assert sorted(edges) == sorted(lines)


# -- highlight --------------------------------------------------------------------------------


def test_highlight_follows_an_instance_state() -> None:
    machine = fsm.RunnerLifecycle("r0")
    assert "class idle current" in diagram.mermaid(machine)
    machine.apply(runner.Load("r0", 0))
    assert machine.path == "running.loading.weights"
    text = diagram.mermaid(machine)
    assert "classDef current" in text
    assert "    class weights current" in text.splitlines()
    assert text.count(" current") == 2  # the classDef and one class line
    assert '"weights" [id="state_weights", label="Weights", style="rounded,filled"' in diagram.dot(machine)


def test_explicit_highlight_overrides_the_instance() -> None:
    machine = fsm.RunnerLifecycle("r0")
    text = diagram.mermaid(machine, highlight="busy")
    assert "class busy current" in text
    assert "class idle current" not in text
    assert "class stopped current" in diagram.mermaid(fsm.RunnerLifecycle, highlight="stopped")
    assert "filled" in diagram.dot(fsm.DownloadLifecycle, highlight="failed")
    assert "filled" not in diagram.dot(fsm.DownloadLifecycle)


@pytest.mark.parametrize("bad", ["nope", "loading", ""])
@pytest.mark.parametrize("render", [diagram.mermaid, diagram.dot])
def test_bad_highlight_raises_invalid_config(render, bad: str) -> None:
    with pytest.raises(fsm.InvalidConfig) as info:
        render(fsm.RunnerLifecycle, highlight=bad)
    assert "weights" in str(info.value) and "stopped" in str(info.value)  # lists the valid leaf ids


def test_not_a_machine_raises_invalid_config() -> None:
    with pytest.raises(fsm.InvalidConfig):
        diagram.mermaid(object)  # type: ignore[arg-type]


# -- DOT -----------------------------------------------------------------------------------------


def test_runner_dot_structure() -> None:
    text = diagram.dot(fsm.RunnerLifecycle)
    assert text.startswith('digraph "RunnerLifecycle" {')
    for compound in ("running", "connecting", "loading", "ready", "shutdown"):
        assert f'subgraph "cluster_{compound}" {{' in text
        assert f'id="cluster_{compound}";' in text
        assert f'"__initial__{compound}" [shape=point' in text
    assert '"__initial__" -> "__initial__running" [lhead="cluster_running"];' in text
    assert '"__initial__running" -> "idle";' in text
    assert '"stopped" [id="state_stopped", label="Stopped", shape=doublecircle];' in text
    assert '"idle" -> "__initial__connecting" [label="connect [multi_rank]\\l", lhead="cluster_connecting"];' in text
    # one edge from Running to Failed; each row starts a left-justified line, its action indented below
    assert (
        '"__initial__running" -> "failed" [label="exited\\l    / exit_while_running\\lfail [has_cause]\\l", '
        'ltail="cluster_running"];' in text
    )


# Without Graphviz a developer's run skips the drawings; CI installs it (.ci/run), so there a missing `dot` fails.
needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None and not os.environ.get("CI"),
    reason="Graphviz `dot` binary not installed (`apt-get install graphviz`; CI installs it)",
)


@needs_dot
@pytest.mark.parametrize("name", NAMES)
def test_graphviz_accepts_dot(name: str) -> None:
    leaf = {"runner": "busy", "instance": "ready", "download": "failed"}[name]
    for machine_dot in (diagram.dot(fsm.MACHINES[name]), diagram.dot(fsm.MACHINES[name], highlight=leaf)):
        result = subprocess.run(["dot", "-Tsvg"], input=machine_dot, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "<svg" in result.stdout
        assert "Warning" not in result.stderr and "Error" not in result.stderr, result.stderr


# -- what a person can take in --------------------------------------------------------------------

# Rendered with `dot -Tsvg`, each drawing must fit about one screen: at most 1000 x 1200 pt (14 x 17 in) keeps
# the 9 pt labels legible at a zoom where the whole machine is in view, scrolled at most once. Measured with
# Graphviz 2.43: runner 582 x 1061 pt, instance 979 x 666 pt, download 280 x 276 pt (before the compounds and
# the merged edges: 1292 x 974 and 3067 x 545). The edge bound counts the initial arrows too; measured 20, 20, 6
# (before: 34, 45, 8). A machine that outgrows a bound needs a new look at its drawing, not a larger bound: the
# instance's went from 16 to 20 with a new state (Degraded, one_for_one's restart of a rank alone: edges in
# from Starting and Ready, out to Ready and, on resume, Starting), after a look at declaring them on Generation
# running instead (Graphviz cannot clip an edge from a cluster to a node inside it).
MAX_WIDTH_PT, MAX_HEIGHT_PT = 1000, 1200
MAX_EDGES = {"runner": 22, "instance": 20, "download": 8}
SVG = "{http://www.w3.org/2000/svg}"


def _svg(text: str) -> ElementTree.Element:
    result = subprocess.run(["dot", "-Tsvg"], input=text, capture_output=True, text=True, timeout=60, check=True)
    return ElementTree.fromstring(result.stdout)


def _groups(svg: ElementTree.Element, kind: str) -> dict[str, ElementTree.Element]:
    """The ``<g class=kind>`` elements of the SVG, by their ``<title>`` (``tail->head`` for an edge)."""
    return {g.findtext(f"{SVG}title"): g for g in svg.iter(f"{SVG}g") if g.get("class") == kind}


@needs_dot
@pytest.mark.parametrize("name", NAMES)
def test_drawing_is_small_enough_to_take_in(name: str) -> None:
    svg = _svg(diagram.dot(fsm.MACHINES[name]))
    width, height = (float(svg.get(side).removesuffix("pt")) for side in ("width", "height"))
    assert width <= MAX_WIDTH_PT and height <= MAX_HEIGHT_PT, (width, height)
    assert len(_groups(svg, "edge")) <= MAX_EDGES[name]


@needs_dot
@pytest.mark.parametrize("name", NAMES)
def test_no_self_loop_is_drawn(name: str) -> None:
    edges = _groups(_svg(diagram.dot(fsm.MACHINES[name])), "edge")
    assert edges and all(tail != head for tail, head in (title.split("->") for title in edges))
    assert [r for r in diagram.transition_table(fsm.MACHINES[name]) if r.source == r.target]  # yet the table has them


@needs_dot
def test_rows_between_two_states_share_one_edge() -> None:
    edges = _groups(_svg(diagram.dot(fsm.InstanceRetry)), "edge")
    # the compound `running` is drawn from its initial point, clipped at the cluster
    lines = [t.text.strip() for t in edges["__initial__running->deleted"].iter(f"{SVG}text")]
    assert lines == [
        "rank_failed [non_retryable]",
        "/ give_up_non_retryable",
        "rank_failed [last_charged_failure]",
        "/ give_up_exhausted",
        "rank_stopped [last_allowed_failure]",
        "/ stopped_and_exhausted",
    ]
    # what the whole of Alive shares (delete, give_up) is declared once: three edges reach Deleted, not six
    into_deleted = sorted(title for title in edges if title.endswith("->deleted"))
    assert into_deleted == ["__initial__alive->deleted", "__initial__running->deleted", "recovering->deleted"]


@needs_dot
@pytest.mark.parametrize("name", NAMES)
def test_every_state_has_its_id_in_the_svg(name: str) -> None:
    cls = fsm.MACHINES[name]
    svg = _svg(diagram.dot(cls))
    ids = {g.get("id"): g.get("class") for g in svg.iter(f"{SVG}g")}
    for state in cls.states_map.values():
        if state.states:
            assert ids.get(f"cluster_{state.id}") == "cluster"
        else:
            assert ids.get(f"state_{state.id}") == "node"
