"""exod.cluster.etcd_state on a real etcd: the cluster's state as a controller term writes it, the log read back in
one order from any point, its bounds, a deposed controller's save refused, and a save whose answer was lost
(applied late, or applied already) never written over what came after it, nor twice."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
import trio
from etcd_harness import run_with_client as run

from exod.cluster.election import Deposed, campaign
from exod.cluster.etcd import Compare, Delete, Etcd, EtcdUnavailable, Put, TxnResult
from exod.cluster.etcd_state import EtcdState
from exod.host.ring import free_ports
from exod.state.journal import Journal
from exod.state.retention import DAY_S, Retention
from exod.state.sqlite import Store, StoreError
from exod.state.store import StateUnavailable
from fsm.cluster import LogEntry

PREFIX = b"/exod-test/"


def entry(n: int, time: float = 1000.0) -> LogEntry:
    return LogEntry(time + n, "instance", f"i{n}", "start", "pending", "starting", cause=f"#{n}")


async def elected(client: Etcd, node_id: str = "node-1"):
    lease = await client.grant(30)
    term = await campaign(client, PREFIX, node_id, lease)
    assert term is not None
    return term, lease


def test_a_snapshot_and_its_log_read_back_as_written_from_any_point(etcd):
    async def body(client: Etcd):
        term, _ = await elected(client)
        state = EtcdState(client, PREFIX, term)
        empty = await state.load(), await state.transitions(), await state.log_start()
        last = [await state.save({"n": k}, [entry(k * 3 + j) for j in range(3)], 2000.0) for k in range(4)]
        reader = EtcdState(client, PREFIX, None)  # another node, or a later term: reads what was written
        return empty, last, await reader.load(), await reader.transitions(), await reader.transitions(after=4, limit=5)

    empty, last, snapshot, everything, window = run(etcd, body)
    assert empty == (None, [], 1)
    assert last == [3, 6, 9, 12] and snapshot == {"n": 3}
    assert everything == [(seq, entry(seq - 1)) for seq in range(1, 13)]
    assert window == [(seq, entry(seq - 1)) for seq in range(5, 10)]  # from inside a batch, across batches


def test_a_new_term_continues_the_sequence_where_the_last_one_ended(etcd):
    async def body(client: Etcd):
        first, lease = await elected(client, "node-1")
        await EtcdState(client, PREFIX, first).save({"by": "node-1"}, [entry(0), entry(1)], 2000.0)
        await client.revoke(lease)  # node-1 is gone
        second, _ = await elected(client, "node-2")
        state = EtcdState(client, PREFIX, second)
        restored = await state.load()
        last = await state.save({"by": "node-2"}, [entry(2)], 2001.0)
        return restored, last, [seq for seq, _ in await state.transitions()]

    restored, last, seqs = run(etcd, body)
    assert restored == {"by": "node-1"} and last == 3 and seqs == [1, 2, 3]


def test_a_deposed_controllers_save_is_refused_and_changes_nothing(etcd):
    async def body(client: Etcd):
        first, lease = await elected(client, "node-1")
        stale = EtcdState(client, PREFIX, first)
        await stale.save({"by": "node-1"}, [entry(0)], 2000.0)
        await client.revoke(lease)
        await elected(client, "node-2")
        with pytest.raises(Deposed, match="node-1 is no longer the controller"):
            await stale.save({"by": "node-1, deposed"}, [entry(1)], 2001.0)
        with pytest.raises(Deposed, match="not the controller"):
            await EtcdState(client, PREFIX, None).save({"by": "a reader"}, [], 2001.0)
        reader = EtcdState(client, PREFIX, None)
        return await reader.load(), await reader.transitions()

    snapshot, log = run(etcd, body)
    assert snapshot == {"by": "node-1"} and log == [(1, entry(0))]


def test_a_save_of_an_earlier_turn_of_the_same_term_is_refused_once_the_node_took_its_term_back(etcd):
    """Found by a 5-min campaign (seed 2074194091): a controller's save timed out at a paused member; the node
    took its term back (the same election key: the same guard), restored and wrote on; then the paused member
    applied the old save, over the new turn's log (readers had been sent another entry at that seq). A turn
    begins by writing its token, and every save compares it: the old save, however late, is refused."""

    async def body(client: Etcd):
        term, _ = await elected(client, "node-1")
        earlier = EtcdState(client, PREFIX, term)
        await earlier.load()
        await earlier.save({"turn": 1}, [entry(0)], 2000.0)
        later = EtcdState(client, PREFIX, term)  # the same node, the same term: its next turn
        restored = await later.load()
        await later.save({"turn": 2}, [entry(1)], 2001.0)
        with pytest.raises(Deposed, match="this turn of it is over"):
            await earlier.save({"turn": "1, late"}, [entry(9)], 2000.5)  # what the paused member held back
        await later.save({"turn": 2}, [entry(2)], 2002.0)  # the new turn goes on
        reader = EtcdState(client, PREFIX, None)
        return restored, await reader.load(), await reader.transitions()

    restored, snapshot, log = run(etcd, body)
    assert restored == {"turn": 1} and snapshot == {"turn": 2}
    assert log == [(1, entry(0)), (2, entry(1)), (3, entry(2))]  # nothing of the late save, no seq written twice


@pytest.mark.parametrize("bound", ["rows", "age"])
def test_the_log_is_pruned_to_its_bounds_in_whole_batches_and_says_where_it_starts(etcd, bound):
    retention = Retention(max_log_rows=10) if bound == "rows" else Retention(max_log_age_days=1.0)

    async def body(client: Etcd):
        term, _ = await elected(client)
        state = EtcdState(client, PREFIX, term, retention=retention)
        for k in range(8):  # batches of 2: seqs 1-2, 3-4, …; one day apart when the age is the bound
            at = 1000.0 + (k * DAY_S / 2 if bound == "age" else 0)
            await state.save({"k": k}, [entry(2 * k, at), entry(2 * k + 1, at)], at + 1)
        return await state.log_start(), await state.transitions(), at + 1

    start, kept, now = run(etcd, body)
    assert [seq for seq, _ in kept] == list(range(start, 17)) and start > 1  # a prefix went, without gaps
    if bound == "rows":
        assert len(kept) <= 10
    else:  # the last save was at day 3.5: nothing older than a day is kept
        assert all(now - e.time <= DAY_S for _, e in kept) and start >= 9


def test_a_snapshot_that_is_not_exods_is_refused_and_left_untouched(etcd):
    async def body(client: Etcd):
        await client.put(PREFIX + b"state/snapshot", b"[1, 2")
        with pytest.raises(StoreError, match=r"cannot be restored .*not JSON.*etcdctl del"):
            await EtcdState(client, PREFIX, None).load()
        return await client.get(PREFIX + b"state/snapshot")

    assert run(etcd, body).value == b"[1, 2"


def test_an_etcd_out_of_reach_is_state_unavailable_not_a_crash():
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"

    async def body(client: Etcd):
        state = EtcdState(client, PREFIX, None)
        with pytest.raises(StateUnavailable, match=f"etcd at {url}"):
            await state.load()
        with pytest.raises(StateUnavailable, match="cannot read the transition log"):
            await state.transitions()
        return True

    assert run(url, body)


def test_a_reader_on_another_node_is_woken_by_the_controllers_next_save(etcd):
    async def body(client: Etcd):
        term, _ = await elected(client)
        writer, reader = EtcdState(client, PREFIX, term), EtcdState(client, PREFIX, None)
        await writer.save({}, [entry(0)], 2000.0)
        with trio.fail_after(5):
            await reader.changed(after=0)  # there is an entry past 0 already: at once
        woken = []
        async with trio.open_nursery() as nursery:

            async def wait() -> None:
                await reader.changed(after=1)
                woken.append(await reader.transitions(after=1))

            nursery.start_soon(wait)
            await trio.sleep(0.5)
            assert woken == []  # nothing new: it waits
            await writer.save({}, [entry(1)], 2001.0)
        return woken

    assert run(etcd, body) == [[(2, entry(1))]]


# -- a save whose answer was lost: a paused member, and the client passing over to the next one ------------


class PausedMember:
    """The client as a save sent to a paused etcd member leaves it: the caller gets `EtcdUnavailable` (a timeout),
    and the save is either held back, to be applied once the member resumes (``fault = "hold"``; ``"hold until
    the next"``: applied just before the next save reaches etcd), or applied already (``"lose"``: only its answer
    was lost). Every other call goes through as it is."""

    def __init__(self, client: Etcd) -> None:
        self.client = client
        self.fault: str | None = None
        self.held: tuple[Sequence[Compare], Sequence[Put | Delete]] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def txn(self, compare: Sequence[Compare], success: Sequence[Put | Delete], failure=()) -> TxnResult:
        saves = any(isinstance(op, Put) and op.key == PREFIX + b"state/meta" for op in success)
        if saves and self.fault == "deliver":
            self.fault = None
            await self.resume()
        elif saves and self.fault is not None:
            fault, self.fault = self.fault, None
            if fault == "lose":
                await self.client.txn(compare, success, failure)
            else:
                self.held = (compare, success)
                self.fault = "deliver" if fault == "hold until the next" else None
            raise EtcdUnavailable(f"cannot reach etcd at {self.client.url}: ReadTimeout (a paused member, {fault})")
        return await self.client.txn(compare, success, failure)

    async def resume(self) -> TxnResult:
        """The paused member resumes: the save it held is proposed now, as it was sent."""
        assert self.held is not None
        compare, success = self.held
        self.held = None
        return await self.client.txn(compare, success)


async def stored(client: Etcd) -> tuple[dict[str, Any] | None, dict[str, Any], list[tuple[int, LogEntry]]]:
    """The snapshot, the meta and the log as any reader finds them."""
    reader = EtcdState(client, PREFIX, None)
    meta = await client.get(PREFIX + b"state/meta")
    assert meta is not None
    return await reader.load(), json.loads(meta.value), await reader.transitions()


async def saved_once(client: Etcd) -> tuple[PausedMember, EtcdState]:
    """A controller's turn through a member that can be paused, with one save made (seq 1)."""
    term, _ = await elected(client)
    etcd = PausedMember(client)
    state = EtcdState(etcd, PREFIX, term)  # type: ignore[arg-type]
    await state.load()
    await state.save({"n": 1}, [entry(0)], 2001.0)
    return etcd, state


