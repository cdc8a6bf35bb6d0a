"""The journal: the controller's writes of the state, in order, one at a time."""

from __future__ import annotations

import trio
import trio.testing

from exod.state.journal import Journal
from exod.state.sqlite import Store
from fsm.cluster import LogEntry


class SlowState:
    """A `StateStore` whose writes end when the test says."""

    where = "a slow store"

    def __init__(self) -> None:
        self.saves: list[list[LogEntry]] = []
        self.release = trio.Event()

    async def save(self, snapshot, entries, now) -> int:
        await self.release.wait()
        self.saves.append(list(entries))
        return len(self.saves)


def entry(n: int) -> LogEntry:
    return LogEntry(float(n), "instance", "i", "start", "pending", "starting")


def test_a_retired_journal_lets_its_write_in_flight_end_first_and_writes_nothing_after(tmp_path):
    """Found by the fault campaign (#26): a controller that stepped down and took its term back restored from
    etcd while a write of its previous turn was still to come; the log then went on from two states."""
    state, local = SlowState(), Store.open(tmp_path / "local.db")

    async def main() -> None:
        journal = Journal(state, local)
        journal.save(dict, [entry(1)], 1.0)
        retired = trio.Event()

        async def retire() -> None:
            await journal.retire("this term is over")
            retired.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(journal.durable)  # the write in flight
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(retire)
            await trio.testing.wait_all_tasks_blocked()
            assert not retired.is_set() and state.saves == []  # it waits for the write to end
            state.release.set()
        assert retired.is_set() and state.saves == [[entry(1)]]
        journal.save(dict, [entry(2)], 2.0)
        assert await journal.durable() is False  # nothing more is written …
        assert state.saves == [[entry(1)]] and journal.degraded == "this term is over"  # … and it says why

    try:
        trio.run(main)
    finally:
        local.close()
