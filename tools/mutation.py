"""Mutation testing of the machines and the planner, run by hand (`make mutation`), never in CI.

    .venv/bin/python tools/mutation.py                     # the six modules, the working tree as it is now
    .venv/bin/python tools/mutation.py backoff download    # some of them
    .venv/bin/python tools/mutation.py --rev HEAD          # a commit instead of the working tree
    .venv/bin/python tools/mutation.py --report            # print the last run's sessions again

Tool: cosmic-ray (the `mutation` extra). It mutates the parse tree of the whole module, class
bodies included, which is where python-statemachine declares the transitions
(``retry = failed.to(pending, cond="backoff_elapsed")``) and attrs its fields; mutmut 3 only
mutates inside functions. Two operators are added to cosmic-ray's own (provider ``exod/``):
``RemoveCallStatement`` (a call whose result is dropped, e.g. ``self.download_event(...)``,
becomes ``pass``) and ``RemoveKeywordArgument`` (``cond=``, ``on=``, ``internal=``,
``validator=`` ... dropped one at a time).

How a run goes:

* The tree (working tree, or ``--rev``) is copied to ``build/mutation/`` once per worker, so
  mutants never touch the checkout that others are editing.
* One cosmic-ray session per module (``build/mutation/<module>.sqlite``; open it with
  ``cr-report`` or ``cr-html``). Not run: the operators EXCLUDED_OPERATORS names (cosmic-ray's
  operators filter, patterns from its docs: ``is`` swapped with ``==`` or ``<``...), and mutants
  inside function annotations: every module has ``from __future__ import annotations``, so those
  annotations are strings that nothing evaluates.
* The mutants run on cosmic-ray's ``http`` distributor, one ``http-worker`` per copy (``--jobs``,
  default: one per CPU), listening on 127.0.0.1 only. Each worker has already imported pytest,
  Hypothesis and the third-party modules ``fsm`` needs, and forks for every mutant a process
  that runs ``pytest.main`` on FAST_TESTS (the module's own test file first, ``-x``), so a
  mutant costs the tests, not an interpreter start. No bytecode is written anywhere: a mutant
  of the same size written within the same second would otherwise run from a stale .pyc.
* Hypothesis runs the ``mutation`` profile: derandomized, 50 examples, no deadline, no database.

Output: per module, the mutants that ran, killed, timeout, survived, the equivalent ones and the
score ``(killed + timeout) / (ran - equivalent)``; the survivors (id, line, operator, diff) go to
``tools/mutation_survivors.txt`` (a run of some modules replaces only their sections). A survivor
that no test can kill is listed in ``tools/mutation_equivalent.txt`` as ``<id> <reason>``: it then
counts as equivalent, not survived.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKDIR = ROOT / "build" / "mutation"
SURVIVORS = ROOT / "tools" / "mutation_survivors.txt"
EQUIVALENT = ROOT / "tools" / "mutation_equivalent.txt"

# The modules under test, each with its own test file, which runs first.
MODULES = {
    "runner": "tests/test_runner.py",
    "instance": "tests/test_instance.py",
    "download": "tests/test_download.py",
    "backoff": "tests/test_backoff.py",
    "plan": "tests/test_plan.py",
    "cluster": "tests/test_cluster.py",
}
# The fast unit tests, in the order they run after the module's own file: the cluster and the
# planner compose every machine, so they come next.
FAST_TESTS = (
    "tests/test_cluster.py",
    "tests/test_plan.py",
    "tests/test_runner.py",
    "tests/test_instance.py",
    "tests/test_download.py",
    "tests/test_backoff.py",
)
PYTEST_ARGS = (
    "-x",
    "-q",
    "-p",
    "no:cacheprovider",
    # tests/conftest.py imports the daemon's harness (trio, httpx, the controller): none of the
    # fast tests needs it, and the Hypothesis profile it registers is replaced by `mutation`.
    "--noconftest",
    # Rewriting the asserts of the test files costs 1-2 s a run when no bytecode may be cached;
    # it changes the messages of failures, never whether a test fails.
    "--assert=plain",
    # Only the Hypothesis plugin: schemathesis, anyio and platformdirs have nothing to do here.
    "--disable-plugin-autoload",
    "-p",
    "_hypothesis_pytestplugin",
)
HYPOTHESIS_PROFILE = {"derandomize": True, "max_examples": 50, "deadline": None, "database": None, "print_blob": False}
OUTPUT_TAIL = 4000  # characters of a killed mutant's pytest output kept in the session
SKIPPED_ANNOTATION = "skipped: inside a function annotation, never evaluated (from __future__ import annotations)"
# cosmic-ray's operators filter, with the patterns its docs (how-tos/filters) give: `is`/`is not` swapped with
# `==`, `!=`, `<`, `<=`, `>`, `>=` and back. Against None, enum members and interned strings the swap to or
# from `==`/`!=` is equivalent, and the ordering ones only raise TypeError, like `is` -> `is not` already does.
EXCLUDED_OPERATORS = [
    "core/ReplaceComparisonOperator_Is(Not)?_(Not)?(Eq|[LG]tE?)",
    "core/ReplaceComparisonOperator_(Not)?(Eq|[LG]tE?)_Is(Not)?",
]


def pytest_command(module: str) -> str:
    """The command cosmic-ray records and the worker runs (in a forked, pre-warmed interpreter)."""
    own = MODULES[module]
    tests = [own, *(t for t in FAST_TESTS if t != own)]
    return shlex.join(["python", "-m", "pytest", *PYTEST_ARGS, *tests])


# -- extra operators -------------------------------------------------------------------------


def _exod_operators() -> dict[str, type]:
    """Operators cosmic-ray lacks: dropping a statement, dropping a keyword argument."""
    import parso.python.tree as pt
    from cosmic_ray.operators.operator import Example, Operator

    def is_call_trailer(node: Any) -> bool:
        return node.type == "trailer" and node.children[0] == "("

    class RemoveCallStatement(Operator):
        """A call whose value is discarded (``self.x.append(y)``) becomes ``pass``."""

        def mutation_positions(self, node):
            if (
                node.type in ("atom_expr", "power")
                and node.parent is not None
                and node.parent.type == "simple_stmt"
                and is_call_trailer(node.children[-1])
            ):
                yield (node.start_pos, node.end_pos)

        def mutate(self, node, index):
            assert index == 0
            return pt.Keyword("pass", node.start_pos, prefix=node.get_first_leaf().prefix)

        @classmethod
        def examples(cls):
            return (Example("def f():\n    g(1)\n    return 2\n", "def f():\n    pass\n    return 2\n"),)

    class RemoveKeywordArgument(Operator):
        """``f(a, k=1, m=2)`` becomes ``f(a, m=2)``, then ``f(a, k=1)``."""

        @staticmethod
        def _keywords(node: Any) -> list[Any]:
            if not is_call_trailer(node) or len(node.children) != 3:
                return []
            inner = node.children[1]
            args = inner.children if inner.type == "arglist" else [inner]
            return [a for a in args if a.type == "argument" and len(a.children) == 3 and a.children[1] == "="]

        def mutation_positions(self, node):
            return [(kw.start_pos, kw.end_pos) for kw in self._keywords(node)]

        def mutate(self, node, index):
            victim = self._keywords(node)[index]
            inner = node.children[1]
            if inner is victim:  # the only argument
                node.children = [node.children[0], node.children[2]]
                return node
            kids = inner.children
            at = kids.index(victim)
            if at + 1 < len(kids) and kids[at + 1] == ",":
                if at + 2 < len(kids):  # the next argument takes the place, and the spacing, of the victim
                    kids[at + 2].get_first_leaf().prefix = victim.get_first_leaf().prefix
                del kids[at : at + 2]  # the argument and the comma after it
            else:
                del kids[at - 1 : at + 1]  # the last argument and the comma before it
            return node

        @classmethod
        def examples(cls):
            return (
                Example("f(a, k=1, m=2)", "f(a, m=2)"),
                Example("f(a, k=1, m=2)", "f(a, k=1)", occurrence=1),
                Example("f(k=1)", "f()"),
            )

    return {"RemoveCallStatement": RemoveCallStatement, "RemoveKeywordArgument": RemoveKeywordArgument}


def _install_exod_operators() -> None:
    """Register the provider ``exod`` next to ``core`` (cosmic-ray finds providers by entry point)."""
    import cosmic_ray.plugins

    class Provider:
        def __init__(self) -> None:
            self._operators = _exod_operators()

        def __iter__(self):
            return iter(self._operators)

        def __getitem__(self, name: str) -> type:
            return self._operators[name]

    cosmic_ray.plugins.OPERATOR_PROVIDERS.setdefault("exod", Provider())


# -- the worker: a pre-warmed interpreter that forks one pytest run per mutant ---------------


def _third_party_modules_of_fsm(tree: Path) -> list[str]:
    """The modules outside ``tree`` that ``import fsm`` (and its six machines) loads, found in a child."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        code = 0
        try:
            for name in ("fsm", *(f"fsm.{m}" for m in MODULES)):
                importlib.import_module(name)
            names = [
                name
                for name, mod in list(sys.modules.items())
                if not str(getattr(mod, "__file__", None) or "").startswith(str(tree))
            ]
            os.write(write, "\n".join(names).encode())
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"worker: `import fsm` fails in {tree}")
    return b"".join(chunks).decode().splitlines()


