"""The model tied to the code: each shortest counterexample `fsm.fencing` finds with a mechanism switched off is
replayed against the daemon's real classes — `Presence` renewing a lease, `exod.cluster.election.campaign`,
`Fleet.earlier_gone`, the `Agent` claiming, spawning, fencing and refusing — on an in-memory etcd with leases
and trio's MockClock, with fake runner processes that end themselves at their deadline as the real watchdog
does.

Twice: with the same mechanism switched off in the real code too (monkeypatched, the removal the model makes),
the replay must follow the model step by step (the runner processes alive on each node are the model's after
every step) and reach its violation, counted as the model counts it (two generations, or two processes of a
rank, alive at once); with the real code intact, the same trace must part from the model somewhere — a step
refused, or a process the model says is alive already gone — and never reach the violation. A model step with
no counterpart in the code fails the test, naming the step: a model that drifts from the code is noticed.

The time scale: one model tick is one second, the lease's TTL three (the model's); renewals fall on every
tick (every TTL/6), so a fault the trace puts between ticks comes just after a renewal, as in the model. The
model's authority is a whole number of ticks, the code's `FENCE_MARGIN` of the TTL short of the lease: after a
tick the two may differ by a fraction of one, so processes are compared after every step but a tick (and by
the next one, they agree)."""

from __future__ import annotations

import math
import re

import attrs
import pytest
import trio
import trio.testing

from daemon_harness import config
from exod.cluster import agent as agent_module
from exod.cluster.agent import Agent, Refused, SpawnRequest
from exod.cluster.election import Deposed, Term, campaign, guarded_write
from exod.cluster.etcd import Compare, EtcdUnavailable, Event, KeyValue, LeaseExpired, Put, TxnResult
from exod.cluster.nodes import NodeRecord, Presence, live_runners
from exod.cluster.remote import Fleet
from exod.host.supervisor import Listener, RunnerSpec, Timeouts
from exod.state.sqlite import Store
from fsm.fencing import MECHANISMS, SAFETY, FencingConfig, Mechanism, _Model, check_fencing

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
    continued: trio.Event = attrs.Factory(trio.Event)
    presence: Presence | None = None
    agent: Agent | None = None
    term: Term | None = None  # as the controller
    running: int = 0  # the generation it runs as the controller
    links: dict[int, tuple[object, int]] = attrs.Factory(dict)  # agent → (its report stream, the stream's number)
    deferred: list = attrs.Factory(list)  # what its paused daemon would have done


class Refusal(Exception):
    """The real code refused a step of the trace."""


class Cluster:
    def __init__(self, mem: MemEtcd, off: frozenset[Mechanism], tmp_path, nursery: trio.Nursery) -> None:
        self.mem, self.off, self.tmp_path, self.nursery = mem, off, tmp_path, nursery
        self.nodes: list[Node] = []
        self.runners: list[Runner | Direct] = []
        self.in_flight: list[tuple[int, int, int, int, SpawnRequest]] = []  # (src, dst, gen, term, request)
        self.allocated = 0

    async def add_node(self, index: int, store: Store) -> None:
        node = Node(index)
        etcd = NodeEtcd(self.mem, node)
        record = NodeRecord(f"n{index}", f"127.0.0.{index + 1}", f"http://127.0.0.{index + 1}:1", 1 << 30, 1 << 30)
        node.presence = Presence(etcd, PREFIX, record, ttl=TTL)
        await self.nursery.start(node.presence.run)

        def spawn(spec: RunnerSpec, listener: Listener, timeouts: Timeouts) -> Runner:
            runner = Runner(index, spec, deadline=Mechanism.DEADLINE not in self.off)
            self.runners.append(runner)
            return runner

        (self.tmp_path / f"n{index}").mkdir()
        node.agent = Agent(
            config(self.tmp_path / f"n{index}", self.tmp_path / "hf"), store, record.address, spawn=spawn
        )
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
        if m := re.fullmatch(r"deliver spawn g(\d+) \(term (\d+)\) n(\d+)→n(\d+)", event):
            return await self.deliver(int(m[1]), int(m[3]), int(m[4]))
        if m := re.fullmatch(r"n(\d+) steps down", event):
            return await self.step_down(self.nodes[int(m[1])])
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
        raise AssertionError(f"the model's step {event!r} has no counterpart in the replay: the model drifted")

    async def elected(self, node: Node) -> None:
        """`Membership.run`: a node campaigns only while it has authority (`Presence.authority_held`), then
        `campaign` — which also gives a node its own live term back (RESUME)."""
        assert node.presence is not None and not node.paused
        if Mechanism.CLOCK not in self.off and trio.current_time() >= node.presence.authority_until:
            raise Refusal(f"n{node.index} has no authority: it does not campaign")
        term = await campaign(node.presence.etcd, PREFIX, f"n{node.index}", node.presence.lease)
        if term is None:
            raise Refusal(f"n{node.index} campaigned and etcd elected another")
        node.term, node.links = term, {}

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
        self.allocated, node.running = gen, gen
        ring = [f"127.0.0.{n + 1}:{7000 + rank}" for rank, n in enumerate(placed)] if len(placed) > 1 else []
        for rank, dst in enumerate(placed):
            if dst == node.index and Mechanism.ONE_PATH in self.off:
                self.runners.append(Direct(dst, gen, rank))
                continue
            agent = self.nodes[dst].agent
            assert agent is not None
            if dst not in node.links:  # `Fleet.link`: the stream opened first, its hello names it
                stream = await agent.connect(node.term.revision)
                hello = await stream.__anext__()
                node.links[dst] = (stream, int(re.search(rb'"stream": (\d+)', hello)[1]))
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

    async def deliver(self, gen: int, src: int, dst: int) -> None:
        [sent] = [f for f in self.in_flight if f[:3] == (src, dst, gen)]
        self.in_flight.remove(sent)
        agent = self.nodes[dst].agent
        assert agent is not None
        try:
            await agent.spawn(sent[3], sent[4])
        except Refused as exc:
            raise Refusal(f"the agent of n{dst} refused the spawn of g{gen} ({exc.status}: {exc.detail})") from exc
        await self.settle()

    async def step_down(self, node: Node) -> None:
        """`Membership._until_deposed` returned: the controller's nursery (its links, its own runners) ends."""
        for stream, _ in node.links.values():
            await stream.aclose()  # type: ignore[attr-defined]
        node.term, node.running, node.links = None, 0, {}
        for runner in self.runners:
            if isinstance(runner, Direct) and runner.node == node.index:
                runner.alive = False
        await self.settle()


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
    # ONE_PATH: `Cluster.start` spawns the controller's own ranks itself (the controller's code path);
    # DEADLINE: the runners honour no deadline (`Runner`), what `exod.runner.watchdog` gives them.


