"""A node's agent (`exod.cluster.agent`) and its half of fencing (DESIGN §5), against a fake etcd and fake runner
processes, on trio's MockClock: a runner is claimed in etcd before it is spawned and released once reaped;
nothing is spawned while the node's lease is not surely alive; and the runners are killed before the
lease may expire."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from daemon_harness import config
from exod.cluster.agent import Agent, Refused, SpawnRequest
from exod.cluster.etcd import EtcdUnavailable
from exod.cluster.nodes import FENCE_MARGIN, NodeRecord, runner_key
from exod.host.supervisor import Listener, RunnerSpec, Timeouts
from exod.state.sqlite import Store

PREFIX = b"/exod/"
TTL = 10


class FakeEtcd:
    """The keys an agent writes, and an outage a test can switch on."""

    def __init__(self) -> None:
        self.keys: dict[bytes, int] = {}  # key → lease
        self.down = False

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        self._answer()
        self.keys[key] = lease
        return 1

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        self._answer()
        gone = [k for k in self.keys if k.startswith(key)] if prefix else [key] * (key in self.keys)
        for k in gone:
            del self.keys[k]
        return len(gone)

    def _answer(self) -> None:
        if self.down:
            raise EtcdUnavailable("etcd is down (the test says so)")


class FakePresence:
    """`exod.cluster.nodes.Presence` as the agent reads it: the lease, and until when it is surely alive."""

    def __init__(self, etcd: FakeEtcd) -> None:
        self.etcd, self.prefix, self.ttl, self.lease = etcd, PREFIX, TTL, 7
        self.record = NodeRecord("node-2", "127.0.0.2", "http://127.0.0.2:1", 1 << 30, 1 << 30)
        self.alive_until = trio.current_time() + TTL

    @property
    def authority_until(self) -> float:
        return self.alive_until - FENCE_MARGIN * self.ttl

    def renewed(self) -> None:
        self.alive_until = trio.current_time() + TTL


class FakeProcess:
    """A runner process that runs until stopped or killed; what the etcd held when it was spawned."""

    def __init__(self, spec: RunnerSpec, etcd: FakeEtcd) -> None:
        self.spec = spec
        self.key_at_spawn = runner_key(PREFIX, "node-2", spec.runner_id, spec.incarnation) in etcd.keys
        self.killed = False
        self._stop = trio.Event()

    async def run(self) -> None:
        try:
            await self._stop.wait()
        except trio.Cancelled:
            self.killed = True
            raise

    def post(self, command: object) -> None: ...

    def stop(self) -> None:
        self._stop.set()


def request(incarnation: int = 1) -> SpawnRequest:
    return SpawnRequest(instance_id="i", runner_id="i/1", incarnation=incarnation, rank=1, world_size=1, ring=[])


def with_agent(tmp_path, body) -> None:
    etcd, processes = FakeEtcd(), []

    def spawn(spec: RunnerSpec, listener: Listener, timeouts: Timeouts) -> FakeProcess:
        processes.append(FakeProcess(spec, etcd))
        return processes[-1]

    async def main() -> None:
        presence = FakePresence(etcd)
        store = Store.open(tmp_path / "store.sqlite")
        agent = Agent(config(tmp_path, tmp_path / "hf"), store, "127.0.0.2", spawn=spawn)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run, presence)
            stream = agent.reports()  # a controller connects
            await stream.__anext__()
            await body(agent, etcd, presence, processes)
            nursery.cancel_scope.cancel()
        store.close()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


KEY = runner_key(PREFIX, "node-2", "i/1", 1)


def test_a_runner_is_claimed_in_etcd_before_it_is_spawned_and_released_once_reaped(tmp_path):
    async def body(agent, etcd, presence, processes):
        await agent.spawn(request())
        await trio.testing.wait_all_tasks_blocked()
        assert processes[0].key_at_spawn and etcd.keys[KEY] == presence.lease  # on the node's lease
        agent.stop("i/1", 1)
        await trio.sleep(0.1)
        assert KEY not in etcd.keys

    with_agent(tmp_path, body)


def test_a_key_that_could_not_be_released_is_released_when_etcd_answers_again(tmp_path):
    async def body(agent, etcd, presence, processes):
        await agent.spawn(request())
        etcd.down = True
        agent.stop("i/1", 1)
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
            await agent.spawn(request())
        assert refused.value.status == 503 and "claim" in str(refused.value) and processes == []

    with_agent(tmp_path, body)


def test_nothing_is_spawned_while_the_lease_is_not_surely_alive(tmp_path):
    async def body(agent, etcd, presence, processes):
        await trio.sleep(TTL * (1 - FENCE_MARGIN))  # no renewal: the lease may expire at any moment now
        with pytest.raises(Refused) as refused:
            await agent.spawn(request())
        assert refused.value.status == 503 and "lease" in str(refused.value) and processes == []

    with_agent(tmp_path, body)


def test_the_runners_are_killed_before_the_lease_may_expire_not_after(tmp_path):
    async def body(agent, etcd, presence, processes):
        await agent.spawn(request())
        fence_at = presence.alive_until - FENCE_MARGIN * TTL
        await trio.sleep_until(fence_at - 0.01)
        assert not processes[0].killed  # renewed until then: nothing happens
        await trio.sleep(0.02)
        assert processes[0].killed  # killed, not asked: a graceful stop could outlast the lease
        assert trio.current_time() < presence.alive_until

    with_agent(tmp_path, body)


def test_a_renewal_moves_the_fence_on(tmp_path):
    async def body(agent, etcd, presence, processes):
        await agent.spawn(request())
        for _ in range(5):
            await trio.sleep(TTL / 3)
            presence.renewed()
        assert not processes[0].killed and KEY in etcd.keys  # still running, still claimed

    with_agent(tmp_path, body)
