"""A node's agent (`exod.cluster.agent`) and its half of fencing (DESIGN §5), against a fake etcd and fake runner
processes, on trio's MockClock: a runner is claimed in etcd before it is spawned and released once reaped;
nothing is spawned while the node's lease is not surely alive; and the runners are killed before the
lease may expire."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import trio
import trio.testing

from daemon_harness import config
from exod.cluster import agent as agent_module
from exod.cluster.agent import NOT_OBEYED, Agent, Refused, SpawnRequest
from exod.cluster.election import election_key
from exod.cluster.etcd import Compare, EtcdUnavailable, KeyValue, Put, TxnResult
from exod.cluster.nodes import FENCE_MARGIN, NodeRecord, runner_key
from exod.host.supervisor import Listener, RunnerSpec, Timeouts
from exod.runner import protocol as p
from exod.runner.faults import Fault, FaultSpec
from exod.state.sqlite import Store

PREFIX = b"/exod/"
TTL = 10
TERM = 41  # the controller's term, in etcd and on its commands


class FakeEtcd:
    """The keys an agent writes, the controller's term (the election key's create revision; None: no
    controller), and an outage a test can switch on."""

    def __init__(self) -> None:
        self.keys: dict[bytes, int] = {}  # key → lease
        self.revisions: dict[bytes, int] = {}  # key → its mod revision
        self.revision = 1  # the store's
        self.term: int | None = TERM
        self.down = False
        self.slow: trio.Event | None = None  # set: a claim waits for it (in flight)

    async def get(self, key: bytes) -> KeyValue | None:
        self._answer()
        assert key == election_key(PREFIX)
        return None if self.term is None else KeyValue(key, b"node-1", self.term, self.term, 1, 3)

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        self._answer()
        if self.slow is not None:
            await self.slow.wait()
        self.revision += 1
        self.keys[key], self.revisions[key] = lease, self.revision
        return self.revision

    async def txn(self, compare: list[Compare], success: list[Put], failure: list[Put] = ()) -> TxnResult:
        """What a claim asks (`Agent._claim`): the election key's create revision, and no runner key written
        since a revision; then puts."""
        self._answer()
        if self.slow is not None:
            await self.slow.wait()
        for c in compare:
            if c.key == election_key(PREFIX):
                assert (c.target, c.result) == ("CREATE", "EQUAL")
                if (self.term or 0) != c.value:
                    return TxnResult(False, self.revision)
            else:
                assert (c.target, c.result, c.range_end) == ("MOD", "LESS", PREFIX + b"runners0")
                if any(c.key <= k < c.range_end and r >= c.value for k, r in self.revisions.items()):
                    return TxnResult(False, self.revision)
        for op in success:
            await self.put(op.key, op.value, lease=op.lease)
        return TxnResult(True, self.revision)

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        self._answer()
        gone = [k for k in self.keys if k.startswith(key)] if prefix else [key] * (key in self.keys)
        for k in gone:
            del self.keys[k], self.revisions[k]
        self.revision += bool(gone)
        return len(gone)

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """The runner keys; or the cluster's live nodes, as their records: node-1 and node-2 (this one)."""
        self._answer()
        if prefix == PREFIX + b"runners/":
            kvs = [KeyValue(k, b"", self.revisions[k], self.revisions[k], 1, lease) for k, lease in self.keys.items()]
            return sorted(kvs, key=lambda kv: kv.key), self.revision
        assert prefix == PREFIX + b"nodes/"
        records = [NodeRecord(f"node-{n}", f"127.0.0.{n}", "", 1 << 30, 1 << 30) for n in (1, 2)]
        return [KeyValue(prefix + r.node_id.encode(), r.to_json(), 1, 1, 1, 7) for r in records], 1

    async def time_to_live(self, lease: int) -> tuple[int, int]:
        return TTL, TTL

    def _answer(self) -> None:
        if self.down:
            raise EtcdUnavailable("etcd is down (the test says so)")