def test_a_save_retried_at_another_member_is_not_overwritten_when_the_paused_one_applies_the_first_attempt(etcd):
    """A save timed out at a paused member; the journal retried it (the client now at another member) with its
    entries and the next ones, and saved again; then the member resumed and applied the first attempt, the same
    term and the same turn: the snapshot and the meta went back, and its batch replaced the retry's at the same
    log key (readers sent entry 3 lost it: the chaos campaign's invariant 6). Each save compares the revision of
    the meta it builds on: the late attempt is refused."""

    async def body(client: Etcd):
        etcd, state = await saved_once(client)
        etcd.fault = "hold"
        with pytest.raises(StateUnavailable, match="paused member"):
            await state.save({"n": 2}, [entry(1)], 2002.0)
        retried = await state.save({"n": 3}, [entry(1), entry(2)], 2003.0)  # as the journal retries: queued first
        later = await state.save({"n": 4}, [entry(3)], 2004.0)
        late = await etcd.resume()
        after = await stored(client)
        goes_on = await state.save({"n": 5}, [entry(4)], 2005.0)
        return retried, later, late.succeeded, after, goes_on

    retried, later, late_applied, (snapshot, meta, log), goes_on = run(etcd, body)
    assert (retried, later, late_applied, goes_on) == (3, 4, False, 5)
    assert snapshot == {"n": 4}
    assert meta == {"last_seq": 4, "log_start": 1, "oldest_time": entry(0).time}
    assert log == [(seq, entry(seq - 1)) for seq in range(1, 5)]


