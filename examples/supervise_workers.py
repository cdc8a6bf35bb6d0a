"""A trio supervisor of two plain worker processes that outlive it: the newcomer's scenario, end to end.

Two independent replicas (``RestartStrategy.ONE_FOR_ONE``) of a ``python -c``
loop. The supervisor brings them up (a worker is Ready once it writes "ready"
to its log), restarts one that dies after its backoff, gives up with the reason
when the budget is spent (exit status 3), stops both cleanly on SIGTERM or
Ctrl-C (exit status 0), and survives its own death:

* each worker starts in a session of its own (``start_new_session=True``) with
  its output to a file in STATE_DIR, so neither a signal to the supervisor's
  process group nor a closed pipe reaches it;
* after every round the cluster is saved to STATE_DIR/cluster.json (written to
  a temporary file and renamed: a kill mid-write leaves the previous one), with
  each worker's `fsm.Handle` (pid and start time: a pid alone may be reused);
* a supervisor started on a STATE_DIR that has a snapshot restores it, adopts
  each worker whose process is still the one its handle names, and restarts
  only the missing one, after what is left of its backoff. An adopted worker
  is not its child: it watches it with a pidfd (polls where there is none) and,
  the exit status having gone to whoever reaps it, reports it as killed.

Times are ``time.monotonic()`` on the clock of this boot (`fsm.Clock`): a wall
clock step moves no deadline. A restored snapshot is rebased onto the new
supervisor's first reading (``from_dict(..., now=)``): a backoff under way is
neither refilled nor skipped by the restart.

    python examples/supervise_workers.py STATE_DIR [--backoff SECONDS] [--crash]

``--crash``: each worker dies right after it starts, so the supervisor gives up.
Needs trio and psutil (``pip install trio psutil``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import trio

import fsm
from fsm import runner as rn

REPLICAS = 2
STARTUP_S = 0.3  # how long a worker takes to get ready
STOP_GRACE_S = 2.0  # a stopped worker that outlives this is killed (the planner's KillRunner)
LIMITS = fsm.PhaseLimits(load_progress=10.0, warm_up=5.0, stop_grace=STOP_GRACE_S)
GAVE_UP = 3  # the exit status when the instance is given up on

WORKER = """
import sys, time
state, runner_id, startup, crash = sys.argv[1:]
time.sleep(float(startup))
if crash == "1":
    sys.exit("crashed on purpose")
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def boot_clock() -> fsm.Clock:
    """The monotonic clock of this boot: its readings mean nothing after a reboot, and the boot id says so."""
    return fsm.Clock.monotonic(epoch=Path("/proc/sys/kernel/random/boot_id").read_text().strip())


def handle_of(pid: int) -> fsm.Handle:
    return fsm.Handle(pid, psutil.Process(pid).create_time())


