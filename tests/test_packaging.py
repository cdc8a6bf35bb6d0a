"""`pip install exod` installs the library `fsm` alone; the daemon's dependencies are the `daemon` extra.

Builds this repository's wheel, installs it without the extra into a fresh venv
that can reach no package index (its dependencies come from wheels repacked from
this venv), and checks what that venv can import, what it holds, and what the
`exod` console script says there.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import exod

ROOT = Path(__file__).resolve().parent.parent
LIBRARY_DEPS = {"python-statemachine", "attrs", "cattrs"}
DAEMON_ONLY = {"mlx", "mlx-cpu", "mlx-lm", "fastapi", "trio", "hypercorn", "huggingface-hub", "click", "numpy"}
DAEMON_MODULES = ("mlx", "mlx_lm", "trio", "fastapi", "hypercorn", "huggingface_hub", "click", "numpy")
NO_EXTRA = {"extra": ""}


def _base_requirements(requires: list[str] | None) -> list[Requirement]:
    """The requirements that apply here when no extra is asked for."""
    reqs = [Requirement(line) for line in requires or ()]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(NO_EXTRA)]


def _closure(names: set[str]) -> set[str]:
    """These distributions and everything they need here without extras, from this venv's metadata."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name not in seen:
            seen.add(name)
            todo.extend(r.name for r in _base_requirements(importlib.metadata.requires(name)))
    return seen


