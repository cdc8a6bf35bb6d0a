"""This node as an agent of the cluster's controller: it runs the runner processes placed on it.

The controller decides; the agent carries out, on its own host, what only its host can do: reserve ring
ports on its advertised address, spawn and supervise runner processes, post them commands, stop them,
fetch models into its cache. What the runners report flows back on one stream (``GET /agent/reports``,
JSON lines), which the controller keeps open for as long as it is the controller.

Crash-only, like a runner's hang-up watchdog: the runners belong to the controller whose stream is open.
When that stream ends (the controller died, was deposed, or the network between them broke), the agent
stops every runner it started for it; the next controller resumes their instances in a new generation.
A second stream (a new controller) ends the first one's runners too.

Commands carry the term (DESIGN §5): every request and stream of a controller names its term, the create
revision of the election key it won. The agent opens a stream only for the term etcd holds now, never lets
an older term replace a newer one, and refuses a command of any other term than its stream's; once etcd
shows the key gone or newer, the stream's runners stop. So a deposed controller that still believes it
leads can neither start runners nor stop the new controller's. A refusal says what to do but never the
term or the stream this node obeys (its log does): they are what a forged command would need. The stream's
number, which each spawn names, is drawn at random, so no one guesses it either.

The generation rule, enforced here too (`exod.cluster.nodes.earlier_generations`, the rule the controller
waits on): a spawn is refused while etcd holds a runner key of an earlier generation of its instance, or
of a later one (or its own rank's), and a generation older than one this node has run or seen is refused
outright. The check and the claim are one etcd transaction, which also compares the election key with the
spawn's term as etcd holds it then: a command replayed, delayed or forged, with the cluster's token and
the right term and stream, still never starts a generation beside another.

Fencing (DESIGN §5): each runner is claimed in etcd (`exod.cluster.nodes.runner_key`, on the node's lease) before
it is spawned, and released once it is reaped. A node that cannot renew its lease kills its runners before
the lease may expire, so a key that vanished with the lease is a runner surely dead: the controller waits
for it before a new generation, and two generations never run at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, Protocol

import attrs
import trio
from fastapi import APIRouter, Header, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from exod.cluster.election import TERM_HEADER, election_key
from exod.cluster.etcd import Compare, EtcdError, Put, unchanged_since
from exod.cluster.nodes import (
    Alive,
    Presence,
    all_runners_prefix,
    described,
    earlier_generations,
    list_nodes,
    read_runners,
    runner_key,
    runners_prefix,
    superseding,
)
from exod.host import ring
from exod.host.heartbeats import Beat
from exod.host.models import InvalidModelId, ModelFiles, validate_model_id
from exod.host.orphans import start_ticks
from exod.host.supervisor import FencedProcess, FencedSpawn, RunnerSpec, Supervisor, Timeouts
from exod.runner import protocol as p
from exod.runner.batch import BatchLimits
from exod.runner.faults import FaultSpec, armed
from exod.state import retention
from exod.state.process_book import ProcessBook
from exod.state.retention import Retention
from exod.state.sqlite import ProcessRecord, Store

log = logging.getLogger("exod.agent")

AGENT_PATHS = "/agent/"  # where the controller reaches this node's agent
BEAT_S = 1.0  # an idle report stream says it is alive this often (`exod.cluster.remote.SILENCE_S` is the limit)
CLAIM_WITHIN_S = 5.0  # a claim that other nodes' claims keep overtaking (each changes the keys it compares) gives up
# Every refusal of a command for its term or stream says this, whichever did not match: an answer that told
# them apart (an older term, a newer one, another stream) would let a caller with the token find both out.
NOT_OBEYED = (
    "not a command of the controller this node obeys now (its term and report stream, as etcd and this node "
    "hold them): not carried out. A controller opens GET /agent/reports with its term first; this node's log "
    "says what did not match"
)


class Refused(HTTPException):
    """The agent will not do what it was asked; ``status`` says why, as HTTP does (the API answers it in its
    error shape, like any other refusal)."""

    @property
    def status(self) -> int:
        return self.status_code


class AgentConfig(Protocol):
    """What the agent needs of the daemon's configuration (`exod.config.DaemonConfig` is one)."""

    @property
    def state_dir(self) -> Path: ...
    @property
    def hf_home(self) -> Path | None: ...
    @property
    def offline(self) -> bool | None: ...
    @property
    def download_timeout(self) -> float: ...
    @property
    def retention(self) -> Retention: ...
    @property
    def script(self) -> str | None: ...
    @property
    def batch(self) -> BatchLimits: ...
    @property
    def timeouts(self) -> Timeouts: ...
    @property
    def faults(self) -> tuple[FaultSpec, ...]: ...