def still_running(handle: fsm.Handle) -> bool:
    """Whether the process the handle names is alive: the same pid *and* start time (not a reused pid)."""
    try:
        proc = psutil.Process(handle.pid)
        return proc.create_time() == handle.started and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Workers:
    """The world: one worker process per replica, each watched by a task of ``nursery``."""

    def __init__(self, nursery: trio.Nursery, state: Path, crash: bool) -> None:
        self.nursery, self.state, self.crash = nursery, state, crash
        self.driver: fsm.Driver
        self.changed = trio.Event()  # set by every report: the loop plans again
        self.pids: dict[tuple[str, int], int] = {}
        self.gone: set[tuple[str, int]] = set()  # the processes that have exited

    def _tell(self, report) -> None:
        report()
        self.changed.set()

    async def _report(self, event: rn.RunnerEvent) -> None:
        self._tell(lambda: self.driver.report(event))

    def log(self, runner_id: str, incarnation: int) -> Path:
        return self.state / f"{runner_id.replace('/', '-')}.{incarnation}.log"

    # -- fsm.Adapter: each starts its work in the nursery and returns --------------------------

    def create_runner(self, action: fsm.CreateRunner) -> None:
        self.nursery.start_soon(self._run, action.runner_id, action.incarnation)

    def load_model(self, action: fsm.LoadModel) -> None:
        self.nursery.start_soon(self._wait_ready, action.runner_id, action.incarnation)

    def warm_up(self, action: fsm.WarmUp) -> None:  # nothing to warm: Ready at once
        self.nursery.start_soon(self._report, rn.Warmed(action.runner_id, action.incarnation))

    def stop_runner(self, action: fsm.StopRunner) -> None:
        self._signal(action.runner_id, action.incarnation, signal.SIGTERM)

    def kill_runner(self, action: fsm.KillRunner) -> None:
        self._signal(action.runner_id, action.incarnation, signal.SIGKILL)

    def connect_runner(self, action: fsm.ConnectRunner) -> None:
        raise NotImplementedError("replicas join no ring")

    def forward_request(self, action: fsm.ForwardRequest) -> None:
        raise NotImplementedError("this example sends no requests")

    cancel_request = forward_request

    # -- the work ----------------------------------------------------------------------------

    async def _run(self, runner_id: str, incarnation: int) -> None:
        """Start a worker that outlives us, keep its handle, and report its exit, whatever ended it."""
        argv = [sys.executable, "-c", WORKER, str(self.state), runner_id, str(STARTUP_S), str(int(self.crash))]
        with self.log(runner_id, incarnation).open("ab") as log:
            proc = await trio.lowlevel.open_process(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.pids[(runner_id, incarnation)] = proc.pid
        self.driver.cluster.attach(runner_id, incarnation, handle_of(proc.pid))
        print(f"{runner_id} started, pid {proc.pid}", flush=True)
        code = await proc.wait()
        self.gone.add((runner_id, incarnation))
        print(f"{runner_id} exited, pid {proc.pid}, code {code}", flush=True)
        self._tell(lambda: self.driver.report(rn.Exited(runner_id, incarnation, exit_code=code)))

    def adopt(self, runner_id: str, incarnation: int, handle: fsm.Handle) -> None:
        """Watch a worker an earlier supervisor started: not our child, so no wait() and no exit status."""
        self.pids[(runner_id, incarnation)] = handle.pid
        self.nursery.start_soon(self._watch_adopted, runner_id, incarnation, handle)

    async def _watch_adopted(self, runner_id: str, incarnation: int, handle: fsm.Handle) -> None:
        try:
            fd = os.pidfd_open(handle.pid)  # Linux ≥ 5.3: readable once the process has exited
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            try:
                await trio.lowlevel.wait_readable(fd)
            finally:
                os.close(fd)
        else:
            while still_running(handle):
                await trio.sleep(0.2)
        self.gone.add((runner_id, incarnation))
        print(f"{runner_id} exited, pid {handle.pid} (adopted: its status went to whoever reaps it)", flush=True)
        killed = rn.Exited(runner_id, incarnation, exit_code=-signal.SIGKILL, detail="adopted: exit status unknown")
        self._tell(lambda: self.driver.report(killed))

    async def _wait_ready(self, runner_id: str, incarnation: int) -> None:
        """Ready once it says so in its log (the load_progress watchdog fails it if it never does)."""
        log = self.log(runner_id, incarnation)
        while not (log.exists() and "ready" in log.read_text(errors="replace")):
            if (runner_id, incarnation) in self.gone:
                return  # it exited first: that is reported, not this
            await trio.sleep(0.05)
        print(f"{runner_id} ready, pid {self.pids[(runner_id, incarnation)]}", flush=True)
        self._tell(lambda: self.driver.report(rn.WeightsLoaded(runner_id, incarnation)))

    def _signal(self, runner_id: str, incarnation: int, signum: signal.Signals) -> None:
        pid = self.pids.get((runner_id, incarnation))
        handle = self.driver.cluster.runners()[runner_id].handle
        if pid is not None and handle is not None and still_running(handle):  # never signal a reused pid
            os.kill(pid, signum)


def save(cluster: fsm.Cluster, path: Path) -> None:
    """Atomically: a kill mid-write leaves the previous snapshot."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cluster.to_dict()))
    os.replace(tmp, path)


def restore(path: Path) -> tuple[fsm.Cluster, dict[str, fsm.Handle]]:
    """The cluster the last supervisor saved, with the workers still alive adopted (`Cluster.recover`)."""
    now = time.monotonic()  # the snapshot's times are rebased onto this reading: what was left of a backoff is left
    cluster = fsm.Cluster.from_dict(json.loads(path.read_text()), clock=boot_clock(), limits=LIMITS, now=now)
    alive = {
        runner_id: runner.handle
        for runner_id, runner in cluster.runners().items()
        if runner.alive and runner.handle is not None and still_running(runner.handle)
    }
    cluster.recover(now, adopt=alive)
    return cluster, alive


async def supervise(driver: fsm.Driver, world: Workers, snapshot: Path, until) -> None:
    """The loop: reconcile (the handlers start their tasks), save, wait for a report or the next wake-up."""
    while not until():
        world.changed = trio.Event()
        driver.reconcile()
        save(driver.cluster, snapshot)
        wake = driver.next_wakeup()
        with trio.move_on_after(math.inf if wake is None else max(0.0, wake - time.monotonic())):
            await world.changed.wait()


async def main(state: Path, backoff: float, crash: bool) -> int:
    snapshot = state / "cluster.json"
    if snapshot.exists():
        cluster, adopted = restore(snapshot)
        print(f"re-attached: adopted {sorted(adopted)}", flush=True)
    else:
        cluster, adopted = fsm.Cluster(clock=boot_clock(), limits=LIMITS), {}
        policy = fsm.RetryPolicy(
            backoff=fsm.Backoff(initial=backoff, factor=2.0, cap=8 * backoff),
            max_failures=3,
            strategy=fsm.RestartStrategy.ONE_FOR_ONE,
        )
        slots = [fsm.Slot(rank, "local", f"web/{rank}") for rank in range(REPLICAS)]
        cluster.place("web", "local/worker", slots, policy=policy, local=True)  # nothing to download
    machine = cluster.instance("web")
    stopping = trio.Event()

    async def stop_on_signal(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for _ in signals:
                print("stopping", flush=True)
                stopping.set()
                cluster.delete("web", time.monotonic())
                world.changed.set()
                return

    async with trio.open_nursery() as nursery:
        world = Workers(nursery, state, crash)
        world.driver = fsm.Driver(cluster, world, time.monotonic)
        for runner_id, handle in adopted.items():
            world.adopt(runner_id, cluster.runners()[runner_id].incarnation, handle)
        await nursery.start(stop_on_signal)
        await supervise(
            world.driver, world, snapshot, lambda: machine.is_deleted and not cluster.has_live_runners("web")
        )
        nursery.cancel_scope.cancel()  # the signal watch, if the instance was given up on
    if not stopping.is_set():
        print(f"gave up: {machine.delete_reason.value}: {machine.last_failure.message}", flush=True)
        return GAVE_UP
    snapshot.unlink()
    print("stopped: every worker reaped", flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("state", type=Path, help="where the snapshot and the workers' logs live")
    parser.add_argument("--backoff", type=float, default=1.0, help="seconds before the first restart (doubles)")
    parser.add_argument("--crash", action="store_true", help="workers die at start: watch it give up")
    args = parser.parse_args()
    args.state.mkdir(parents=True, exist_ok=True)
    sys.exit(trio.run(main, args.state, args.backoff, args.crash))
