"""specs/ is what the code generates, and `exod diagram` / `exod specs` say what they claim."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import fsm
from exod.cli import main
from exod.specs import drifted, render_spec, write_specs

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
MACHINES = list(fsm.MACHINES)
FORMATS = ["mermaid", "dot", "svg", "md"]
HAS_DOT = shutil.which("dot") is not None or bool(os.environ.get("CI"))  # CI installs it: missing there fails


def test_specs_dir_matches_the_code():
    stale = drifted(SPECS)
    assert not stale, f"specs/ differs from the code for {stale}: run `make specs` and commit the result"


@pytest.mark.parametrize("name", MACHINES)
def test_spec_has_every_part(name):
    text = render_spec(name)
    cls = fsm.MACHINES[name]
    assert text.startswith("# ") and f"`{cls.__name__}`" in text.splitlines()[0]
    for heading in ("## Theory of operation", "## Diagram", "## Transitions", "## Invariants", "## Defaults"):
        assert heading in text
    assert "```mermaid\nstateDiagram-v2\n" in text
    assert "| source | event | guard | target | action |" in text
    assert text == render_spec(name)  # deterministic


def test_spec_defaults_come_from_the_code():
    instance = render_spec("instance")
    policy = fsm.RetryPolicy()
    assert f"| `max_failures` | {policy.max_failures} |" in instance
    assert f"| `backoff.cap` | {policy.backoff.cap:g} s |" in instance
    assert f"| `reset_after` | {policy.reset_after:g} s |" in instance
    download = render_spec("download")
    assert f"| `initial` | {fsm.DEFAULT_DOWNLOAD_BACKOFF.initial:g} s |" in download
    runner = render_spec("runner")
    assert "| `loading` | `weights`, `loaded`, `warming_up` |" in runner


def test_write_then_drift_detects_an_edit(tmp_path):
    written = write_specs(tmp_path)
    assert sorted(p.name for p in written) == sorted(f"{n}.md" for n in MACHINES)
    assert drifted(tmp_path) == []
    (tmp_path / "instance.md").write_text(render_spec("instance").replace("| `max_failures` | 5 |", "| x |"))
    (tmp_path / "download.md").unlink()
    assert drifted(tmp_path) == ["instance", "download"]


def test_specs_command_writes_and_checks(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["specs", "--check", "--dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "runner.md differs from the code; run `make specs`" in result.output
    result = runner.invoke(main, ["specs", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert {p.name for p in tmp_path.iterdir()} == {"runner.md", "instance.md", "download.md"}
    result = runner.invoke(main, ["specs", "--check", "--dir", str(tmp_path)])
    assert result.exit_code == 0 and "up to date" in result.output


# -- exod diagram ------------------------------------------------------------------------


def _diagram(*args: str):
    return CliRunner().invoke(main, ["diagram", *args])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", MACHINES)
def test_diagram_every_machine_and_format(name, fmt):
    if fmt == "svg" and not HAS_DOT:
        pytest.skip("Graphviz `dot` is not installed")
    first = _diagram(name, "--format", fmt)
    assert first.exit_code == 0, first.output
    if fmt == "mermaid":
        assert first.output.startswith("stateDiagram-v2\n")
        assert first.output == fsm.diagram.mermaid(fsm.MACHINES[name])
    elif fmt == "dot":
        assert first.output.startswith(f'digraph "{fsm.MACHINES[name].__name__}" {{')
        assert first.output == fsm.diagram.dot(fsm.MACHINES[name])
    elif fmt == "md":
        assert first.output.splitlines()[0] == "| source | event | guard | target | action |"
    else:
        assert first.output.startswith("<?xml")
        assert "</svg>" in first.output
    if fmt in ("mermaid", "dot", "md"):
        assert _diagram(name, "--format", fmt).output == first.output  # byte-for-byte


def test_diagram_svg_without_graphviz_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    result = _diagram("runner", "--format", "svg")
    assert result.exit_code == 1
    assert "SVG export needs Graphviz" in result.output
    assert "--format dot" in result.output


@pytest.mark.parametrize("fmt", ["mermaid", "dot", "md"])
def test_diagram_state_highlights(fmt):
    result = _diagram("runner", "--format", fmt, "--state", "busy")
    assert result.exit_code == 0, result.output
    if fmt == "mermaid":
        assert "    class busy current" in result.output
        assert "classDef current" in result.output
    elif fmt == "dot":
        assert '"busy" [id="state_busy", label="Busy", style="rounded,filled"' in result.output
    else:
        assert "| **`busy`** | `request_finished` |" in result.output
    plain = _diagram("runner", "--format", fmt)
    assert "current" not in plain.output and "filled" not in plain.output and "**" not in plain.output


@pytest.mark.skipif(not HAS_DOT, reason="Graphviz `dot` is not installed")
def test_diagram_svg_state_highlight_and_output_file(tmp_path):
    out = tmp_path / "runner.svg"
    result = _diagram("runner", "--format", "svg", "--state", "busy", "--output", str(out))
    assert result.exit_code == 0, result.output
    svg = out.read_text()
    assert svg.startswith("<?xml") and "#40e0d0" in svg.lower()


def test_diagram_output_file(tmp_path):
    out = tmp_path / "instance.mmd"
    result = _diagram("instance", "--output", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_text() == fsm.diagram.mermaid(fsm.InstanceRetry)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bogus"], "'bogus' is not one of"),
        (["runner", "--state", "nope"], "runner has no state 'nope'"),
        (["instance", "--state", "busy", "--format", "md"], "instance has no state 'busy'"),
        (["runner", "--state", "ready"], "runner has no state 'ready'"),  # compound: not a leaf
        (["runner", "--format", "png"], "'png' is not one of"),
    ],
)
def test_diagram_bad_machine_or_state(args, message):
    result = _diagram(*args)
    assert result.exit_code != 0
    assert message in result.output
