"""exod.cluster.etcd against a real etcd: keys, prefixes, transactions, leases and watches over the JSON gateway."""

from __future__ import annotations

import socket

import pytest
import trio
from etcd_harness import run_with_client as run

from exod.cluster.etcd import Delete, Etcd, EtcdUnavailable, LeaseExpired, Put, _prefix_end, value_is, version_is


def test_put_get_prefix_and_delete(etcd):
    async def body(client: Etcd):
        first = await client.put(b"/exod/nodes/a", b"\x00binary\xff")
        await client.put(b"/exod/nodes/b", b"B")
        await client.put(b"/exod/nodesX", b"not under the prefix")
        one = await client.get(b"/exod/nodes/a")
        listed, revision = await client.get_prefix(b"/exod/nodes/")
        deleted = await client.delete(b"/exod/nodes/", prefix=True)
        return first, one, listed, revision, deleted, await client.get(b"/exod/nodes/a"), await client.get(b"/nope")

    first, one, listed, revision, deleted, gone, missing = run(etcd, body)
    assert one.value == b"\x00binary\xff" and one.mod_revision == first and one.version == 1
    assert [kv.key for kv in listed] == [b"/exod/nodes/a", b"/exod/nodes/b"] and revision >= first + 2
    assert deleted == 2 and gone is None and missing is None


def test_a_transaction_is_a_compare_and_set(etcd):
    async def body(client: Etcd):
        key = b"/exod/controller"
        created = await client.txn([version_is(key, 0)], [Put(key, b"node-a")])
        taken = await client.txn([version_is(key, 0)], [Put(key, b"node-b")], [Delete(b"/never")])
        guarded = await client.txn([value_is(key, b"node-a")], [Put(b"/exod/state", b"written by a")])
        deposed = await client.txn([value_is(key, b"node-b")], [Put(b"/exod/state", b"written by b")])
        return created, taken, guarded, deposed, (await client.get(key)).value, (await client.get(b"/exod/state"))

    created, taken, guarded, deposed, holder, state = run(etcd, body)
    assert created.succeeded and not taken.succeeded and holder == b"node-a"
    assert guarded.succeeded and not deposed.succeeded and state.value == b"written by a"
    assert created.revision < guarded.revision


def test_keys_on_a_lease_go_with_it(etcd):
    async def body(client: Etcd):
        lease = await client.grant(5)
        await client.put(b"/exod/nodes/a", b"alive", lease=lease)
        ttl = await client.keep_alive(lease)
        held = await client.get(b"/exod/nodes/a")
        await client.revoke(lease)
        after = await client.get(b"/exod/nodes/a")
        with pytest.raises(LeaseExpired):
            await client.keep_alive(lease)
        with pytest.raises(LeaseExpired):
            await client.put(b"/exod/nodes/b", b"x", lease=lease)
        await client.revoke(lease)  # twice: nothing to do
        return ttl, held, after

    ttl, held, after = run(etcd, body)
    assert 0 < ttl <= 5 and held.lease != 0 and after is None


def test_a_watch_streams_every_change_in_order_and_resumes_from_a_revision(etcd):
    async def body(client: Etcd):
        seen = []
        start = await client.put(b"/exod/log/0", b"before the watch")

        async def watch(task_status=trio.TASK_STATUS_IGNORED):
            task_status.started()
            async for event in client.watch(b"/exod/log/", start_revision=start):
                seen.append(event)
                if len(seen) == 4:
                    return

        async with trio.open_nursery() as nursery:
            await nursery.start(watch)
            await client.put(b"/exod/log/1", b"one")
            await client.put(b"/exod/other", b"not watched")
            await client.put(b"/exod/log/2", b"two")
            await client.delete(b"/exod/log/1")
        return start, seen

    start, seen = run(etcd, body)
    assert [(e.deleted, e.kv.key, e.kv.value) for e in seen] == [
        (False, b"/exod/log/0", b"before the watch"),
        (False, b"/exod/log/1", b"one"),
        (False, b"/exod/log/2", b"two"),
        (True, b"/exod/log/1", b""),
    ]
    revisions = [e.kv.mod_revision for e in seen]
    assert revisions[0] == start and revisions == sorted(revisions)


def test_an_etcd_that_is_not_there_is_unavailable_not_a_hang():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens here once it is closed

    async def body(client: Etcd):
        with pytest.raises(EtcdUnavailable, match="cannot reach etcd"):
            await client.get(b"/x")
        with pytest.raises(EtcdUnavailable):
            async for _ in client.watch(b"/x"):
                pass

    run(f"http://127.0.0.1:{port}", body)


@pytest.mark.parametrize(
    ("prefix", "end"),
    [(b"/a/", b"/a0"), (b"a\xff", b"b"), (b"\xff\xff", b"\0"), (b"x", b"y")],
)
def test_the_end_of_a_prefix_range(prefix, end):
    assert _prefix_end(prefix) == end
