"""Shared helpers of the benchmarks: the command line (``--smoke``, ``--results-dir``), a timestamping
Controller, statistics, cleanup, result files."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import trio

import fsm
from exod.config import DaemonConfig
from exod.controller import Controller
from exod.host.supervisor import Listener, Process, RunnerSpec, Supervisor, Timeouts
from exod.state.sqlite import Store
from fsm.cluster import LogEntry

RESULTS = Path(__file__).resolve().parent / "results"

# a short backoff and a budget that a benchmark never exhausts
BENCH_POLICY = fsm.RetryPolicy(backoff=fsm.Backoff(initial=0.05, factor=1.0, cap=0.05), max_failures=100_000)
BENCH_TIMEOUTS = Timeouts(connect=30, load_progress=60, warm_up=60, stop_grace=2, term_grace=2)


def bench_config(state_dir: Path, hf_home: Path) -> DaemonConfig:
    return DaemonConfig(
        state_dir=state_dir,
        hf_home=hf_home,
        offline=True,
        timeouts=BENCH_TIMEOUTS,
        policy=BENCH_POLICY,
        download_policy=fsm.Backoff(initial=0.2, factor=2.0, cap=0.5),
        download_timeout=5.0,
    )


# -- the command line every benchmark shares ------------------------------------------------------------

SMOKE_HELP = (
    "one short repetition at the smallest sizes: runs the benchmark end to end and fails (non-zero exit) if it "
    "breaks; its figures are not measurements, no goal is judged, and nothing is written to bench/results "
    "unless --results-dir is given"
)


def parse_args(parser: argparse.ArgumentParser, smoke: dict[str, Any]) -> argparse.Namespace:
    """Parse the benchmark's options, adding ``--smoke`` and ``--results-dir``.

    With ``--smoke``, ``smoke`` replaces the options' defaults (options given explicitly still win). Either
    way SIGTERM ends the script through its ``finally`` blocks, so what it started is stopped and reaped.
    """
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help=f"where NAME.json is written (default {RESULTS.relative_to(RESULTS.parent.parent)}; a smoke run "
        "writes nothing unless given)",
    )
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**smoke)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # trio's signal receivers take it over while they run
    if args.smoke:
        print("smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in smoke.items()), flush=True)
    return args


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def verdict(args: argparse.Namespace, met: bool) -> str:
    """How a goal is reported: judged in full runs only."""
    if args.smoke:
        return "not judged (smoke run)"
    return "meets" if met else "MISSES"


class TimedController(Controller):
    """A Controller whose runners' supervisors are timestamped (``time.monotonic``), and whose waiters wake
    without polling.

    It observes through the controller's public surfaces only, so a refactor of its insides does not blind it
    (`check_observed` fails loudly if it ever does):

    * the ``spawn`` argument of `Controller` (what starts a runner's supervisor): each supervisor gets a
      listener that timestamps what it tells the controller, then passes it on unchanged —
      ``spawned`` (pid and time per runner incarnation), ``reports`` (every line a runner sent),
      ``exit_reported`` (when the supervisor reported the reaped process's exit), ``alive`` (spawned, not yet
      reaped);
    * the transition log (`Controller.transitions`, `log_grew`): what the machines did and when (`logged`,
      `log_times`), and when it was durable;
    * the status document (`Controller.status`): states, incarnations, failures (`instance_doc`).
    """

    def __init__(self, config: DaemonConfig, store: Store) -> None:
        super().__init__(config, store, spawn=self._spawn_timed)
        self.spawned: dict[tuple[str, int], tuple[float, int]] = {}
        self.exit_reported: dict[tuple[str, int], float] = {}
        self.reports: list[tuple[float, str, Any]] = []
        self.alive: set[tuple[str, int]] = set()
        self.changed = trio.Event()
        self._clock_offset = self.now() - time.monotonic()  # the log's wall time - monotonic (one constant)

    def _spawn_timed(self, spec: RunnerSpec, listener: Listener, timeouts: Timeouts) -> Process:
        return Supervisor(spec, _TimedListener(self, listener), timeouts)

    def kick(self) -> None:
        """Wake every `until`."""
        self.changed.set()
        self.changed = trio.Event()

    async def until(self, predicate: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Wait, woken by each write of the log and each supervisor report (no polling), until ``predicate()``
        is truthy; returns its value."""
        with trio.fail_after(timeout):
            while not (value := predicate()):
                await self.changed.wait()
            return value

    def instance_doc(self, instance_id: str) -> dict[str, Any] | None:
        """The instance's entry in the status document (None if there is none)."""
        return next((i for i in self.status()["instances"] if i["instance_id"] == instance_id), None)

    def instance_state(self, instance_id: str) -> str | None:
        doc = self.instance_doc(instance_id)
        return None if doc is None else doc["state"]

    def monotonic(self, log_time: float) -> float:
        """A transition log time (the controller's wall time) on the ``time.monotonic`` clock."""
        return log_time - self._clock_offset

    async def last_seq(self) -> int:
        """The sequence number of the newest durable log entry (0 if none)."""
        entries = await self.transitions()
        return entries[-1][0] if entries else 0

    async def logged(
        self, after: int, match: Callable[[LogEntry], bool], timeout: float = 60.0
    ) -> tuple[LogEntry, float]:
        """The first durable log entry past ``after`` that ``match``es, and when (``time.monotonic``) this
        waiter saw it written: woken by the log's own growth."""
        with trio.fail_after(timeout):
            while True:
                await self.log_grew(after)
                seen = time.monotonic()
                for seq, entry in await self.transitions(after):
                    if match(entry):
                        return entry, seen
                    after = seq

    async def log_times(self, after: int = 0) -> list[tuple[float, LogEntry]]:
        """Every durable log entry past ``after``, with its time on the ``time.monotonic`` clock."""
        return [(self.monotonic(entry.time), entry) for _, entry in await self.transitions(after)]

    def check_observed(self) -> None:
        """Fail loudly if the clock mapping drifted or a hook saw nothing: the controller's code moved."""
        drift = abs(self.now() - time.monotonic() - self._clock_offset)
        if drift > 0.001:
            raise RuntimeError(f"the controller's clock drifted {drift * 1000:.3f} ms from time.monotonic")
        if not self.spawned:
            raise RuntimeError("no runner spawn was observed: Controller(spawn=...) is no longer how runners start")


class _TimedListener:
    """A supervisor's listener (`exod.host.supervisor.Listener`) that timestamps each call, then passes it on."""

    def __init__(self, controller: TimedController, inner: Listener) -> None:
        self.controller, self.inner = controller, inner

    def on_spawned(self, spec: RunnerSpec, pid: int) -> None:
        key = (spec.runner_id, spec.incarnation)
        self.controller.spawned[key] = (time.monotonic(), pid)
        self.controller.alive.add(key)
        self.inner.on_spawned(spec, pid)
        self.controller.kick()

    def on_report(self, spec: RunnerSpec, report: Any) -> None:
        self.controller.reports.append((time.monotonic(), spec.runner_id, report))
        self.inner.on_report(spec, report)
        self.controller.kick()

    def on_stall(self, spec: RunnerSpec, phase: str, seconds: float) -> None:
        self.inner.on_stall(spec, phase, seconds)
        self.controller.kick()

    def on_exit(self, spec: RunnerSpec, exit_code: int, stderr_tail: str, stop_delivered: bool) -> None:
        key = (spec.runner_id, spec.incarnation)
        self.controller.exit_reported.setdefault(key, time.monotonic())  # the process is reaped by now
        self.controller.alive.discard(key)
        self.inner.on_exit(spec, exit_code, stderr_tail, stop_delivered)
        self.controller.kick()


async def run_controller(config: DaemonConfig, body: Callable[[TimedController], Any]) -> Any:
    """Run a TimedController while ``body`` runs; on return, error, Ctrl-C or SIGTERM every runner is reaped."""
    store = Store.open(config.db_path)
    try:
        controller = TimedController(config, store)
        await controller.restore()
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            nursery.start_soon(_cancel_on_sigterm, nursery.cancel_scope)
            nursery.start_soon(_kick_on_log_writes, controller)
            result = await body(controller)
            controller.check_observed()
            nursery.cancel_scope.cancel()  # the supervisors kill and reap their processes (shielded)
        return result
    finally:
        store.close()


async def _kick_on_log_writes(controller: TimedController) -> None:
    while True:
        await controller.log_written.wait()
        controller.kick()


async def _cancel_on_sigterm(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            raise KeyboardInterrupt


@contextlib.contextmanager
def reaped(process: subprocess.Popen[Any]) -> Iterator[subprocess.Popen[Any]]:
    """Kill and reap ``process`` however the block ends."""
    try:
        yield process
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, 9)
        process.wait()
        for stream in (process.stdout, process.stderr, process.stdin):
            if stream is not None:
                stream.close()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); with n < 100 samples p99 is the maximum."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summary(values_ms: list[float]) -> dict[str, float]:
    return {
        "n": len(values_ms),
        "median_ms": round(statistics.median(values_ms), 3),
        "p99_ms": round(percentile(values_ms, 99), 3),
        "min_ms": round(min(values_ms), 3),
        "max_ms": round(max(values_ms), 3),
        "mean_ms": round(statistics.fmean(values_ms), 3),
    }


def machine_info() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_result(name: str, result: dict[str, Any], args: argparse.Namespace) -> Path | None:
    """Write ``result`` to ``NAME.json`` in the results directory; a smoke run writes only where
    ``--results-dir`` says (it must never replace the figures of a full run)."""
    text = json.dumps({**result, "smoke": True} if args.smoke else result, indent=2, sort_keys=True) + "\n"
    if args.smoke and args.results_dir is None:
        print(f"smoke run: {name}.json not written")
        return None
    directory = args.results_dir or RESULTS
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(text)
    print(f"→ {path}")
    return path


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
