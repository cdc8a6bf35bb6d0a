"""The controller's runner processes: one per runner the machines accepted.

The controller decides (an accepted `fsm.CreateRunner`, `StopRunner`, a command to post); this room
carries it out. On one host: the ring's hostfile, the spec, the supervisor in the controller's nursery. In
a cluster: through each rank's node's agent, this node's own included (`exod.cluster.remote`), so that every
runner is claimed and fenced the same way, and no rank is spawned before etcd holds the controller's write
of its generation, guarded by the controller's term (``recorded``): a generation's number is allocated in
etcd, so two controllers can never run the same one (DESIGN §5); nor while a runner key of an earlier
generation of its instance is left in etcd (`exod.cluster.remote.Fleet.earlier_gone`). When a process is
reaped, its generation's files are forgotten (`exod.state.retention.Generations`). What a process reports
goes to the listener (`exod.reports.Reports`), never back here.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import trio

import fsm
from exod.cluster.election import Deposed
from exod.cluster.remote import AgentUnavailable, Fleet, RemoteProcess, Ring
from exod.config import DaemonConfig
from exod.host import ring
from exod.host.heartbeats import Beat
from exod.host.supervisor import Process, RunnerSpec, Spawn
from exod.reports import Reports
from exod.runner import protocol as p
from exod.runner.faults import armed
from exod.state import retention

log = logging.getLogger("exod.processes")


Published = Callable[[str, int, str], None]  # (runner id, incarnation, its ring's HOST:PORT)
Recorded = Callable[[], Awaitable[None]]  # returns once the state store holds every change made so far


class Processes:
    def __init__(
        self,
        config: DaemonConfig,
        spawn: Spawn,
        listener: Reports,
        fleet: Fleet | None = None,
        published: Published = lambda runner_id, incarnation, endpoint: None,
        recorded: Recorded | None = None,
    ) -> None:
        self.config, self._spawn, self._listener, self.fleet = config, spawn, listener, fleet
        self._recorded = recorded  # in a cluster: the generation is etcd's, under this term, before a rank runs
        self._published = published  # a rank's endpoint is known: the planner may connect the ring
        self._running: dict[tuple[str, int], Process] = {}
        self._rings: dict[tuple[str, int], Ring] = {}  # (instance, generation): the ring of ranks on several nodes
        self._reaped = trio.Event()  # set (and replaced) whenever a process is reaped
        self._generations = retention.Generations(config.state_dir, config.retention)  # forgets their files

    def __bool__(self) -> bool:
        return bool(self._running)

    def start(self, nursery: trio.Nursery, action: fsm.CreateRunner, nodes_by_rank: list[str]) -> None:
        """Spawn the runner ``action`` names, on its node; ``nodes_by_rank`` is where its generation's ranks
        run. A spawn that fails is the runner's failure, reported as such.

        In a cluster every rank is run by its node's agent, this node's own included: one path, so every
        runner is claimed in etcd before it runs and fenced with its node's lease (DESIGN §5)."""
        gen = action.incarnation
        if self.fleet is not None:
            across = self._ring(action.instance_id, gen, nodes_by_rank, self.fleet)
            try:
                link = self.fleet.link(action.node_id)
            except AgentUnavailable as exc:
                self._listener.on_not_started(action.runner_id, gen, exc, host=True)
                return
            spec = self._spec(action, None)  # its agent writes the hostfile on its node
            fleet, recorded = self.fleet, self._recorded

            async def cleared() -> None:  # etcd holds its generation, and no runner of an earlier one
                if recorded is not None:
                    await recorded()
                await fleet.earlier_gone(action.instance_id, gen)

            iid, listener = action.instance_id, self._listener
            process = RemoteProcess(spec, link, across, iid, listener, self._published, cleared=cleared)
            self._begin(nursery, action, process)
            return
        try:  # the ring's ports and its hostfile: no fds or no disk is the host's failure, never the daemon's end
            hostfile = self._hostfile(action.instance_id, gen, action.world_size)
        except OSError as exc:
            self._listener.on_not_started(action.runner_id, gen, exc)
            return
        self._begin(nursery, action, self._spawn(self._spec(action, hostfile), self._listener, self.config.timeouts))
        if hostfile is not None:  # every rank's port is in it already
            self._published(action.runner_id, gen, ring.endpoints(hostfile)[action.rank])

    def _begin(self, nursery: trio.Nursery, action: fsm.CreateRunner, process: Process) -> None:
        """Supervise ``process``, and listen to its heartbeat (`exod.host.heartbeats`): pinged from here if it
        runs on this host, by its agent if on a cluster's node."""
        self._running[(action.runner_id, action.incarnation)] = process
        self._generations.started(action.instance_id, action.incarnation)
        listened, limit = partial(self._listener.listened, process.spec), self.config.timeouts.heartbeat
        if isinstance(process, RemoteProcess):  # pinged by its agent; heard while its node's stream flows
            beat = Beat(process, limit, ping=False, listened=listened, unheard=process.unheard)
        else:
            beat = Beat(process, limit, listened=listened)
        nursery.start_soon(beat.run)
        nursery.start_soon(self._supervise, process, action.instance_id, beat)

    def _spec(self, action: fsm.CreateRunner, hostfile: Path | None) -> RunnerSpec:
        rank, gen = action.rank, action.incarnation
        return RunnerSpec(
            runner_id=action.runner_id,
            incarnation=gen,
            rank=rank,
            world_size=action.world_size,
            hostfile=hostfile,
            log_path=retention.runner_log_path(self.config.state_dir, action.instance_id, rank, gen),
            fault=armed(self.config.faults, rank, gen),
            script=self.config.script,
            batch=self.config.batch,
        )

    def _ring(self, instance_id: str, generation: int, nodes_by_rank: list[str], fleet: Fleet) -> Ring:
        key = (instance_id, generation)
        if key not in self._rings:
            for old in [k for k in self._rings if k[0] == instance_id and k[1] < generation]:
                del self._rings[old]  # a generation is over once the next one starts

            async def reserve(node: str, count: int) -> list[str]:
                link = fleet.link(node)
                return [f"{link.client.node.address}:{port}" for port in await link.client.ports(count)]

            self._rings[key] = Ring(nodes_by_rank, reserve)
        return self._rings[key]

    def post(self, runner_id: str, incarnation: int, command: p.Command) -> None:
        if (process := self._running.get((runner_id, incarnation))) is not None:
            process.post(command)

    def load(self, runner_id: str, incarnation: int, model_id: str, path: Path | None) -> None:
        """Load ``model_id``: from ``path`` on this node, or as the runner's own node has it in its cache."""
        process = self._running.get((runner_id, incarnation))
        if isinstance(process, RemoteProcess):  # its agent finds the files: it takes no path from the wire
            process.post(p.Load(""), model_id=model_id)
        elif process is not None:
            assert path is not None
            process.post(p.Load(str(path)))

    def is_local(self, node_id: str) -> bool:
        return self.fleet is None or node_id == self.fleet.local

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

    async def _supervise(self, process: Process, instance_id: str, beat: Beat) -> None:
        spec = process.spec
        try:
            await process.run()
        except Deposed:  # this term is over: nothing of it may act, and the machines' next owner says what ran
            raise
        except Exception as exc:  # the runner's failure, never the daemon's: spawn errors, I/O errors
            log.exception("supervisor of %s/%d failed", spec.runner_id, spec.incarnation)
            if process.pid is None:
                host = isinstance(exc, AgentUnavailable)  # another rank's node out of reach
                self._listener.on_not_started(spec.runner_id, spec.incarnation, exc, host=host)
            else:
                self._listener.on_supervisor_error(spec, exc)
        finally:
            beat.stop()
            self._running.pop((spec.runner_id, spec.incarnation), None)
            self._generations.ended(instance_id, spec.incarnation)
            self._reaped.set()
            self._reaped = trio.Event()