class FakePresence:
    """`exod.cluster.nodes.Presence` as the agent reads it: the lease, and until when it is surely alive."""

    def __init__(self, etcd: FakeEtcd) -> None:
        self.etcd, self.prefix, self.ttl, self.lease = etcd, PREFIX, TTL, 7
        self.record = NodeRecord("node-2", "127.0.0.2", "http://127.0.0.2:1", 1 << 30, 1 << 30)
        self.alive_until = trio.current_time() + TTL
        self.renewed = trio.Event()  # set (and replaced) at each renewal, as `Presence.renewed`

    @property
    def authority_until(self) -> float:
        return self.alive_until - FENCE_MARGIN * self.ttl

    def renew(self) -> None:
        self.alive_until = trio.current_time() + TTL
        self.renewed.set()
        self.renewed = trio.Event()


class FakeProcess:
    """A runner process that runs until stopped or killed; what the etcd held when it was spawned."""

    def __init__(self, spec: RunnerSpec, etcd: FakeEtcd) -> None:
        self.spec = spec
        self.key_at_spawn = runner_key(PREFIX, "node-2", spec.runner_id, spec.incarnation) in etcd.keys
        self.killed = False
        self.deadlines: list[float] = []  # every extension of its dead man's switch
        self.posted: list[object] = []  # the commands it was sent
        self.pings = 0  # the heartbeat's pings it was sent (`exod.host.heartbeats`), not in ``posted``
        self._stop = trio.Event()

    async def run(self) -> None:
        try:
            await self._stop.wait()
        except trio.Cancelled:
            self.killed = True
            raise

    def post(self, command: object) -> None:
        if isinstance(command, p.Ping):
            self.pings += 1
            return
        self.posted.append(command)

    def extend(self, until: float) -> None:
        self.deadlines.append(until)

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()


def request(incarnation: int = 1, stream: int = 1) -> SpawnRequest:
    """A spawn as the controller sends it, on the first report stream opened (``with_agent``'s)."""
    return SpawnRequest(
        instance_id="i", runner_id="i/0", incarnation=incarnation, rank=0, world_size=1, ring=[], stream=stream
    )


def with_agent(tmp_path, body, process_cls: type[FakeProcess] = FakeProcess, **overrides) -> None:
    etcd, processes = FakeEtcd(), []

    def spawn(spec: RunnerSpec, listener: Listener, timeouts: Timeouts) -> FakeProcess:
        processes.append(process_cls(spec, etcd))
        processes[-1].listener = listener  # what the runner reports goes there
        return processes[-1]

    async def main() -> None:
        presence = FakePresence(etcd)
        store = Store.open(tmp_path / "store.sqlite")
        agent = Agent(config(tmp_path, tmp_path / "hf", **overrides), store, "127.0.0.2", spawn=spawn)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run, presence)
            stream = await agent.connect(TERM)  # the controller connects
            await stream.__anext__()
            await body(agent, etcd, presence, processes)
            nursery.cancel_scope.cancel()
        store.close()

    with pytest.MonkeyPatch.context() as patch:  # streams numbered 1, 2 …, not at random: `request` names them
        patch.setattr(agent_module, "_new_stream", lambda previous: previous + 1)
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


KEY = runner_key(PREFIX, "node-2", "i/0", 1)


def test_a_runner_is_claimed_in_etcd_before_it_is_spawned_and_released_once_reaped(tmp_path):
    async def body(agent, etcd, presence, processes):
        await agent.spawn(TERM, request())
        await trio.testing.wait_all_tasks_blocked()
        assert processes[0].key_at_spawn and etcd.keys[KEY] == presence.lease  # on the node's lease
        agent.stop(TERM, "i/0", 1)
        await trio.sleep(0.1)
        assert KEY not in etcd.keys

    with_agent(tmp_path, body)


def test_a_stop_that_overtakes_its_spawn_cancels_it(tmp_path):
    """fsm.fencing's TOMBSTONE: the stop came first, so the spawn that follows it is refused, not run for ever
    with no one to stop it and its key holding back the next generation."""

    async def body(agent, etcd, presence, processes):
        agent.stop(TERM, "i/0", 1)
        with pytest.raises(Refused, match="stopped before its spawn arrived") as refused:
            await agent.spawn(TERM, request())
        assert refused.value.status == 409 and processes == [] and KEY not in etcd.keys
        await agent.spawn(TERM, request(incarnation=2))  # the next one is not stopped
        assert [p.spec.incarnation for p in processes] == [2]

    with_agent(tmp_path, body)


