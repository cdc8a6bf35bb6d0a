"""fsm's documentation site builds with no warning, documents what a library user reaches for (#27), and every
snippet on it runs (#49)."""

from __future__ import annotations

import ast
import pickle
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from docutils import nodes

import fsm

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_build_without_warnings_and_cover_every_public_name(tmp_path):
    out = tmp_path / "html"
    # the machine pages are generated into docs/_generated (ignored by git); the rest goes to tmp_path
    argv = ["-W", "--keep-going", "-q", "-b", "html", "-d", str(tmp_path / "doctrees"), str(ROOT / "docs"), str(out)]
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    api = (out / "api.html").read_text()
    documented = set(re.findall(r'id="fsm\.([A-Za-z_]+)"', api))
    kinds = (type, type(fsm.plan))
    public = {name for name in fsm.__all__ if isinstance(getattr(fsm, name), kinds)}
    assert public <= documented, sorted(public - documented)
    for event in ("runner.Connected", "instance.RankFailed", "download.Complete"):
        assert f'id="fsm.{event}"' in api, event
    for machine in fsm.MACHINES:
        page = (out / "_generated" / f"{machine}.html").read_text()
        assert "<svg" in page or ".svg" in page, f"{machine}: no diagram"
        assert "Transitions" in page
    tutorial = (out / "tutorial.html").read_text()
    assert "supervise" in tutorial and "create_runner" in tutorial  # the example's code, included from its file
    # a page per design rule, each linked from the rules' index
    rules = sorted(p.stem for p in (ROOT / "docs" / "rules").glob("*.rst") if p.stem != "index")
    assert len(rules) >= 6, rules
    index = (out / "rules" / "index.html").read_text()
    for rule in rules:
        assert f'href="{rule}.html"' in index, f"rules/index does not link {rule}"
        assert "<h1>" in (out / "rules" / f"{rule}.html").read_text()
    assert "Prevent failed instance retries" in (out / "rules" / "retries-end.html").read_text()
    # the methods' docstrings and the enum members' #: comments reach the reference
    assert 'id="fsm.Adapter.stop_runner"' in api and "escalate if it lingers" in api
    assert 'id="fsm.ClockKind.WALL"' in api and "seconds since the Unix epoch" in api


# -- every snippet on the site runs (#49) ----------------------------------------------------------------------------

EXAMPLES = ROOT / "examples"
_MARKER = re.compile(r"^# tutorial: ", re.M)  # where a page cuts a program into parts (start-after/end-before)


def _doctest(docs: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, str, Path]:
    """`sphinx -b doctest` over ``docs``: runs the pages' doctests and any ``>>>`` in a docstring autodoc shows."""
    out, doctrees = tmp_path / "doctest", tmp_path / "doctrees"
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-q", "-b", "doctest", "-d", str(doctrees), str(docs), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = (out / "output.txt").read_text() if (out / "output.txt").exists() else ""
    return build, report, doctrees


def _looks_like_python(text: str) -> bool:
    """A literal block that would run as Python (a diagram of arrows, or a shell line, does not parse)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    runs = (ast.Call, ast.Assign, ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.With, ast.For)
    return any(isinstance(node, runs) for node in ast.walk(tree))


def test_every_snippet_on_the_site_is_run_and_every_program_is_shown_whole(tmp_path):
    """The doctests pass; every other block of code is included from an example the tests run, and a page that
    includes a program in parts shows all of it, so no part uses a name the page never defines."""
    build, report, doctrees = _doctest(ROOT / "docs", tmp_path)
    assert build.returncode == 0, report or build.stderr
    ran = int(re.search(r"^\s+(\d+) tests$", report, re.M).group(1))
    prompts = sum(p.read_text().count(">>> ") for p in (ROOT / "docs").rglob("*.rst"))
    assert prompts >= 8 and ran >= prompts, (ran, prompts)  # the pages' own, and any docstring's
    assert re.search(r"^\s+0 failures in tests$", report, re.M), report

    tested = (ROOT / "tests" / "test_examples.py").read_text()
    shown: dict[tuple[str, Path], list[str]] = {}
    for path in sorted(doctrees.rglob("*.doctree")):
        page = str(path.relative_to(doctrees).with_suffix(""))
        doctree = pickle.loads(path.read_bytes())
        for block in doctree.findall(nodes.literal_block):
            source = Path(block.get("source") or "")
            if source.parent == EXAMPLES:
                assert source.name in tested, f"{page} shows {source.name}, which no test runs"
                shown.setdefault((page, source), []).append(block.astext())
            else:
                assert "testnodetype" in block or not _looks_like_python(block.astext()), (
                    f"{page}: a block of code neither run as a doctest nor included from a tested example:\n"
                    + block.astext()
                )
    assert any(page == "tutorial" for page, _ in shown) and any(page == "examples" for page, _ in shown), shown
    for (page, source), parts in shown.items():
        text = source.read_text()
        left, at = [], 0
        for part in parts:  # in the page's order, each after the last
            start = text.find(part.rstrip("\n"), at)
            assert start >= 0, f"{page}: a part of {source.name} out of order or not from it:\n{part}"
            left.append(text[at:start])
            at = start + len(part.rstrip("\n"))
        left.append(text[at:])
        unshown = [line for gap in left for line in gap.splitlines() if line.strip() and not _MARKER.match(line)]
        assert not unshown, f"{page} leaves out lines of {source.name}: {unshown[:5]}"


def test_a_broken_snippet_fails_the_docs_tests(tmp_path):
    """The check above can fail: a snippet that no longer matches the code breaks the doctest build."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("_generated", "*.png"))
    shutil.copytree(EXAMPLES, tmp_path / "examples")  # what the pages include, as ../examples/
    tutorial = docs / "tutorial.rst"
    tutorial.write_text(tutorial.read_text().replace("seconds=30.0)]", "seconds=31.0)]", 1))
    build, report, _ = _doctest(docs, tmp_path)
    assert build.returncode != 0 and "1 failure in tests" in report.replace("failures", "failure"), report
    assert "seconds=31.0" in report


def test_the_docs_extra_installs_sphinx_and_fsm_s_dependencies_but_not_mlx():
    """`make docs` builds in a venv with only ``exod[docs]``: resolved here through the installed packages'
    metadata (the requirements of the requirements), it reaches Sphinx and fsm's three, never MLX or the daemon's."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["docs"]]
    assert not [r for r in todo if canonicalize_name(r.name) == "exod"], "the docs extra pulls another extra"
    reached: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in reached or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        reached.add(name)
        todo += [Requirement(r) for r in metadata.requires(req.name) or ()]
    assert {"sphinx", "python-statemachine", "attrs", "cattrs", "docutils"} <= reached, sorted(reached)
    daemon = {canonicalize_name(Requirement(r).name) for r in project["optional-dependencies"]["daemon"]}
    assert "mlx" in daemon and not reached & (daemon | {"mlx-metal"}), sorted(reached & daemon)  # no MLX, no daemon
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("\ndocs:") :].split("\n\n")[0]
    assert "$(DOCS_STAMP)" in target and "$(BIN)" not in target, target  # not the test venv with MLX in it
    assert '-e ".[docs]"' in makefile[makefile.index("$(DOCS_STAMP):") :].split("\n\n")[0]
