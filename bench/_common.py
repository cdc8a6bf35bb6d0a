"""Shared helpers of the benchmarks: a timestamping Controller, statistics, cleanup, result files."""

from __future__ import annotations

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
from exod.host.supervisor import RunnerSpec, Timeouts
from exod.reports import Reports
from exod.state.sqlite import Store
from fsm import runner as rn

RESULTS = Path(__file__).resolve().parent / "results"

# a short backoff and a budget that a benchmark never exhausts
BENCH_POLICY = fsm.RetryPolicy(backoff=fsm.Backoff(initial=0.05, factor=1.0, cap=0.05), max_retries=100_000)
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


class TimedController(Controller):
    """A Controller that timestamps (``time.monotonic``) what it does and learns, and wakes waiters without polling.

    * ``events``: ``(t_received, t_recorded, event)`` for every runner event; ``t_recorded`` is taken after
      the machines changed and the change was committed to the store.
    * ``first_exit``: per ``(runner_id, incarnation)``, the first ``Exited``/``Fail`` event's timestamps, the
      runner state and the failure the controller recorded.
    * ``reports``: ``(t, runner_id, report)`` for every line a runner sent, as the supervisor hands it over.
    * ``exit_reported``: per runner incarnation, when the supervisor called ``on_exit`` (before the store write).
    * ``actions``: ``(t, action)`` for every action executed; ``spawned``: pid and time per runner incarnation.
    """

    def __init__(self, config: DaemonConfig, store: Store) -> None:
        super().__init__(config, store)
        self._reports = _TimedReports(self)
        self.events: list[tuple[float, float, rn.RunnerEvent]] = []
        self.first_exit: dict[tuple[str, int], tuple[float, float, str, str | None]] = {}
        self.exit_reported: dict[tuple[str, int], float] = {}
        self.reports: list[tuple[float, str, Any]] = []
        self.actions: list[tuple[float, fsm.Action]] = []
        self.spawned: dict[tuple[str, int], tuple[float, int]] = {}
        self.download_done: list[float] = []
        self.tick = trio.Event()

    def runner_event(self, event: rn.RunnerEvent) -> None:
        t_received = time.monotonic()
        super().runner_event(event)
        t_recorded = time.monotonic()
        self.events.append((t_received, t_recorded, event))
        key = (event.runner_id, event.incarnation)
        if isinstance(event, rn.Exited | rn.Fail) and key not in self.first_exit:
            # an Exited from a running state passes through Failed (recording the cause) on to Shutdown
            entry = self.cluster.runners.get(event.runner_id)
            machine = None if entry is None else entry.machine
            state = "gone" if machine is None else machine.runner_state.value
            failure = None if machine is None or machine.failure is None else machine.failure.message
            self.first_exit[key] = (t_received, t_recorded, state, failure)
        self._kick()

    def _execute(self, action: fsm.Action, now: float) -> None:
        self.actions.append((time.monotonic(), action))
        super()._execute(action, now)

    async def _download(self, model_id: str) -> None:
        await super()._download(model_id)
        self.download_done.append(time.monotonic())
        self._kick()

    def _kick(self) -> None:
        self.tick.set()
        self.tick = trio.Event()

    async def until(self, predicate: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Wait, woken by each runner event (no polling), until ``predicate()`` is truthy; returns its value."""
        with trio.fail_after(timeout):
            while not (value := predicate()):
                await self.tick.wait()
            return value

    def instance_state(self, instance_id: str) -> str | None:
        placement = self.cluster.instances.get(instance_id)
        return None if placement is None else placement.machine.instance_state.value

    def runners_alive(self) -> bool:
        return bool(self.processes)


class _TimedReports(Reports):
    """The supervisors' listener, timestamping what each runner said into the controller's lists."""

    def __init__(self, controller: TimedController) -> None:
        super().__init__(controller)
        self.controller = controller

    def on_spawned(self, spec: RunnerSpec, pid: int) -> None:
        self.controller.spawned[(spec.runner_id, spec.incarnation)] = (time.monotonic(), pid)
        super().on_spawned(spec, pid)

    def on_report(self, spec: RunnerSpec, report: Any) -> None:
        self.controller.reports.append((time.monotonic(), spec.runner_id, report))
        super().on_report(spec, report)

    def on_exit(self, spec: RunnerSpec, exit_code: int, stderr_tail: str, stop_delivered: bool) -> None:
        self.controller.exit_reported.setdefault((spec.runner_id, spec.incarnation), time.monotonic())
        super().on_exit(spec, exit_code, stderr_tail, stop_delivered)


async def run_controller(config: DaemonConfig, body: Callable[[TimedController], Any]) -> Any:
    """Run a TimedController while ``body`` runs; on return, error, Ctrl-C or SIGTERM every runner is reaped."""
    store = Store.open(config.db_path)
    try:
        controller = TimedController(config, store)
        await controller.restore()
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            nursery.start_soon(_cancel_on_sigterm, nursery.cancel_scope)
            result = await body(controller)
            nursery.cancel_scope.cancel()  # the supervisors kill and reap their processes (shielded)
        return result
    finally:
        store.close()


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


def write_result(name: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
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