def test_a_stop_that_comes_while_the_spawn_claims_its_key_cancels_it_and_releases_the_key(tmp_path):
    async def body(agent, etcd, presence, processes):
        etcd.slow = trio.Event()
        async with trio.open_nursery() as nursery:
            refusals = []

            async def spawn() -> None:
                try:
                    await agent.spawn(TERM, request())
                except Refused as exc:
                    refusals.append(exc)

            nursery.start_soon(spawn)
            await trio.testing.wait_all_tasks_blocked()  # the claim is on its way to etcd
            agent.stop(TERM, "i/0", 1)
            etcd.slow.set()
        assert len(refusals) == 1 and processes == []
        await trio.sleep(2)
        assert KEY not in etcd.keys  # claimed, then released: it held nothing back

    with_agent(tmp_path, body)


def test_a_spawn_delayed_past_the_end_of_its_stream_is_refused_even_when_the_same_term_connects_again(tmp_path):
    """The controller stepped down by its clock and took its term back (fsm.fencing's RESUME), or merely
    reconnected: a spawn it sent on its first stream, arriving now, would run a runner it no longer knows of."""

    async def body(agent, etcd, presence, processes):
        stream = await agent.connect(TERM)  # the same term, a new stream
        hello = json.loads(await stream.__anext__())
        with pytest.raises(Refused, match="not a command of the controller this node obeys now") as refused:
            await agent.spawn(TERM, request(stream=1))
        assert hello == {"kind": "hello", "stream": 2} and refused.value.status == 409
        assert processes == [] and KEY not in etcd.keys
        await agent.spawn(TERM, request(stream=2))  # what it sends now
        assert len(processes) == 1

    with_agent(tmp_path, body)


class NoFds(FakeProcess):
    async def run(self) -> None:
        raise OSError(errno.EMFILE, "Too many open files")  # its supervisor's socketpair, on a node out of fds


def test_a_runner_whose_node_has_no_fds_left_is_the_hosts_failure_not_the_models(tmp_path):
    """Found by the fault campaign (#26): an agent's lowered fd limit failed a spawn, reported as the runner's
    own failure and charged; on one host the same is the host's (exod.reports), and so it is here."""

    async def body(agent, etcd, presence, processes):
        stream = await agent.connect(TERM)
        assert json.loads(await stream.__anext__())["kind"] == "hello"
        await agent.spawn(TERM, request(stream=2))
        report = json.loads(await stream.__anext__())
        while report["kind"] != "report":
            report = json.loads(await stream.__anext__())
        assert report["report"]["host"] is True and "Too many open files" in report["report"]["message"]
        assert json.loads(await stream.__anext__())["kind"] == "exit"

    with_agent(tmp_path, body, NoFds)


def two_ranks(**changes) -> SpawnRequest:
    """Rank 1 of a world of two, its ring on node-1 and node-2."""
    body = {"instance_id": "i", "runner_id": "i/1", "incarnation": 1, "rank": 1, "world_size": 2, "stream": 1}
    body["ring"] = ["127.0.0.1:7001", "127.0.0.2:7002"]
    return SpawnRequest(**(body | changes))


STEPS = ["hostfile_path", "write_hostfile", "runner_log_path", "spawn", "extend", "generations"]


