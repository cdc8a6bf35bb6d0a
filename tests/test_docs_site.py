"""fsm's documentation site builds with no warning, and documents what a library user reaches for (#27)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
