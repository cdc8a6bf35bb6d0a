"""This node as an agent of the cluster's controller: it runs the runner processes placed on it.

The controller decides; the agent carries out, on its own host, what only its host can do: reserve ring
ports on its advertised address, spawn and supervise runner processes, post them commands, stop them,
fetch models into its cache. What the runners report flows back on one stream (``GET /agent/reports``,
JSON lines), which the controller keeps open for as long as it is the controller.

Crash-only, like a runner's hang-up watchdog: the runners belong to the controller whose stream is open.
When that stream ends (the controller died, was deposed, or the network between them broke), the agent
stops every runner it started for it; the next controller resumes their instances in a new generation.
A second stream (a new controller) ends the first one's runners too.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import trio
from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from exod import protocol as p
from exod import retention, ring
from exod.config import DaemonConfig
from exod.errors import ApiError
from exod.models import ModelFiles
from exod.nodes import Presence
from exod.orphans import start_ticks
from exod.store import ProcessRecord, Store
from exod.supervisor import Process, RunnerSpec, Spawn, Supervisor

log = logging.getLogger("exod.agent")

BEAT_S = 1.0  # an idle report stream says it is alive this often (`exod.remote.SILENCE_S` is the limit)
FENCE_MARGIN = 0.2  # of the lease's TTL: runners stop this much before the node's lease may expire


class SpawnRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    instance_id: str = Field(..., min_length=1, max_length=200)
    runner_id: str = Field(..., min_length=1, max_length=200)
    incarnation: int = Field(..., ge=1)
    rank: int = Field(..., ge=0)
    world_size: int = Field(..., ge=1, le=64)
    ring: list[str] = Field(..., description="HOST:PORT of every rank, rank 0 first")
    fault: str | None = None


class CommandRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    command: dict[str, Any]
    model_id: str | None = Field(None, description="for a load: the model, resolved in this node's cache")


class Agent:
    """The runners this node runs for the cluster's controller, and the stream of what they report."""

    def __init__(self, config: DaemonConfig, store: Store, advertise: str, *, spawn: Spawn = Supervisor) -> None:
        self.config, self.store, self.advertise, self._spawn = config, store, advertise, spawn
        self.models = ModelFiles(hf_home=config.hf_home, offline=config.offline, timeout=config.download_timeout)
        self._running: dict[tuple[str, int], Process] = {}
        self._stream: trio.MemorySendChannel[bytes] | None = None
        self._session = 0  # the stream's number: runners belong to the stream open when they were spawned
        self._nursery: trio.Nursery | None = None
        self._generations = retention.Generations(config.state_dir, config.retention)  # their files, bounded

    async def run(
        self, presence: Presence | None = None, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Supervise what the controller asks this node to run, until cancelled (which kills and reaps it).

        Fencing (DESIGN §5): once the node's lease may have expired by its own clock (``presence``), another
        controller may place its ranks elsewhere, so its runners stop first."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await trio.sleep(BEAT_S)
                margin = FENCE_MARGIN * presence.ttl if presence is not None else 0.0
                if presence is not None and self._running and trio.current_time() > presence.alive_until - margin:
                    self._end_session("this node's lease may have expired (etcd out of reach)")

    # -- what the controller asks -------------------------------------------------------------------

    def reserve_ports(self, count: int) -> list[int]:
        """Ports free now on this node's advertised address, for one generation's ring."""
        return ring.free_ports(count, host=self.advertise)

    def spawn(self, request: SpawnRequest) -> None:
        if self._stream is None or self._nursery is None:
            raise ApiError(409, "no controller is connected to this agent: open GET /agent/reports first")
        key = (request.runner_id, request.incarnation)
        if key in self._running:
            raise ApiError(409, f"runner {request.runner_id}/{request.incarnation} already runs here")
        hostfile = None
        if request.world_size > 1:
            path = retention.hostfile_path(self.config.state_dir, request.instance_id, request.incarnation)
            hostfile = ring.write_hostfile(path, request.ring)
        spec = RunnerSpec(
            runner_id=request.runner_id,
            incarnation=request.incarnation,
            rank=request.rank,
            world_size=request.world_size,
            hostfile=hostfile,
            log_path=retention.runner_log_path(
                self.config.state_dir, request.instance_id, request.rank, request.incarnation
            ),
            fault=request.fault,
        )
        process = self._spawn(spec, _Forward(self, self._session), self.config.timeouts)
        self._running[key] = process
        self._generations.started(request.instance_id, request.incarnation)
        self._nursery.start_soon(self._supervise, process, request.instance_id)

    def post(self, runner_id: str, incarnation: int, request: CommandRequest) -> None:
        process = self._running.get((runner_id, incarnation))
        if process is None:
            raise ApiError(404, f"no runner {runner_id}/{incarnation} on this node")
        try:
            command = p.from_json(json.dumps(request.command))
        except p.ProtocolError as exc:
            raise ApiError(400, str(exc)) from exc
        if not isinstance(command, p.Command):
            raise ApiError(400, f"{request.command.get('type')!r} is not a command")
        if isinstance(command, p.Load) and request.model_id is not None:
            try:  # the model as this node's cache has it
                command = p.Load(str(self.models.path(request.model_id)), command.layers_total)
            except Exception as exc:  # ModelNotFound: the runner fails the load, retryably
                failed = {"kind": "report", **_key(process.spec), "report": json.loads(_failed(process.spec, exc))}
                self._send(self._session, failed)
                return
        process.post(command)

    def stop(self, runner_id: str, incarnation: int) -> None:
        if (process := self._running.get((runner_id, incarnation))) is not None:
            process.stop()

    async def fetch(self, model_id: str) -> None:
        await self.models.fetch(model_id, progress=lambda done, total: None)

    async def reports(self) -> AsyncIterator[bytes]:
        """The stream of one controller: every report of the runners it started here, until it goes."""
        self._end_session("a new controller connected")
        send, receive = trio.open_memory_channel[bytes](math.inf)
        self._session += 1
        session, self._stream = self._session, send
        try:
            yield b'{"kind": "hello"}\n'
            async with receive:
                while True:
                    with trio.move_on_after(BEAT_S) as quiet:
                        try:
                            line = await receive.receive()
                        except trio.EndOfChannel:
                            return
                    yield b'{"kind": "beat"}\n' if quiet.cancelled_caught else line  # silence means gone
        finally:
            if self._session == session:
                self._end_session("its controller went away")

    # -- the runners ---------------------------------------------------------------------------------

    def _end_session(self, why: str) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self._running:
            log.warning("stopping %d runner(s): %s", len(self._running), why)
        for process in list(self._running.values()):
            process.stop()

    def _send(self, session: int, event: dict[str, Any]) -> None:
        if session == self._session and self._stream is not None:
            self._stream.send_nowait((json.dumps(event) + "\n").encode())

    async def _supervise(self, process: Process, instance_id: str) -> None:
        spec = process.spec
        try:
            await process.run()
        except Exception as exc:  # the runner's failure, never the agent's
            log.exception("supervisor of %s/%d failed", spec.runner_id, spec.incarnation)
            self._send(self._session, {"kind": "report", **_key(spec), "report": json.loads(_failed(spec, exc))})
            self._send(self._session, {"kind": "exit", **_key(spec), "exit_code": 1, "tail": "", "stopped": False})
        finally:
            self._running.pop((spec.runner_id, spec.incarnation), None)
            self._generations.ended(instance_id, spec.incarnation)


class _Forward:
    """The `exod.supervisor.Listener` of a runner on this node: what it reports goes to its controller's
    stream; its pid is recorded in this host's store, so a restarted daemon reaps an orphan."""

    def __init__(self, agent: Agent, session: int) -> None:
        self.agent, self.session = agent, session

    def on_spawned(self, spec: RunnerSpec, pid: int) -> None:
        self.agent.store.record_process(ProcessRecord(spec.runner_id, spec.incarnation, pid, start_ticks(pid) or 0))
        self.agent._send(self.session, {"kind": "spawned", **_key(spec), "pid": pid})

    def on_report(self, spec: RunnerSpec, report: p.Report) -> None:
        self.agent._send(self.session, {"kind": "report", **_key(spec), "report": json.loads(report.to_json())})

    def on_stall(self, spec: RunnerSpec, phase: str, seconds: float) -> None:
        self.agent._send(self.session, {"kind": "stall", **_key(spec), "phase": phase, "seconds": seconds})

    def on_exit(self, spec: RunnerSpec, exit_code: int, stderr_tail: str, stop_delivered: bool) -> None:
        self.agent.store.forget_process(spec.runner_id, spec.incarnation)
        event = {"kind": "exit", **_key(spec), "exit_code": exit_code, "tail": stderr_tail, "stopped": stop_delivered}
        self.agent._send(self.session, event)


def _key(spec: RunnerSpec) -> dict[str, Any]:
    return {"runner_id": spec.runner_id, "incarnation": spec.incarnation}


def _failed(spec: RunnerSpec, exc: Exception) -> str:
    report = p.Failed(spec.runner_id, spec.incarnation, type(exc).__name__, str(exc), "", retryable=True)
    return report.to_json()


def router(agent: Agent) -> APIRouter:
    """The agent's endpoints: the controller's, behind the cluster's API key like every other."""
    api = APIRouter(prefix="/agent", include_in_schema=False)

    @api.post("/ports")
    async def ports(count: int) -> dict[str, Any]:
        if not 1 <= count <= 64:
            raise ApiError(400, f"count must be 1..64, got {count}")
        return {"address": agent.advertise, "ports": agent.reserve_ports(count)}

    @api.post("/runners", status_code=202)
    async def spawn(body: SpawnRequest) -> dict[str, Any]:
        agent.spawn(body)
        return {"runner_id": body.runner_id, "incarnation": body.incarnation}

    @api.post("/runners/{runner_id:path}/{incarnation}/commands", status_code=202)
    async def post(runner_id: str, incarnation: int, body: CommandRequest) -> dict[str, Any]:
        agent.post(runner_id, incarnation, body)
        return {}

    @api.delete("/runners/{runner_id:path}/{incarnation}", status_code=202)
    async def stop(runner_id: str, incarnation: int) -> dict[str, Any]:
        agent.stop(runner_id, incarnation)
        return {}

    @api.post("/models/{model_id:path}")
    async def fetch(model_id: str) -> dict[str, Any]:
        try:
            await agent.fetch(model_id)
        except Exception as exc:  # ModelNotFound, or what the hub client raised: the controller retries
            raise ApiError(424, f"{type(exc).__name__}: {exc}") from exc
        return {"model_id": model_id}

    @api.get("/reports")
    async def reports() -> StreamingResponse:
        return StreamingResponse(agent.reports(), media_type="application/x-ndjson")

    return api