def _forked_run_tests(command: str, timeout: float) -> tuple[Any, str]:
    """cosmic-ray's ``run_tests``, for ``python -m pytest ARGS``: ``pytest.main(ARGS)`` in a fork."""
    import pytest
    from cosmic_ray.work_item import TestOutcome

    argv = shlex.split(command)
    if argv[1:3] != ["-m", "pytest"]:
        raise ValueError(f"this worker only runs `python -m pytest ...`, not {command!r}")
    tree = os.getcwd()
    with tempfile.TemporaryFile() as out:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 98
            try:
                signal.set_wakeup_fd(-1)  # the worker's event loop must not hear the child's signals
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_DFL)
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                code = int(pytest.main(argv[3:]))
                fsm = sys.modules.get("fsm")
                where = getattr(fsm, "__file__", None) or ""
                if code == 0 and not where.startswith(tree + os.sep):
                    print(f"MUTATION-TOOL: fsm was imported from {where!r}, not from {tree}")
                    code = 97
            except BaseException:
                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return TestOutcome.KILLED, "timeout"
            time.sleep(0.005)
        out.seek(0)
        output = out.read().decode("utf-8", "replace")[-OUTPUT_TAIL:]
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return TestOutcome.SURVIVED, output
    if code == 97:
        return TestOutcome.INCOMPETENT, output
    return TestOutcome.KILLED, output


