"""One controller per cluster, elected in etcd; what it writes is guarded so a deposed one cannot.

The election key (``PREFIX/controller``) is created in a transaction that succeeds only if it does not
exist, on the candidate's node lease: the node that creates it is the controller for as long as its lease
lives. When that node dies or is cut off, its lease expires, the key goes, and the others, watching it,
campaign again. Nobody compares clocks.

Every write of the controller is a transaction guarded by the key *as it won it*: its value (the node id)
and its create revision. A controller whose lease expired — even one that was elected again since, under a
new revision — finds the comparison false, and etcd refuses the write (`Deposed`): two controllers never
both write, whatever the timing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import trio

from exod.cluster.etcd import Compare, Delete, Etcd, EtcdUnavailable, Put, version_is

log = logging.getLogger("exod.election")

TERM_HEADER = "X-Exod-Term"  # a controller's request to an agent names its term: `Term.revision`


class Deposed(Exception):
    """This node is no longer the controller: etcd refused its write."""


@attrs.frozen
class Term:
    """A won election: the key as it was created, which every guarded write compares against."""

    key: bytes
    node_id: str
    revision: int  # the election key's create revision

    def guard(self) -> list[Compare]:
        return [
            Compare(self.key, "VALUE", "EQUAL", self.node_id.encode()),
            Compare(self.key, "CREATE", "EQUAL", self.revision),  # this term, not a later re-election
        ]


def election_key(prefix: bytes) -> bytes:
    return prefix + b"controller"


async def campaign(etcd: Etcd, prefix: bytes, node_id: str, lease: int) -> Term | None:
    """Try once to become the controller; the `Term` if this node is (now, or already was), else None."""
    key = election_key(prefix)
    await etcd.txn([version_is(key, 0)], [Put(key, node_id.encode(), lease)])
    holder = await etcd.get(key)
    if holder is not None and holder.value == node_id.encode() and holder.lease == lease:
        return Term(key, node_id, holder.create_revision)
    return None


async def leader(etcd: Etcd, prefix: bytes) -> str | None:
    """The controller's node id, if there is one."""
    holder = await etcd.get(election_key(prefix))
    return None if holder is None else holder.value.decode()


async def guarded_write(etcd: Etcd, term: Term, ops: Sequence[Put | Delete]) -> int:
    """Apply ``ops`` only while ``term`` holds; returns the revision. `Deposed` otherwise."""
    result = await etcd.txn(term.guard(), ops)
    if not result.succeeded:
        raise Deposed(f"node {term.node_id} is no longer the controller (its term of revision {term.revision} ended)")
    return result.revision


async def wait_for_term(etcd: Etcd, prefix: bytes, node_id: str, lease: int, *, recheck: float = 10.0) -> Term:
    """Campaign until elected: again each time the key is deleted (its holder's lease expired, or it resigned),
    and at least every ``recheck`` seconds: a watch whose connection died in silence says nothing, so none is
    trusted to say the key went."""
    key = election_key(prefix)
    while True:
        term = await campaign(etcd, prefix, node_id, lease)
        if term is not None:
            return term
        holder, revision = await etcd.read(key)
        if holder is None:
            continue
        try:
            with trio.move_on_after(recheck):
                async for event in etcd.watch(key, start_revision=revision + 1):
                    if event.deleted:
                        break
        except EtcdUnavailable as exc:
            log.warning("watching the election failed (%s): campaigning again", exc)
            await trio.sleep(1.0)
