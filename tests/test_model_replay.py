"""The model tied to the code: each shortest counterexample `fsm.fencing` finds with a mechanism switched off is
replayed against the daemon's real classes — `Presence` renewing a lease, `exod.cluster.election.campaign`,
`Membership._until_deposed` ending a term (by etcd, or by the node's own clock), `Fleet.earlier_gone`, the
`Agent` claiming, spawning, fencing and refusing — on an in-memory etcd with leases and trio's MockClock, with
fake runner processes that end themselves at their deadline as the real watchdog does.

Safety (ONE_PATH, CLOCK, TERM, DEADLINE, STREAM; CLOCK and TERM have no counterexample alone, so each is
replayed with the mechanisms whose removal the checker needs beside it): with the same mechanisms switched
off in the real code too (monkeypatched, the removal the model makes), the replay must follow the model step
by step (the runner processes alive on each node are the model's after every step) and reach its violation,
counted as the model counts it (two generations, or two processes of a rank, alive at once); with the real
code intact, the same trace must part from the model somewhere — a step refused, or a process the model says
is alive already gone — and never reach the violation. A model step with no counterpart in the code fails the
test, naming the step: a model that drifts from the code is noticed. A step-down is the code's own: the trace's
"steps down" only checks that `Membership._until_deposed` has returned by then.

Liveness (TOMBSTONE, RESUME): the checker's shortest traces take a minute to find, so they are stored
(`tests/fencing_traces/`); a test checks each is still a counterexample of the current model (no search), and
the replay continues past its heal the way the model does: with the mechanism off the real objects end stuck
where the model is (never Ready), intact they reach Ready.

The time scale: one model tick is one second, the lease's TTL three (the model's); renewals fall on every
tick (every TTL/6), so a fault the trace puts between ticks comes just after a renewal, as in the model. The
code's `FENCE_MARGIN` is set to one tick of the TTL, so that a node's authority ends one tick before its lease
may expire, as the model's does (the margin is a parameter; the mechanisms are the code's): a controller cut
off or paused steps down by its clock at the tick the model's does. Processes are compared after every step
but a tick."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from daemon_harness import config
from exod.cluster import agent as agent_module
from exod.cluster import election
from exod.cluster import nodes as nodes_module
from exod.cluster.agent import Agent, Refused, SpawnRequest
from exod.cluster.election import Deposed, Term, guarded_write
from exod.cluster.etcd import Compare, EtcdUnavailable, Event, KeyValue, LeaseExpired, Put, TxnResult, version_is
from exod.cluster.membership import ClusterConfig, Membership
from exod.cluster.nodes import NodeRecord, Presence, live_runners
from exod.cluster.remote import Fleet
from exod.host.supervisor import Listener, RunnerSpec, Timeouts
from exod.state.sqlite import Store
from fsm.fencing import LIVENESS, MECHANISMS, SAFETY, Fault, FencingConfig, Mechanism, _Model, check_fencing

PREFIX = b"/exod/"
TTL = 3  # seconds: the model's ticks
INSTANCE = "i"


# -- an etcd in memory, its leases on the trio clock -----------------------------------------------------------


class MemEtcd:
    """One etcd for the cluster: keys with their revisions and leases; a lease expires by the (mock) clock."""

    def __init__(self) -> None:
        self.revision = 1
        self.kvs: dict[bytes, KeyValue] = {}
        self.leases: dict[int, float] = {}  # lease → when it expires (trio time)
        self.next_lease = 100

    def expire(self) -> None:
        now = trio.current_time()
        for lease in [lease for lease, at in self.leases.items() if at <= now]:
            del self.leases[lease]
            gone = [k for k, kv in self.kvs.items() if kv.lease == lease]
            for key in gone:
                del self.kvs[key]
            self.revision += bool(gone)

    def put(self, key: bytes, value: bytes, lease: int) -> None:
        if lease and lease not in self.leases:
            raise LeaseExpired(f"lease {lease} not found")
        self.revision += 1
        old = self.kvs.get(key)
        create, version = (old.create_revision, old.version + 1) if old else (self.revision, 1)
        self.kvs[key] = KeyValue(key, value, create, self.revision, version, lease)

    def compare(self, c: Compare) -> bool:
        keys = [k for k in self.kvs if c.key <= k < c.range_end] if c.range_end else [c.key]
        field = {"VALUE": "value", "VERSION": "version", "CREATE": "create_revision", "MOD": "mod_revision"}
        for key in keys:
            kv = self.kvs.get(key)
            have = getattr(kv, field[c.target]) if kv is not None else (b"" if c.target == "VALUE" else 0)
            if c.target == "VALUE" and kv is None:
                return False
            ok = {"EQUAL": have == c.value, "NOT_EQUAL": have != c.value}.get(c.result)
            if ok is None:
                ok = have < c.value if c.result == "LESS" else have > c.value
            if not ok:
                return False
        return True


class NodeEtcd:
    """A node's client of `MemEtcd`: it answers while the node reaches etcd, and a paused daemon asks nothing
    (its calls wait until it continues)."""

    timeout = 1.0

    def __init__(self, mem: MemEtcd, node: Node) -> None:
        self.mem, self.node = mem, node

    async def _gate(self) -> None:
        while self.node.paused:
            await self.node.continued.wait()
        if self.node.off_etcd:
            raise EtcdUnavailable(f"n{self.node.index} is cut from etcd (the trace says so)")
        self.mem.expire()

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        await self._gate()
        self.mem.put(key, value, lease)
        return self.mem.revision

    async def get(self, key: bytes) -> KeyValue | None:
        await self._gate()
        return self.mem.kvs.get(key)

    async def read(self, key: bytes) -> tuple[KeyValue | None, int]:
        await self._gate()
        return self.mem.kvs.get(key), self.mem.revision

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        await self._gate()
        return sorted((kv for k, kv in self.mem.kvs.items() if k.startswith(prefix)), key=lambda kv: kv.key), (
            self.mem.revision
        )

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        await self._gate()
        gone = [k for k in self.mem.kvs if (k.startswith(key) if prefix else k == key)]
        for k in gone:
            del self.mem.kvs[k]
        self.mem.revision += bool(gone)
        return len(gone)

    async def txn(self, compare: list[Compare], success: list, failure: list = ()) -> TxnResult:
        await self._gate()
        ok = all(self.mem.compare(c) for c in compare)
        for op in success if ok else failure:
            assert isinstance(op, Put), op
            self.mem.put(op.key, op.value, op.lease)
        return TxnResult(ok, self.mem.revision)

    async def grant(self, ttl: int) -> int:
        await self._gate()
        self.mem.next_lease += 1
        self.mem.leases[self.mem.next_lease] = trio.current_time() + ttl
        return self.mem.next_lease

    async def keep_alive(self, lease: int, *, timeout: float | None = None) -> int:
        await self._gate()
        if lease not in self.mem.leases:
            raise LeaseExpired(f"lease {lease} expired")
        self.mem.leases[lease] = trio.current_time() + TTL
        return TTL

    async def time_to_live(self, lease: int) -> tuple[int, int]:
        await self._gate()
        at = self.mem.leases.get(lease)
        return (-1, TTL) if at is None else (math.ceil(at - trio.current_time()), TTL)

    async def revoke(self, lease: int) -> None:
        await self._gate()

    async def watch(self, prefix: bytes, *, start_revision: int = 0):  # pragma: no cover - never awaited here
        await trio.sleep_forever()
        yield Event(True, KeyValue(prefix, b"", 0, 0, 0))


# -- runners: fake processes that end themselves at their deadline, as `exod.runner.watchdog` does ---------------


class Runner:
    def __init__(self, node: int, spec: RunnerSpec, *, deadline: bool) -> None:
        self.node, self.gen, self.rank, self.direct = node, spec.incarnation, spec.rank, False
        self.spec, self.honours_deadline = spec, deadline
        self.deadline = math.inf
        self.alive = True
        self._stop = trio.Event()

    def extend(self, until: float) -> None:
        if self.honours_deadline:
            self.deadline = max(self.deadline, until) if self.deadline != math.inf else until

    def post(self, command: object) -> None:
        pass

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        try:
            while not self._stop.is_set() and trio.current_time() < self.deadline:
                with trio.move_on_at(self.deadline):
                    await self._stop.wait()
        finally:
            self.alive = False


class Direct:
    """A runner its controller spawned itself (`ONE_PATH` off): no key, no deadline; its step-down ends it."""

    def __init__(self, node: int, gen: int, rank: int) -> None:
        self.node, self.gen, self.rank, self.direct, self.alive = node, gen, rank, True, True


# -- the nodes, and the translation of the model's events into calls on them -------------------------------------


@attrs.define(eq=False)
class Node:
    index: int
    paused: bool = False
    off_etcd: bool = False
    cut: bool = False  # from every other node too
    continued: trio.Event = attrs.Factory(trio.Event)
    membership: Membership | None = None
    presence: Presence | None = None
    agent: Agent | None = None
    term: Term | None = None  # as the controller
    running: int = 0  # the generation it runs as the controller
    placed: list[int] = attrs.Factory(list)  # the nodes of the generation it runs
    links: dict[int, tuple[object, int]] = attrs.Factory(dict)  # agent → (its report stream, the stream's number)
    deferred: list = attrs.Factory(list)  # what its paused daemon would have done

    async def running_again(self) -> None:
        """A paused daemon does nothing until it continues: what it would do waits here."""
        while self.paused:
            await self.continued.wait()


class Refusal(Exception):
    """The real code refused a step of the trace."""


class Cluster:
    def __init__(self, mem: MemEtcd, off: frozenset[Mechanism], tmp_path, nursery: trio.Nursery) -> None:
        self.mem, self.off, self.tmp_path, self.nursery = mem, off, tmp_path, nursery
        self.nodes: list[Node] = []
        self.runners: list[Runner | Direct] = []
        self.in_flight: list[tuple[int, int, int, int, SpawnRequest]] = []  # (src, dst, gen, term, request)
        self.stops: list[tuple[int, int, int, int, str]] = []  # stops in flight: (src, dst, gen, term, runner id)
        self.step_downs: list[tuple[int, float]] = []  # (node, when): each controller's term ending, in order
        self.allocated = 0

    async def add_node(self, index: int, store: Store) -> None:
        node = Node(index)
        etcd = NodeEtcd(self.mem, node)
        record = NodeRecord(f"n{index}", f"127.0.0.{index + 1}", f"http://127.0.0.{index + 1}:1", 1 << 30, 1 << 30)
        cluster = ClusterConfig("http://etcd", record.node_id, record.address, lease_ttl=TTL, prefix=PREFIX.decode())
        node.membership = Membership(etcd, cluster, record)  # its `_until_deposed` ends each term it wins
        node.presence = node.membership.presence
        await self.nursery.start(node.presence.run)

        def spawn(spec: RunnerSpec, listener: Listener, timeouts: Timeouts) -> Runner:
            runner = Runner(index, spec, deadline=Mechanism.DEADLINE not in self.off)
            self.runners.append(runner)
            return runner

        (self.tmp_path / f"n{index}").mkdir()
        node.agent = Agent(
            config(self.tmp_path / f"n{index}", self.tmp_path / "hf"), store, record.address, spawn=spawn
        )
        if Mechanism.TOMBSTONE in self.off:  # a stop that finds no runner is forgotten: its spawn runs after it
            node.agent._stopped = _Forgetful()
        ending = node.agent._end_session

        def end_session(why: str, *, kill: bool = False) -> None:  # a paused daemon ends nothing until it continues
            if node.paused:
                node.deferred.append(lambda: ending(why, kill=kill))
            else:
                ending(why, kill=kill)

        node.agent._end_session = end_session  # type: ignore[method-assign]
        await self.nursery.start(node.agent.run, node.presence)
        self.nodes.append(node)

    def alive(self) -> set[tuple[int, int, int]]:
        return {(r.node, r.gen, r.rank) for r in self.runners if r.alive}

    async def settle(self) -> None:
        await trio.testing.wait_all_tasks_blocked()

    async def tick(self, clock: trio.testing.MockClock) -> None:
        end = round(trio.current_time()) + 1  # whole seconds: no rounding error piles up over the ticks
        for i in range(1, 21):
            clock.jump(end - 1 + i / 20 - trio.current_time())
            await self.settle()

    async def step(self, event: str, clock: trio.testing.MockClock) -> None:
        """One event of the model's trace, as calls on the real objects; `Refusal` where the code refuses it."""
        if event == "tick":
            return await self.tick(clock)
        if m := re.fullmatch(r"n(\d+) elected \(term (\d+)\)|n(\d+) finds its term (\d+) alive", event):
            return await self.elected(self.nodes[int(m[1] or m[3])])
        if m := re.fullmatch(r"n(\d+) starts g(\d+) on (.+)", event):
            return await self.start(self.nodes[int(m[1])], int(m[2]), [int(n) for n in re.findall(r"\d+", m[3])])
        if m := re.fullmatch(r"n(\d+) abandons g(\d+) \(a rank failed\)", event):
            return await self.abandon(self.nodes[int(m[1])], int(m[2]))
        if m := re.fullmatch(r"deliver spawn g(\d+) \(term (\d+)\) n(\d+)→n(\d+)", event):
            return await self.deliver(int(m[1]), int(m[3]), int(m[4]))
        if m := re.fullmatch(r"deliver stop g(\d+) \(term (\d+)\) n(\d+)→n(\d+)", event):
            return await self.deliver_stop(int(m[1]), int(m[3]), int(m[4]))
        if m := re.fullmatch(r"n(\d+) steps down", event):
            return await self.stepped_down(self.nodes[int(m[1])])
        if m := re.fullmatch(r"n(\d+)'s daemon paused", event):
            self.nodes[int(m[1])].paused = True
            return None
        if m := re.fullmatch(r"n(\d+) continues", event):
            node = self.nodes[int(m[1])]
            node.paused, continued, node.continued = False, node.continued, trio.Event()
            continued.set()
            for later in node.deferred:
                later()
            node.deferred.clear()
            return await self.settle()
        if m := re.fullmatch(r"n(\d+) cut off|n(\d+) cut from etcd", event):
            node = self.nodes[int(m[1] or m[2])]
            node.off_etcd, node.cut = True, node.cut or m[1] is not None
            crossing = [n for n in self.nodes if n is not node and (node.index in n.links or n.index in node.links)]
            assert not (node.cut and crossing), f"{event!r}: a report stream crosses the cut (not translated yet)"
            return await self.settle()
        if m := re.fullmatch(r"n(\d+) reaches etcd again", event):
            self.nodes[int(m[1])].off_etcd = False
            return await self.settle()
        raise AssertionError(f"the model's step {event!r} has no counterpart in the replay: the model drifted")

    async def elected(self, node: Node) -> None:
        """`Membership.run`: a node campaigns only once it has authority (`Presence.authority_held`), then
        `campaign` — which also gives a node its own live term back (RESUME); `Membership._until_deposed`
        then ends the term, by the node's clock or by etcd."""
        assert node.presence is not None and not node.paused
        with trio.CancelScope() as waiting:
            self.nursery.start_soon(_cancel_when_blocked, waiting)
            await node.presence.authority_held()
        if waiting.cancelled_caught:
            raise Refusal(f"n{node.index} has no authority (Presence.authority_held): it does not campaign")
        term = await election.campaign(node.presence.etcd, PREFIX, f"n{node.index}", node.presence.lease)
        if term is None:
            raise Refusal(f"n{node.index} campaigned and etcd elected another (or holds its own key: no RESUME)")
        await self.take(node, term)

    async def take(self, node: Node, term: Term) -> None:
        """The node is the controller of ``term``, until `_serve` says otherwise."""
        node.term, node.links = term, {}
        self.nursery.start_soon(self._serve, node, term)
        await self.settle()

    def ready(self) -> bool:
        """The model's Ready: a controller of the term etcd holds runs a generation whose every rank is alive."""
        holder = self.mem.kvs.get(election.election_key(PREFIX))
        for node in self.nodes:
            if node.term is not None and holder is not None and holder.create_revision == node.term.revision:
                ranks = {rank for n, gen, rank in self.alive() if gen == node.running}
                return bool(node.running) and ranks == set(range(len(node.placed)))
        return False

    async def _serve(self, node: Node, term: Term) -> None:
        """The controller's nursery, for as long as `Membership._until_deposed` says its term lasts."""
        assert node.membership is not None
        await node.membership._until_deposed(term)
        await node.running_again()  # a paused daemon's clock ran out meanwhile: it steps down once it continues
        if node.term is term:
            await self.step_down(node)

    async def start(self, node: Node, gen: int, placed: list[int]) -> None:
        """The controller's guarded write allocates the generation; each rank waits for `Fleet.earlier_gone`,
        then is spawned through its node's agent — or, `ONE_PATH` off, by the controller itself."""
        assert node.term is not None and node.presence is not None
        etcd = node.presence.etcd
        try:
            await guarded_write(etcd, node.term, [Put(PREFIX + b"generations/" + INSTANCE.encode(), str(gen).encode())])
        except Deposed as exc:
            raise Refusal(str(exc)) from exc
        fleet = Fleet(f"n{node.index}", lambda: _no_records(), lambda: live_runners(etcd, PREFIX), "", lambda: None)
        with trio.CancelScope() as waiting:
            self.nursery.start_soon(_cancel_when_blocked, waiting)
            await fleet.earlier_gone(INSTANCE, gen)
        if waiting.cancelled_caught:
            raise Refusal(f"generation {gen} waits for an earlier generation's runner key (Fleet.earlier_gone)")
        self.allocated, node.running, node.placed = gen, gen, placed
        ring = [f"127.0.0.{n + 1}:{7000 + rank}" for rank, n in enumerate(placed)] if len(placed) > 1 else []
        for rank, dst in enumerate(placed):
            if dst == node.index and Mechanism.ONE_PATH in self.off:
                self.runners.append(Direct(dst, gen, rank))
                continue
            if dst not in node.links:  # `Fleet.link`: the stream opened first, its hello names it
                node.links[dst] = await self.link(node.term, dst)
            request = SpawnRequest(
                instance_id=INSTANCE,
                runner_id=f"{INSTANCE}/{rank}",
                incarnation=gen,
                rank=rank,
                world_size=len(placed),
                ring=ring,
                stream=node.links[dst][1],
            )
            self.in_flight.append((node.index, dst, gen, node.term.revision, request))

    async def link(self, term: Term, dst: int) -> tuple[object, int]:
        """`Fleet.link`: a report stream of ``term`` opened on ``dst``'s agent; the number its hello says."""
        agent = self.nodes[dst].agent
        assert agent is not None
        stream = await agent.connect(term.revision)
        hello = await stream.__anext__()  # type: ignore[attr-defined]
        return stream, int(re.search(rb'"stream": (\d+)', hello)[1])

    async def abandon(self, node: Node, gen: int) -> None:
        """A rank failed: the controller stops the generation's ranks (each a request of its own, which may be
        overtaken or overtake) and forgets it; the ranks it spawned itself die at once."""
        assert node.term is not None and node.running == gen
        for rank, dst in enumerate(node.placed):
            if dst == node.index and Mechanism.ONE_PATH in self.off:
                for runner in self.runners:
                    if isinstance(runner, Direct) and (runner.node, runner.gen) == (dst, gen):
                        runner.alive = False
            else:
                self.stops.append((node.index, dst, gen, node.term.revision, f"{INSTANCE}/{rank}"))
        node.running, node.placed = 0, []

    async def deliver(self, gen: int, src: int, dst: int) -> None:
        """The spawn reaches its agent. The model's agent takes on a controller's stream with the first spawn
        it obeys from it; here the controller opened it at the start (`Fleet.link`), and opens it again if it
        is over by now (the stream broke, or its term ended): the agent may refuse that too."""
        [sent] = [f for f in self.in_flight if f[:3] == (src, dst, gen)]
        self.in_flight.remove(sent)
        agent = self.nodes[dst].agent
        assert agent is not None
        if agent._stream is None:
            try:
                await agent.connect(sent[3])
            except Refused as exc:
                why = f"{exc.status}: {exc.detail}"
                raise Refusal(f"the agent of n{dst} refused the report stream of the spawn's term ({why})") from exc
        try:
            await agent.spawn(sent[3], sent[4])
        except Refused as exc:
            raise Refusal(f"the agent of n{dst} refused the spawn of g{gen} ({exc.status}: {exc.detail})") from exc
        await self.settle()

    async def deliver_stop(self, gen: int, src: int, dst: int) -> None:
        """`Agent.stop` (the model stops every node; the code, the ranks placed: a stop to another is none)."""
        for sent in [f for f in self.stops if f[:3] == (src, dst, gen)]:
            self.stops.remove(sent)
            agent = self.nodes[dst].agent
            assert agent is not None
            try:
                agent.stop(sent[3], sent[4], gen)
            except Refused as exc:
                raise Refusal(f"the agent of n{dst} refused the stop of g{gen} ({exc.status}: {exc.detail})") from exc
        await self.settle()

    async def stepped_down(self, node: Node) -> None:
        """The model's step-down: the real controller's term must have ended by now, by itself (`_serve`)."""
        await self.settle()
        if node.term is not None:
            raise Refusal(f"n{node.index} is still the controller: `Membership._until_deposed` has not returned")

    async def step_down(self, node: Node) -> None:
        """`Membership._until_deposed` returned: the controller's nursery (its links, its own runners) ends."""
        self.step_downs.append((node.index, trio.current_time()))
        for stream, _ in node.links.values():
            await stream.aclose()  # type: ignore[attr-defined]
        node.term, node.running, node.placed, node.links = None, 0, [], {}
        for runner in self.runners:
            if isinstance(runner, Direct) and runner.node == node.index:
                runner.alive = False
        await self.settle()