def serve_worker(port: int) -> None:
    """``http-worker`` of cosmic-ray in the current directory (a copy of the tree), pre-warmed."""
    tree = Path.cwd().resolve()
    sys.dont_write_bytecode = True
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    sys.path[:] = [str(tree), *(p for p in sys.path if p not in ("", str(ROOT / "tools"), str(ROOT)))]

    import _hypothesis_pytestplugin  # noqa: F401
    import cosmic_ray.distribution.http as cr_http
    import cosmic_ray.mutating
    import pytest  # noqa: F401
    from aiohttp import web
    from hypothesis import HealthCheck, settings

    settings.register_profile("mutation", suppress_health_check=[HealthCheck.too_slow], **HYPOTHESIS_PROFILE)
    settings.load_profile("mutation")
    for name in _third_party_modules_of_fsm(tree):
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    leaked = sorted(n for n in sys.modules if n == "fsm" or n.startswith("fsm."))
    if leaked:
        raise SystemExit(f"worker: {leaked} imported before forking; mutants would not be seen")

    _install_exod_operators()
    cosmic_ray.mutating.run_tests = _forked_run_tests
    app = web.Application()
    app.add_routes([web.post("/", cr_http.handle_mutate_and_test)])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# -- the run -----------------------------------------------------------------------------------


