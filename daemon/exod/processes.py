"""The runner processes of this host: one supervised process per runner the machines accepted.

The controller decides (an accepted `fsm.CreateRunner`, `StopRunner`, a command to post); this room
carries it out: the ring's hostfile, the spec, the supervisor in the controller's nursery, and, when a
process is reaped, its generation's files (`exod.retention.Generations`). What a process reports goes
to the listener (`exod.reports.Reports`), never back here.
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio

import fsm
from exod import protocol as p
from exod import retention, ring
from exod.config import DaemonConfig
from exod.reports import Reports
from exod.supervisor import Process, RunnerSpec, Spawn

log = logging.getLogger("exod.processes")


class Processes:
    def __init__(self, config: DaemonConfig, spawn: Spawn, listener: Reports) -> None:
        self.config, self._spawn, self._listener = config, spawn, listener
        self._running: dict[tuple[str, int], Process] = {}
        self._reaped = trio.Event()  # set (and replaced) whenever a process is reaped
        self._generations = retention.Generations(config.state_dir, config.retention)  # forgets their files

    def __bool__(self) -> bool:
        return bool(self._running)

    def start(self, nursery: trio.Nursery, action: fsm.CreateRunner) -> None:
        """Spawn the runner ``action`` names; a spawn that fails is the runner's failure, reported as such."""
        rank, gen = action.rank, action.incarnation
        try:  # the ring's ports and its hostfile: no fds or no disk is the host's failure, never the daemon's end
            hostfile = self._hostfile(action.instance_id, gen, action.world_size)
        except OSError as exc:
            self._listener.on_not_started(action.runner_id, gen, exc)
            return
        spec = RunnerSpec(
            runner_id=action.runner_id,
            incarnation=gen,
            rank=rank,
            world_size=action.world_size,
            hostfile=hostfile,
            log_path=retention.runner_log_path(self.config.state_dir, action.instance_id, rank, gen),
            fault=next((str(f.fault) for f in self.config.faults if f.applies(rank, gen)), None),
        )
        process = self._spawn(spec, self._listener, self.config.timeouts)
        self._running[(action.runner_id, gen)] = process
        self._generations.started(action.instance_id, gen)
        nursery.start_soon(self._supervise, process, action.instance_id)

    def post(self, runner_id: str, incarnation: int, command: p.Command) -> None:
        if (process := self._running.get((runner_id, incarnation))) is not None:
            process.post(command)

    def stop(self, runner_id: str, incarnation: int) -> None:
        if (process := self._running.get((runner_id, incarnation))) is not None:
            process.stop()

    def pid(self, runner_id: str, incarnation: int) -> int | None:
        """The pid of a live runner process (None if it is not running)."""
        process = self._running.get((runner_id, incarnation))
        return None if process is None else process.pid

    async def stop_all(self, within: float) -> None:
        """Stop every process the graceful way (ask → grace → SIGTERM → SIGKILL) and wait, at most ``within``
        seconds, until all are reaped."""
        for process in list(self._running.values()):
            process.stop()
        with trio.move_on_after(within):
            while self._running:
                await self._reaped.wait()

    def _hostfile(self, instance_id: str, generation: int, world_size: int) -> Path | None:
        if world_size == 1:
            return None
        return ring.hostfile(retention.hostfile_path(self.config.state_dir, instance_id, generation), world_size)

    async def _supervise(self, process: Process, instance_id: str) -> None:
        spec = process.spec
        try:
            await process.run()
        except Exception as exc:  # the runner's failure, never the daemon's: spawn errors, I/O errors
            log.exception("supervisor of %s/%d failed", spec.runner_id, spec.incarnation)
            if process.pid is None:
                self._listener.on_not_started(spec.runner_id, spec.incarnation, exc)
            else:
                self._listener.on_supervisor_error(spec, exc)
        finally:
            self._running.pop((spec.runner_id, spec.incarnation), None)
            self._generations.ended(instance_id, spec.incarnation)
            self._reaped.set()
            self._reaped = trio.Event()
