"""This daemon as a member of a cluster: its node record kept alive, and the controller election.

`Membership.run` (in the daemon's nursery) joins with the node's lease (`exod.cluster.nodes.Presence`) and
campaigns on that same lease (`exod.cluster.election`), for as long as the daemon runs: elected, it holds the
controller's `Term` until the key goes (its lease expired) or its authority ends by its clock, then campaigns
again once it has authority back; a key still its own is its term again (`fsm.fencing`'s RESUME). What it is now —
controller or not, and the term to guard its writes with — is read from `term`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import trio

from exod.cluster.election import Term, election_key, leader, wait_for_term
from exod.cluster.etcd import Etcd, EtcdError, EtcdSecurity, EtcdUnavailable, KeyValue
from exod.cluster.nodes import DEFAULT_TTL, NodeRecord, Presence, list_nodes
from exod.cluster.tls import NodeTls, peer_url, verify

log = logging.getLogger("exod.membership")

DEFAULT_PREFIX = "/exod/"  # every key of the cluster is under it


@attrs.frozen
class ClusterConfig:
    """``exod serve --cluster URL --node-id NAME --advertise ADDR``."""

    url: str
    node_id: str
    advertise: str
    lease_ttl: int = attrs.field(default=DEFAULT_TTL, validator=attrs.validators.ge(2))
    prefix: str = DEFAULT_PREFIX
    token: str = attrs.field(default="", repr=False)  # the cluster's credential (`exod.cluster.token`)
    etcd: EtcdSecurity = attrs.Factory(EtcdSecurity)  # how to reach a secured etcd (TLS, etcd's own user)
    tls: NodeTls | None = None  # node-to-node HTTPS, both ends verified (`exod.cluster.tls`); None: plain HTTP


class Membership:
    def __init__(
        self,
        etcd: Etcd,
        config: ClusterConfig,
        record: NodeRecord,
        refresh: Callable[[NodeRecord], NodeRecord] | None = None,
    ) -> None:
        self.etcd, self.config = etcd, config
        self.prefix = config.prefix.encode()
        self.presence = Presence(etcd, self.prefix, record, ttl=config.lease_ttl, refresh=refresh)
        self._term: Term | None = None
        self._term_changed = trio.Event()
        self.malformed: Counter[str] = Counter()  # values in etcd skipped as not exod's, by kind (`/metrics`)
        self._last_seen: tuple[str, str, float] | None = None  # the controller's id and URL, and when (trio time)

    @property
    def term(self) -> Term | None:
        """The controller's term while this node is the controller; None while it is not."""
        return self._term

    @term.setter
    def term(self, term: Term | None) -> None:
        self._term = term
        self._term_changed.set()
        self._term_changed = trio.Event()

    async def elected(self) -> Term:
        """Wait until this node is the controller; its term."""
        while self._term is None:
            await self._term_changed.wait()
        return self._term

    async def deposed(self, term: Term) -> None:
        """Wait until ``term`` has ended."""
        while self._term is term:
            await self._term_changed.wait()

    @property
    def node_id(self) -> str:
        return self.config.node_id

    def peer_client(self, timeout: httpx.Timeout) -> httpx.AsyncClient:
        """An HTTP client for requests to the other nodes: over TLS, verified both ways, where the cluster has it."""
        return httpx.AsyncClient(timeout=timeout, verify=verify(self.config.tls))

    def peer_url(self, url: str) -> str:
        """Where this node reaches the API another node serves at ``url`` (`exod.cluster.tls.peer_url`)."""
        return peer_url(url, self.config.tls)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.presence.run)
            task_status.started()
            while True:
                try:
                    await self.presence.authority_held()
                    lease, ttl = self.presence.lease, self.config.lease_ttl
                    term = await wait_for_term(self.etcd, self.prefix, self.node_id, lease, recheck=ttl)
                    self.term = term
                    log.warning("node %s is the controller (term %d)", self.node_id, term.revision)
                    await self._until_deposed(term)
                except EtcdUnavailable as exc:
                    log.error("the election cannot reach etcd: %s", exc)
                    await trio.sleep(1.0)
                except EtcdError as exc:  # e.g. our lease expired under the campaign: Presence joins again
                    log.warning("campaign refused (%s): trying again", exc)
                    await trio.sleep(self.config.lease_ttl / 3)
                finally:
                    self.term = None

    async def _until_deposed(self, term: Term) -> None:
        """Return once ``term`` has ended: the election key is no longer ours (deleted with our lease, or
        written by another), or — whatever etcd or any watch says — our authority ran out by our own clock
        (`Presence.authority_until`). A silent partition leaves a watch waiting forever; the clock ends the
        term all the same, before our lease may expire and another node be elected (DESIGN §5). Through a
        short outage the term holds, and the runners keep serving."""

        async def key_lost() -> None:
            await self._until_key_lost(term)
            ended.cancel_scope.cancel()

        async def clock() -> None:
            await self.presence.authority_lost()
            log.error("node %s cannot renew its lease in time: stepping down as the controller", self.node_id)
            ended.cancel_scope.cancel()

        async with trio.open_nursery() as ended:
            ended.start_soon(key_lost)
            ended.start_soon(clock)

    async def _until_key_lost(self, term: Term) -> None:
        """Return once etcd says the election key is no longer ``term``'s."""
        while True:
            try:
                holder, revision = await self.etcd.read(term.key)
                if holder is None or not _holds(term, holder):
                    return
                async for event in self.etcd.watch(term.key, start_revision=revision + 1):
                    if event.deleted or not _holds(term, event.kv):
                        return
            except EtcdUnavailable:  # meanwhile the clock decides (`_until_deposed`)
                await trio.sleep(1.0)

    async def controller(self) -> tuple[str | None, str | None]:
        """The controller's node id and API URL, as etcd has them (None where there is none yet). Through an
        outage of etcd, the controller last seen, for as long as its term can still be alive: its lease's TTL
        from when it was seen holding the election key; `EtcdUnavailable` after that."""
        try:
            node_id = await leader(self.etcd, self.prefix)
            nodes = await list_nodes(self.etcd, self.prefix, self.malformed)
        except EtcdUnavailable:
            if self._last_seen is not None and trio.current_time() < self._last_seen[2] + self.config.lease_ttl:
                return self._last_seen[0], self._last_seen[1]
            raise
        url = {n.record.node_id: n.record.api_url for n in nodes}.get(node_id) if node_id is not None else None
        self._last_seen = (node_id, url, trio.current_time()) if node_id is not None and url else None
        return node_id, url

    async def nodes(self) -> dict[str, Any]:
        """Every live node, which one is the controller, and this node's id: the cluster as etcd has it."""
        controller = await leader(self.etcd, self.prefix)
        members = await list_nodes(self.etcd, self.prefix, self.malformed)
        return {
            "cluster": self.config.url,
            "node_id": self.node_id,
            "controller": controller,
            "election_key": election_key(self.prefix).decode(),
            # this node's runners end in so many seconds unless its lease is renewed (their deadline)
            "fence_in": round(max(0.0, self.presence.authority_until - trio.current_time()), 3),
            "nodes": [
                {
                    **attrs.asdict(n.record),
                    "lease_age": n.lease_age,
                    "lease_ttl": n.lease_ttl,
                    "controller": n.record.node_id == controller,
                }
                for n in members
            ],
        }

    async def leave(self) -> None:
        with trio.move_on_after(2.0):
            await self.presence.leave()


def _holds(term: Term, holder: KeyValue) -> bool:
    """The election key is still ``term``'s: created by it, and naming this node (what `Term.guard` compares)."""
    return holder.create_revision == term.revision and holder.value == term.node_id.encode()