def _snapshot(rev: str | None, dest: Path) -> str:
    """Copy the tree (``rev``, or the working tree with its uncommitted changes) to ``dest``."""
    dest.mkdir(parents=True)
    if rev:
        commit = _git("rev-parse", "--short", rev)
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        return commit
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    for name in filter(None, listing.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, check=True, capture_output=True).stdout
    return _git("rev-parse", "--short", "HEAD") + ("+uncommitted" if dirty.strip() else "")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Workers:
    trees: list[Path]
    procs: list[subprocess.Popen] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    def start(self, logdir: Path) -> None:
        for i, tree in enumerate(self.trees):
            port = _free_port()
            # this script, not the tree's copy: a --rev tree may predate it
            cmd = [sys.executable, "-B", str(Path(__file__).resolve()), "--worker", str(port)]
            with (logdir / f"worker-{i}.log").open("w") as log:
                self.procs.append(subprocess.Popen(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT))
            self.urls.append(f"http://127.0.0.1:{port}")
        for proc, url, i in zip(self.procs, self.urls, range(len(self.procs)), strict=True):
            port = int(url.rsplit(":", 1)[1])
            deadline = time.monotonic() + 120
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"worker {i} exited; see {logdir / f'worker-{i}.log'}")
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"worker {i} did not start; see {logdir / f'worker-{i}.log'}")
                time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _config(module: str, timeout: float, urls: list[str]) -> dict[str, Any]:
    from cosmic_ray.config import ConfigDict

    return ConfigDict(
        {
            "module-path": f"fsm/{module}.py",
            "timeout": timeout,
            "excluded-modules": [],
            "test-command": pytest_command(module),
            "distributor": ConfigDict({"name": "http", "http": ConfigDict({"worker-urls": list(urls)})}),
            "filters": ConfigDict({"operators-filter": ConfigDict({"exclude-operators": EXCLUDED_OPERATORS})}),
        }
    )


def _distribute(db: Any, cfg: Any, label: str, total: int) -> None:
    """``cosmic-ray exec`` with a progress line."""
    import asyncio

    import cosmic_ray.plugins

    started, done, last = time.monotonic(), 0, 0.0
    counts: Counter[str] = Counter()

    def on_task_complete(job_id: str, result: Any) -> None:
        nonlocal done, last
        db.set_result(job_id, result)
        done += 1
        counts[result.test_outcome.value if result.test_outcome else result.worker_outcome.value] += 1
        now = time.monotonic()
        if now - last > 15 or done == total:
            last = now
            print(f"  {label}: {done}/{total} in {now - started:.0f}s {dict(counts)}", flush=True)

    asyncio.set_event_loop(asyncio.new_event_loop())
    distributor = cosmic_ray.plugins.get_distributor(cfg.distributor_name)
    distributor(db.pending_work_items, cfg.test_command, cfg.timeout, cfg.distributor_config, on_task_complete)


def _baseline(module: str, urls: list[str], sessions: Path) -> float:
    """The unmutated tree passes the tests on a worker; returns how long that took."""
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import TestOutcome, WorkItem

    cfg = _config(module, 300.0, urls[:1])
    with use_db(sessions / "baseline.sqlite") as db:
        db.clear()
        db.add_work_item(WorkItem(mutations=[], job_id="baseline"))
        started = time.monotonic()
        _distribute(db, cfg, "baseline", 1)
        elapsed = time.monotonic() - started
        result = next(db.results)[1]
    if result.test_outcome != TestOutcome.SURVIVED:
        raise SystemExit(f"the fast tests fail on the unmutated tree:\n{result.output}")
    return elapsed


def _annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) of every parameter and return annotation, in parso's (line, column)."""
    import parso

    tree = ast.parse(source)
    future = any(
        isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    )
    if not future:
        return []
    spans = []

    def walk(node: Any) -> None:
        if node.type == "funcdef":
            for param in node.get_params():
                if param.annotation is not None:
                    spans.append((param.annotation.start_pos, param.annotation.end_pos))
            if node.annotation is not None:
                spans.append((node.annotation.start_pos, node.annotation.end_pos))
        for child in getattr(node, "children", ()):
            walk(child)

    walk(parso.parse(source))
    return spans


