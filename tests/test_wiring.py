"""The wiring that puts the fencing mechanisms on every path (issue #47, item 1), and refusals where a change
meets a deposition (item 5). The unit tests of `Agent`, `Fleet` and `RemoteProcess` drive each mechanism with
fakes; these drive what calls them, so that a mechanism taken off its path fails a test here:

* the real controller and `exod.processes.Processes` with a fleet of fake agents: in a cluster every
  `CreateRunner` is an agent's spawn (the controller's own node's ranks too), made only once the state store
  holds the generation and no runner key of an earlier generation is left (DESIGN §5);
* a fenced `Supervisor` refuses to start a runner without its deadline;
* a real runner process fed its deadline by the real agent, `Supervisor` and `Presence`, its daemon frozen:
  the runner's own watchdog kills it by the node's authority;
* a lease renewal whose answer etcd holds back buys authority from when it was *sent*, never answered.

Time is trio's MockClock, except for the real runner process (a few seconds of real time).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from fake_runners import FakeFleet, FakeModels
from reliability_report import cluster_fault
from test_agent import PREFIX, TERM
from test_agent import FakeEtcd as AgentEtcd
from test_agent import request as spawn_request
from test_controller_clock import MODEL, POLICY, WALL, instance, until

from daemon_harness import config, runner_pids
from exod.api.app import create_app
from exod.cluster import agent as agent_module
from exod.cluster.agent import Agent
from exod.cluster.election import Deposed
from exod.cluster.nodes import FENCE_MARGIN, NodeRecord, Presence, earlier_generations
from exod.cluster.remote import Fleet
from exod.controller import Controller
from exod.host.supervisor import RunnerSpec, Supervisor, Timeouts, Unfenced
from exod.state.sqlite import Store
from exod.state.store import SqliteState

# -- the controller, Processes, and a fleet of fake agents ----------------------------------------------------

# Long limits: only what the test does ends a generation (no phase limit nor heartbeat fires meanwhile).
QUIET = Timeouts(connect=600, load_progress=600, warm_up=600, generate=600, stop_grace=5, term_grace=3, heartbeat=600)
WRITE_S = 0.5  # how long the fake etcd takes to write the controller's state
HELD_S = 30.0  # how long the test keeps an earlier generation's key in etcd


class SlowState(SqliteState):
    """The controller's state store as etcd is to it: each write takes `WRITE_S`; it says which runner
    generations it holds once a write has ended, or refuses every write once the term is over (``deposed``)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.held: set[tuple[str, int]] = set()  # (runner id, generation) of every runner a finished write held
        self.deposed = False

    async def save(self, snapshot: dict[str, Any], entries, now: float) -> int:
        if self.deposed:
            raise Deposed("node node-1 is no longer the controller: etcd refused its write")
        await trio.sleep(WRITE_S)
        seq = await super().save(snapshot, entries, now)
        for runner_id, runner in snapshot["runners"].items():
            self.held.add((runner_id, runner["machine"]["incarnation"]))
        return seq


class FakeAgentClient:
    """One node's agent as `exod.cluster.remote.RemoteProcess` drives it (`AgentClient`'s methods): a spawn
    claims the runner's key (kept until the test releases it, as a real agent keeps it until the process is
    reaped and its release reaches etcd), a stop ends it at once."""

    def __init__(self, fleet: FakeAgents, node: NodeRecord) -> None:
        self.fleet, self.node = fleet, node
        self.link: FakeLink | None = None
        self._next_port = 20000

    async def ports(self, count: int) -> list[int]:
        self._next_port += count
        return list(range(self._next_port - count, self._next_port))

    async def spawn(self, body: dict[str, Any]) -> None:
        key = (body["runner_id"], body["incarnation"])
        fleet = self.fleet
        left = earlier_generations(await fleet.runner_keys(), body["instance_id"], body["incarnation"])
        fleet.spawns.append(
            Spawn(trio.current_time(), self.node.node_id, *key, stored=key in fleet.state.held, earlier_left=left)
        )
        fleet.keys.setdefault(self.node.node_id, set()).add(key)
        assert self.link is not None
        self.link.running[key].on_event({"kind": "spawned", "pid": 1 << 22})

    async def post(self, runner_id: str, incarnation: int, command, model_id: str | None) -> None: ...

    async def stop(self, runner_id: str, incarnation: int) -> None:
        assert self.link is not None
        if (process := self.link.running.get((runner_id, incarnation))) is not None:
            process.on_event({"kind": "exit", "exit_code": 0, "tail": "", "stopped": True})

    async def fetch(self, model_id: str) -> None: ...


