"""Where instances go, and whether they stay: `fsm.admit`, `fsm.admit_unpark` and `fsm.place_again`, asked
with what this daemon knows.

The decisions are the library's (pure); this room gathers their inputs — the model's facts from its files,
the machines' view, the nodes (this host alone, or the cluster's live nodes and what each holds) and the
limits — and applies the answers to the machines: a placement, the idle instances it evicts (parks) to make
room, an unpark, a move of ranks off a node that is gone (`fsm.cluster.Cluster.move`).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable
from typing import Any

import fsm
from exod.cluster.remote import Fleet
from exod.config import DaemonConfig
from exod.host.models import ModelFiles
from exod.status import NODE
from fsm.cluster import Cluster, LogEntry

log = logging.getLogger("exod.placer")


class PlacementRefused(Exception):
    """`fsm.admit` refused a placement (or an unpark); ``refusal`` says why (the API maps it to 404, 409, 422)."""

    def __init__(self, refusal: fsm.Refusal, message: str) -> None:
        super().__init__(message)
        self.refusal = refusal


class InstanceBusy(Exception):
    """The instance cannot be parked or unparked now: a request in flight, a failed generation retried, or its
    runners still being stopped. The message says which, and when to try again."""


class Placer:
    def __init__(
        self,
        cluster: Callable[[], Cluster],
        models: ModelFiles,
        config: DaemonConfig,
        fleet: Fleet | None,
        requests: Callable[[], Iterable[fsm.PendingRequest]] = tuple,
    ) -> None:
        """``requests``: those waiting in the request book (an instance a request waits for is never evicted)."""
        self._cluster, self.models, self.config, self.fleet = cluster, models, config, fleet
        self._requests = requests

    def admission(
        self, model_id: str, ranks: int, nodes: list[str] | None = None, *, evict: bool = False
    ) -> fsm.Admission:
        """What `fsm.admit` answers for placing ``model_id`` on ``ranks`` ranks (on ``nodes`` only) now."""
        return fsm.admit(model_id, ranks, pin=nodes, evict=evict, **self._facts(model_id))

    def place(
        self,
        model_id: str,
        ranks: int,
        now: float,
        policy: fsm.RetryPolicy,
        nodes: list[str] | None,
        keep_alive: float | None,
    ) -> str:
        """Place it if `fsm.admit` admits it, parking first the idle instances it names; the new instance's id.
        `PlacementRefused` (and nothing changed) if not."""
        answer = self.admission(model_id, ranks, nodes, evict=True)
        if not answer.admitted:
            assert answer.refusal is not None
            raise PlacementRefused(answer.refusal, answer.message)
        cluster = self._cluster()
        self.evict(answer, now)
        instance_id = f"{model_id.split('/')[-1]}-{secrets.token_hex(3)}"
        slots = [fsm.Slot(rank, node, f"{instance_id}/{rank}") for rank, node in enumerate(answer.nodes)]
        cluster.place(instance_id, model_id, slots, policy=policy, keep_alive=keep_alive)
        cluster.log.append(LogEntry(now, "instance", instance_id, "place", "", "pending"))
        return instance_id

    def evict(self, answer: fsm.Admission, now: float) -> None:
        """Park the idle instances an admission names, for the memory of the one it admitted."""
        cluster = self._cluster()
        for instance_id in answer.evict:
            log.info("parking %s to make room", instance_id)
            cluster.park(instance_id, now, fsm.ParkReason.EVICTED)

    def park(self, instance_id: str, now: float) -> None:
        """Park it as an operator asked; `InstanceBusy` while it cannot be."""
        try:
            self._cluster().park(instance_id, now)
        except fsm.IllegalTransition as exc:
            raise InstanceBusy(f"instance {instance_id} cannot be parked now: {exc.why}") from exc

    def unpark(self, instance_id: str, now: float) -> None:
        """Bring a parked instance back now, parking idle ones for its memory: `PlacementRefused` if it does not
        fit even so, `InstanceBusy` while it is still parking (a parked one that is not parked: nothing to do)."""
        cluster = self._cluster()
        if cluster.instance(instance_id).instance_state is fsm.InstanceState.PARKING:
            raise InstanceBusy(f"instance {instance_id} is still parking: its runners are being stopped; try again")
        if cluster.instance(instance_id).instance_state is not fsm.InstanceState.PARKED:
            return
        answer = self.room_to_unpark(instance_id)
        if not answer.admitted:
            assert answer.refusal is not None
            raise PlacementRefused(answer.refusal, answer.message)
        self.evict(answer, now)
        cluster.unpark(instance_id, now)

    def room_to_unpark(self, instance_id: str) -> fsm.Admission:
        """What `fsm.admit_unpark` answers for the parked ``instance_id`` now (evictions included)."""
        return fsm.admit_unpark(instance_id, **self._facts(self._cluster().instances[instance_id].model_id))

    def place_again(self, instance_id: str) -> None:
        """Between generations, the ranks on a node that is gone move to live ones."""
        cluster = self._cluster()
        model_id = cluster.instances[instance_id].model_id
        if self.fleet is not None and (nodes := fsm.place_again(instance_id, **self._facts(model_id))):
            cluster.move(instance_id, nodes)

    def _facts(self, model_id: str) -> dict[str, Any]:
        cluster = self._cluster()
        placed = {pl.model_id for pl in cluster.instances.values() if not pl.machine.is_deleted}
        facts = {m: f for m in placed if isinstance(f := self.models.facts(m), fsm.ModelFacts)}
        nodes, cached = ({NODE: self.config.memory_bytes}, {}) if self.fleet is None else self.fleet.rooms()
        model, view, limits = self.models.facts(model_id), cluster.view(self._requests()), self.config.limits
        return {"model": model, "view": view, "nodes": nodes, "limits": limits, "facts": facts, "cached": cached}