class _Forgetful(set):
    """`Agent._stopped` with the tombstone switched off: a stop that finds no runner is not remembered."""

    def add(self, item: object) -> None:
        pass


async def _no_records() -> list[NodeRecord]:
    return []


async def _cancel_when_blocked(scope: trio.CancelScope) -> None:
    """A wait that does not end before everything blocks would wait for time to pass: the step is refused."""
    await trio.testing.wait_all_tasks_blocked()
    scope.cancel()


# -- the mechanisms switched off in the real code: the same removal the model makes -----------------------------


def switch_off(off: frozenset[Mechanism], patch: pytest.MonkeyPatch, *, generation_rule: bool = True) -> None:
    """``generation_rule``: False also switches off the agent's check of the runner keys at its claim
    (`Agent._check_generation`), a second guard the model does not have (see the STREAM test)."""
    if not generation_rule:
        patch.setattr(Agent, "_check_generation", lambda self, request, alive: None)
    if Mechanism.STREAM in off:  # any stream of its controller's term will do: the one open
        check = Agent._check_spawn
        patch.setattr(Agent, "_check_spawn", lambda self, key, stream: check(self, key, self._session))
    if Mechanism.CLOCK in off:  # a term ends only by etcd; a node campaigns without authority
        patch.setattr(Presence, "authority_lost", _forever)
        patch.setattr(Presence, "authority_held", _at_once)
    if Mechanism.TERM in off:  # any term's stream and commands obeyed; the claim compares no term; none followed
        patch.setattr(Agent, "_check_term", lambda self, term: None)
        patch.setattr(Agent, "_check_not_over", lambda self, term: None)
        patch.setattr(Agent, "_check_current", lambda self, term: _at_once())
        patch.setattr(Agent, "_follow_term", lambda self, presence: _forever())
        patch.setattr(agent_module, "Compare", _no_term_compare)
    if Mechanism.RESUME in off:  # a campaign wins only a key it creates: its own key, alive, is another's
        patch.setattr(election, "campaign", _campaign_without_resume)
    # ONE_PATH: `Cluster.start` spawns the controller's own ranks itself (the controller's code path);
    # DEADLINE: the runners honour no deadline (`Runner`), what `exod.runner.watchdog` gives them;
    # TOMBSTONE: `Agent._stopped` forgets (`_Forgetful`).


