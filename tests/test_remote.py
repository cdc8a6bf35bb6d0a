"""The controller's view of the other nodes (`exod.cluster.remote.Fleet`), against a fake etcd: what it waits for
before two generations could run at once (DESIGN §5, fencing). Time is trio's MockClock."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from exod.cluster.nodes import NodeRecord
from exod.cluster.remote import Fleet, RemoteProcess, Ring
from exod.host.supervisor import RunnerSpec
from exod.runner import protocol as p

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

    return Fleet("node-1", records, keys.runners, api_key=None, term=lambda: 1)


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
