"""Supervise plain processes with fsm's driver, in asyncio: no MLX, no exod.

Two ranks of ``python -m http.server`` make one instance. The supervisor is an
`fsm.Adapter` (each handler starts work and returns) and a loop that calls
`Driver.reconcile` after every report and at `Driver.next_wakeup`. It brings
generation 1 up, SIGKILLs rank 1 — the driver stops rank 0 (one_for_all), backs
off and starts generation 2, charging one retry — then deletes the instance and
checks that the transition log replays through the machines. Times are
``time.monotonic()``: a step of the wall clock moves no deadline.

With ``--one-for-one`` the two servers are independent replicas
(``RestartStrategy.ONE_FOR_ONE``): the killed one alone is restarted after its
backoff, as generation 2, while rank 0 keeps its process and serves on.

    python examples/supervise_processes.py [--one-for-one]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import urllib.request

import fsm
from fsm import runner as rn
from fsm.conformance import replay

POLICY = fsm.RetryPolicy(backoff=fsm.Backoff(initial=0.2, factor=2.0, cap=2.0), max_failures=3)
STOP_GRACE_S = 2.0
# Deadlines on time.monotonic(), which no wall clock step moves; nothing outlives this process (no snapshot), so
# its own run is the clock's epoch (a supervisor that keeps snapshots names the boot: examples/supervise_workers.py).
CLOCK = fsm.Clock.monotonic(epoch=f"supervise_processes pid {os.getpid()}")


# tutorial: adapter
class Processes:
    """The world: one ``http.server`` per rank. Reports go to the driver, and wake the loop."""

    def __init__(self) -> None:
        self.driver: fsm.Driver
        self.changed = asyncio.Event()
        self.procs: dict[tuple[str, int], asyncio.subprocess.Process] = {}
        self.endpoints: dict[tuple[str, int], asyncio.Future[str]] = {}  # each process's, once it says it

    def _tell(self, report) -> None:
        report()
        self.changed.set()

    # -- fsm.Adapter: each starts work and returns -----------------------------------------------

    async def create_runner(self, action: fsm.CreateRunner) -> None:
        key = (action.runner_id, action.incarnation)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        self.procs[key] = proc
        line = (await proc.stdout.readline()).decode()  # "Serving HTTP on 127.0.0.1 port 41234 (...) ..."
        if "port" in line:
            endpoint = f"127.0.0.1:{line.split('port')[1].split()[0]}"
            self._endpoint(key).set_result(endpoint)
            self._tell(lambda: self.driver.published(*key, endpoint))
        else:
            self._endpoint(key).cancel()  # it never served: whoever waits for its port stops waiting
        code = await proc.wait()
        self._tell(lambda: self.driver.report(rn.Exited(*key, exit_code=code)))

    def _endpoint(self, key: tuple[str, int]) -> asyncio.Future[str]:
        return self.endpoints.setdefault(key, asyncio.get_running_loop().create_future())

    async def _reachable(self, key: tuple[str, int], then: rn.RunnerEvent) -> None:
        """Connect, load and warm up all mean one thing for a web server: it answers (a replica is told to
        load as soon as it is created: its port may not be known yet)."""
        url = f"http://{await self._endpoint(key)}/"
        try:
            await asyncio.to_thread(get, url)
        except OSError as exc:
            failure = fsm.Failure.exception(type(exc).__name__, str(exc))
            self._tell(lambda: self.driver.report(rn.Fail(*key, failure=failure)))
        else:
            self._tell(lambda: self.driver.report(then))

    def connect_runner(self, action: fsm.ConnectRunner):
        return self._reachable((action.runner_id, action.incarnation), rn.Connected(*action_key(action)))

    def load_model(self, action: fsm.LoadModel):
        return self._reachable((action.runner_id, action.incarnation), rn.WeightsLoaded(*action_key(action)))

    def warm_up(self, action: fsm.WarmUp):
        return self._reachable((action.runner_id, action.incarnation), rn.Warmed(*action_key(action)))

    async def stop_runner(self, action: fsm.StopRunner) -> None:
        proc = self.procs.get((action.runner_id, action.incarnation))
        if proc is None or proc.returncode is not None:
            return  # its exit is reported by create_runner's watch
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            proc.kill()

    def forward_request(self, action: fsm.ForwardRequest) -> None:
        raise NotImplementedError("this example sends no requests")

    cancel_request = forward_request


def get(url: str) -> None:
    with urllib.request.urlopen(url, timeout=5) as response:
        response.read()


def action_key(action) -> tuple[str, int]:
    return action.runner_id, action.incarnation


# tutorial: loop
async def supervise(driver: fsm.Driver, world: Processes, until) -> None:
    """The loop: reconcile, schedule the handlers' work, wait for a report or the next wake-up."""
    tasks: set[asyncio.Task] = set()
    while not until():
        world.changed.clear()
        for work in driver.reconcile().work:
            task = asyncio.ensure_future(work)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        wake = driver.next_wakeup()
        timeout = None if wake is None else max(0.0, wake - time.monotonic())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(world.changed.wait(), timeout)


# tutorial: main
def generation(cluster: fsm.Cluster, world: Processes) -> str:
    machine = cluster.instance("web")
    pids = [world.procs[(f"web/{r}", machine.rank_generations[r])].pid for r in range(2)]
    if machine.policy.strategy is fsm.RestartStrategy.ONE_FOR_ONE:
        return f"replicas of generations {machine.rank_generations} ready, attempts {machine.attempts}, pids {pids}"
    return f"generation {machine.generation} ready, attempts {machine.attempts}, pids {pids}"


async def main(strategy: fsm.RestartStrategy) -> None:
    cluster = fsm.Cluster(clock=CLOCK)
    world = Processes()
    driver = world.driver = fsm.Driver(cluster, world, time.monotonic)
    slots = [fsm.Slot(rank, "local", f"web/{rank}") for rank in range(2)]
    policy = fsm.RetryPolicy(backoff=POLICY.backoff, max_failures=POLICY.max_failures, strategy=strategy)
    cluster.place("web", "local/http.server", slots, policy=policy, local=True)  # nothing to download
    machine = cluster.instance("web")

    def ready(gen: int):  # the newest generation, of the whole instance or of the replica restarted last
        return lambda: machine.instance_state is fsm.InstanceState.READY and machine.generation == gen

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
    asyncio.run(main(fsm.RestartStrategy.ONE_FOR_ONE if alone else fsm.RestartStrategy.ONE_FOR_ALL))