async def _forever(*args: object) -> None:
    await trio.sleep_forever()


async def _at_once(*args: object) -> None:
    pass


def _no_term_compare(key: bytes, target: str, result: str, value: object) -> Compare:
    """The claim's comparison of the election key with the spawn's term, made one that always holds."""
    if key == election.election_key(PREFIX):
        return Compare(key, "CREATE", "GREATER", -1)
    return Compare(key, target, result, value)  # type: ignore[arg-type]


async def _campaign_without_resume(etcd, prefix: bytes, node_id: str, lease: int) -> Term | None:
    """`election.campaign` less what takes a live key of this node's lease back."""
    key = election.election_key(prefix)
    if not (await etcd.txn([version_is(key, 0)], [Put(key, node_id.encode(), lease)])).succeeded:
        return None
    holder = await etcd.get(key)
    return Term(key, node_id, holder.create_revision)


@attrs.frozen
class Replay:
    steps: int
    refused_at: int | None  # 1-based; None: every step went through
    refusal: str
    diverged_at: int | None  # the first step after which the processes alive were not the model's
    violated_at: int | None  # the first step after which the real processes broke the invariant
    seen: str
    step_downs: tuple[tuple[int, int, float], ...] = ()  # (node, the step during which, when): terms ended
    then: object = None  # what the ``then`` continuation returned