def _init_session(module: str, tree: Path, db: Any, config: Path) -> tuple[int, int]:
    """All mutants of ``module``, less the excluded operators and those inside function annotations."""
    from argparse import Namespace

    import cosmic_ray.commands
    from cosmic_ray.tools.filters.operators_filter import OperatorsFilter
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    path = Path(f"fsm/{module}.py")
    with contextlib.chdir(tree):
        cosmic_ray.commands.init([path], db, {})
    OperatorsFilter().filter(db, Namespace(config=str(config)))
    spans = _annotation_spans((tree / path).read_text())
    done = {job_id for job_id, _ in db.results}
    in_annotation = [
        item.job_id
        for item in db.work_items
        if item.job_id not in done
        and any(a <= tuple(item.mutations[0].start_pos) and tuple(item.mutations[0].end_pos) <= b for a, b in spans)
    ]
    if in_annotation:
        result = WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=SKIPPED_ANNOTATION)
        db.set_multiple_results(in_annotation, result)
    return db.num_work_items, db.num_results


def run(modules: list[str], jobs: int, rev: str | None, timeout: float | None, fail_under: float | None) -> int:
    from cosmic_ray.work_db import use_db

    _install_exod_operators()
    WORKDIR.mkdir(parents=True, exist_ok=True)
    for old in [*WORKDIR.glob("tree*"), *(WORKDIR / f"{m}.{ext}" for m in modules for ext in ("sqlite", "toml"))]:
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
    source = WORKDIR / "tree"
    label = _snapshot(rev, source)
    trees = []
    for i in range(jobs):
        shutil.copytree(source, WORKDIR / f"tree-{i}")
        trees.append(WORKDIR / f"tree-{i}")
    print(f"mutation testing {', '.join(f'fsm/{m}.py' for m in modules)} at {label}, {jobs} worker(s)", flush=True)
    runs = _runs()
    workers = Workers(trees)
    try:
        workers.start(WORKDIR)
        base = _baseline(modules[0], workers.urls, WORKDIR)
        limit = timeout or max(30.0, round(5 * base))
        print(f"baseline: the fast tests pass in {base:.1f}s; a mutant times out after {limit:.0f}s", flush=True)
        for module in modules:
            cfg = _config(module, limit, workers.urls)
            (WORKDIR / f"{module}.toml").write_text(_toml(cfg))
            with use_db(WORKDIR / f"{module}.sqlite") as db:
                total, skipped = _init_session(module, source, db, WORKDIR / f"{module}.toml")
                started = time.monotonic()
                _distribute(db, cfg, f"fsm/{module}.py", total - skipped)
            runs[module] = {"tree": label, "seconds": round(time.monotonic() - started, 1), "jobs": jobs}
            (WORKDIR / "runs.json").write_text(json.dumps(runs, indent=1))
    finally:
        workers.stop()
    return report(modules, fail_under)


def _runs() -> dict[str, Any]:
    """Per module: the tree it ran on, how long it took, with how many workers."""
    path = WORKDIR / "runs.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _toml(cfg: dict[str, Any]) -> str:
    from cosmic_ray.config import serialize_config

    return serialize_config(json.loads(json.dumps(cfg)))


# -- the report --------------------------------------------------------------------------------


@dataclass
class Mutant:
    module: str
    line: int
    operator: str
    definition: str | None
    diff: str
    outcome: str  # killed, timeout, survived, filtered, annotation, error, pending
    output: str
    id: str = ""

    def key(self, context: bool = False) -> str:
        """Module, operator and the changed lines (with ``context``: the whole hunk), stripped."""
        lines = [ln for ln in self.diff.splitlines() if ln[:3] not in ("---", "+++", "@@ ")]
        if not context:
            lines = [ln for ln in lines if ln[:1] in "+-"]
        return "\n".join([self.module, self.operator, *(ln[:1] + ln[1:].strip() for ln in lines)])