@pytest.mark.parametrize("applied", ["before the retry", "as the retry was sent"])
def test_a_save_applied_whose_answer_was_lost_is_not_written_twice_nor_counted_a_deposition(etcd, applied):
    """The mirror case: etcd applied the save, but its answer was lost (the member paused after it applied it, or
    the paused member resumed just after the retry had read the meta and found it not applied). The retry
    carries its entries again: it must not write them twice (a refused retry, before, was counted a deposition:
    a controller's turnover), nor lose any."""

    async def body(client: Etcd):
        etcd, state = await saved_once(client)
        etcd.fault = "lose" if applied == "before the retry" else "hold until the next"
        with pytest.raises(StateUnavailable, match="paused member"):
            await state.save({"n": 2}, [entry(1), entry(2)], 2002.0)
        retried = await state.save({"n": 3}, [entry(1), entry(2), entry(3)], 2003.0)
        later = await state.save({"n": 4}, [entry(4)], 2004.0)
        return retried, later, await stored(client)

    retried, later, (snapshot, meta, log) = run(etcd, body)
    assert (retried, later, snapshot) == (4, 5, {"n": 4})
    assert meta == {"last_seq": 5, "log_start": 1, "oldest_time": entry(0).time}
    assert log == [(seq, entry(seq - 1)) for seq in range(1, 6)]  # every entry once, in order


def test_the_journal_writes_a_save_whose_answer_was_lost_once_and_goes_on(etcd, tmp_path):
    """The journal's side of the contract: what a refused save held stays queued and is written with the next,
    which the store writes once although etcd had applied the first; the journal stays the controller's."""
    local = Store.open(tmp_path / "local.db")

    async def body(client: Etcd):
        term, _ = await elected(client)
        etcd = PausedMember(client)
        state = EtcdState(etcd, PREFIX, term)  # type: ignore[arg-type]
        await state.load()
        journal = Journal(state, local)
        journal.save(lambda: {"n": 1}, [entry(0)], 2001.0)
        etcd.fault = "lose"
        first = await journal.durable()
        degraded = journal.degraded
        journal.save(lambda: {"n": 2}, [entry(1)], 2002.0)
        second = await journal.durable()
        return first, degraded, second, journal.degraded, await stored(client)

    try:
        first, degraded, second, healed, (snapshot, _, log) = run(etcd, body)
    finally:
        local.close()
    assert first is False and degraded is not None and "paused member" in degraded
    assert second is True and healed is None and snapshot == {"n": 2}
    assert log == [(1, entry(0)), (2, entry(1))]