@pytest.mark.parametrize("step", STEPS)
def test_a_failure_at_any_step_of_a_spawn_after_its_claim_releases_the_claim_at_once(tmp_path, monkeypatch, step):
    """Issue #25: a claim left behind holds every next generation of its instance back, for as long as the node
    lives. Whatever raises between the claim and the supervisor taking the runner over releases it."""
    from exod.host import ring
    from exod.state import retention

    def boom(*args, **kwargs):
        raise OSError(f"{step} failed (the test says so)")

    if step in ("hostfile_path", "runner_log_path"):
        monkeypatch.setattr(retention, step, boom)
    elif step == "write_hostfile":
        monkeypatch.setattr(ring, step, boom)
    elif step == "extend":
        monkeypatch.setattr(FakeProcess, "extend", boom)

    async def body(agent, etcd, presence, processes):
        if step == "generations":
            monkeypatch.setattr(agent._generations, "started", boom)
        if step == "spawn":
            monkeypatch.setattr(agent, "_spawn", boom)
        with pytest.raises((OSError, Refused), match=step):  # a file's error said as the node's (503)
            await agent.spawn(TERM, two_ranks())
        assert not etcd.keys and agent._running == {}  # released at once, not at the next beat

    with_agent(tmp_path, body)


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"instance_id": ".."}, "pattern"),
        ({"instance_id": "a/b", "runner_id": "a/b/1"}, "pattern"),
        ({"instance_id": "a\x00", "runner_id": "a\x00/1"}, "pattern"),
        ({"runner_id": "j/1"}, "instance_id/rank"),
        ({"rank": 2, "runner_id": "i/2"}, "not below world_size"),
        ({"ring": ["127.0.0.1:7001"]}, "ring has 1 endpoints"),
        ({"ring": ["127.0.0.1:7001", "127.0.0.2"]}, "not HOST:PORT"),
        ({"ring": ["127.0.0.1:7001", "127.0.0.2:99999"]}, "not HOST:PORT"),
    ],
)
def test_a_spawn_that_names_bad_ids_or_a_bad_ring_is_refused_before_anything_is_written(changes, why):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=why):
        two_ranks(**changes)