def violated(alive: set[tuple[int, int, int]]) -> bool:
    """The model's invariant, counted on the real processes: two generations, or two processes of a rank."""
    ranks = [rank for _, _, rank in alive]
    return len({gen for _, gen, _ in alive}) > 1 or len(set(ranks)) < len(ranks)


def model_walk(fencing: FencingConfig, trace: tuple[str, ...] | list[str], state=None) -> list:
    """The model's states after each event of ``trace`` (each must be one of its steps), from ``state`` or
    the start."""
    model = _Model(fencing)
    state, states = state or model.initial(), []
    for event in trace:
        steps = dict(model.successors(state))
        assert event in steps, f"{event!r} is not a step of the model here: it takes {sorted(steps)}"
        state = steps[event]
        states.append(state)
    return states


def model_states(fencing: FencingConfig, trace: tuple[str, ...]) -> list[set[tuple[int, int, int]]]:
    """The processes alive in the model after each event of ``trace``: (node, generation, rank)."""
    return [
        {(n, p.gen, p.rank) for n, procs in enumerate(state.procs) for p in procs}
        for state in model_walk(fencing, trace)
    ]


def replay(
    tmp_path,
    fencing: FencingConfig,
    trace: tuple[str, ...],
    off: frozenset[Mechanism],
    *,
    generation_rule: bool = True,
    then: Callable[[Cluster, trio.testing.MockClock], Awaitable[object]] | None = None,
) -> Replay:
    """``then``: what to do once the trace is through (unless refused), its result kept in `Replay.then`.

    The code's `FENCE_MARGIN` is one tick of the TTL here, the model's: a node's authority ends one tick
    before its lease may expire, by its clock, as in the model, so the real `Membership._until_deposed` ends
    a term at the tick the model does."""
    expected = model_states(fencing, trace)
    outcome: dict[str, object] = {"refused_at": None, "refusal": "", "diverged_at": None, "violated_at": None}
    outcome["seen"] = ""

    async def main() -> None:
        clock = trio.lowlevel.current_clock()
        mem = MemEtcd()
        store = Store.open(tmp_path / "store.sqlite")
        step = 0
        async with trio.open_nursery() as nursery:
            cluster = Cluster(mem, off, tmp_path, nursery)
            for index in range(fencing.nodes):
                await cluster.add_node(index, store)
            await cluster.settle()
            downs = 0
            for step, event in enumerate(trace, 1):
                try:
                    await cluster.step(event, clock)
                except Refusal as exc:
                    outcome["refused_at"], outcome["refusal"] = step, f"step {step} ({event}): {exc}"
                    break
                finally:
                    outcome["step_downs"] = (
                        *outcome.get("step_downs", ()),
                        *[(n, step, at) for n, at in cluster.step_downs[downs:]],
                    )
                    downs = len(cluster.step_downs)
                alive = cluster.alive()
                if event != "tick" and alive != expected[step - 1] and outcome["diverged_at"] is None:
                    outcome["diverged_at"] = step
                if violated(alive) and outcome["violated_at"] is None:
                    outcome["violated_at"] = step
                outcome["seen"] = ", ".join(f"g{g} rank {r} on n{n}" for n, g, r in sorted(alive))
            else:
                if then is not None:
                    outcome["then"] = await then(cluster, clock)
            for node in cluster.nodes:  # let the paused go, so that everything ends
                node.paused = False
                node.continued.set()
            nursery.cancel_scope.cancel()
        store.close()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(agent_module, "_new_stream", lambda previous: previous + 1)
        patch.setattr(nodes_module, "FENCE_MARGIN", 1 / TTL)
        switch_off(off, patch, generation_rule=generation_rule)
        trio.run(main, clock=trio.testing.MockClock())
    return Replay(len(trace), **outcome)  # type: ignore[arg-type]