def _load(module: str) -> list[Mutant]:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    path = WORKDIR / f"{module}.sqlite"
    if not path.exists():
        return []
    mutants = []
    with use_db(path, WorkDB.Mode.open) as db:
        results = dict(db.results)
        for item in db.work_items:
            spec = item.mutations[0]
            result = results.get(item.job_id)
            if result is None:
                outcome = "pending"
            elif result.worker_outcome == WorkerOutcome.SKIPPED:
                outcome = "annotation" if result.output == SKIPPED_ANNOTATION else "filtered"
            elif result.worker_outcome != WorkerOutcome.NORMAL or result.test_outcome == TestOutcome.INCOMPETENT:
                outcome = "error"
            elif result.test_outcome == TestOutcome.SURVIVED:
                outcome = "survived"
            elif result.output == "timeout":
                outcome = "timeout"
            else:
                outcome = "killed"
            diff = "\n".join(
                ln for ln in ((result.diff or "") if result else "").splitlines() if ln != "--- mutation diff ---"
            )
            mutants.append(
                Mutant(
                    f"fsm/{module}.py",
                    spec.start_pos[0],
                    spec.operator_name,
                    spec.definition_name,
                    diff,
                    outcome,
                    (result.output or "") if result else "",
                )
            )
    mutants.sort(key=lambda m: (m.line, m.operator, m.diff))
    # The id: a hash of the changed lines, which stays put when other code moves; of the whole hunk when
    # the changed lines alone are not unique (a decorator removed on several classes); then an ordinal.
    short = Counter(m.key() for m in mutants)
    keys = [m.key(context=short[m.key()] > 1) for m in mutants]
    seen: Counter[str] = Counter()
    for m, key in zip(mutants, keys, strict=True):
        digest = hashlib.sha1(key.encode()).hexdigest()[:10]
        m.id = digest if not seen[key] else f"{digest}~{seen[key]}"
        seen[key] += 1
    return mutants


def _equivalents() -> dict[str, str]:
    """``tools/mutation_equivalent.txt``: ``<id> <one-line reason>``; # starts a comment."""
    if not EQUIVALENT.exists():
        return {}
    entries = {}
    for line in EQUIVALENT.read_text().splitlines():
        line = line.split("#", 1)[0].strip() if line.lstrip().startswith("#") else line.strip()
        if line:
            mid, _, reason = line.partition(" ")
            entries[mid] = reason.strip()
    return entries


def report(modules: list[str], fail_under: float | None = None) -> int:
    runs = _runs()
    equivalents = _equivalents()
    print(f"{'module':<18}" + "".join(f" {title:>{width}}" for title, width in COLUMNS) + f" {'score':>7} {'time':>6}")
    sections: dict[str, str] = {}
    status = 0
    totals: Counter[str] = Counter()
    outcome_of: dict[str, str] = {}  # id -> outcome, over the modules reported
    for module in modules:
        mutants = _load(module)
        if not mutants:
            print(f"fsm/{module}.py: no session in {WORKDIR.relative_to(ROOT)}")
            status = 1
            continue
        for m in mutants:
            if m.outcome == "survived" and m.id in equivalents:
                m.outcome = "equivalent"
            outcome_of[m.id] = m.outcome
        c = Counter(m.outcome for m in mutants)
        c["mutants"] = len(mutants)
        totals.update(c)
        score = _score(c)
        info = runs.get(module, {})
        secs = info.get("seconds")
        took = f"{secs // 60:.0f}m{secs % 60:02.0f}s" if secs is not None else "-"
        print(_row(f"fsm/{module}.py", c) + f" {took:>6}")
        if c["error"] or c["pending"] or (fail_under is not None and score < fail_under):
            status = 1
        sections[module] = _section(module, mutants, c, info.get("tree", "?"), equivalents)
    if len(sections) > 1:
        print(_row("all", totals))
    print(
        "score = (killed + timeout) / (ran - equivalent); not run: filtered = excluded operators (is <-> ==, ...),"
        " annot = inside function annotations"
    )
    _write_survivors(sections)
    print(f"survivors: {SURVIVORS.relative_to(ROOT)}; sessions: {WORKDIR.relative_to(ROOT)}/<module>.sqlite")
    for mid in sorted(equivalents):
        if outcome_of.get(mid, "survived") not in ("survived", "equivalent"):
            print(f"note: {mid} in {EQUIVALENT.name} is now {outcome_of[mid]}: drop it from there")
    return status


def _score(c: Counter[str]) -> float:
    killed = c["killed"] + c["timeout"]
    return 100.0 * killed / (killed + c["survived"]) if killed + c["survived"] else 100.0


COLUMNS = [("mutants", 7), ("filtered", 8), ("annot", 5), ("ran", 5), ("killed", 6), ("timeout", 7)]
COLUMNS += [("survived", 8), ("equiv", 5), ("error", 5)]