def _repack(name: str, into: Path) -> None:
    """Rebuild the wheel of an installed pure-Python distribution from its RECORD."""
    dist = importlib.metadata.distribution(name)
    dist_info = next(str(f.parent) for f in dist.files or () if f.name == "METADATA")
    wheel_meta = Parser().parsestr(dist.read_text("WHEEL") or "")
    assert wheel_meta["Root-Is-Purelib"] == "true", f"{name} is not pure Python; cannot repack it"
    tag = wheel_meta.get_all("Tag")[0]
    skip = {f"{dist_info}/{n}" for n in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")}
    version = dist.version
    target = into / f"{canonicalize_name(name).replace('-', '_')}-{version}-{tag}.whl"
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as whl:
        for f in dist.files or ():
            arc = f.as_posix()
            if arc.startswith("..") or "__pycache__" in f.parts or arc in skip:
                continue
            data = Path(dist.locate_file(f)).read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            whl.writestr(arc, data)
            writer.writerow([arc, f"sha256={digest}", len(data)])
        writer.writerow([f"{dist_info}/RECORD", "", ""])
        whl.writestr(f"{dist_info}/RECORD", record.getvalue())


def _clean_env() -> dict[str, str]:
    """No pip configuration (so no index, no extra find-links) and nothing from this venv on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PYTHONNOUSERSITE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this repository."""
    tmp = tmp_path_factory.mktemp("build")
    # Build from a copy, so that the build writes no build/ or *.egg-info into the checkout.
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for lic in ROOT.glob("LICENSE*"):
        shutil.copy2(lic, src / lic.name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "fsm", src / "fsm", ignore=skip)
    shutil.copytree(ROOT / "daemon" / "exod", src / "daemon" / "exod", ignore=skip)
    dist = tmp / "dist"
    # With build isolation: the index is used for the build backend (setuptools) only.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)],
        check=True,
        cwd=tmp,
    )
    (built,) = dist.glob("exod-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel without the `daemon` extra, installed with no index."""
    tmp = tmp_path_factory.mktemp("install")
    wheelhouse = tmp / "wheelhouse"
    wheelhouse.mkdir()
    shutil.copy2(wheel, wheelhouse)
    for name in _closure(LIBRARY_DEPS):
        _repack(name, wheelhouse)

    fresh = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    python = fresh / "bin" / "python"
    # No index at all: a requirement of the wheel that is not in the wheelhouse fails the install.
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    subprocess.run(
        [*pip, "install", "-q", "--no-index", "--find-links", str(wheelhouse), "exod"],
        check=True,
        cwd=tmp,
        env=_clean_env(),
    )
    return fresh


def _dist_info_file(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as whl:
        (member,) = [n for n in whl.namelist() if n.endswith(f".dist-info/{name}")]
        return whl.read(member).decode()


def _run(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, cwd=venv, env=_clean_env(), timeout=60)


def test_wheel_requires_the_daemon_stack_only_under_the_daemon_extra(wheel: Path) -> None:
    meta = Parser().parsestr(_dist_info_file(wheel, "METADATA"))
    reqs = [Requirement(line) for line in meta.get_all("Requires-Dist")]
    assert {r.name for r in reqs if r.marker is None} == LIBRARY_DEPS
    assert "daemon" in meta.get_all("Provides-Extra")
    mlx = [r for r in reqs if r.name == "mlx"]
    assert mlx, "the daemon extra lost mlx"
    for platform in ("linux", "darwin"):
        env = {"sys_platform": platform, "platform_machine": "x86_64" if platform == "linux" else "arm64"}
        for r in mlx:
            assert 'extra == "daemon"' in str(r.marker), r
            assert not r.marker.evaluate(env | NO_EXTRA), r
        assert any(r.marker.evaluate(env | {"extra": "daemon"}) for r in mlx), platform
    for r in reqs:  # nothing of the daemon's stack is ever a base requirement
        if canonicalize_name(r.name) in DAEMON_ONLY:
            assert r.marker is not None and 'extra == "daemon"' in str(r.marker), r
    assert re.search(r"^exod = exod:main$", _dist_info_file(wheel, "entry_points.txt"), re.M)
    with zipfile.ZipFile(wheel) as whl:
        assert {"fsm/__init__.py", "fsm/py.typed", "exod/__init__.py", "exod/default.toml"} <= set(whl.namelist())
        dashboard = {f"exod/ui/{name}" for name in ("index.html", "dashboard.js", "dashboard.css")}
        vendored = ("swagger-ui-bundle.js", "swagger-ui.css", "LICENSE")
        swagger = {f"exod/ui/vendor/swagger-ui/{name}" for name in vendored}
        assert dashboard | swagger <= set(whl.namelist())  # the page and /docs need nothing from elsewhere
        # every module of the source is in the wheel: `exod chaos` once ran only from a checkout
        source = {str(path.relative_to(ROOT / "daemon")) for path in (ROOT / "daemon" / "exod").rglob("*.py")} | {
            str(path.relative_to(ROOT)) for path in (ROOT / "fsm").rglob("*.py")
        }
        assert source <= set(whl.namelist()), sorted(source - set(whl.namelist()))


def test_the_library_works_without_the_daemon_stack(venv: Path) -> None:
    probe = f"""
import importlib.metadata, importlib.util, json
import fsm
from fsm import runner

m = fsm.RunnerLifecycle("r/0")
assert m.apply(runner.Load("r/0", 0)).accepted
assert fsm.RunnerLifecycle.from_dict(m.to_dict()).leaf == "weights"   # cattrs round trip
assert fsm.Backoff().delay(3) == 8.0
print(json.dumps({{
    "fsm": fsm.__file__,
    "found": [n for n in {DAEMON_MODULES!r} if importlib.util.find_spec(n) is not None],
    "dists": sorted(d.metadata["Name"] for d in importlib.metadata.distributions()),
}}))
"""
    proc = _run(venv, str(venv / "bin" / "python"), "-I", "-c", probe)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert Path(seen["fsm"]).is_relative_to(venv), seen["fsm"]  # the wheel's copy, not the checkout
    assert seen["found"] == []
    dists = {canonicalize_name(n) for n in seen["dists"]}
    assert dists == {"exod"} | _closure(LIBRARY_DEPS)
    assert not dists & DAEMON_ONLY


def test_the_console_script_without_the_extra_says_what_to_install(venv: Path) -> None:
    proc = _run(venv, str(venv / "bin" / "exod"), "--help")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    message = 'exod: the daemon needs its dependencies: pip install "exod[daemon]" (missing: click)\n'
    assert proc.stderr == message
    proc = _run(venv, str(venv / "bin" / "python"), "-I", "-m", "exod", "--help")
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", message)


def test_the_daemon_import_names_cover_the_daemon_extra(wheel: Path) -> None:
    """`exod.main` names the missing extra for every module the extra installs."""
    reqs = [
        Requirement(line) for line in Parser().parsestr(_dist_info_file(wheel, "METADATA")).get_all("Requires-Dist")
    ]
    daemon = {
        canonicalize_name(r.name).replace("-", "_") for r in reqs if r.marker and 'extra == "daemon"' in str(r.marker)
    }
    assert daemon
    assert daemon <= exod.DAEMON_IMPORTS