# -- the tests -------------------------------------------------------------------------------------------------

FENCING = FencingConfig()  # CI's exhaustive configuration: 3 nodes, 1 rank, one fault, 2 generations


@pytest.mark.parametrize("mechanism", [Mechanism.ONE_PATH, Mechanism.DEADLINE], ids=lambda m: m.name.lower())
def test_the_models_counterexample_breaks_the_real_code_with_the_mechanism_off_and_not_with_it_on(tmp_path, mechanism):
    config_off = attrs.evolve(FENCING, mechanisms=MECHANISMS - {mechanism})
    result = check_fencing(config_off)
    assert not result.ok and result.violation.invariant == SAFETY, result.report()
    trace = result.violation.trace
    broken = replay(tmp_path / "off", config_off, trace, frozenset({mechanism}))
    assert broken.refused_at is None, f"the code refused a step the model takes: {broken.refusal}"
    assert broken.diverged_at is None, f"the code parted from the model at step {broken.diverged_at}: {trace}"
    assert broken.violated_at == len(trace), broken
    intact = replay(tmp_path / "on", config_off, trace, frozenset())
    assert intact.violated_at is None, intact
    assert intact.refused_at is not None or intact.diverged_at is not None, intact


def test_a_spawn_from_before_its_controller_took_its_term_back_is_refused_by_its_stream_and_by_the_claim(tmp_path):
    """STREAM's counterexample: the controller paused, stepped down by its clock, took its live term back and
    started g2, and then its g1 spawn, sent before, arrives. The real agent refuses it for its stream (step 11).
    With the stream check off, the code still refuses the step after, g2's spawn, for g1's runner key: the
    agent's generation rule at the claim (`Agent._check_generation`), a guard the model does not have. Both
    off, the replay follows the model to its violation."""
    config_off = attrs.evolve(FENCING, mechanisms=MECHANISMS - {Mechanism.STREAM})
    result = check_fencing(config_off)
    trace = result.violation.trace
    assert not result.ok and any("finds its term 1 alive" in event for event in trace), result.report()
    both_off = replay(tmp_path / "both", config_off, trace, frozenset({Mechanism.STREAM}), generation_rule=False)
    assert both_off.refused_at is None and both_off.diverged_at is None, both_off
    assert both_off.violated_at == len(trace), both_off
    stream_off = replay(tmp_path / "off", config_off, trace, frozenset({Mechanism.STREAM}))
    assert stream_off.refused_at == len(trace) and "earlier generation" in stream_off.refusal, stream_off
    intact = replay(tmp_path / "on", config_off, trace, frozenset())
    assert intact.refused_at == len(trace) - 1 and "deliver spawn g1" in intact.refusal, intact
    assert intact.violated_at is None and stream_off.violated_at is None