class FakeLink:
    """`exod.cluster.remote.NodeLink` with its report stream always heard: the test says what the runners do."""

    def __init__(self, client: FakeAgentClient) -> None:
        self.client, self.running, self.unconfirmed, self.lost = client, {}, set(), None
        client.link = self
        self.stream = 1
        self.heard_at = math.inf  # never unheard
        self.connected = trio.Event()
        self.connected.set()

    def close(self, why: str) -> None:
        self.lost = why


class Spawn:
    def __init__(self, at: float, node: str, runner_id: str, incarnation: int, *, stored: bool, earlier_left: list):
        self.at, self.node, self.runner_id, self.incarnation = at, node, runner_id, incarnation
        self.stored, self.earlier_left = stored, earlier_left

    def __repr__(self) -> str:
        return f"<spawn {self.runner_id}/{self.incarnation} on {self.node} at {self.at:.2f}>"


class FakeAgents(Fleet):
    """The real `Fleet` (its refresh, its settling, `earlier_gone`) on a fake etcd's runner keys, its links to
    fake agents on node-1 (the controller's) and node-2."""

    def __init__(self, state: SlowState) -> None:
        records = [NodeRecord(f"node-{n}", f"127.0.0.{n}", f"http://127.0.0.{n}:1", 1 << 40, 1 << 40) for n in (1, 2)]

        async def listed() -> list[NodeRecord]:
            return records

        super().__init__("node-1", listed, self.runner_keys, token="t" * 43, term=lambda: TERM)
        self.state = state
        self.keys: dict[str, set[tuple[str, int]]] = {}
        self.spawns: list[Spawn] = []
        self._fakes = {r.node_id: FakeLink(FakeAgentClient(self, r)) for r in records}

    async def runner_keys(self) -> dict[str, set[tuple[str, int]]]:
        return {node: set(keys) for node, keys in self.keys.items()}

    def link(self, node_id: str) -> FakeLink:  # type: ignore[override]
        return self._fakes[node_id]

    def crash(self, runner_id: str, incarnation: int) -> None:
        """The runner's process died (its agent reaped it; its key is left until `release`)."""
        for link in self._fakes.values():
            if (process := link.running.get((runner_id, incarnation))) is not None:
                process.on_event({"kind": "exit", "exit_code": 1, "tail": "boom", "stopped": False})

    def release(self, generation: int) -> None:
        for keys in self.keys.values():
            keys -= {k for k in keys if k[1] == generation}