class SpawnRequest(BaseModel):
    """A spawn as the controller sends it; everything in it is checked here, before anything is written: it
    names paths on this node (its log, its hostfile) and where the runner connects."""

    model_config = ConfigDict(extra="forbid", strict=True)

    instance_id: str = Field(..., max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    runner_id: str = Field(..., max_length=210)
    incarnation: int = Field(..., ge=1)
    rank: int = Field(..., ge=0)
    world_size: int = Field(..., ge=1, le=64)
    ring: list[str] = Field(..., max_length=64, description="HOST:PORT of every rank, rank 0 first")
    stream: int = Field(..., ge=1, description="the report stream it belongs to: the number its hello said")

    @model_validator(mode="after")
    def _consistent(self) -> SpawnRequest:
        if self.runner_id != f"{self.instance_id}/{self.rank}":
            raise ValueError(f"runner_id must be '{self.instance_id}/{self.rank}' (instance_id/rank)")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        if self.ring and len(self.ring) != self.world_size:
            raise ValueError(f"ring has {len(self.ring)} endpoints for a world of {self.world_size}")
        if self.world_size > 1 and not self.ring:
            raise ValueError("a rank of a world of several needs the ring's endpoints")
        for endpoint in self.ring:
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"ring endpoint {endpoint!r} is not HOST:PORT")
        return self


class CommandRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    command: dict[str, Any]
    model_id: str | None = Field(None, description="for a load: the model, resolved in this node's cache")


