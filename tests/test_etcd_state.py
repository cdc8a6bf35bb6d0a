"""exod.cluster.etcd_state on a real etcd: the cluster's state as a controller term writes it, the log read back in
one order from any point, its bounds, and a deposed controller's save refused."""

from __future__ import annotations

import pytest
import trio
from etcd_harness import run_with_client as run

from exod.cluster.election import Deposed, campaign
from exod.cluster.etcd import Etcd
from exod.cluster.etcd_state import EtcdState
from exod.host.ring import free_ports
from exod.state.retention import DAY_S, Retention
from exod.state.sqlite import StoreError
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