def in_cluster(tmp_path: Path, body) -> tuple[Any, FakeAgents, FakeFleet]:
    """Run ``body(controller, agents)`` against a cluster's controller whose agents are fakes; ``local`` is what
    the controller could spawn on its own node by itself (it must not, in a cluster)."""
    cfg = config(tmp_path, None, timeouts=QUIET, policy=POLICY)
    local = FakeFleet(FakeModels())

    async def main() -> Any:
        store = Store.open(cfg.db_path)
        state = SlowState(store)
        agents = FakeAgents(state)
        try:
            controller = Controller(
                cfg, store, state=state, fleet=agents, spawn=local, models=FakeModels(), wall=lambda: WALL
            )
            await controller.restore()

            async def term(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                try:
                    await controller.run(task_status=task_status)
                except* Deposed:  # etcd refused its write: the term is over, as the daemon ends it
                    pass

            with trio.fail_after(3600):
                async with trio.open_nursery() as nursery:
                    await nursery.start(term)
                    result = await body(controller, agents)
                    nursery.cancel_scope.cancel()
            return result, agents
        finally:
            store.close()

    result, agents = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return result, agents, local


def test_in_a_cluster_every_rank_is_an_agents_spawn_after_its_generation_is_stored_and_the_earlier_one_gone(
    tmp_path,
):
    """Two ranks, one on the controller's own node: each rank of each generation reaches its node's agent, none
    is spawned by the controller itself; none before the state store holds its generation; generation 2's
    none while a key of generation 1 is left in etcd, however long, and at once when it goes."""

    async def spawned(agents: FakeAgents, generation: int) -> None:
        """Until both ranks of ``generation`` reached their agents (a minute at most: the assertions say why not)."""
        with trio.move_on_after(60):
            while len([s for s in agents.spawns if s.incarnation == generation]) < 2:
                await trio.sleep(0.01)

    async def body(controller: Controller, agents: FakeAgents):
        iid = await controller.place(MODEL, 2, nodes=["node-1", "node-2"])
        await until(controller, lambda s: instance(s, iid)["generation"] == 1)
        await spawned(agents, 1)
        nodes = sorted(s.node for s in agents.spawns)
        agents.crash(f"{iid}/0", 1)  # gen 1 ends: rank 0 died; rank 1 is stopped; both keys left in etcd
        await until(controller, lambda s: instance(s, iid)["generation"] == 2)
        await trio.sleep(HELD_S)
        during = [s for s in agents.spawns if s.incarnation == 2]
        released = trio.current_time()
        agents.release(1)
        await spawned(agents, 2)
        await trio.testing.wait_all_tasks_blocked()
        return iid, nodes, during, released

    (iid, nodes, during, released), agents, local = in_cluster(tmp_path, body)
    created = {(s.runner_id, s.incarnation) for s in agents.spawns}
    assert local.runners == [], local.runners  # the controller spawned nothing by itself
    assert nodes == ["node-1", "node-2"]  # a rank on the controller's node: its path is the agent's too
    assert created == {(f"{iid}/{rank}", gen) for rank in (0, 1) for gen in (1, 2)}, agents.spawns
    assert len(agents.spawns) == len(created)  # each once
    assert {k for k in agents.state.held if k[1] > 0} == created  # every generation the store holds ran, once
    assert [s for s in agents.spawns if not s.stored] == []  # … before its rank was spawned
    assert during == []  # generation 1's keys held generation 2 back, however long
    late = [s.at - released for s in agents.spawns if s.incarnation == 2]
    assert all(0 <= t <= 0.2 for t in late), late  # and no longer (`EARLIER_POLL_S`)
    assert [s for s in agents.spawns if s.earlier_left] == []


# -- a fenced Supervisor without its deadline -----------------------------------------------------------------


class Heard:
    def __init__(self) -> None:
        self.spawned: list[int] = []
        self.exits: list[tuple[int, str]] = []

    def on_spawned(self, spec: RunnerSpec, pid: int) -> None:
        self.spawned.append(pid)

    def on_report(self, spec, report) -> None: ...

    def on_stall(self, spec, phase, seconds) -> None: ...

    def on_exit(self, spec: RunnerSpec, exit_code: int, stderr_tail: str, stop_delivered: bool) -> None:
        self.exits.append((exit_code, stderr_tail))


def test_a_fenced_supervisor_refuses_to_start_a_runner_without_its_deadline(tmp_path):
    spec = RunnerSpec("i/0", 1, rank=0, world_size=1, hostfile=None, log_path=tmp_path / "r.log", fenced=True)
    heard, before = Heard(), runner_pids()
    supervisor = Supervisor(spec, heard)

    async def main() -> None:
        with pytest.raises(Unfenced, match="fenced"):
            await supervisor.run()

    trio.run(main)
    assert heard.spawned == [] and supervisor.pid is None and runner_pids() == before  # nothing started


# -- a real runner's deadline, from the node's lease to its watchdog ------------------------------------------

LEASE_TTL = 3  # the real clock's: a renewal every 0.5 s, an authority of 2.4 s
KILL_LATENCY_S = FENCE_MARGIN * LEASE_TTL / 2  # the kill and /proc showing it (polled every 5 ms): half the margin
STARTUP_S = 30.0  # a runner process's start, to its watchdog forked, on a busy machine


class LeaseEtcd(AgentEtcd):
    """`test_agent`'s fake etcd, with a lease a real `Presence` keeps: each renewal answered after ``answer_s``
    (each sent time noted)."""

    timeout = 5.0

    def __init__(self, answer_s: float = 0.0) -> None:
        super().__init__()
        self.answer_s = answer_s
        self.sent: list[float] = []  # when each keep-alive was sent
        self.answered: list[float] = []

    async def grant(self, ttl: int) -> int:
        self.sent.append(trio.current_time())
        await trio.sleep(self.answer_s)
        self.answered.append(trio.current_time())
        return 7

    async def keep_alive(self, lease: int, *, timeout: float | None = None) -> int:
        self.sent.append(trio.current_time())
        await trio.sleep(self.answer_s)
        self.answered.append(trio.current_time())
        return LEASE_TTL

    async def revoke(self, lease: int) -> None: ...


def _state(pid: int) -> str | None:
    """The process's state letter in /proc (Z: dead, not reaped yet), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _watchdog_forked(pid: int) -> bool:
    try:
        return bool(Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    except OSError:
        return False


def test_a_runner_whose_daemon_freezes_is_killed_by_its_own_watchdog_by_the_nodes_authority(tmp_path, monkeypatch):
    """The agent (real), its node's `Presence` (real, a fake etcd) and the runner's `Supervisor` (real) start a
    real runner process; then the daemon's event loop freezes (nothing extends the deadline, nothing kills): the
    runner's watchdog process kills it, by `Presence.authority_until` as it stood when the loop froze."""
    monkeypatch.setattr(agent_module, "_new_stream", lambda previous: previous + 1)  # `spawn_request`'s stream
    etcd = LeaseEtcd()
    record = NodeRecord("node-2", "127.0.0.2", "http://127.0.0.2:1", 1 << 30, 1 << 30)
    presence = Presence(etcd, PREFIX, record, ttl=LEASE_TTL)
    store = Store.open(tmp_path / "store.sqlite")
    agent = Agent(config(tmp_path, tmp_path / "hf"), store, "127.0.0.2", spawn=Supervisor)
    before = set(runner_pids())

    async def main() -> tuple[float, float, float | None]:
        async with trio.open_nursery() as nursery:
            await nursery.start(presence.run)
            await nursery.start(agent.run, presence)
            stream = await agent.connect(TERM)
            await stream.__anext__()
            await agent.spawn(TERM, spawn_request())
            with trio.fail_after(STARTUP_S):
                while not (pids := set(runner_pids()) - before) or not _watchdog_forked(min(pids)):
                    await trio.sleep(0.05)
            (pid,) = pids
            await presence.renewed.wait()
            await trio.sleep(0.05)  # the agent extends the runner's deadline to the authority the renewal bought
            now_trio, now = trio.current_time(), time.monotonic()
            authority = now + (presence.authority_until - now_trio)
            lease_ends = now + (presence.alive_until - now_trio)
            died = None
            while time.monotonic() < lease_ends + LEASE_TTL:  # the event loop frozen: the daemon stalled
                if _state(pid) in ("Z", None):
                    died = time.monotonic()
                    break
                time.sleep(0.005)
            nursery.cancel_scope.cancel()
        return authority, lease_ends, died

    try:
        authority, lease_ends, died = trio.run(main)
    finally:
        store.close()
    log = (tmp_path / "state").rglob("*.log")
    said = "".join(p.read_text(errors="replace") for p in log)
    assert died is not None, f"the runner outlived its node's lease by over {LEASE_TTL} s"
    assert died <= authority + KILL_LATENCY_S, (died - authority, said[-2000:])
    assert died < lease_ends  # before the lease may have expired, and another node may run its generation
    assert "deadline passed without an extension" in said  # its watchdog, not a hang-up nor the agent
    assert set(runner_pids()) <= before  # reaped once the loop ran again
    cluster_fault(
        "frozen agent daemon, its runner's watchdog",
        f"the daemon's event loop frozen (lease TTL {LEASE_TTL} s): its runner (real process, real Supervisor) "
        f"killed by its own watchdog {died - authority:+.3f} s from the node's authority, "
        f"{lease_ends - died:.2f} s before its lease could expire",
    )


# -- a renewal's answer held back -----------------------------------------------------------------------------


@pytest.mark.parametrize("answer_s", [0.0, 1.5])
def test_a_renewal_buys_authority_from_when_it_was_sent_not_answered(answer_s):
    """etcd holds each keep-alive's answer ``answer_s``: the lease runs from when etcd got the renewal, and this
    node cannot know when that was, only that it was after it sent it. So `Presence.alive_until` is never past
    the last renewal's sending + TTL, and `authority_until` never past that less the margin — watched at every
    instant something happened, over a minute of renewals."""
    ttl = 10
    etcd = LeaseEtcd(answer_s)
    record = NodeRecord("node-1", "127.0.0.1", "http://127.0.0.1:1", 1 << 30, 1 << 30)
    presence = Presence(etcd, PREFIX, record, ttl=ttl)
    worst: list[float] = []  # authority_until less the bound, at each look

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(presence.run)
            for _ in range(6000):  # every 10 ms for a minute
                bound = max(etcd.sent) + ttl
                assert presence.alive_until <= bound, (presence.alive_until, etcd.sent[-3:])
                worst.append(presence.authority_until - (bound - FENCE_MARGIN * ttl))
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert max(worst) <= 0, max(worst)
    assert len(etcd.answered) >= 30  # renewed all along: the delay cost no authority
    assert presence.lost is None and presence.renewals.failures == 0
    if answer_s:
        took = presence.renewals.took_max
        assert took == pytest.approx(answer_s)  # held back as the test says
        # what an answer-timed bound would have claimed: answer_s more than is safe
        assert min(a - s for s, a in zip(etcd.sent, etcd.answered, strict=False)) == pytest.approx(answer_s)


# -- refusals where a change meets a deposition (item 5) --------------------------------------------------------


def test_a_placement_park_or_delete_meeting_a_deposition_is_503_with_retry_after_and_the_reason(tmp_path):
    """The term ends under the change (etcd refuses the controller's write: `Deposed`): each of the three answers
    503 with Retry-After and why, never a 500; and the store holds nothing of it."""

    async def body(controller: Controller, agents: FakeAgents):
        iid = await controller.place(MODEL, 1, nodes=["node-2"])
        await until(controller, lambda s: instance(s, iid)["generation"] == 1)
        agents.state.deposed = True
        stored = await agents.state.load()
        transport = httpx.ASGITransport(app=create_app(controller))
        answers = {}
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            answers["place"] = await client.post("/instances", json={"model": MODEL, "ranks": 1})
            answers["park"] = await client.post(f"/instances/{iid}/park")
            answers["delete"] = await client.delete(f"/instances/{iid}")
        return answers, stored, await agents.state.load()

    (answers, stored, after), _, _ = in_cluster(tmp_path, body)
    for what, answer in answers.items():
        assert answer.status_code == 503, (what, answer.text)
        assert answer.headers["retry-after"] == "1", what
        error = answer.json()["error"]
        assert error["code"] == "controller_unavailable", (what, error)
        assert "no longer the controller" in error["message"] and "nothing was stored" in error["message"], what
    assert after == stored  # nothing of the three reached the store
    cluster_fault(
        "placement, park or delete meeting a deposition",
        "; ".join(f"{what}: {a.status_code} Retry-After {a.headers['retry-after']}" for what, a in answers.items())
        + f" ({answers['park'].json()['error']['message'][:80]}…); the store unchanged",
    )