def _row(name: str, c: Counter[str]) -> str:
    ran = c["mutants"] - c["filtered"] - c["annotation"] - c["pending"]
    values = [c["mutants"], c["filtered"], c["annotation"], ran, c["killed"], c["timeout"]]
    values += [c["survived"], c["equivalent"], c["error"]]
    cells = "".join(f" {v:>{width}}" for v, (_, width) in zip(values, COLUMNS, strict=True))
    return f"{name:<18}{cells} {_score(c):>6.1f}%"


def _section(module: str, mutants: list[Mutant], c: Counter[str], tree: str, eq: dict[str, str]) -> str:
    lines = [
        f"## fsm/{module}.py: {len(mutants) - c['filtered'] - c['annotation']} ran, {c['killed']} killed, "
        f"{c['timeout']} timeout, "
        f"{c['survived']} survived, {c['equivalent']} equivalent, {c['error']} error; "
        f"score {_score(c):.1f}% (tree {tree})",
        "",
    ]
    for m in mutants:
        if m.outcome not in ("survived", "equivalent", "error"):
            continue
        where = f" in {m.definition}" if m.definition else ""
        tag = {"survived": "SURVIVED", "equivalent": "equivalent", "error": "ERROR"}[m.outcome]
        lines.append(f"[{m.id}] {tag} {m.module}:{m.line}{where} {m.operator}")
        if m.outcome == "equivalent":
            lines.append(f"    why equivalent: {eq[m.id]}")
        lines.extend("    " + ln for ln in m.diff.splitlines() if ln[:3] not in ("---", "+++"))
        if m.outcome == "error":
            lines.extend("    ! " + ln for ln in m.output.splitlines()[-10:])
        lines.append("")
    return "\n".join(lines)


def _write_survivors(sections: dict[str, str]) -> None:
    """Replace the sections of the modules that ran; keep the others."""
    kept: dict[str, str] = {}
    if SURVIVORS.exists():
        for chunk in re.split(r"^(?=## fsm/)", SURVIVORS.read_text(), flags=re.M):
            m = re.match(r"## fsm/(\w+)\.py", chunk)
            if m:
                kept[m.group(1)] = chunk.rstrip("\n") + "\n"
    kept.update({k: v.rstrip("\n") + "\n" for k, v in sections.items()})
    head = (
        "# Surviving mutants of tools/mutation.py (`make mutation`), one section per module, written by the\n"
        "# script: each is [id] line operator and the diff. Kill one with a test that asserts behaviour, or,\n"
        "# if no test can tell it from the original, add `<id> <one-line reason>` to mutation_equivalent.txt.\n"
    )
    order = [m for m in MODULES if m in kept]
    SURVIVORS.write_text(head + "".join("\n" + kept[m] for m in order))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", metavar="MODULE", help="some of: " + ", ".join(MODULES))
    parser.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1, help="workers (default: CPUs)")
    parser.add_argument("--rev", help="mutate this commit instead of the working tree")
    parser.add_argument("--timeout", type=float, help="seconds before a mutant's run counts as timeout")
    parser.add_argument("--fail-under", type=float, help="exit 1 if a module's score is below this percentage")
    parser.add_argument("--report", action="store_true", help="print the last run's results again, run nothing")
    parser.add_argument("--worker", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        serve_worker(args.worker)
        return 0
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        print('cosmic-ray is missing: .venv/bin/pip install -e ".[test,mutation]" (or `make mutation`)')
        return 2
    if unknown := set(args.modules) - set(MODULES):
        parser.error(f"unknown module(s) {sorted(unknown)}; pick from {', '.join(MODULES)}")
    modules = [m for m in MODULES if m in args.modules] if args.modules else list(MODULES)
    if args.report:
        return report(modules, args.fail_under)
    if args.timeout is not None and not 0 < args.timeout < 290:
        parser.error("--timeout must lie in (0, 290): the http distributor gives a request 300 s")
    return run(modules, max(1, args.jobs), args.rev, args.timeout, args.fail_under)


if __name__ == "__main__":
    sys.exit(main())