def test_a_controller_cut_off_with_ranks_it_spawned_itself_steps_down_by_its_clock(tmp_path):
    """CLOCK's counterexample (alone it has none: with one path, the keys fence; so ONE_PATH is off too, and the
    fault a cut): the controller, cut off, runs g1 itself with no key; its lease expires and n1 starts g2.
    With the clock on in the code, `Membership._until_deposed` ends n0's term by n0's own clock — at the
    second tick, still cut off, nothing read from etcd — and its g1 dies with its nursery before n1 can be
    elected; with it off, g1 runs on beside g2."""
    config_off = attrs.evolve(
        FENCING, faults=frozenset({Fault.CUT}), mechanisms=MECHANISMS - {Mechanism.ONE_PATH, Mechanism.CLOCK}
    )
    result = check_fencing(config_off)
    assert not result.ok and result.violation.invariant == SAFETY, result.report()
    trace = result.violation.trace
    cut, elected = trace.index("n0 cut off") + 1, trace.index("n1 elected (term 2)") + 1
    both_off = replay(tmp_path / "off", config_off, trace, frozenset({Mechanism.ONE_PATH, Mechanism.CLOCK}))
    assert both_off.refused_at is None and both_off.diverged_at is None, both_off
    assert both_off.violated_at == len(trace) and both_off.step_downs == (), both_off
    clock_on = replay(tmp_path / "on", config_off, trace, frozenset({Mechanism.ONE_PATH}))
    assert clock_on.refused_at is None and clock_on.violated_at is None, clock_on
    [(node, during, at)] = clock_on.step_downs  # by the clock: two ticks of authority after the cut, no more
    assert node == 0 and trace[cut:during] == ("tick", "tick") and at == pytest.approx(2.0), clock_on
    assert clock_on.diverged_at == elected, clock_on  # g1, which the model still runs there, is gone
    intact = replay(tmp_path / "intact", config_off, trace, frozenset())  # g1 through n0's agent: never delivered
    assert intact.violated_at is None and intact.diverged_at == cut - 1 and intact.step_downs[0][1] == cut + 2


