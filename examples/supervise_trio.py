"""Supervise plain processes with fsm's driver, in trio: the tutorial's supervisor, in structured concurrency.

The same world as ``supervise_processes.py`` (asyncio): two ranks of
``python -m http.server`` make one instance; it brings generation 1 up,
SIGKILLs rank 1, lets the driver stop rank 0, back off and start generation 2,
then deletes the instance and replays the transition log. What trio changes:
every handler of the `fsm.Adapter` starts its work in the supervisor's nursery
with ``nursery.start_soon(fn, *args)`` (trio takes the function and its
arguments, never an awaitable) and returns None, so ``Round.work`` is empty and
no task outlives ``main``. Times are ``time.monotonic()``: a step of the wall
clock moves no deadline.

    python examples/supervise_trio.py [--one-for-one]
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import urllib.request

import trio

import fsm
from fsm import runner as rn
from fsm.conformance import replay

POLICY = fsm.RetryPolicy(backoff=fsm.Backoff(initial=0.2, factor=2.0, cap=2.0), max_failures=3)
STOP_GRACE_S = 2.0
# Nothing outlives this process (no snapshot), so its own run is the monotonic clock's epoch (a supervisor that
# keeps snapshots names the boot: examples/supervise_workers.py).
CLOCK = fsm.Clock.monotonic(epoch=f"supervise_trio pid {os.getpid()}")

Key = tuple[str, int]  # (runner_id, incarnation): one process


class Processes:
    """The world: one ``http.server`` per rank, each watched by a task of ``nursery``."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.driver: fsm.Driver
        self.changed = trio.Event()  # set by every report: the loop plans again
        self.procs: dict[Key, trio.Process] = {}
        self.endpoints: dict[Key, str | None] = {}  # each process's, once it says it (None: it never served)
        self.said: dict[Key, trio.Event] = {}

    def _tell(self, report) -> None:
        report()
        self.changed.set()

    def _said(self, key: Key) -> trio.Event:
        return self.said.setdefault(key, trio.Event())

    # -- fsm.Adapter: each starts its work in the nursery and returns --------------------------

    def create_runner(self, action: fsm.CreateRunner) -> None:
        self.nursery.start_soon(self._run, (action.runner_id, action.incarnation))

    def connect_runner(self, action: fsm.ConnectRunner) -> None:
        key = (action.runner_id, action.incarnation)
        self.nursery.start_soon(self._reachable, key, rn.Connected(*key))

    def load_model(self, action: fsm.LoadModel) -> None:
        key = (action.runner_id, action.incarnation)
        self.nursery.start_soon(self._reachable, key, rn.WeightsLoaded(*key))

    def warm_up(self, action: fsm.WarmUp) -> None:
        key = (action.runner_id, action.incarnation)
        self.nursery.start_soon(self._reachable, key, rn.Warmed(*key))

    def stop_runner(self, action: fsm.StopRunner) -> None:
        self.nursery.start_soon(self._stop, (action.runner_id, action.incarnation))

    def forward_request(self, action: fsm.ForwardRequest) -> None:
        raise NotImplementedError("this example sends no requests")

    cancel_request = forward_request

    # -- the work ----------------------------------------------------------------------------

    async def _run(self, key: Key) -> None:
        """Start the process, publish its port once it says it, and report its exit, whatever ended it."""
        argv = [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1"]
        proc = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.procs[key] = proc
        line = await _first_line(proc.stdout)  # "Serving HTTP on 127.0.0.1 port 41234 (...) ..."
        self.endpoints[key] = f"127.0.0.1:{line.split('port')[1].split()[0]}" if "port" in line else None
        self._said(key).set()
        if (endpoint := self.endpoints[key]) is not None:
            self._tell(lambda: self.driver.published(*key, endpoint))
        code = await proc.wait()
        await proc.stdout.aclose()
        self._tell(lambda: self.driver.report(rn.Exited(*key, exit_code=code)))

    async def _reachable(self, key: Key, then: rn.RunnerEvent) -> None:
        """Connect, load and warm up all mean one thing for a web server: it answers."""
        await self._said(key).wait()  # a replica is told to load as soon as it is created
        if (endpoint := self.endpoints[key]) is None:
            return  # it never served: its exit is reported by _run
        try:
            await trio.to_thread.run_sync(get, f"http://{endpoint}/")
        except OSError as exc:
            failure = fsm.Failure.exception(type(exc).__name__, str(exc))
            self._tell(lambda: self.driver.report(rn.Fail(*key, failure=failure)))
        else:
            self._tell(lambda: self.driver.report(then))

    async def _stop(self, key: Key) -> None:
        proc = self.procs.get(key)
        if proc is None or proc.returncode is not None:
            return  # its exit is reported by _run
        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(STOP_GRACE_S):
            await proc.wait()
            return
        proc.kill()


async def _first_line(stream: trio.abc.ReceiveStream) -> str:
    data = b""
    while b"\n" not in data and (chunk := await stream.receive_some()):
        data += chunk
    return data.decode(errors="replace")


def get(url: str) -> None:
    with urllib.request.urlopen(url, timeout=5) as response:
        response.read()


async def supervise(driver: fsm.Driver, world: Processes, until) -> None:
    """The loop: reconcile (the handlers start their tasks), then wait for a report or the next wake-up."""
    while not until():
        world.changed = trio.Event()
        driver.reconcile()
        wake = driver.next_wakeup()
        with trio.move_on_after(math.inf if wake is None else max(0.0, wake - time.monotonic())):
            await world.changed.wait()


def generation(cluster: fsm.Cluster, world: Processes) -> str:
    machine = cluster.instance("web")
    pids = [world.procs[(f"web/{r}", machine.rank_generations[r])].pid for r in range(2)]
    if machine.policy.strategy is fsm.RestartStrategy.ONE_FOR_ONE:
        return f"replicas of generations {machine.rank_generations} ready, attempts {machine.attempts}, pids {pids}"
    return f"generation {machine.generation} ready, attempts {machine.attempts}, pids {pids}"


async def main(strategy: fsm.RestartStrategy) -> None:
    cluster = fsm.Cluster(clock=CLOCK)
    slots = [fsm.Slot(rank, "local", f"web/{rank}") for rank in range(2)]
    policy = fsm.RetryPolicy(backoff=POLICY.backoff, max_failures=POLICY.max_failures, strategy=strategy)
    cluster.place("web", "local/http.server", slots, policy=policy, local=True)  # nothing to download
    machine = cluster.instance("web")

    def ready(gen: int):  # the newest generation, of the whole instance or of the replica restarted last
        return lambda: machine.instance_state is fsm.InstanceState.READY and machine.generation == gen

    async with trio.open_nursery() as nursery:  # every process's task: main returns once all have ended
        world = Processes(nursery)
        driver = world.driver = fsm.Driver(cluster, world, time.monotonic)
        await supervise(driver, world, ready(1))
        print(generation(cluster, world))
        victim = world.procs[("web/1", 1)]
        victim.kill()
        print(f"killed rank 1 (pid {victim.pid})")
        await supervise(driver, world, ready(2))
        print(generation(cluster, world))
        cluster.delete("web", time.monotonic())
        await supervise(driver, world, lambda: not cluster.has_live_runners("web"))
    print(f"deleted; every process reaped: {all(p.returncode is not None for p in world.procs.values())}")
    for entry in cluster.log:
        if entry.machine == "instance" and entry.source != entry.target:
            print(f"  instance {entry.source} → {entry.target} ({entry.event})")
    print(f"log replays: {'ok' if replay(cluster.log).ok else 'DIVERGED'}")


if __name__ == "__main__":
    alone = "--one-for-one" in sys.argv[1:]
    trio.run(main, fsm.RestartStrategy.ONE_FOR_ONE if alone else fsm.RestartStrategy.ONE_FOR_ALL)
