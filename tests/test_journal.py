"""The journal: the controller's writes of the state, in order, one at a time."""

from __future__ import annotations

import trio
import trio.testing

from exod.state.journal import LAZY_WRITE_S, Journal
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


class Recording:
    """A `StateStore` that takes every write at once and notes when (trio's clock) and what."""

    where = "memory"

    def __init__(self) -> None:
        self.saves: list[tuple[float, list[LogEntry]]] = []

    async def save(self, snapshot, entries, now) -> int:
        self.saves.append((trio.current_time(), list(entries)))
        return len(self.saves)


def busy(n: int) -> LogEntry:
    return LogEntry(float(n), "runner", "i/0", "request_started", "available", "busy")


def test_what_only_requests_changed_is_written_in_one_go_what_a_restart_needs_at_once(tmp_path):
    """bench/request_cost.py: the whole state written twice per request cost the hot path. A save that only a
    request made waits `LAZY_WRITE_S` for company; any other save, or a caller of `durable`, writes it all at once."""
    state, local = Recording(), Store.open(tmp_path / "local.db")
    clock = trio.testing.MockClock(autojump_threshold=0)  # time jumps whenever every task waits

    async def main() -> None:
        journal = Journal(state, local)
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            for n in range(3):  # three requests' transitions, 10 ms apart
                journal.save(dict, [busy(n)], float(n), lazy=True)
                await trio.sleep(0.01)
            await trio.sleep(LAZY_WRITE_S)
            assert state.saves == [(LAZY_WRITE_S, [busy(0), busy(1), busy(2)])]  # one write, when the window ended

            start = trio.current_time()
            journal.save(dict, [busy(3)], 3.0, lazy=True)
            await trio.sleep(0.01)
            journal.save(dict, [entry(4)], 4.0)  # a lifecycle transition: it does not wait, nor does what came first
            await trio.testing.wait_all_tasks_blocked()
            assert state.saves[1:] == [(start + 0.01, [busy(3), entry(4)])]

            journal.save(dict, [busy(5)], 5.0, lazy=True)
            assert await journal.durable() and state.saves[2][1] == [busy(5)]  # a caller who waits is not kept waiting
            assert state.saves[2][0] == start + 0.01
            nursery.cancel_scope.cancel()

    try:
        trio.run(main, clock=clock)
    finally:
        local.close()
