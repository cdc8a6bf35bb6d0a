"""Where instances go: `fsm.admit` and `fsm.place_again`, asked with what this daemon knows.

The decisions are the library's (pure); this room gathers their inputs — the model's facts from its files,
the machines' view, the nodes (this host alone, or the cluster's live nodes and what each holds) and the
limits — and applies a move of ranks off a node that is gone (`fsm.cluster.Cluster.move`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import fsm
from exod.cluster.remote import Fleet
from exod.config import DaemonConfig
from exod.host.models import ModelFiles
from exod.status import NODE
from fsm.cluster import Cluster


class Placer:
    def __init__(self, cluster: Callable[[], Cluster], models: ModelFiles, config: DaemonConfig, fleet: Fleet | None):
        self._cluster, self.models, self.config, self.fleet = cluster, models, config, fleet

    def admission(self, model_id: str, ranks: int, nodes: list[str] | None = None) -> fsm.Admission:
        """What `fsm.admit` answers for placing ``model_id`` on ``ranks`` ranks (on ``nodes`` only) now."""
        return fsm.admit(model_id, ranks, pin=nodes, **self._facts(model_id))

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
        model, view, limits = self.models.facts(model_id), cluster.view(), self.config.limits
        return {"model": model, "view": view, "nodes": nodes, "limits": limits, "facts": facts, "cached": cached}