def test_a_ring_beyond_the_clusters_live_nodes_is_refused_and_no_fault_comes_from_the_wire(tmp_path):
    """A caller could otherwise make a runner connect to any HOST:PORT, or fail at will."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="fault"):
        two_ranks(fault="loading:sigkill")

    async def body(agent, etcd, presence, processes):
        with pytest.raises(Refused) as refused:
            await agent.spawn(TERM, two_ranks(ring=["127.0.0.1:7001", "127.0.0.9:7002"]))
        await agent.spawn(TERM, two_ranks())  # the cluster's own nodes: started
        assert refused.value.status == 400
        assert "127.0.0.9:7002" in str(refused.value) and "not on live nodes" in str(refused.value)
        assert len(processes) == 1 and list(etcd.keys) == [runner_key(PREFIX, "node-2", "i/1", 1)]
        assert processes[0].spec.fault is None  # this node arms none

    with_agent(tmp_path, body)


def test_a_node_arms_the_runners_it_starts_from_its_own_fault_configuration(tmp_path):
    """Found by the fault campaign (#26, seed 1): the controller sent the [[fault]] of its own configuration
    with every spawn, and an agent whose configuration had none refused the spawn, the controller took the
    refusal for a lost node, and the armed fault never fired where it was armed. Each node arms its own."""
    armed = FaultSpec(Fault.parse("loading:exception"), rank=1, generation=2)

    async def body(agent, etcd, presence, processes):
        await agent.spawn(TERM, two_ranks())  # rank 1 of generation 1: not armed
        await agent.spawn(TERM, two_ranks(instance_id="j", runner_id="j/1", incarnation=2))
        await agent.spawn(TERM, two_ranks(instance_id="k", runner_id="k/0", rank=0, incarnation=2))
        assert [p.spec.fault for p in processes] == [None, "loading:exception", None]

    with_agent(tmp_path, body, faults=(armed,))


def test_a_load_is_of_a_model_id_this_node_resolves_never_a_path_from_the_wire(tmp_path):
    """`model_path=/etc` loaded an arbitrary directory, and its failure told whether a path exists."""
    from exod.cluster.agent import CommandRequest

    async def body(agent, etcd, presence, processes):
        await agent.spawn(TERM, request())
        refusals = []
        for load in (
            CommandRequest(command={"type": "load", "model_path": "/etc"}),
            CommandRequest(command={"type": "load", "model_path": "/etc"}, model_id="../etc"),
        ):
            with pytest.raises(Refused) as refused:
                agent.post(TERM, "i/0", 1, load)
            refusals.append(refused.value)
        unknown = CommandRequest(command={"type": "load", "model_path": "/etc"}, model_id="org/absent")
        agent.post(TERM, "i/0", 1, unknown)  # not in this node's cache: the runner's retryable failure, said
        assert [r.status for r in refusals] == [400, 400] and "model_id" in str(refusals[0])
        assert processes[0].posted == []  # nothing reached the runner, /etc least of all

    with_agent(tmp_path, body)


def test_a_key_that_could_not_be_released_is_released_when_etcd_answers_again(tmp_path):
    async def body(agent, etcd, presence, processes):
        await agent.spawn(TERM, request())
        etcd.down = True
        agent.stop(TERM, "i/0", 1)
        await trio.sleep(5)
        assert KEY in etcd.keys  # the controller must go on waiting: it cannot know
        etcd.down = False
        await trio.sleep(2)
        assert KEY not in etcd.keys

    with_agent(tmp_path, body)


def test_nothing_is_spawned_while_etcd_cannot_take_the_claim(tmp_path):
    async def body(agent, etcd, presence, processes):
        etcd.down = True
        with pytest.raises(Refused) as refused:
            await agent.spawn(TERM, request())
        assert refused.value.status == 503 and "claim" in str(refused.value) and processes == []

    with_agent(tmp_path, body)


def test_nothing_is_spawned_while_the_lease_is_not_surely_alive(tmp_path):
    async def body(agent, etcd, presence, processes):
        await trio.sleep(TTL * (1 - FENCE_MARGIN))  # no renewal: the lease may expire at any moment now
        with pytest.raises(Refused) as refused:
            await agent.spawn(TERM, request())
        assert refused.value.status == 503 and "lease" in str(refused.value) and processes == []

    with_agent(tmp_path, body)


def test_the_runners_are_killed_before_the_lease_may_expire_not_after(tmp_path):
    async def body(agent, etcd, presence, processes):
        await agent.spawn(TERM, request())
        fence_at = presence.alive_until - FENCE_MARGIN * TTL
        await trio.sleep_until(fence_at - 0.01)
        assert not processes[0].killed  # renewed until then: nothing happens
        await trio.sleep(0.02)
        assert processes[0].killed  # killed, not asked: a graceful stop could outlast the lease
        assert trio.current_time() < presence.alive_until

    with_agent(tmp_path, body)


def test_a_renewal_moves_the_fence_on(tmp_path):
    async def body(agent, etcd, presence, processes):
        await agent.spawn(TERM, request())
        for _ in range(5):
            await trio.sleep(TTL / 3)
            presence.renew()
        assert not processes[0].killed and KEY in etcd.keys  # still running, still claimed

    with_agent(tmp_path, body)


def test_an_older_term_never_takes_over_and_its_commands_are_refused_saying_why(tmp_path):
    """The deposed controller reconnects after the new one did: refused, and the new one's runners run on. The
    refusals say what to do, never the term obeyed (the log does)."""

    async def body(agent, etcd, presence, processes):
        await agent.spawn(TERM, request())
        with pytest.raises(Refused) as not_current:  # etcd holds TERM: a later term is not the cluster's yet
            await agent.connect(TERM + 1)
        etcd.term = TERM + 1  # elected: the new controller connects
        await agent.connect(TERM + 1)
        await trio.testing.wait_all_tasks_blocked()
        stopped_by_new_term = processes[0].stopped
        await agent.spawn(TERM + 1, request(incarnation=2, stream=2))
        refusals = []
        for attempt in (
            lambda: agent.connect(TERM),
            lambda: agent.spawn(TERM, request(incarnation=3)),
        ):
            with pytest.raises(Refused) as refused:
                await attempt()
            refusals.append(refused.value)
        with pytest.raises(Refused) as stop_refused:
            agent.stop(TERM, "i/0", 2)
        assert stopped_by_new_term  # the old term's runner: its controller is no longer obeyed
        every = [not_current.value, *refusals, stop_refused.value]
        assert [r.status for r in every] == [409] * 4
        assert all(r.detail == NOT_OBEYED and str(TERM) not in r.detail for r in every)  # nothing to forge with
        assert len(processes) == 2 and not processes[1].stopped and not processes[1].killed  # the new one's runs

    with_agent(tmp_path, body)


def test_a_command_without_an_open_stream_of_its_term_is_refused(tmp_path):
    async def body(agent, etcd, presence, processes):
        with pytest.raises(Refused) as refused:
            await agent.spawn(TERM + 1, request())
        assert refused.value.status == 409 and "GET /agent/reports" in refused.value.detail and processes == []

    with_agent(tmp_path, body)


def test_a_spawn_naming_the_new_term_on_the_old_terms_stream_is_refused_and_claims_nothing(tmp_path):
    """etcd has moved on to a new controller's term; a spawn that names that term but rides the stream the
    old term opened (a replayed or forged command) is no command of the new term: 409, nothing claimed. The
    claim's transaction alone would let it through (the term it names is etcd's), so the agent checks the
    stream's own term first (a planted regression found this unguarded: tools/plants.py)."""

    async def body(agent, etcd, presence, processes):
        etcd.term = TERM + 1
        with pytest.raises(Refused) as refused:
            await agent.spawn(TERM + 1, request(stream=1))
        assert refused.value.status == 409 and processes == [] and KEY not in etcd.keys

    with_agent(tmp_path, body)


