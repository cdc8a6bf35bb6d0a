"""What the controller writes, in order, and what happens when the store refuses a write.

The controller changes its machines in plain (synchronous) code and hands each change to `save`, which
never blocks and never fails: the writer (`run`, in the controller's nursery) writes the newest snapshot
with every log entry queued since the last write, in one atomic save, so a reader never sees a transition
whose state was lost. Whoever must tell a caller that something is stored (a placement) awaits `durable`.

A full disk, an I/O error, a vanished file or an etcd out of reach must not end the daemon: its runners
keep serving, and what could not be written is kept in memory, in order, and written once the store takes
it again (tried at the next change, or after `WRITE_RETRY` seconds). Until then the daemon is *degraded*:
`degraded` says why (status, ``/health``, ``/ready``), and new placements wait, for a caller would be told
of an instance that a crash could lose.

The runner processes this host started are recorded in the host's own SQLite file whatever the cluster's
state store is (a pid means something on one host only), through the same degraded rule.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from exod.state.process_book import ProcessBook
from exod.state.sqlite import ProcessRecord, Store
from exod.state.store import StateStore, StateUnavailable
from fsm.cluster import LogEntry

log = logging.getLogger("exod.journal")

WRITE_RETRY = 2.0  # seconds between attempts to write the state again while the store refuses it
# How long a save that only a request made (a runner busy, then available again) may wait for company. No restart
# needs it (requests die with the daemon), and writing the whole state twice per request cost the hot path a
# share of the CPU (bench/request_cost.py); within this window the saves of every request coalesce into one.
LAZY_WRITE_S = 0.25


class StoreUnavailable(Exception):
    """The state cannot be written now (degraded: new placements wait until it can), or read (etcd is away)."""


class NotStoredYet(StoreUnavailable):
    """The change was made, but its write was refused: it is written once the store takes it, unless another node
    becomes the controller first. Neither done nor undone, for its caller: ask again what became of it."""


class Journal:
    def __init__(self, state: StateStore, local: Store) -> None:
        self.state, self.local = state, local
        self.written = trio.Event()  # set (and replaced) at every write: wakes the event streams
        self._state_error: str | None = None
        self._book = ProcessBook(local, refused=lambda: self._wake.set())  # the writer retries it
        self._snapshot: Callable[[], dict[str, Any]] | None = None
        self._now = 0.0
        self._entries: list[LogEntry] = []
        self._asked = 0  # saves asked for …
        self._done = 0  # … and how many of them a write covered
        self._wake = trio.Event()
        self._urgent = trio.Event()  # set while a queued save is one a restart would need
        self._lock = trio.Lock()  # one write at a time: the writer's, or a `durable` caller's
        self._retired: str | None = None  # why this journal writes nothing more (`retire`)

    @staticmethod
    async def read(reading: Awaitable[Any]) -> Any:
        """What the store answers; `StoreUnavailable` (the controller's word for it) if it cannot now."""
        try:
            return await reading
        except StateUnavailable as exc:
            raise StoreUnavailable(str(exc)) from exc

    @property
    def degraded(self) -> str | None:
        """Why the state cannot be written now; None: it can."""
        return self._retired or self.state.refused or self._state_error or self._book.error

    def writable(self, what: str) -> None:
        """`StoreUnavailable` if the store refuses writes now: ``what`` (a placement …) would be acknowledged
        while a crash could lose it."""
        if self.degraded is not None:
            raise StoreUnavailable(f"{self.degraded}; {what} wait until it can be written again")

    async def stored(self, what: str) -> None:
        """Until every save so far is written; `StoreUnavailable` if the store refused it, so that nothing it
        has not taken is acknowledged. Found by the fault campaign (#26): a controller cut from etcd answered
        201 to a placement whose write had failed, stepped down, and the placement was lost. What was refused
        stays queued and is written once the store takes it, unless another node is the controller by then."""
        if not await self.durable():
            raise NotStoredYet(
                f"{self.degraded}; {what} but not stored yet: it is written once the store takes it, unless "
                "another node becomes the controller first (ask again in a few seconds what became of it)"
            )

    async def retire(self, why: str) -> None:
        """Write nothing more, and wait for a write in flight to end: whoever reads the state next (the next
        term, another node's or this one's again) must read it after this journal's last write. Found by the
        fault campaign (#26): a controller that stepped down and took its term back restored from the stored
        state while a write of its previous turn was still to come; the log then went on from two states."""
        self._retired = why
        async with self._lock:
            pass

    # -- the controller's side ------------------------------------------------------------------

    def save(
        self, snapshot: Callable[[], dict[str, Any]], entries: Iterable[LogEntry], now: float, *, lazy: bool = False
    ) -> None:
        """Queue a write of the state as ``snapshot`` will read it, with ``entries``; the journal owns them now.
        ``lazy``: nothing a restart needs changed (a request came or went): the writer may wait `LAZY_WRITE_S` for
        more before it writes; whoever awaits `durable` has it written at once all the same."""
        self._snapshot, self._now = snapshot, now
        self._entries.extend(entries)
        self._asked += 1
        if not lazy:
            self._urgent.set()
        self._wake.set()

    async def durable(self) -> bool:
        """Wait until every save asked for so far is written; False if the store refuses it now (degraded:
        it stays queued and is written once the store takes it)."""
        target = self._asked
        while self._done < target:
            if not await self.flush():
                return False
        return True

    async def recorded(self) -> None:
        """Wait until every save asked for so far is written, however long the store refuses it. In a cluster a
        refused write raises `exod.cluster.election.Deposed`: what waits here must not act for a term that is over."""
        while not await self.durable():
            await trio.sleep(WRITE_RETRY)

    def record_process(self, record: ProcessRecord) -> None:
        self._book.record(record)

    def forget_process(self, runner_id: str, incarnation: int) -> None:
        self._book.forget(runner_id, incarnation)

    # -- the writer ---------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write whatever is queued, as it comes; while the store refuses, again at each change, or after
        `WRITE_RETRY` s."""
        task_status.started()
        while True:
            if self._done == self._asked and self._book.error is None:
                await self._wake.wait()
            self._wake = trio.Event()
            if not self._urgent.is_set():  # only requests came and went: let the next ones join this write
                with trio.move_on_after(LAZY_WRITE_S):
                    await self._urgent.wait()
            if not await self.flush():  # again in WRITE_RETRY s, or at the next change if it comes sooner
                with trio.move_on_after(WRITE_RETRY):
                    await self._wake.wait()

    async def flush(self) -> bool:
        """Write what is queued now; True once nothing is."""
        async with self._lock:
            if self._retired is not None:
                return False
            self._book.retry()
            if self._done == self._asked:
                return self._book.error is None
            asked, entries, urgent = self._asked, list(self._entries), self._urgent
            self._urgent = trio.Event()  # what comes during the write is written after it
            assert self._snapshot is not None
            try:
                await self.state.save(self._snapshot(), entries, self._now)
            except StateUnavailable as exc:
                if urgent.is_set():  # still queued, and still needed by a restart
                    self._urgent.set()
                if self._state_error is None:
                    log.error("%s: degraded until it can be written", exc)
                self._state_error = str(exc)
                return False
            del self._entries[: len(entries)]
            self._done = asked
            if self._state_error is not None:
                log.warning("the state is written to %s again", self.state.where)
                self._state_error = None
            self.written.set()
            self.written = trio.Event()
            return self._book.error is None
