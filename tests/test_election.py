"""Nodes and the controller election on a real etcd: records live with their leases, one controller at a
time, another one elected once its lease expires, and a deposed controller's writes refused by etcd."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import attrs
import trio
from etcd_harness import run_with_client as run

from exod.cluster.election import Deposed, Term, campaign, election_key, guarded_write, leader, wait_for_term
from exod.cluster.etcd import Etcd, EtcdUnavailable, Put
from exod.cluster.membership import ClusterConfig, Membership
from exod.cluster.nodes import FENCE_MARGIN, NodeRecord, Presence, list_nodes

PREFIX = b"/exod-test/"
TTL = 5  # the shortest the cluster tests use: two busy cores must not expire a lease falsely


def record(node_id: str, address: str) -> NodeRecord:
    return NodeRecord(node_id, address, f"http://{address}:8420", memory_total=8 << 30, memory_free=6 << 30)


def test_three_nodes_list_each_other_and_a_node_that_leaves_is_gone(etcd):
    async def body(client: Etcd):
        presences = [Presence(client, PREFIX, record(f"node-{n}", f"127.0.0.{n}"), ttl=TTL) for n in (1, 2, 3)]
        async with trio.open_nursery() as nursery:
            for presence in presences:
                await nursery.start(presence.run)
            seen = await list_nodes(client, PREFIX)
            await presences[1].renewed.wait()  # renewed at least once: the lease outlives its first TTL
            await presences[1].leave()
            after = await list_nodes(client, PREFIX)
            nursery.cancel_scope.cancel()
        return seen, after

    seen, after = run(etcd, body)
    assert [n.record.node_id for n in seen] == ["node-1", "node-2", "node-3"]
    assert seen[0].record == record("node-1", "127.0.0.1") and all(0 <= n.lease_age <= TTL for n in seen)
    assert [n.record.node_id for n in after] == ["node-1", "node-3"]


def test_one_controller_and_another_once_its_lease_expires(etcd):
    async def body(client: Etcd):
        a, b = await client.grant(TTL), await client.grant(TTL)
        first = await campaign(client, PREFIX, "node-a", a)
        second = await campaign(client, PREFIX, "node-b", b)
        again = await campaign(client, PREFIX, "node-a", a)  # the holder campaigning again keeps its term
        written = await guarded_write(client, first, [Put(PREFIX + b"state", b"from a")])

        async def renew_b():  # node-b's daemon renews its lease; node-a's was killed and renews nothing
            while True:
                await trio.sleep(1)
                await client.keep_alive(b)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(renew_b)
            with trio.fail_after(3 * TTL):  # node-b is elected once node-a's lease expires
                term_b = await wait_for_term(client, PREFIX, "node-b", b)
            nursery.cancel_scope.cancel()
        try:
            await guarded_write(client, first, [Put(PREFIX + b"state", b"from the deposed a")])
        except Deposed as exc:
            refused = str(exc)
        else:
            refused = None
        await guarded_write(client, term_b, [Put(PREFIX + b"state", b"from b")])
        state = (await client.get(PREFIX + b"state")).value
        return first, second, again, written, term_b, refused, state, await leader(client, PREFIX)

    first, second, again, written, term_b, refused, state, holder = run(etcd, body)
    assert first is not None and second is None and again == first and written > first.revision
    assert term_b.node_id == "node-b" and term_b.revision > first.revision
    assert refused is not None and "no longer the controller" in refused  # etcd refused the deposed write
    assert state == b"from b" and holder == "node-b"


def test_a_controller_reelected_under_a_new_term_cannot_write_with_its_old_one(etcd):
    async def body(client: Etcd):
        lease = await client.grant(TTL)
        old = await campaign(client, PREFIX, "node-a", lease)
        await client.revoke(lease)  # its lease ended (a partition, say)...
        lease = await client.grant(TTL)
        new = await campaign(client, PREFIX, "node-a", lease)  # ...and it was elected again, same name
        try:
            await guarded_write(client, old, [Put(PREFIX + b"x", b"stale")])
        except Deposed:
            stale_refused = True
        else:
            stale_refused = False
        await guarded_write(client, new, [Put(PREFIX + b"x", b"fresh")])
        return old, new, stale_refused, (await client.get(PREFIX + b"x")).value

    old, new, stale_refused, value = run(etcd, body)
    assert new.revision > old.revision and stale_refused and value == b"fresh"


def test_a_node_record_is_refreshed_at_each_renewal(etcd):
    """Free memory and cached models change while a node runs; the others see them within a renewal."""
    free = iter(range(5 << 30, 0, -(1 << 30)))

    def refresh(current: NodeRecord) -> NodeRecord:
        return attrs.evolve(current, memory_free=next(free), models=("org/model",))

    async def body(client: Etcd):
        presence = Presence(client, PREFIX, record("node-1", "127.0.0.1"), ttl=TTL, refresh=refresh)
        async with trio.open_nursery() as nursery:
            await nursery.start(presence.run)
            before = await list_nodes(client, PREFIX)
            await presence.renewed.wait()
            after = await list_nodes(client, PREFIX)
            nursery.cancel_scope.cancel()
        return before[0].record, after[0].record

    before, after = run(etcd, body)
    assert (before.memory_free, before.models) == (6 << 30, ())
    assert (after.memory_free, after.models) == (5 << 30, ("org/model",))


class Silenced(Etcd):
    """An etcd client whose network can go silent, as a cut cable does: calls get no answer until their
    timeout, and an open watch gets nothing more, not even an error."""

    silent = False

    async def _call(self, path, body):
        if self.silent:
            await trio.sleep(self.timeout)
            raise EtcdUnavailable(f"no answer from {path} within {self.timeout} s (silenced by the test)")
        return await super()._call(path, body)

    async def watch(self, prefix, *, start_revision=0):
        async for event in super().watch(prefix, start_revision=start_revision):
            while self.silent:
                await trio.sleep_forever()
            yield event


@contextlib.asynccontextmanager
async def elected_on_a_silenceable_client(etcd: str) -> AsyncIterator[tuple[Silenced, Etcd, Membership, Term]]:
    """node-a, the controller, its lease just renewed, on a client the test can silence; an observer that
    still reaches etcd. The lease is revoked on the way out."""
    client, observer = Silenced(etcd, timeout=1.0), Etcd(etcd)
    config = ClusterConfig(etcd, "node-a", "127.0.0.1", lease_ttl=TTL, prefix=PREFIX.decode())
    membership = Membership(client, config, record("node-a", "127.0.0.1"))
    await membership.presence.join()
    async with trio.open_nursery() as nursery:
        await nursery.start(membership.run)
        with trio.fail_after(TTL):
            term = await membership.elected()
            await membership.presence.renewed.wait()
        yield client, observer, membership, term
        nursery.cancel_scope.cancel()
    await observer.revoke(membership.presence.lease)
    await observer.aclose()


def test_a_controller_cut_off_in_silence_steps_down_by_its_own_clock_before_its_lease_expires(etcd):
    """The term ends by the clock (DESIGN §5): no answer and no watch event ever come, and still the controller
    steps down before its lease may expire, so before another node can be elected."""

    async def main():
        async with elected_on_a_silenceable_client(etcd) as (client, observer, membership, term):
            renewed_at, client.silent = trio.current_time(), True
            with trio.fail_after(2 * TTL):  # before the fix: never (the watch waited on, silent forever)
                await membership.deposed(term)
            stepped_down_after = trio.current_time() - renewed_at
            still_held = await observer.get(election_key(PREFIX))  # the lease has not expired yet
        return stepped_down_after, still_held

    stepped_down_after, still_held = trio.run(main)
    assert still_held is not None and still_held.value == b"node-a"
    assert stepped_down_after <= TTL * (1 - FENCE_MARGIN) + 0.5  # the renewal was asked for before renewed_at


def test_a_controller_that_stepped_down_by_its_clock_takes_its_term_back_once_etcd_answers_in_time(etcd):
    """fsm.fencing's RESUME: the silence ended before the lease did, so the election key is still this node's.
    It campaigns again only once a renewal gave it authority back, and finds that same term: without this, the
    key would live on with no controller behind it for as long as the node renews its lease."""

    async def main():
        async with elected_on_a_silenceable_client(etcd) as (client, _observer, membership, term):
            client.silent = True  # the next renewal goes unanswered; the watch hears nothing more
            await trio.sleep_until(membership.presence.authority_until - 0.1)
            client.silent = False  # etcd answers again just before the clock ends the term, the renewal after it
            with trio.fail_after(2 * TTL):
                await membership.deposed(term)
            with trio.fail_after(2 * TTL):
                again = await membership.elected()
            authority_left = membership.presence.authority_until - trio.current_time()
        return term, again, authority_left

    term, again, authority_left = trio.run(main)
    assert again.revision == term.revision and again is not term  # the same key, as it was won
    assert authority_left > 0  # it campaigned with authority, not to step down at once


FORGED = {
    "not json": b"not json",
    "an extra key": json.dumps({**attrs.asdict(record("x", "127.0.0.9")), "admin": True}).encode(),
    "a list": b"[1, 2]",
    "memory in words": json.dumps({**attrs.asdict(record("x", "127.0.0.9")), "memory_total": "lots"}).encode(),
    "negative memory": json.dumps({**attrs.asdict(record("x", "127.0.0.9")), "memory_free": -1e30}).encode(),
    "infinite memory": b'{"node_id": "x", "address": "127.0.0.9", "api_url": "", "memory_total": 1e400}',
    "10 PB": json.dumps({**attrs.asdict(record("x", "127.0.0.9")), "memory_total": 10**16}).encode(),
    "a path for an id": json.dumps(attrs.asdict(record("../x", "127.0.0.9"))).encode(),
}


def test_records_in_etcd_that_are_not_a_nodes_own_are_skipped_counted_and_never_trusted(etcd):
    """Issue #25: whoever can write to etcd can write anything; one such record made /nodes, placement and
    follower chat answer 500, or won rank 0 with a claim of 10 PB. Each is skipped, said, counted; the real
    nodes are listed as ever. So is a record filed under another node's key, and a runner key with no
    incarnation."""
    from collections import Counter

    from exod.cluster.nodes import live_runners, node_key

    async def body(client: Etcd):
        lease = await client.grant(30)
        real = record("node-a", "127.0.0.1")
        await client.put(node_key(PREFIX, "node-a"), real.to_json(), lease=lease)
        for n, raw in enumerate(FORGED.values()):
            await client.put(node_key(PREFIX, f"x{n}"), raw, lease=lease)
        await client.put(node_key(PREFIX, "node-b"), real.to_json(), lease=lease)  # node-a's record under node-b
        await client.put(PREFIX + b"runners/node-a/i/0/1", b"", lease=lease)
        await client.put(PREFIX + b"runners/node-a/no-incarnation", b"", lease=lease)
        malformed: Counter[str] = Counter()
        listed = await list_nodes(client, PREFIX, malformed)
        runners = await live_runners(client, PREFIX, malformed)
        await client.revoke(lease)
        return listed, runners, malformed

    listed, runners, malformed = run(etcd, body)
    assert [n.record.node_id for n in listed] == ["node-a"]
    assert runners == {"node-a": {("i/0", 1)}}
    assert malformed == {"node": len(FORGED) + 1, "runner": 1}


def test_a_record_update_that_cannot_reach_etcd_is_written_at_the_next_renewal_not_raised(etcd):
    """Found by the fault campaign (#26, seed 723748302): a node restarted while etcd's first member was paused
    could not write its API's address into its record; the update raised, and the daemon died with its API
    just bound (clients saw their connections dropped). Now the address waits for the next renewal."""

    async def main():
        client, observer = Silenced(etcd, timeout=0.5), Etcd(etcd)
        presence = Presence(client, PREFIX, record("node-u", "127.0.0.1"), ttl=TTL)
        await presence.join()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(presence.run)
                client.silent = True
                await presence.update(attrs.evolve(presence.record, api_url="http://127.0.0.1:9999"))  # no raise
                before = [n.record.api_url for n in await list_nodes(observer, PREFIX) if n.record.node_id == "node-u"]
                client.silent = False
                with trio.fail_after(2 * TTL):  # the renewal under way may still be the silenced one
                    await presence.renewed.wait()
                after = [n.record.api_url for n in await list_nodes(observer, PREFIX) if n.record.node_id == "node-u"]
                nursery.cancel_scope.cancel()
        finally:
            await observer.revoke(presence.lease)
            await observer.aclose()
            await client.aclose()
        return before, after

    before, after = trio.run(main)
    assert before == ["http://127.0.0.1:8420"] and after == ["http://127.0.0.1:9999"]