def test_a_spawn_of_a_deposed_term_is_refused_by_the_term_and_by_its_stream(tmp_path, caplog):
    """TERM's counterexample. Alone it has none (a deposed term's spawn names a stream that is over, which
    STREAM refuses); with TERM and STREAM off, the shortest is STREAM's own (a spawn from before its
    controller took its term back: term 1 is etcd's throughout, TERM has nothing to refuse), so RESUME is
    off in the model too, which leaves the deposed term's: n0 paused past its lease, n1 elected (term 2) runs
    g2, and n0's g1 spawn, sent before, arrives once n0 continued and stepped down. The real agent of n0 takes
    the controller's stream up again for it (the model's agent does with the spawn itself), and with TERM on
    refuses that stream (`Agent._check_current`: etcd holds term 2); with only the stream check on, it takes
    the stream and refuses the spawn (it names the stream that ended); with both off, only the agent's
    generation rule at the claim is left (g2's key), and with that off too, g1 runs beside g2."""
    config_off = attrs.evolve(FENCING, mechanisms=MECHANISMS - {Mechanism.TERM, Mechanism.STREAM, Mechanism.RESUME})
    result = check_fencing(config_off)
    assert not result.ok and result.violation.invariant == SAFETY, result.report()
    trace = result.violation.trace
    assert trace[-1] == "deliver spawn g1 (term 1) n0→n0" and "n1 elected (term 2)" in trace, result.report()
    term_and_stream = frozenset({Mechanism.TERM, Mechanism.STREAM})
    all_off = replay(tmp_path / "all", config_off, trace, term_and_stream, generation_rule=False)
    assert all_off.refused_at is None and all_off.diverged_at is None, all_off
    assert all_off.violated_at == len(trace), all_off
    assert [(n, trace[during - 1]) for n, during, _ in all_off.step_downs] == [(0, "n0 continues")], all_off
    claim = replay(tmp_path / "claim", config_off, trace, term_and_stream)
    assert claim.refused_at == len(trace) and "stale or runs already" in claim.refusal, claim
    caplog.clear()
    term_on = replay(tmp_path / "term", config_off, trace, frozenset({Mechanism.STREAM}), generation_rule=False)
    assert "refused a report stream of term" in caplog.text and "etcd has term" in caplog.text  # _check_current
    assert term_on.refused_at == len(trace) and "refused the report stream" in term_on.refusal, term_on
    stream_on = replay(tmp_path / "stream", config_off, trace, frozenset({Mechanism.TERM}), generation_rule=False)
    assert stream_on.refused_at == len(trace) and "refused the spawn of g1" in stream_on.refusal, stream_on
    intact = replay(tmp_path / "on", config_off, trace, frozenset())
    assert intact.refused_at == len(trace) and "refused the report stream" in intact.refusal, intact
    assert not any(r.violated_at for r in (claim, term_on, stream_on, intact))


# -- liveness: the stored shortest traces (their search takes a minute), checked against the model, then replayed --

TRACES = Path(__file__).parent / "fencing_traces"


def stored(mechanism: Mechanism) -> tuple[FencingConfig, tuple[str, ...]]:
    """The checker's shortest liveness counterexample with ``mechanism`` off, as `exod check-fencing --without`
    printed it (`tests/fencing_traces/`), and the configuration it holds for."""
    saved = json.loads((TRACES / f"{mechanism.name.lower()}.json").read_text())
    assert saved["mechanism"] == mechanism.name and saved["invariant"] == LIVENESS
    return attrs.evolve(FENCING, mechanisms=MECHANISMS - {mechanism}), tuple(saved["trace"])


@pytest.mark.parametrize("mechanism", [Mechanism.TOMBSTONE, Mechanism.RESUME], ids=lambda m: m.name.lower())
def test_each_stored_liveness_trace_is_still_a_counterexample_of_the_model(mechanism):
    """Without a search: every event is a step of the current model, the last a heal, and from where it ends
    no path leads to Ready with the mechanism off — while with it on, the same events lead where one does.
    Should the model change so that this fails, `exod check-fencing --without <mechanism>` prints the trace to
    store now (about a minute)."""
    config_off, trace = stored(mechanism)
    *_, before, end = model_walk(config_off, trace)
    assert before.paused or before.off_etcd or before.cut, "the trace must end with a heal"
    assert not (end.paused or end.off_etcd or end.cut), "the trace must end with a heal"
    assert not _Model(config_off, recovering=True).recovers(end, {}), f"{mechanism.name} off: Ready again after {trace}"
    config_on = attrs.evolve(config_off, mechanisms=MECHANISMS)
    assert _Model(config_on, recovering=True).recovers(model_walk(config_on, trace)[-1], {})