@attrs.frozen
class Replay:
    steps: int
    refused_at: int | None  # 1-based; None: every step went through
    refusal: str
    diverged_at: int | None  # the first step after which the processes alive were not the model's
    violated_at: int | None  # the first step after which the real processes broke the invariant
    seen: str


def violated(alive: set[tuple[int, int, int]]) -> bool:
    """The model's invariant, counted on the real processes: two generations, or two processes of a rank."""
    ranks = [rank for _, _, rank in alive]
    return len({gen for _, gen, _ in alive}) > 1 or len(set(ranks)) < len(ranks)


def model_states(fencing: FencingConfig, trace: tuple[str, ...]) -> list[set[tuple[int, int, int]]]:
    """The processes alive in the model after each event of ``trace``: (node, generation, rank)."""
    model = _Model(fencing)
    state, alive = model.initial(), []
    for event in trace:
        state = next(after for label, after in model.successors(state) if label == event)
        alive.append({(n, p.gen, p.rank) for n, procs in enumerate(state.procs) for p in procs})
    return alive


def replay(
    tmp_path, fencing: FencingConfig, trace: tuple[str, ...], off: frozenset[Mechanism], *, generation_rule: bool = True
) -> Replay:
    expected = model_states(fencing, trace)
    outcome: dict[str, object] = {"refused_at": None, "refusal": "", "diverged_at": None, "violated_at": None}
    outcome["seen"] = ""

    async def main() -> None:
        clock = trio.lowlevel.current_clock()
        mem = MemEtcd()
        store = Store.open(tmp_path / "store.sqlite")
        async with trio.open_nursery() as nursery:
            cluster = Cluster(mem, off, tmp_path, nursery)
            for index in range(fencing.nodes):
                await cluster.add_node(index, store)
            await cluster.settle()
            for i, event in enumerate(trace, 1):
                try:
                    await cluster.step(event, clock)
                except Refusal as exc:
                    outcome["refused_at"], outcome["refusal"] = i, f"step {i} ({event}): {exc}"
                    break
                alive = cluster.alive()
                if event != "tick" and alive != expected[i - 1] and outcome["diverged_at"] is None:
                    outcome["diverged_at"] = i
                if violated(alive) and outcome["violated_at"] is None:
                    outcome["violated_at"] = i
                outcome["seen"] = ", ".join(f"g{g} rank {r} on n{n}" for n, g, r in sorted(alive))
            for node in cluster.nodes:  # let the paused go, so that everything ends
                node.paused = False
                node.continued.set()
            nursery.cancel_scope.cancel()
        store.close()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(agent_module, "_new_stream", lambda previous: previous + 1)
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
