"""The campaign's eyes: the process table every `PROCESS_POLL_S`, and the cluster's state in etcd every
`STATE_POLL_S`, both recorded into the `History`. Nothing the daemons say of themselves is read."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import psutil
import trio

import fsm
from exod.chaos.history import History, InstanceSample, ProcessLife
from exod.cluster.etcd import Etcd, EtcdError
from exod.cluster.etcd_state import stored_cluster
from exod.cluster.membership import DEFAULT_PREFIX
from exod.state.store import StateUnavailable

PROCESS_POLL_S = 0.03  # the issue asks for ≤ 50 ms; a sweep of the table takes a few ms more
STATE_POLL_S = 0.25


def runner_processes() -> dict[int, tuple[int, list[str]]]:
    """Every live runner process on this machine: pid → (parent pid, command line)."""
    found = {}
    for process in psutil.process_iter(["ppid", "cmdline", "status"]):
        argv = process.info["cmdline"] or []
        if "exod.runner" in argv and "--runner-id" in argv and process.info["status"] != psutil.STATUS_ZOMBIE:
            found[process.pid] = (process.info["ppid"], argv)
    return found


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv else ""


class Watcher:
    """Two threads: one sweeps the process table, one reads etcd's snapshot. ``daemons`` says which pid is
    which node's daemon now (nodes restart), so that a runner is put down to the node that spawned it."""

    def __init__(
        self,
        history: History,
        clock: Callable[[], float],
        daemons: Callable[[], dict[int, str]],
        etcd: str,
        *,
        overlap: Callable[[str], object] = lambda _: None,
    ):
        self.history, self.clock, self.daemons, self.etcd = history, clock, daemons, etcd
        self.overlap = overlap  # told at once when a sweep sees two generations, or two processes of a rank, alive
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=t, daemon=True) for t in (self._processes, self._state)]
        self.latest: dict[int, ProcessLife] = {}  # the runners alive at the last sweep
        self._told: set[str] = set()

    def __enter__(self) -> Watcher:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def sweep(self) -> None:
        """One look at the process table: every runner of this campaign's daemons seen now."""
        now, daemons = self.clock(), self.daemons()
        alive = {}
        for pid, (ppid, argv) in runner_processes().items():
            known = self.history.processes.get(pid)
            node = daemons.get(ppid) or (known.node if known else None)
            if node is None:
                continue  # not one of ours (or its daemon died before we saw it: its parent is gone)
            iid, _, rank = _arg(argv, "--runner-id").rpartition("/")
            with contextlib.suppress(ValueError):
                life = known or ProcessLife(
                    pid, node, iid, int(rank), int(_arg(argv, "--incarnation")), now, now, _arg(argv, "--fault")
                )
                self.history.seen(pid, now, life)
                alive[pid] = life
        self.latest = alive
        generations: dict[str, set[int]] = {}
        ranks: dict[str, list[int]] = {}
        for life in alive.values():
            generations.setdefault(life.instance, set()).add(life.generation)
            ranks.setdefault(life.instance, []).append(life.rank)
        for iid, seen in generations.items():
            twice = sorted({rank for rank in ranks[iid] if ranks[iid].count(rank) > 1})
            if (len(seen) > 1 or twice) and iid not in self._told:
                self._told.add(iid)
                self.overlap(f"t+{now:.2f}s {iid}: generations {sorted(seen)} alive at once, ranks twice: {twice}")

    def _processes(self) -> None:
        while not self._stop.is_set():
            self.sweep()
            self._stop.wait(PROCESS_POLL_S)

    def _state(self) -> None:
        trio.run(self._read_state)

    async def _read_state(self) -> None:
        etcd = Etcd(self.etcd, timeout=1.0)
        try:
            while not self._stop.is_set():
                with contextlib.suppress(EtcdError, StateUnavailable, OSError):
                    cluster = await stored_cluster(etcd, DEFAULT_PREFIX.encode())
                    now = self.clock()
                    self.history.sample(
                        InstanceSample(
                            now,
                            iid,
                            p.machine.instance_state.value,
                            p.machine.generation,
                            p.machine.attempts,
                            p.machine.uncharged,
                            p.machine.is_deleted,
                            fsm.budget_exhausted(p.machine.attempts, p.machine.policy.max_failures),
                        )
                        for iid, p in cluster.instances.items()
                    )
                await trio.sleep(STATE_POLL_S)
        finally:
            await etcd.aclose()


def wait(done: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    """Until ``done()``; False if ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True
