"""The other nodes of a cluster, as the controller drives them: runner processes run by their agents.

`Fleet` is the controller's view of the nodes (their records, refreshed from etcd) and one `NodeLink` per
node it runs runners on: the agent's report stream (`exod.cluster.agent`), dispatched to the `RemoteProcess`
of each runner there. A `RemoteProcess` is what `exod.processes` needs of any runner process (spawn,
post, stop, the exit), over the agent's API; commands go one at a time, in order, as to a local one.

A node whose stream breaks (it died, or the network did) takes its runners with it: each is reported
as failed by the host (uncharged, `fsm.Failure.host`) at once, and as exited once its key in etcd is gone
(`exod.cluster.nodes.live_runners`): reaped by its agent, or killed when its node fenced itself before its lease
expired. Until then it may still run, so no new generation starts beside it (DESIGN §5, fencing).

`Ring` gives every rank of a generation the same hostfile, from each rank's node: its advertised
address and a port its agent reserved there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import trio

from exod.cluster.election import TERM_HEADER
from exod.cluster.etcd import EtcdError
from exod.cluster.nodes import Alive, NodeRecord, described, earlier_generations
from exod.cluster.tls import NodeTls, peer_transport, peer_url
from exod.cluster.token import HEADER
from exod.host.supervisor import Listener, RunnerSpec
from exod.runner import protocol as p

log = logging.getLogger("exod.remote")

REFRESH_S = 1.0  # how often the controller reads the node records
SILENCE_S = 5.0  # a report stream silent this long (an agent beats every second) is a node lost
UNHEARD_S = 2.0  # a report stream silent this long has missed beats: its runners' heartbeats are not heard
EARLIER_POLL_S = 0.1  # how often a new generation's rank reads whether an earlier one's keys are gone


class AgentUnavailable(Exception):
    """A node's agent cannot be reached, or refused: the message says which and why."""


