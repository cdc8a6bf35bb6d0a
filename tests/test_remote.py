"""The controller's view of the other nodes (`exod.cluster.remote.Fleet`), against a fake etcd: what it waits for
before two generations could run at once (DESIGN §5, fencing). Time is trio's MockClock."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from exod.cluster.election import Deposed
from exod.cluster.nodes import NodeRecord
from exod.cluster.remote import Fleet, RemoteProcess, Ring
from exod.host.supervisor import RunnerSpec
from exod.runner import protocol as p
from exod.state.journal import WRITE_RETRY, Journal
from exod.state.sqlite import Store
from exod.state.store import StateUnavailable

SPEC = RunnerSpec("i/1", 1, rank=1, world_size=2, hostfile=None, log_path=Path("/dev/null"))


class Keys:
    """What etcd says runs on each node (`exod.cluster.nodes.live_runners`), as a test sets it."""

    def __init__(self, alive: dict[str, set[tuple[str, int]]]) -> None:
        self.alive = alive

    async def runners(self) -> dict[str, set[tuple[str, int]]]:
        return {node: set(keys) for node, keys in self.alive.items()}


class Heard:
    """An `exod.host.supervisor.Listener` that writes down what it hears."""

    def __init__(self) -> None:
        self.reports: list[p.Report] = []
        self.exits: list[int] = []

    def on_spawned(self, spec: RunnerSpec, pid: int) -> None: ...

    def on_report(self, spec: RunnerSpec, report: p.Report) -> None:
        self.reports.append(report)

    def on_stall(self, spec: RunnerSpec, phase: str, seconds: float) -> None: ...

    def on_exit(self, spec: RunnerSpec, exit_code: int, stderr_tail: str, stop_delivered: bool) -> None:
        self.exits.append(exit_code)


def fleet_of(keys: Keys, api_url: str = "") -> Fleet:
    async def records() -> list[NodeRecord]:
        return [NodeRecord("node-2", "127.0.0.2", api_url, 1 << 30, 1 << 30)]

    return Fleet("node-1", records, keys.runners, token="t" * 43, term=lambda: 1)


def run(body) -> None:
    trio.run(body, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_new_term_starts_nothing_while_a_runner_an_earlier_term_left_may_still_run():
    keys = Keys({"node-2": {("i/1", 1)}})
    fleet = fleet_of(keys)

    async def main():
        started = trio.Event()
        async with trio.open_nursery() as nursery:

            async def term():
                await nursery.start(fleet.run)
                started.set()

            nursery.start_soon(term)
            await trio.sleep(60)
            assert not started.is_set()  # its key is there: that runner may still run
            keys.alive["node-2"] = set()  # stopped by its agent, or gone with its node's lease
            await trio.sleep(2)
            assert started.is_set()
            nursery.cancel_scope.cancel()

    run(main)


def test_a_rank_waits_for_every_key_of_an_earlier_generation_of_its_instance_and_no_other():
    """Whatever left it (a runner its controller no longer knows of, a key not released yet), an earlier
    generation's key means it may run: the next generation's rank is not spawned beside it."""
    keys = Keys({"node-2": {("i/0", 1), ("other/0", 1), ("i/1", 3)}, "node-3": {("i/1", 1)}})
    fleet, link = fleet_of(keys), Link()
    spec = RunnerSpec("i/0", 2, rank=0, world_size=1, hostfile=None, log_path=Path("/dev/null"))

    async def main():
        process = RemoteProcess(
            spec,
            link,
            Ring(["node-2"], None),
            "i",
            Heard(),
            lambda *a: None,
            cleared=lambda: fleet.earlier_gone("i", 2),
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(process.run)
            await trio.sleep(60)
            assert link.client.spawned == []  # i/0/1 on node-2 and i/1/1 on node-3 may still run
            keys.alive["node-2"].discard(("i/0", 1))
            await trio.sleep(60)
            assert link.client.spawned == []
            keys.alive["node-3"] = set()  # another instance's runner and a later generation's hold nothing back
            await trio.sleep(1)
            assert len(link.client.spawned) == 1
            nursery.cancel_scope.cancel()

    run(main)


def test_a_runner_lost_with_its_node_fails_at_once_and_exits_only_once_its_key_is_gone():
    keys = Keys({"node-2": set()})
    fleet = fleet_of(keys, api_url="http://127.0.0.1:9")  # nothing answers there: the node is cut off
    heard = Heard()

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(fleet.run)
            link = fleet.link("node-2")

            process = RemoteProcess(SPEC, link, Ring(["node-1", "node-2"], None), "i", heard, lambda *a: None)
            keys.alive["node-2"] = {("i/1", 1)}  # it was spawned there, and its node went silent
            process.lost("node node-2: ReadTimeout")
            await trio.sleep(30)
            assert [type(r) for r in heard.reports] == [p.Failed] and heard.reports[0].host  # the host's, at once
            assert heard.exits == []  # but not gone: its node may not have fenced itself yet
            keys.alive["node-2"] = set()
            await trio.sleep(2)
            assert heard.exits == [-9]
            nursery.cancel_scope.cancel()

    run(main)


class Etcd:
    """The controller's `exod.state.store.StateStore` in etcd, as a test makes it answer: out of reach for a
    while, then writing, or refusing every write of a deposed term."""

    where = "etcd (fake)"

    def __init__(self, refusals: int = 0, deposed: bool = False) -> None:
        self.refusals, self.deposed = refusals, deposed
        self.written: list[float] = []  # trio time of each write it took

    async def save(self, snapshot, entries, now) -> int:
        if self.deposed:
            raise Deposed("node node-1 is no longer the controller: etcd refused its write")
        if self.refusals:
            self.refusals -= 1
            raise StateUnavailable("cannot write the state to etcd (fake): timed out")
        self.written.append(trio.current_time())
        return 1


class Agent:
    """A node's agent as `RemoteProcess` drives it: it writes down when a spawn reached it."""

    def __init__(self) -> None:
        self.node = NodeRecord("node-2", "127.0.0.2", "", 1 << 30, 1 << 30)
        self.spawned: list[float] = []

    async def spawn(self, body) -> None:
        self.spawned.append(trio.current_time())

    async def stop(self, runner_id, incarnation) -> None: ...