class Agent:
    """The runners this node runs for the cluster's controller, and the stream of what they report."""

    def __init__(
        self,
        config: AgentConfig,
        store: Store,
        advertise: str,
        *,
        spawn: FencedSpawn = Supervisor,
        models: ModelFiles | None = None,
    ) -> None:
        """``models``: this node's model files, the controller's on this node too (local directories it named)."""
        self.config, self.store, self.advertise, self._spawn = config, store, advertise, spawn
        self.book = ProcessBook(store)  # its runners' pids; a full disk degrades the node, never ends it
        self.models = models or ModelFiles(
            hf_home=config.hf_home, offline=config.offline, timeout=config.download_timeout
        )
        self._running: dict[tuple[str, int], FencedProcess] = {}
        self._loading: dict[tuple[str, int], str] = {}  # the model each runner was told to load
        self._scopes: dict[tuple[str, int], trio.CancelScope] = {}  # cancelling one kills its runner at once
        self._stream: trio.MemorySendChannel[bytes] | None = None
        self._session = 0  # the stream's number, drawn at random: runners belong to the stream open at their spawn
        self._term = 0  # the newest controller's term this agent obeyed: no older one takes over again
        self._newest: dict[str, int] = {}  # instance → the newest generation of it run or seen here: none older runs
        self._nursery: trio.Nursery | None = None
        self._generations = retention.Generations(config.state_dir, config.retention)  # their files, bounded
        self._presence: Presence | None = None  # in a cluster: the node's lease, which the runners' keys are on
        self._released: set[bytes] = set()  # keys of reaped runners, deleted from etcd as soon as it answers
        # Runners stopped before their spawn arrived (two requests, two connections: a stop can overtake the
        # spawn it follows). Their spawn is refused when it comes, or else it would run with no one to stop
        # it and its key would keep the next generation from starting. Cleared with the stream.
        self._stopped: set[tuple[str, int]] = set()

    async def run(
        self, presence: Presence | None = None, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Supervise what the controller asks this node to run, until cancelled (which kills and reaps it).

        Fencing (DESIGN §5): once the node's lease may have expired by its own clock (``presence``), another
        controller may place its ranks elsewhere, so its runners are killed first."""
        self._presence = presence
        if presence is not None:  # a previous daemon's runners were reaped before this agent was made
            with contextlib.suppress(EtcdError):  # if not now, their keys go with that daemon's lease
                await presence.etcd.delete(runners_prefix(presence.prefix, presence.record.node_id), prefix=True)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if presence is not None:
                nursery.start_soon(self._fence, presence)
                nursery.start_soon(self._release_keys_forever)
                nursery.start_soon(self._follow_term, presence)
            task_status.started()
            await trio.sleep_forever()

    async def _fence(self, presence: Presence) -> None:
        """Kill the runners once the lease may have expired, by this node's monotonic clock: at its TTL less
        the margin after the last renewal was asked for. Its own task: nothing else may delay it. Meanwhile
        each runner's own deadline is moved on to the same instant every beat: should this daemon stall,
        its runners end themselves there (`exod.runner.watchdog`)."""
        while True:
            now = trio.current_time()
            fence_at = presence.authority_until
            if now < fence_at:
                for process in self._running.values():
                    process.extend(fence_at)
                renewed = presence.renewed
                with trio.move_on_at(min(fence_at, now + BEAT_S)):  # a renewal moves it on: extended at once
                    await renewed.wait()
                continue
            if self._running:
                self._end_session("this node's lease may have expired (etcd out of reach)", kill=True)
            await trio.sleep(BEAT_S / 10)

    async def _follow_term(self, presence: Presence) -> None:
        """End the stream once etcd shows its term over (the election key gone, or won again): that
        controller's runners stop now, not when its silence is noticed. Read every beat, with a timeout: an
        etcd out of reach says nothing here, and the clock fences meanwhile (`_fence`)."""
        key = election_key(presence.prefix)
        while True:
            await trio.sleep(BEAT_S)
            if self._stream is None:
                continue
            try:
                holder = await presence.etcd.get(key)
            except EtcdError:
                continue
            if self._stream is not None and (holder is None or holder.create_revision != self._term):
                self._end_session(f"the term {self._term} of its controller is over in etcd")

    async def _release_keys_forever(self) -> None:
        """Every beat: the keys of reaped runners etcd did not take yet, the records the disk did not."""
        while True:
            await trio.sleep(BEAT_S)
            await self._release_keys()
            self.book.retry()

    # -- what the controller asks -------------------------------------------------------------------

    def reserve_ports(self, count: int) -> list[int]:
        """Ports free now on this node's advertised address, for one generation's ring."""
        return ring.free_ports(count, host=self.advertise)

    async def spawn(self, term: int, request: SpawnRequest) -> None:
        """Check everything first; claim the runner in etcd; start it. Whatever fails after the claim releases
        it at once: a key left behind would hold every next generation of its instance back."""
        self._check_term(term)
        key = (request.runner_id, request.incarnation)
        self._check_spawn(key, request.stream)
        self._check_newest(request)
        await self._check_ring(request.ring)
        await self._claim(key, term, request)  # in etcd first: no process runs that the controller could not know of
        try:
            self._check_spawn(key, request.stream)  # again: its stream may have ended, or a stop come, meanwhile
            try:
                self._start(key, request)
            except OSError as exc:  # a full disk, say: the host's failure, said as such
                raise Refused(503, f"this node cannot prepare the runner's files: {exc}") from exc
        except BaseException:
            if self._presence is not None:  # claimed for nothing
                self._released.add(self._key_of(key))
                with trio.CancelScope(shield=True), trio.move_on_after(BEAT_S):
                    await self._release_keys()  # or at the next beat
            raise

    def _start(self, key: tuple[str, int], request: SpawnRequest) -> None:
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
            fault=armed(self.config.faults, request.rank, request.incarnation),  # its own [[fault]], never asked for
            script=self.config.script,
            batch=self.config.batch,
            fenced=self._presence is not None,
        )
        assert self._nursery is not None
        process = self._spawn(spec, _Forward(self, self._session), self.config.timeouts)
        if self._presence is not None:  # its dead man's switch: it runs no longer than this node may
            process.extend(self._presence.authority_until)
        self._generations.started(request.instance_id, request.incarnation)
        self._running[key] = process  # nothing below raises: from here its supervisor releases the key
        self._scopes[key] = trio.CancelScope()
        beat = Beat(process, self.config.timeouts.heartbeat)  # its answers go to the controller's stream
        self._nursery.start_soon(beat.run)
        self._nursery.start_soon(self._supervise, process, request.instance_id, beat)

    async def _check_ring(self, endpoints: list[str]) -> None:
        """A runner connects only to the cluster's live nodes: every ring endpoint's host must be one's address."""
        if not endpoints or self._presence is None:
            return
        try:
            live = {node.record.address for node in await list_nodes(self._presence.etcd, self._presence.prefix)}
        except EtcdError as exc:
            raise Refused(503, f"this node cannot check the ring's nodes in etcd: {exc}") from exc
        strangers = sorted({e for e in endpoints if e.rpartition(":")[0].strip("[]") not in live})
        if strangers:
            raise Refused(400, f"ring endpoints {', '.join(strangers)} are not on live nodes of this cluster")

    def _check_term(self, term: int) -> None:
        """A command is obeyed only from the controller whose stream is open here, by its term."""
        if term != self._term or self._stream is None:
            why = "no stream is open" if self._stream is None else f"this node obeys term {self._term}"
            log.warning("refused a command of term %d: %s", term, why)
            raise Refused(409, NOT_OBEYED)

    def _check_spawn(self, key: tuple[str, int], stream: int) -> None:
        """A spawn belongs to the stream it names, open now: one that was delayed past its stream's end (its
        controller stepped down, even to take the same term back) would run a runner no controller knows."""
        if self._stream is None or self._nursery is None:
            log.warning("refused the spawn of %s/%d: no report stream is open", *key)
            raise Refused(409, NOT_OBEYED)
        if stream != self._session:
            log.warning("refused the spawn of %s/%d: its report stream is over (another one is open)", *key)
            raise Refused(409, NOT_OBEYED)
        if key in self._running:
            raise Refused(409, f"runner {key[0]}/{key[1]} already runs here")
        if key in self._stopped:
            raise Refused(409, f"runner {key[0]}/{key[1]} was stopped before its spawn arrived: it is not started")

    def _key_of(self, key: tuple[str, int]) -> bytes:
        assert self._presence is not None
        return runner_key(self._presence.prefix, self._presence.record.node_id, *key)

    def _check_newest(self, request: SpawnRequest) -> None:
        """No generation older than one this node has run or seen in etcd: a command of the past, replayed."""
        newest = self._newest.get(request.instance_id, 0)
        if request.incarnation < newest:
            raise Refused(
                409,
                f"generation {request.incarnation} of instance {request.instance_id} is older than generation "
                f"{newest}, which this node has run or seen: a stale command, not started",
            )

    def _check_generation(self, request: SpawnRequest, alive: Alive) -> None:
        """The generation rule, on the runner keys as etcd holds them (`exod.cluster.nodes`): no earlier
        generation of the instance left, no later one (nor this rank of this one) already there."""
        iid, generation = request.instance_id, request.incarnation
        if earlier := earlier_generations(alive, iid, generation):
            raise Refused(
                409,
                f"an earlier generation of instance {iid} still holds runner keys in etcd ({described(earlier)}): "
                f"generation {generation} may start only once they are gone; not started",
            )
        if later := superseding(alive, request.runner_id, generation):
            self._newest[iid] = max(self._newest.get(iid, 0), *(incarnation for _, _, incarnation in later))
            raise Refused(
                409,
                f"runner {request.runner_id}/{generation} is stale or runs already: etcd holds {described(later)}; "
                "not started",
            )

    async def _claim(self, key: tuple[str, int], term: int, request: SpawnRequest) -> None:
        """Write the runner's key on the node's lease, in one transaction with the checks it rests on: the
        election key is still ``term``'s (etcd's now, not this node's view of it), and no runner key changed
        since they were read and found to keep the generation rule (`_check_generation`). Refused (503) while
        etcd cannot be reached or the lease is not surely alive: a runner spawned then could outlive the lease
        unknown to the controller."""
        presence = self._presence
        if presence is None:
            return
        if trio.current_time() >= presence.authority_until:
            raise Refused(503, "this node cannot renew its lease in etcd: it runs nothing until it can")
        election, runners = election_key(presence.prefix), all_runners_prefix(presence.prefix)
        give_up = trio.current_time() + CLAIM_WITHIN_S
        while True:
            try:
                alive, revision = await read_runners(presence.etcd, presence.prefix)
                self._check_generation(request, alive)
                guard = [Compare(election, "CREATE", "EQUAL", term), unchanged_since(runners, revision)]
                claim = Put(self._key_of(key), b"", presence.lease)
                if (await presence.etcd.txn(guard, [claim])).succeeded:
                    self._newest[request.instance_id] = max(self._newest.get(request.instance_id, 0), key[1])
                    return
                holder = await presence.etcd.get(election)
            except EtcdError as exc:
                raise Refused(503, f"this node cannot claim the runner in etcd: {exc}") from exc
            if holder is None or holder.create_revision != term:
                now = "no controller" if holder is None else f"term {holder.create_revision}"
                log.warning("refused the spawn of %s/%d: its term %d is not etcd's (%s)", *key, term, now)
                raise Refused(409, NOT_OBEYED)
            if trio.current_time() >= give_up:  # every try overtaken by another node's claim
                raise Refused(503, "the runners' keys in etcd changed at every try of this claim: try again")

    async def _release_keys(self) -> None:
        """Delete the keys of reaped runners (retried at every beat while etcd does not answer)."""
        if self._presence is None:
            self._released.clear()
            return
        for key in sorted(self._released):
            try:
                await self._presence.etcd.delete(key)
            except EtcdError as exc:
                log.debug("runner key %r not released yet: %s", key, exc)
                return
            self._released.discard(key)

    def post(self, term: int, runner_id: str, incarnation: int, request: CommandRequest) -> None:
        self._check_term(term)
        process = self._running.get((runner_id, incarnation))
        if process is None:
            raise Refused(404, f"no runner {runner_id}/{incarnation} on this node")
        try:
            command = p.from_json(json.dumps(request.command))
        except p.ProtocolError as exc:
            raise Refused(400, str(exc)) from exc
        if not isinstance(command, p.Command):
            raise Refused(400, f"{request.command.get('type')!r} is not a command")
        if isinstance(command, p.Load):  # a path from the wire is never loaded: the model as this node has it
            if request.model_id is None:
                raise Refused(400, "a load names its model by id (model_id): this node finds its files itself")
            try:
                validate_model_id(request.model_id)
            except InvalidModelId as exc:
                raise Refused(400, str(exc)) from exc
            self._loading[(runner_id, incarnation)] = request.model_id
            try:
                command = p.Load(str(self.models.path(request.model_id)), command.layers_total)
            except Exception as exc:  # ModelNotFound: the runner fails the load (the host's, if it was here)
                lost = self.models.lost(request.model_id, type(exc).__name__, str(exc))
                report = json.loads(_failed(process.spec, exc, host=lost))
                self._send(self._session, {"kind": "report", **_key(process.spec), "report": report})
                return
        process.post(command)

    def stop(self, term: int, runner_id: str, incarnation: int) -> None:
        self._check_term(term)
        if (process := self._running.get((runner_id, incarnation))) is not None:
            process.stop()
        else:  # not spawned yet, or reaped already: either way it is not to run (a tombstone)
            self._stopped.add((runner_id, incarnation))

    async def fetch(self, model_id: str) -> None:
        await self.models.fetch(model_id, progress=lambda done, total: None)

    async def connect(self, term: int) -> AsyncIterator[bytes]:
        """The controller of ``term`` opens its stream: every report of the runners it starts here, until it
        goes. Refused unless ``term`` is the cluster's term in etcd now and no newer one was obeyed here; a
        stream of the same term (its controller reconnected) replaces the one open."""
        self._check_not_over(term)
        await self._check_current(term)
        self._check_not_over(term)  # a newer controller connected while etcd answered
        self._end_session("a new controller connected" if term > self._term else "its controller connected again")
        self._term = term
        send, receive = trio.open_memory_channel[bytes](math.inf)
        self._session = _new_stream(self._session)
        self._stream = send
        return self._reports(self._session, receive)

    def _check_not_over(self, term: int) -> None:
        if term < self._term:
            log.warning("refused a report stream of term %d: this node obeys term %d", term, self._term)
            raise Refused(409, NOT_OBEYED)

    async def _check_current(self, term: int) -> None:
        presence = self._presence
        if presence is None:
            return
        try:
            holder = await presence.etcd.get(election_key(presence.prefix))
        except EtcdError as exc:
            raise Refused(503, f"this node cannot read the controller's term in etcd: {exc}") from exc
        if holder is None or holder.create_revision != term:
            now = "no controller" if holder is None else f"term {holder.create_revision}"
            log.warning("refused a report stream of term %d: etcd has %s", term, now)
            raise Refused(409, NOT_OBEYED)

    async def _reports(self, session: int, receive: trio.MemoryReceiveChannel[bytes]) -> AsyncIterator[bytes]:
        try:
            yield (json.dumps({"kind": "hello", "stream": session}) + "\n").encode()  # named by its spawns
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

    def _end_session(self, why: str, *, kill: bool = False) -> None:
        """The runners of the open stream stop: asked to (a controller went), or killed at once (fencing:
        the lease may expire before a graceful stop would end)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._stopped.clear()  # a spawn of that stream is refused anyway: it is no longer open
        if self._running:
            log.warning("%s %d runner(s): %s", "killing" if kill else "stopping", len(self._running), why)
        for key, process in list(self._running.items()):
            if kill:
                self._scopes[key].cancel()
            else:
                process.stop()

    def _send(self, session: int, event: dict[str, Any]) -> None:
        """Tell the open stream's controller. One that went is told nothing more: its stream ends here, and the
        next controller learns what became of the runners from etcd's keys. Found by the suite on a busy
        machine (#26): a runner's exit, reported into a stream its controller had just closed, raised in the
        runner's supervisor task and crashed the node's daemon as the cluster shut down."""
        if session != self._session or self._stream is None:
            return
        try:
            self._stream.send_nowait((json.dumps(event) + "\n").encode())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._end_session("its controller went away")

    async def _supervise(self, process: FencedProcess, instance_id: str, beat: Beat | None = None) -> None:
        spec = process.spec
        key = (spec.runner_id, spec.incarnation)
        try:
            with self._scopes[key]:  # cancelled: killed and reaped (`Supervisor.run`)
                await process.run()
        except Exception as exc:  # the runner's failure, never the agent's
            log.exception("supervisor of %s/%d failed", spec.runner_id, spec.incarnation)
            self._send(self._session, {"kind": "report", **_key(spec), "report": json.loads(_failed(spec, exc))})
            self._send(self._session, {"kind": "exit", **_key(spec), "exit_code": 1, "tail": "", "stopped": False})
        finally:
            if beat is not None:
                beat.stop()
            self._running.pop(key, None)
            self._loading.pop(key, None)
            self._scopes.pop(key, None)
            self._generations.ended(instance_id, spec.incarnation)
            self.book.forget(*key)  # killed by fencing, it never said its exit
            if self._presence is not None:
                self._released.add(self._key_of(key))
        await self._release_keys()


class _Forward:
    """The `exod.host.supervisor.Listener` of a runner on this node: what it reports goes to its controller's
    stream; its pid is recorded in this host's store, so a restarted daemon reaps an orphan."""

    def __init__(self, agent: Agent, session: int) -> None:
        self.agent, self.session = agent, session

    def on_spawned(self, spec: RunnerSpec, pid: int) -> None:
        self.agent.book.record(ProcessRecord(spec.runner_id, spec.incarnation, pid, start_ticks(pid) or 0))
        self.agent._send(self.session, {"kind": "spawned", **_key(spec), "pid": pid})

    def on_report(self, spec: RunnerSpec, report: p.Report) -> None:
        key = (spec.runner_id, spec.incarnation)
        model_id = self.agent._loading.get(key)
        if (
            isinstance(report, p.Failed)
            and not report.host
            and model_id is not None
            and self.agent.models.lost(model_id, report.exception_type, report.message)  # this node's to judge
        ):
            report = attrs.evolve(report, host=True)
        self.agent._send(self.session, {"kind": "report", **_key(spec), "report": json.loads(report.to_json())})

    def on_stall(self, spec: RunnerSpec, phase: str, seconds: float) -> None:
        self.agent._send(self.session, {"kind": "stall", **_key(spec), "phase": phase, "seconds": seconds})

    def on_exit(self, spec: RunnerSpec, exit_code: int, stderr_tail: str, stop_delivered: bool) -> None:
        self.agent.book.forget(spec.runner_id, spec.incarnation)
        event = {"kind": "exit", **_key(spec), "exit_code": exit_code, "tail": stderr_tail, "stopped": stop_delivered}
        self.agent._send(self.session, event)


def _new_stream(previous: int) -> int:
    """A report stream's number: at random (JSON's safe integers), so that no one guesses the open one."""
    while (stream := secrets.randbelow(2**53 - 1) + 1) == previous:
        pass
    return stream


def _key(spec: RunnerSpec) -> dict[str, Any]:
    return {"runner_id": spec.runner_id, "incarnation": spec.incarnation}


def _failed(spec: RunnerSpec, exc: Exception, *, host: bool = False) -> str:
    """A supervisor's failure, as the runner's report: out of fds or disk is the host's (uncharged), as on one
    host (`exod.reports`); found by the fault campaign (#26), an fd limit charged the model a retry."""
    host = host or (isinstance(exc, OSError) and exc.errno in p.HOST_ERRNOS)
    report = p.Failed(spec.runner_id, spec.incarnation, type(exc).__name__, str(exc), "", retryable=True, host=host)
    return report.to_json()


Term = Annotated[int, Header(alias=TERM_HEADER, ge=1, description="the controller's term")]


def router(agent: Agent) -> APIRouter:
    """The agent's endpoints: the controller's, behind the cluster's API key like every other."""
    api = APIRouter(prefix=AGENT_PATHS.rstrip("/"), include_in_schema=False)

    @api.post("/ports")
    async def ports(count: int) -> dict[str, Any]:
        if not 1 <= count <= 64:
            raise Refused(400, f"count must be 1..64, got {count}")
        return {"address": agent.advertise, "ports": agent.reserve_ports(count)}

    @api.post("/runners", status_code=202)
    async def spawn(body: SpawnRequest, term: Term) -> dict[str, Any]:
        await agent.spawn(term, body)
        return {"runner_id": body.runner_id, "incarnation": body.incarnation}

    @api.post("/runners/{runner_id:path}/{incarnation}/commands", status_code=202)
    async def post(runner_id: str, incarnation: int, body: CommandRequest, term: Term) -> dict[str, Any]:
        agent.post(term, runner_id, incarnation, body)
        return {}

    @api.delete("/runners/{runner_id:path}/{incarnation}", status_code=202)
    async def stop(runner_id: str, incarnation: int, term: Term) -> dict[str, Any]:
        agent.stop(term, runner_id, incarnation)
        return {}

    @api.post("/models/{model_id:path}")
    async def fetch(model_id: str) -> dict[str, Any]:
        try:
            await agent.fetch(model_id)
        except Exception as exc:  # ModelNotFound, or what the hub client raised: the controller retries
            raise Refused(424, f"{type(exc).__name__}: {exc}") from exc
        return {"model_id": model_id}

    @api.get("/reports")
    async def reports(term: Term) -> StreamingResponse:
        return StreamingResponse(await agent.connect(term), media_type="application/x-ndjson")

    return api