class AgentClient:
    """One node's agent API (`exod.cluster.agent`), with the cluster's token (never a client's key), each
    request naming the controller's term (`exod.cluster.election.TERM_HEADER`): the agent obeys no other.
    Over TLS where the cluster has it (`exod.cluster.tls`): then no one on the network reads either."""

    def __init__(
        self, node: NodeRecord, token: str, client: httpx.AsyncClient, term: int, tls: NodeTls | None = None
    ) -> None:
        self.node, self._client = node, client
        self.url = peer_url(node.api_url, tls)
        self._headers = {TERM_HEADER: str(term), HEADER: token}

    async def ports(self, count: int) -> list[int]:
        return (await self._call("POST", "/agent/ports", params={"count": count}))["ports"]

    async def spawn(self, body: dict[str, Any]) -> None:
        await self._call("POST", "/agent/runners", json=body)

    async def post(self, runner_id: str, incarnation: int, command: p.Command, model_id: str | None) -> None:
        body = {"command": json.loads(command.to_json()), "model_id": model_id}
        await self._call("POST", f"/agent/runners/{runner_id}/{incarnation}/commands", json=body)

    async def stop(self, runner_id: str, incarnation: int) -> None:
        await self._call("DELETE", f"/agent/runners/{runner_id}/{incarnation}")

    async def fetch(self, model_id: str) -> None:
        await self._call("POST", f"/agent/models/{model_id}", timeout=None)

    async def reports(self) -> AsyncIterator[dict[str, Any]]:
        url = f"{self.url}/agent/reports"
        timeout = httpx.Timeout(10.0, read=SILENCE_S)  # the agent beats every second: silence is a lost node
        try:
            async with self._client.stream("GET", url, headers=self._headers, timeout=timeout) as response:
                if response.status_code != 200:
                    raise AgentUnavailable(
                        f"node {self.node.node_id} refused its report stream: {response.status_code}"
                    )
                async for line in response.aiter_lines():
                    if line.strip():
                        yield json.loads(line)
        except httpx.HTTPError as exc:
            raise AgentUnavailable(f"node {self.node.node_id}: {type(exc).__name__}: {exc}") from exc

    async def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = await self._client.request(method, f"{self.url}{path}", headers=self._headers, **kwargs)
        except httpx.HTTPError as exc:
            raise AgentUnavailable(f"node {self.node.node_id}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 300:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            raise AgentUnavailable(f"node {self.node.node_id} refused {method} {path}: {message}")
        return response.json()


class RemoteProcess:
    """A runner process on another node: `exod.host.supervisor.Process`, through that node's agent."""

    def __init__(
        self,
        spec: RunnerSpec,
        link: NodeLink,
        ring: Ring,
        instance_id: str,
        listener: Listener,
        published: Callable[[str, int, str], None],
        *,
        cleared: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.spec, self.link, self.ring, self.instance_id, self.listener = spec, link, ring, instance_id, listener
        self._published = published
        self._cleared = cleared  # returns once it may run: its generation is etcd's, no earlier one is left
        self.pid: int | None = None  # on its node; never reaped from here
        self._commands, self._outbox = trio.open_memory_channel[tuple[p.Command, str | None]](math.inf)
        self._stop = trio.Event()
        self._exited = trio.Event()

    def post(self, command: p.Command, model_id: str | None = None) -> None:
        self._commands.send_nowait((command, model_id))

    def unheard(self) -> bool:
        """Whether its node's report stream has missed its beats: while it has, the runner's heartbeat goes
        unheard for its node's sake (lost past `SILENCE_S`: the host's failure), not for the runner's."""
        return trio.current_time() - self.link.heard_at > UNHEARD_S

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        s = self.spec
        if self._cleared is not None:  # a deposed controller's write is refused (`Deposed`): it spawns nothing
            await self._cleared()
        try:
            await self.link.connected.wait()
            if self.link.lost is not None:
                raise AgentUnavailable(self.link.lost)
            ring = await self.ring.endpoints() if s.world_size > 1 else []
            if ring:
                self._published(s.runner_id, s.incarnation, ring[s.rank])
            self.link.running[(s.runner_id, s.incarnation)] = self
            body = {"instance_id": self.instance_id, "runner_id": s.runner_id, "incarnation": s.incarnation}
            body |= {"rank": s.rank, "world_size": s.world_size, "ring": ring}
            body["stream"] = self.link.stream  # the agent refuses a spawn whose stream is over
            await self.link.client.spawn(body)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_commands)
                nursery.start_soon(self._stop_when_asked)
                await self._exited.wait()
                nursery.cancel_scope.cancel()
        except AgentUnavailable as exc:  # the node is out of reach, or its stream is not ours: the host's failure
            self.link.close(str(exc))
            self.lost(str(exc))
        finally:
            self.link.running.pop((s.runner_id, s.incarnation), None)
            if not self._exited.is_set():  # cancelled (the controller stops): the agent stops it too
                with trio.move_on_after(2.0) as cleanup, contextlib.suppress(AgentUnavailable):
                    cleanup.shield = True
                    await self.link.client.stop(s.runner_id, s.incarnation)

    async def _send_commands(self) -> None:
        try:
            async for command, model_id in self._outbox:
                await self.link.client.post(self.spec.runner_id, self.spec.incarnation, command, model_id)
        except AgentUnavailable as exc:
            self.lost(str(exc))

    async def _stop_when_asked(self) -> None:
        await self._stop.wait()
        try:
            await self.link.client.stop(self.spec.runner_id, self.spec.incarnation)
        except AgentUnavailable as exc:
            self.lost(str(exc))

    # -- what the node's stream says -------------------------------------------------------------------

    def on_event(self, event: dict[str, Any]) -> None:
        match event["kind"]:
            case "spawned":
                self.pid = event["pid"]
            case "report":
                report = p.from_json(json.dumps(event["report"]))
                assert isinstance(report, p.Report)
                self.listener.on_report(self.spec, report)
            case "stall":
                self.listener.on_stall(self.spec, event["phase"], event["seconds"])
            case "exit":
                self.link.unconfirmed.discard(self)
                if not self._exited.is_set():
                    self.listener.on_exit(self.spec, event["exit_code"], event["tail"], event["stopped"])
                    self._exited.set()

    def lost(self, why: str) -> None:
        """Its node is out of reach: a failure of the host. The process may still run there until its node
        fences itself, so its exit is said only once its key is gone (`gone`, from `Fleet.refresh`)."""
        if self._exited.is_set() or self in self.link.unconfirmed:
            return
        s, node = self.spec, self.link.client.node.node_id
        lost = f"node {node} lost ({why.removeprefix(f'node {node}: ')})"
        failed = p.Failed(s.runner_id, s.incarnation, "NodeLost", lost, "", retryable=True, host=True)
        self.listener.on_report(s, failed)
        self.link.unconfirmed.add(self)

    def gone(self) -> None:
        """Its key is gone from etcd: the process is surely dead."""
        self.link.unconfirmed.discard(self)
        if not self._exited.is_set():
            self.listener.on_exit(self.spec, -9, "", False)
            self._exited.set()


class NodeLink:
    """One node's agent as this controller drives it: its report stream, and the runners it runs for us."""

    def __init__(self, client: AgentClient, unconfirmed: set[RemoteProcess]) -> None:
        self.client = client
        self.running: dict[tuple[str, int], RemoteProcess] = {}
        self.unconfirmed = unconfirmed  # the fleet's: runners lost with their node, maybe alive until fenced
        self.connected = trio.Event()
        self.stream = 0  # the agent's number for our report stream, which each spawn names (its hello says)
        self.heard_at = -math.inf  # (trio time) its stream's last line: a beat at least every second
        self.lost: str | None = None
        self._scope = trio.CancelScope()

    def close(self, why: str) -> None:
        """Give the node up (its lease is gone, or its agent refused us): its runners are lost, and its stream
        is closed, which tells its agent to stop them if it still can hear. The next use opens a new link."""
        self._why = why
        self.lost = self.lost or why
        self._scope.cancel()

    async def run(self) -> None:
        self._why = f"node {self.client.node.node_id} closed its report stream"
        with self._scope:
            try:
                async for event in self.client.reports():
                    self.heard_at = trio.current_time()
                    if event["kind"] == "hello":
                        self.stream = event["stream"]
                        self.connected.set()
                    elif event["kind"] == "beat":
                        continue
                    elif (process := self.running.get((event["runner_id"], event["incarnation"]))) is not None:
                        process.on_event(event)
            except AgentUnavailable as exc:
                self._why = str(exc)
            except (ValueError, KeyError, p.ProtocolError) as exc:
                self._why = f"node {self.client.node.node_id} sent a report that is not exod's: {exc}"
        why = self._why
        log.error("%s: its runners are lost", why)
        self.lost = why
        self.connected.set()  # whoever waits learns it from `running` being lost
        for process in list(self.running.values()):
            process.lost(why)


class Ring:
    """One generation's MLX ring across nodes: every rank's HOST:PORT, reserved once, on each rank's node."""

    def __init__(self, nodes_by_rank: list[str], reserve: Callable[[str, int], Awaitable[list[str]]]) -> None:
        self.nodes_by_rank, self._reserve = nodes_by_rank, reserve
        self._lock = trio.Lock()
        self._endpoints: list[str] | None = None

    async def endpoints(self) -> list[str]:
        async with self._lock:
            if self._endpoints is None:
                wanted = {node: self.nodes_by_rank.count(node) for node in dict.fromkeys(self.nodes_by_rank)}
                got = {node: list(await self._reserve(node, count)) for node, count in wanted.items()}
                self._endpoints = [got[node].pop(0) for node in self.nodes_by_rank]
            return self._endpoints


class Fleet:
    """The cluster's nodes as this controller sees them, and the links to those it runs runners on."""

    def __init__(
        self,
        local: str,
        records: Callable[[], Awaitable[list[NodeRecord]]],
        runners: Callable[[], Awaitable[Alive]],
        token: str,
        term: Callable[[], int | None],
        *,
        tls: NodeTls | None = None,
    ) -> None:
        """``tls``: the cluster's node-to-node TLS (`exod.cluster.tls`); None: its nodes talk plain HTTP."""
        self.local, self._records, self._runners, self._token = local, records, runners, token
        self._term = term  # this node's term as the controller now; None: it is not, and commands nothing
        self.nodes: dict[str, NodeRecord] = {}
        self._links: dict[str, NodeLink] = {}
        self._unconfirmed: set[RemoteProcess] = set()
        self._tls = tls
        self._client = httpx.AsyncClient(timeout=30.0, transport=peer_transport(tls))
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """For one controller term: the links it opens live and die with it (a new term opens its own).

        It is started once every runner an earlier term left on an agent is gone (`_settle`)."""
        self._links, self._unconfirmed = {}, set()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self.refresh()
                await self._settle()
                task_status.started()
                while True:
                    await trio.sleep(REFRESH_S)
                    await self.refresh()
        finally:
            self._links, self._nursery = {}, None

    async def refresh(self) -> None:
        """Read the node records now (a placement reads them fresh); a node whose record went with its
        lease is given up."""
        try:
            self.nodes = {record.node_id: record for record in await self._records()}
        except Exception as exc:  # etcd away: keep what was known (the membership reports it degraded)
            log.debug("node records not refreshed: %s", exc)
            return
        for node_id, link in self._links.items():
            if node_id not in self.nodes and link.lost is None:
                link.close(f"node {node_id}'s lease expired")
        if self._unconfirmed:
            with contextlib.suppress(EtcdError):  # etcd away: they stay unconfirmed, which is the safe side
                alive = await self._runners()
                for process in list(self._unconfirmed):
                    node, s = process.link.client.node.node_id, process.spec
                    if (s.runner_id, s.incarnation) not in alive.get(node, ()):
                        process.gone()

    async def _settle(self) -> None:
        """Wait until no runner of an earlier term is alive on any agent. Opening a link ends the earlier
        term's stream there, and its agent stops them; on a node out of reach they go when it fences itself
        (its keys with its lease). Meanwhile this term starts nothing."""
        said: set[str] = set()
        while True:
            try:
                alive = {node: keys for node, keys in (await self._runners()).items() if keys}
            except EtcdError as exc:  # the membership fences this term if it lasts
                log.warning("cannot read the runners left by the previous controller: %s", exc)
                await trio.sleep(REFRESH_S)
                continue
            if not alive:
                return
            for node in alive:
                with contextlib.suppress(AgentUnavailable):
                    self.link(node)
            if set(alive) != said:
                said = set(alive)
                log.info("waiting for the runners of the previous controller to stop on %s", ", ".join(sorted(said)))
            await trio.sleep(REFRESH_S)
            await self.refresh()

    async def earlier_gone(self, instance_id: str, generation: int) -> None:
        """Return once etcd holds no runner key of an earlier generation of ``instance_id``: whatever left it
        there (a runner its controller no longer knows of, an agent that has not released it yet), a rank of
        ``generation`` never runs beside it (DESIGN §5; `fsm.fencing`'s controller waits for no key left). The
        same rule as each agent's own (`exod.cluster.nodes.earlier_generations`), which refuses the spawn else."""
        said = None
        while True:
            try:
                left = described(earlier_generations(await self._runners(), instance_id, generation))
            except EtcdError as exc:  # the membership fences this term if it lasts
                left = f"(etcd: {exc})"
            if not left:
                return
            if left != said:
                said = left
                log.info("generation %d of %s waits for %s to end", generation, instance_id, left)
            await trio.sleep(EARLIER_POLL_S)

    def rooms(self) -> tuple[dict[str, int], dict[str, tuple[str, ...]]]:
        """For admission: the memory of each live node (its ``memory_total``: admission subtracts what is
        reserved), and the models each holds."""
        nodes = self.nodes.values()
        return {n.node_id: n.memory_total for n in nodes}, {n.node_id: n.models for n in nodes}

    def link(self, node_id: str) -> NodeLink:
        """The link to ``node_id``'s agent, opened on first use (`AgentUnavailable` if the node is unknown)."""
        link = self._links.get(node_id)
        if link is None or link.lost is not None:
            record = self.nodes.get(node_id)
            if record is None or not record.api_url or self._nursery is None:
                raise AgentUnavailable(f"node {node_id} is not a live node of the cluster")
            if (term := self._term()) is None:
                raise AgentUnavailable(f"node {self.local} is not the controller: it commands no agent")
            client = AgentClient(record, self._token, self._client, term, self._tls)
            link = self._links[node_id] = NodeLink(client, self._unconfirmed)
            self._nursery.start_soon(link.run)
        return link
