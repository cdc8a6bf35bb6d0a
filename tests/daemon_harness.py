"""Run a real Controller (real runner processes, real MLX) inside ``trio.run`` for a test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Self

import httpx
import pytest
import trio

import fsm
from exod.config import DaemonConfig
from exod.controller import Controller
from exod.host.supervisor import Timeouts
from exod.state.sqlite import Store

FAST_RETRY = fsm.RetryPolicy(backoff=fsm.Backoff(initial=0.2, factor=2.0, cap=1.0), max_failures=5)
FAST_TIMEOUTS = Timeouts(connect=30, load_progress=60, warm_up=60, stop_grace=2, term_grace=2)


def config(tmp_path: Path, hf_home: Path, **overrides: Any) -> DaemonConfig:
    values: dict[str, Any] = {
        "state_dir": tmp_path / "state",
        "hf_home": hf_home,
        "offline": True,
        "timeouts": FAST_TIMEOUTS,
        "policy": FAST_RETRY,
        "download_policy": fsm.Backoff(initial=0.2, factor=2.0, cap=0.5),
        "download_timeout": 5.0,
    }
    values.update(overrides)
    return DaemonConfig(**values)


def with_controller(
    cfg: DaemonConfig,
    body: Callable[[Controller], Awaitable[Any]],
    *,
    limit: float = 90.0,
    clock: trio.abc.Clock | None = None,
    **controller_args: Any,
) -> Any:
    """Start a controller, run ``body`` against it, then cancel everything (which reaps every runner).

    ``clock`` and ``controller_args`` (``spawn``, ``models``, ``wall``) are for in-process fakes on a
    `trio.testing.MockClock` (tests/fake_runners.py); ``limit`` is then virtual seconds.
    """

    async def main() -> Any:
        store = Store.open(cfg.db_path, retention=cfg.retention)
        try:
            controller = Controller(cfg, store, **controller_args)
            await controller.restore()
            with trio.fail_after(limit):
                async with trio.open_nursery() as nursery:
                    await nursery.start(controller.run)
                    result = await body(controller)
                    nursery.cancel_scope.cancel()
            return result
        finally:
            store.close()

    return trio.run(main, clock=clock)


async def wait_for(controller: Controller, predicate: Callable[[dict], bool], timeout: float = 60.0) -> dict:
    """Poll the controller's status (a test's view from outside) until ``predicate`` holds."""
    with trio.fail_after(timeout):
        while True:
            status = controller.status()
            if predicate(status):
                return status
            await trio.sleep(0.02)


def instance(status: dict, instance_id: str) -> dict:
    return next(i for i in status["instances"] if i["instance_id"] == instance_id)


# Every process this test session starts inherits this tag, so a check for leftovers sees only ours
# (another test run, or a benchmark, on the same machine is none of our business).
os.environ.setdefault("EXOD_TEST_SESSION", str(os.getpid()))
SESSION_TAG = f"EXOD_TEST_SESSION={os.environ['EXOD_TEST_SESSION']}".encode()


def runner_pids() -> list[int]:
    """Live exod runners started by this test session (their hang-up watchdogs, forked children, excluded)."""
    found: dict[int, int] = {}  # pid -> parent pid
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            ours = SESSION_TAG in (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        unreaped_child = fields[0] == "Z" and int(fields[1]) == os.getpid()  # ours to reap, and we did not
        if b"exod.runner" in cmdline and ours and (fields[0] != "Z" or unreaped_child):
            found[int(entry.name)] = int(fields[1])
    return sorted(pid for pid, parent in found.items() if parent not in found)


# -- `exod serve` as a real process -------------------------------------------------------


def exod(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exod", *args], env=env, capture_output=True, text=True, timeout=60, check=check
    )


def start_daemon(
    tmp_path: Path, env: dict[str, str], *extra: str, state: Path | None = None, nofile: int | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`exod serve` with ``tmp_path/exod.toml``; ``nofile``: its RLIMIT_NOFILE (an attacker's target)."""
    import resource

    log = (tmp_path / "serve.log").open("ab")
    state = state or tmp_path / "state"
    args = [sys.executable, "-m", "exod", "serve", "--config", str(tmp_path / "exod.toml"), "--state-dir", str(state)]
    args += extra
    limit = None if nofile is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
    daemon = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            info = json.loads((state / "daemon.json").read_text())
            if info["pid"] == daemon.pid:
                return daemon, info["url"]
        except (OSError, ValueError):
            pass
        assert daemon.poll() is None, (tmp_path / "serve.log").read_text()
        time.sleep(0.05)
    daemon.kill()
    raise AssertionError("daemon did not start: " + (tmp_path / "serve.log").read_text())


def placing(model: str, ranks: int = 1) -> str:
    """The configuration of a daemon on a free port, offline, that places ``model`` on ``ranks``."""
    return f'[daemon]\nport = 0\noffline = true\n\n[[place]]\nmodel = "{model}"\nranks = {ranks}\n'


@contextlib.contextmanager
def ready_daemon(tmp: Path, config: str, models: dict[str, int]) -> Iterator[tuple[str, Path]]:
    """`exod serve` with ``config`` and the tiny ``models`` (repo id → seed) in its own HF cache, once an
    instance is Ready: yields its URL and that cache; stops it with SIGTERM, which must end it cleanly."""
    from exod.host.tiny_model import make_tiny_model

    hf = tmp / "hf"
    for model, seed in models.items():
        make_tiny_model(model, layers=2, hf_home=hf, seed=seed)
    (tmp / "exod.toml").write_text(config)
    process, url = start_daemon(tmp, {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"})
    try:
        wait_instance(url, lambda i: i["state"] == "ready")
        yield url, hf
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def wait_instance(url: str, predicate, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = httpx.get(f"{url}/instances", timeout=10).json()["instances"]
        if last and predicate(last[0]):
            return last[0]
        time.sleep(0.05)
    raise AssertionError(f"timed out; last status: {last}")


def assert_log_conforms(db_path: Path) -> None:
    """The daemon's transition log replays through the machines without a divergence."""
    from exod.state.sqlite import Store
    from fsm.conformance import replay

    store = Store.open(db_path)
    try:
        report = replay(entry for _, entry in store.transitions())
    finally:
        store.close()
    assert report.ok, report.text()
    assert report.entries > 0


def runner_pid(rank: int) -> int:
    """The live runner process of ``rank`` (this session's; one instance at a time)."""
    for pid in runner_pids():
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if args[args.index(b"--rank") + 1] == str(rank).encode():
            return pid
    raise AssertionError(f"no live runner of rank {rank}")


@pytest.fixture
def no_runner_left_behind():
    """Modules that start runners use it: after each test, none of this session's runners is alive."""
    yield
    assert runner_pids() == [], "a runner process outlived its test"


class Background:
    """What a test keeps doing on a thread of its own while it does something else (a sampler of the process
    table, a client sending chats): `step`, again and again `EVERY` seconds apart, from `start` (or the start of
    a ``with`` block) until `stop` (or its end)."""

    EVERY = 0.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def step(self) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.step()
            self._stop.wait(self.EVERY)