def test_once_etcd_shows_the_term_over_its_runners_stop_without_waiting_for_its_silence(tmp_path):
    async def body(agent, etcd, presence, processes):
        await agent.spawn(TERM, request())
        etcd.term = None  # its lease expired: no controller now
        await trio.sleep(2)
        assert processes[0].stopped

    with_agent(tmp_path, body)


def test_each_runners_deadline_is_the_nodes_authority_moved_on_only_while_the_lease_is_renewed(tmp_path):
    """The dead man's switch (DESIGN §5): set before the runner runs, moved on each beat to the node's
    authority, never past it; without renewals it stays where the lease may expire."""

    async def body(agent, etcd, presence, processes):
        await agent.spawn(TERM, request())
        runner = processes[0]
        first = runner.deadlines[0]
        for _ in range(3):
            await trio.sleep(TTL / 3)
            presence.renew()
        await trio.sleep(1.5)
        renewed_to = presence.authority_until
        await trio.sleep(TTL * (1 - FENCE_MARGIN) - 2)  # no renewal since
        assert first == pytest.approx(TTL * (1 - FENCE_MARGIN), abs=0.01)  # its spawn's authority
        assert runner.deadlines[-1] == renewed_to and max(runner.deadlines) == renewed_to
        assert runner.deadlines == sorted(runner.deadlines)  # moved on, never back

    with_agent(tmp_path, body)


def test_a_renewal_extends_the_runners_deadlines_at_once_not_at_the_next_beat(tmp_path):
    """A renewal that comes late, just before the authority would end, must reach the runners before then."""

    async def body(agent, etcd, presence, processes):
        await agent.spawn(TERM, request())
        await trio.sleep(TTL * (1 - FENCE_MARGIN) - 0.05)  # renewals failed until just before the end
        presence.renew()
        await trio.sleep(0.01)
        assert processes[0].deadlines[-1] == presence.authority_until and not processes[0].killed

    with_agent(tmp_path, body)


def cached_model(hf_home, model_id: str = "org/m") -> Path:
    """A model whole in the Hugging Face cache layout (config and weights), as a finished download leaves it."""
    repo = hf_home / "hub" / f"models--{model_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"weights")
    return snapshot


