"""This daemon as a member of a cluster: its node record kept alive, and the controller election.

`Membership.run` (in the daemon's nursery) joins with the node's lease (`exod.nodes.Presence`) and
campaigns on that same lease (`exod.election`), for as long as the daemon runs: elected, it holds the
controller's `Term` until the key goes (its lease expired), then campaigns again. What it is now —
controller or not, and the term to guard its writes with — is read from `term`.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import trio

from exod.election import Term, election_key, leader, wait_for_term
from exod.etcd import Etcd, EtcdError, EtcdUnavailable
from exod.nodes import DEFAULT_TTL, NodeRecord, Presence, list_nodes

log = logging.getLogger("exod.membership")


@attrs.frozen
class ClusterConfig:
    """``exod serve --cluster URL --node-id NAME --advertise ADDR``."""

    url: str
    node_id: str
    advertise: str
    lease_ttl: int = attrs.field(default=DEFAULT_TTL, validator=attrs.validators.ge(2))
    prefix: str = "/exod/"


class Membership:
    def __init__(self, etcd: Etcd, config: ClusterConfig, record: NodeRecord) -> None:
        self.etcd, self.config = etcd, config
        self.prefix = config.prefix.encode()
        self.presence = Presence(etcd, self.prefix, record, ttl=config.lease_ttl)
        self.term: Term | None = None  # set while this node is the controller

    @property
    def node_id(self) -> str:
        return self.config.node_id

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.presence.run)
            task_status.started()
            while True:
                try:
                    self.term = await wait_for_term(self.etcd, self.prefix, self.node_id, self.presence.lease)
                    log.warning("node %s is the controller (term %d)", self.node_id, self.term.revision)
                    await self._until_deposed(self.term)
                except EtcdUnavailable as exc:
                    log.error("the election cannot reach etcd: %s", exc)
                    await trio.sleep(1.0)
                except EtcdError as exc:  # e.g. our lease expired under the campaign: Presence joins again
                    log.warning("campaign refused (%s): trying again", exc)
                    await trio.sleep(self.config.lease_ttl / 3)
                finally:
                    self.term = None

    async def _until_deposed(self, term: Term) -> None:
        """Return once the election key is no longer ours (deleted with our lease, or written by another)."""
        holder, revision = await self.etcd.read(term.key)
        if holder is None or holder.create_revision != term.revision:
            return
        async for event in self.etcd.watch(term.key, start_revision=revision + 1):
            if event.deleted or event.kv.create_revision != term.revision:
                return

    async def nodes(self) -> dict[str, Any]:
        """Every live node, which one is the controller, and this node's id: the cluster as etcd has it."""
        controller = await leader(self.etcd, self.prefix)
        members = await list_nodes(self.etcd, self.prefix)
        return {
            "cluster": self.config.url,
            "node_id": self.node_id,
            "controller": controller,
            "election_key": election_key(self.prefix).decode(),
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