class Link:
    def __init__(self) -> None:
        self.client, self.running, self.unconfirmed, self.lost = Agent(), {}, set(), None
        self.stream = 1  # the agent's number for the report stream
        self.connected = trio.Event()
        self.connected.set()


def journal_on(state: Etcd, tmp_path: Path) -> Journal:
    journal = Journal(state, Store.open(tmp_path / "state.db"))  # type: ignore[arg-type]
    journal.save(dict, [], 0.0)  # the controller's write that started generation 1
    return journal


def test_a_rank_is_spawned_only_once_etcd_holds_the_write_that_started_its_generation(tmp_path):
    state, link = Etcd(refusals=3), Link()
    journal = journal_on(state, tmp_path)
    spec = RunnerSpec("i/0", 1, rank=0, world_size=1, hostfile=None, log_path=Path("/dev/null"))

    async def main():
        process = RemoteProcess(
            spec, link, Ring(["node-2"], None), "i", Heard(), lambda *a: None, cleared=journal.recorded
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(process.run)
            await trio.sleep(2.5 * WRITE_RETRY)
            assert link.client.spawned == [] and state.written == []  # etcd out of reach: no generation, no spawn
            await trio.sleep(2 * WRITE_RETRY)
            assert len(state.written) == 1 and link.client.spawned == state.written  # at once, and only then
            nursery.cancel_scope.cancel()

    run(main)


def test_a_deposed_controller_spawns_nothing_and_its_term_ends(tmp_path):
    state, link = Etcd(deposed=True), Link()
    journal = journal_on(state, tmp_path)

    async def main():
        process = RemoteProcess(
            SPEC, link, Ring(["node-1", "node-2"], None), "i", Heard(), lambda *a: None, cleared=journal.recorded
        )
        with pytest.raises(Deposed):
            await process.run()
        assert link.client.spawned == [] and link.running == {}

    run(main)