def test_files_of_a_model_that_go_missing_while_it_loads_are_the_hosts_failure_not_the_models(tmp_path):
    """Found by the fault campaign (#26, seed 1452815653): a model's files removed from a node's cache for a few
    seconds while a rank loaded charged the instance retries (ModelNotFound) or, back before the runner's
    FileNotFoundError was, deleted the instance as a defect of the model. The node judges its own files: a
    file the model had when it was found whole is the host's loss; a file it never had is the model's."""
    from exod.cluster.agent import CommandRequest

    snapshot = cached_model(tmp_path / "hf")
    load = CommandRequest(command={"type": "load", "model_path": ""}, model_id="org/m")

    async def next_report(stream) -> dict:
        while (event := json.loads(await stream.__anext__()))["kind"] != "report":
            pass
        return event["report"]

    async def body(agent, etcd, presence, processes):
        stream = await agent.connect(TERM)
        await stream.__anext__()
        await agent.spawn(TERM, request(stream=2))
        agent.post(TERM, "i/0", 1, load)
        assert processes[0].posted[0].model_path == str(snapshot)  # found whole: its files are known
        runner, spec = processes[0], processes[0].spec
        for missing, host in ((snapshot / "model.safetensors", True), (snapshot / "tokenizer.json", False)):
            message = f"[Errno 2] No such file or directory: '{missing}'"
            runner.listener.on_report(spec, p.Failed("i/0", 1, "FileNotFoundError", message, "", retryable=False))
            assert (await next_report(stream))["host"] is host, missing.name  # tokenizer.json: never there
        runner.listener.on_report(spec, p.Failed("i/0", 1, "ValueError", "bad config", "", retryable=False))
        assert (await next_report(stream))["host"] is False  # not a missing file: the model's
        shutil.rmtree(tmp_path / "hf" / "hub")  # the whole model gone from the cache (a cleanup)
        agent.stop(TERM, "i/0", 1)  # its next generation starts once this one's key is gone
        while any(etcd.keys):
            await trio.sleep(0.1)
        await agent.spawn(TERM, request(incarnation=2, stream=2))
        agent.post(TERM, "i/0", 2, load)
        report = await next_report(stream)
        assert (report["exception_type"], report["host"]) == ("ModelNotFound", True)
        assert processes[1].posted == []

    with_agent(tmp_path, body)


def test_a_node_restarted_since_its_download_still_knows_missing_files_for_the_hosts(tmp_path):
    """Found by the fourth 30-min campaign (seed 16553628): a node's daemon restarted after the model was
    downloaded there never found it whole itself, so the model's files removed while a rank loaded (the whole
    directory) were charged as the model's defect. The whole directory gone is always the host's (a load comes
    only after the node's download completed); a file is the host's loss when the cache still holds its entry
    (a snapshot's link to a blob that is gone), whoever found the model."""
    from exod.host.models import ModelFiles

    hf = tmp_path / "hf"
    snapshot = cached_model(hf)
    blobs = snapshot.parent.parent / "blobs"
    blobs.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):  # the cache's layout: links to blobs
        blob = blobs / f"sha-{name}"
        (snapshot / name).unlink(missing_ok=True)
        blob.write_bytes(b"x")
        (snapshot / name).symlink_to(blob)
    restarted = ModelFiles(hf_home=hf, offline=True)  # found nothing yet
    gone = f"model 'org/m' is neither cached in {hf / 'hub'} nor reachable"
    assert restarted.lost("org/m", "ModelNotFound", gone)
    (blobs / "sha-model.safetensors").unlink()  # a cleanup removed a blob: its link dangles
    missing = f"[Errno 2] No such file or directory: '{snapshot / 'model.safetensors'}'"
    assert restarted.lost("org/m", "FileNotFoundError", missing)
    never = f"[Errno 2] No such file or directory: '{snapshot / 'merges.txt'}'"  # not in the model: its defect
    assert not restarted.lost("org/m", "FileNotFoundError", never)
    assert not restarted.lost("org/m", "ValueError", missing)


def test_a_report_for_a_controller_that_closed_its_stream_ends_the_session_instead_of_raising(tmp_path):
    """Found by the suite on a busy machine (#26): the controller closed its report stream (it was shutting
    down) before the agent ended the session; a runner's exit reported into it raised BrokenResourceError in the
    runner's supervisor task, and the node's daemon died with it (exit 1)."""
    import math

    async def body(agent, etcd, presence, processes):
        stream = await agent.connect(TERM)
        await stream.__anext__()
        await agent.spawn(TERM, request(stream=2))
        await trio.testing.wait_all_tasks_blocked()
        send, receive = trio.open_memory_channel[bytes](math.inf)
        receive.close()  # the controller's end is gone, the session not yet ended
        agent._stream = send
        runner = processes[0]
        runner.listener.on_exit(runner.spec, 0, "", True)  # raised here
        assert agent._stream is None and runner.stopped  # the session ended: its runners are stopped

    with_agent(tmp_path, body)
