"""This daemon as a member of a cluster: its node record kept alive, and the controller election.

`Membership.run` (in the daemon's nursery) joins with the node's lease (`exod.cluster.nodes.Presence`) and
campaigns on that same lease (`exod.cluster.election`), for as long as the daemon runs: elected, it holds the
controller's `Term` until the key goes (its lease expired) or its authority ends by its clock, then campaigns
again once it has authority back; a key still its own is its term again (`fsm.fencing`'s RESUME). What it is now —
controller or not, and the term to guard its writes with — is read from `term`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import trio

from exod.cluster.election import Term, election_key, leader, wait_for_term
from exod.cluster.etcd import Etcd, EtcdError, EtcdSecurity, EtcdUnavailable, KeyValue
from exod.cluster.nodes import DEFAULT_TTL, NodeRecord, NodeStatus, Presence, list_nodes
from exod.cluster.tls import NodeTls, peer_transport, peer_url
from exod.cluster.token import HEADER, MIN_FORWARD_IDLE_S

log = logging.getLogger("exod.membership")

DEFAULT_PREFIX = "/exod/"  # every key of the cluster is under it
# `[cluster] forward_idle` by default: this many lease TTLs. Less would gain a client nothing: a controller gone
# is replaced only once its lease expired (a TTL) and its successor has taken over, so the client's retry,
# sooner, would find the same silent controller; and it leaves a busy controller many late keep-alives.
FORWARD_IDLE_TTLS = 3
PEERS_VIEW_S = 2.0  # how long what the other nodes said of the controller is taken as still true
PEERS_VIEW_TIMEOUT_S = 2.0  # for each of them to say it


def _at_least_min_idle(_: object, attribute: attrs.Attribute[float | None], value: float | None) -> None:
    if value is not None and value < MIN_FORWARD_IDLE_S:
        raise ValueError(
            f"{attribute.name} must be at least {MIN_FORWARD_IDLE_S:g} s (a forwarded stream's keep-alives come "
            f"every few seconds: a shorter bound would end live answers), got {value!r}"
        )


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
    # seconds a forwarded request may go without a word from its controller (`exod.api.forward`); None: a few TTLs
    forward_idle: float | None = attrs.field(default=None, validator=_at_least_min_idle)

    @property
    def idle_bound(self) -> float:
        """`forward_idle` as it applies: given, or `FORWARD_IDLE_TTLS` lease TTLs."""
        return FORWARD_IDLE_TTLS * self.lease_ttl if self.forward_idle is None else self.forward_idle


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
        self._last_known: tuple[str, str] | None = None  # the last controller of another node seen, however long ago
        self._peers: dict[str, str] = {}  # every other node's API URL, as etcd last listed them
        self._peers_view: tuple[tuple[str, str] | None, float] | None = None  # what they said, and when (trio time)

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
        """An HTTP client for requests to the other nodes: over TLS, verified both ways, where the cluster has it;
        TCP keep-alive on (`exod.cluster.tls.peer_transport`), so that a connection to a host gone silent ends."""
        return httpx.AsyncClient(timeout=timeout, transport=peer_transport(self.config.tls))

    @property
    def last_known_controller(self) -> tuple[str, str] | None:
        """The controller this node last saw in etcd, if another node (its id and API URL), however long ago:
        where a node that cannot reach etcd may still send a request, for that node to serve or refuse."""
        return self._last_known

    def peer_url(self, url: str) -> str:
        """Where this node reaches the API another node serves at ``url`` (`exod.cluster.tls.peer_url`)."""
        return peer_url(url, self.config.tls)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.presence.run)
            nursery.start_soon(self._keep_peers)
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

    async def _keep_peers(self) -> None:
        """Keep the other nodes' addresses as etcd lists them, every third of a TTL: whom to ask for the controller when
        etcd is out of reach (`controller_seen_by_peers`), the controller itself included (it forwards nothing
        while it is one, so nothing else would have told it)."""
        while True:
            with contextlib.suppress(EtcdUnavailable, EtcdError):
                await self.records()
            await trio.sleep(self.config.lease_ttl / 3)

    async def records(self) -> list[NodeRecord]:
        """Every live node's record, as etcd lists them now (the other nodes' addresses remembered)."""
        nodes = await list_nodes(self.etcd, self.prefix, self.malformed)
        self._remember(nodes)
        return [node.record for node in nodes]

    def _remember(self, nodes: list[NodeStatus]) -> None:
        self._peers = {n.record.node_id: n.record.api_url for n in nodes if n.record.node_id != self.node_id}

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
        self._remember(nodes)
        url = {n.record.node_id: n.record.api_url for n in nodes}.get(node_id) if node_id is not None else None
        self._last_seen = (node_id, url, trio.current_time()) if node_id is not None and url else None
        if node_id is not None and url and node_id != self.node_id:
            self._last_known = (node_id, url)
        return node_id, url

    async def controller_seen_by_peers(self) -> tuple[str, str] | None:
        """The controller as the other nodes see it (their `/nodes`, asked with the cluster's token), for a node
        cut from etcd while they are not: the controller they elected, which this node could not learn from
        etcd (a controller that stepped down, cut off, last saw itself). None if none of them says one.
        Asked at most every `PEERS_VIEW_S`, however many requests want it."""
        now = trio.current_time()
        if self._peers_view is not None and now < self._peers_view[1] + PEERS_VIEW_S:
            return self._peers_view[0]
        seen: tuple[str, str] | None = None
        async with self.peer_client(httpx.Timeout(PEERS_VIEW_TIMEOUT_S)) as client:
            for url in self._peers.values():
                try:
                    answer = await client.get(f"{self.peer_url(url)}/nodes", headers={HEADER: self.config.token})
                    view = answer.json() if answer.status_code == 200 else {}
                except (httpx.HTTPError, ValueError):
                    continue
                urls = {n.get("node_id"): n.get("api_url") for n in view.get("nodes", []) if isinstance(n, dict)}
                controller = view.get("controller")
                if controller and controller != self.node_id and isinstance(urls.get(controller), str):
                    seen = (controller, urls[controller])
                    break
        self._peers_view = (seen, trio.current_time())
        return seen

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
            "renewal": self.presence.renewals.report(),  # how late, how slow, the authority left (#46)
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