def test_a_stop_that_overtakes_its_spawn_leaves_no_runner_behind_to_hold_the_next_generation_back(tmp_path):
    """TOMBSTONE's counterexample: g1 is abandoned before its spawn arrived, and the stop overtakes the spawn.
    Then (the model's way on, checked on the model too) the spawn arrives and time passes. With the
    tombstone off in the code, the real agent starts g1 after its stop: a runner no one will stop (its
    controller forgot g1), alive and renewed 2 × TTL later, whose key keeps `Fleet.earlier_gone` from
    letting g2 start — never Ready. Intact, the agent refuses the spawn (the stop came first) and g2 runs."""
    config_off, trace = stored(Mechanism.TOMBSTONE)
    then = ("deliver spawn g1 (term 1) n0→n0", *("tick",) * (2 * TTL), "n0 starts g2 on n0")
    stuck = model_walk(config_off, then[:-1], model_walk(config_off, trace)[-1])[-1]
    assert then[-1] not in dict(_Model(config_off).successors(stuck)), "the model starts g2 after all"

    async def go_on(cluster: Cluster, clock: trio.testing.MockClock) -> dict[str, object]:
        refused = []
        for event in (*then, "deliver spawn g2 (term 1) n0→n0"):
            try:
                await cluster.step(event, clock)
            except Refusal as exc:
                refused.append(f"{event}: {exc}")
                if event == then[-1]:
                    break
        keys = sorted(k.decode() for k in cluster.mem.kvs if b"/runners/" in k)
        return {"refused": refused, "alive": cluster.alive(), "keys": keys, "ready": cluster.ready()}

    off = replay(tmp_path / "off", config_off, trace, frozenset({Mechanism.TOMBSTONE}), then=go_on)
    assert off.refused_at is None and off.diverged_at is None and off.violated_at is None, off
    [refused] = off.then["refused"]  # type: ignore[index]
    assert refused.startswith(then[-1]) and "Fleet.earlier_gone" in refused, off
    assert off.then["alive"] == {(0, 1, 0)} and len(off.then["keys"]) == 1 and not off.then["ready"], off
    intact = replay(tmp_path / "on", config_off, trace, frozenset(), then=go_on)
    assert intact.refused_at is None and intact.diverged_at is None, intact
    [refused] = intact.then["refused"]  # type: ignore[index]
    assert refused.startswith(then[0]) and "stopped before its spawn arrived" in refused, intact
    assert intact.then["alive"] == {(0, 2, 0)} and intact.then["ready"], intact


def test_a_controller_that_stepped_down_by_its_clock_takes_its_live_term_back(tmp_path):
    """RESUME's counterexample: the controller paused two ticks, its authority spent, its lease not. The real
    `Membership._until_deposed` ends its term by its clock once it continues; its key lives on, renewed. Then
    every node campaigns (`wait_for_term`) for 2 × TTL. With RESUME off in the code (`campaign` wins only a
    key it creates), nobody is elected, and the key is still n0's: never Ready. Intact, n0 takes its term
    back at once, and its g1 runs."""
    config_off, trace = stored(Mechanism.RESUME)

    async def campaign_all(cluster: Cluster, clock: trio.testing.MockClock) -> dict[str, object]:
        elected: dict[int, Term] = {}

        async def campaign(node: Node) -> None:
            assert node.presence is not None
            await node.presence.authority_held()
            lease, name = node.presence.lease, f"n{node.index}"
            elected[node.index] = await election.wait_for_term(node.presence.etcd, PREFIX, name, lease, recheck=TTL)

        async with trio.open_nursery() as campaigns:
            for node in cluster.nodes:
                campaigns.start_soon(campaign, node)
            for _ in range(2 * TTL):
                await cluster.tick(clock)
                if elected:
                    break
            campaigns.cancel_scope.cancel()
        holder = cluster.mem.kvs[election.election_key(PREFIX)]
        seen = {"elected": sorted(elected), "holder": holder.value.decode(), "revision": holder.create_revision}
        for index, term in elected.items():
            node = cluster.nodes[index]
            await cluster.take(node, term)
            await cluster.step(f"n{index} starts g1 on n{index}", clock)
            await cluster.step(f"deliver spawn g1 (term 1) n{index}→n{index}", clock)
        return {**seen, "ready": cluster.ready(), "t": trio.current_time()}

    off = replay(tmp_path / "off", config_off, trace, frozenset({Mechanism.RESUME}), then=campaign_all)
    assert off.refused_at is None and off.step_downs == ((0, len(trace), 2.0),), off  # at "n0 continues"
    assert off.then["elected"] == [] and off.then["holder"] == "n0" and not off.then["ready"], off
    assert off.then["t"] == pytest.approx(2.0 + 2 * TTL), off  # the model's window, past the heal
    intact = replay(tmp_path / "on", config_off, trace, frozenset(), then=campaign_all)
    assert intact.refused_at is None and intact.step_downs == ((0, len(trace), 2.0),), intact
    assert intact.then["elected"] == [0] and intact.then["revision"] == off.then["revision"], intact
    assert intact.then["ready"], intact
