"""Placement: which node hosts each rank of an instance, a pure function of what the nodes have.

The rules, in order of weight:

* **never over a node's room**: a node takes another rank only while its free memory covers one more
  rank's need and it is under ``runners_per_node``;
* **distinct nodes for distinct ranks** when there are enough: ranks are dealt round-robin over the
  candidates, one per node per round, so a node gets a second rank only once every other node that can
  take one has its first (a model split over machines uses them all, and one machine's death costs one
  rank, not several);
* **nodes that hold the model first** (no download before the ranks can start), then the node with the
  most room, then the node id: the same facts always give the same placement;
* **pinned**: a placement given ``pin`` uses those nodes only (``exod place --nodes a,b``).

Round-robin dealing finds a placement whenever the candidates' capacities add up to the ranks asked
for, which is exactly when one exists; otherwise `NoFit` says, node by node, what each lacks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from fsm._validate import integer
from fsm.errors import InvalidConfig

MIB = 1 << 20


@attrs.frozen
class NodeRoom:
    """What a node can give a new instance: memory free for ranks, runners it may still start, its models."""

    node_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    memory_free: int = attrs.field(validator=integer(InvalidConfig))
    runners_free: int = attrs.field(validator=integer(InvalidConfig))
    models: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)

    def capacity(self, need: int) -> int:
        """How many ranks of ``need`` bytes each fit here."""
        if self.runners_free <= 0 or self.memory_free < need:
            return 0
        by_memory = self.memory_free // need if need > 0 else self.runners_free
        return min(by_memory, self.runners_free)


@attrs.frozen
class NoFit:
    """No placement of the ranks fits; ``message`` says what each candidate node lacks."""

    message: str
    too_few_runners: bool  # runners_per_node alone refuses it, whatever the memory: a limit, not the host


def place(
    model_id: str,
    ranks: int,
    need: int,
    nodes: Iterable[NodeRoom],
    *,
    pin: Sequence[str] | None = None,
) -> tuple[str, ...] | NoFit:
    """The node of each rank (rank 0 first), or `NoFit`. ``need`` is what one rank needs, in bytes.

    `InvalidConfig` if ``ranks`` is not a positive int, or ``pin`` names a node that is not among ``nodes``.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise InvalidConfig(f"ranks must be an int >= 1, got {ranks!r}")
    rooms = {room.node_id: room for room in nodes}
    if pin is not None:
        unknown = sorted(set(pin) - set(rooms))
        if unknown or not pin:
            raise InvalidConfig(
                f"pinned node(s) {', '.join(unknown) or '(none)'} not among the live nodes "
                f"({', '.join(sorted(rooms)) or 'none'}); `exod status` lists them"
            )
        rooms = {node: rooms[node] for node in dict.fromkeys(pin)}
    order = sorted(rooms.values(), key=lambda r: (model_id not in r.models, -r.memory_free, r.node_id))
    left = {room.node_id: room.capacity(need) for room in order}
    placed: list[str] = []
    while len(placed) < ranks:
        dealt = False
        for room in order:
            if len(placed) == ranks:
                break
            if left[room.node_id] > 0:
                left[room.node_id] -= 1
                placed.append(room.node_id)
                dealt = True
        if not dealt:
            return _no_fit(ranks, need, order)
    return tuple(placed)


def _no_fit(ranks: int, need: int, order: Sequence[NodeRoom]) -> NoFit:
    lacks = []
    for room in sorted(order, key=lambda r: r.node_id):
        if room.runners_free <= 0:
            lacks.append(f"{room.node_id} is at runners_per_node")
        elif room.memory_free < need:
            short = -(-(need - room.memory_free) // MIB)
            lacks.append(f"{room.node_id} has {room.memory_free // MIB} MiB free, {short} MiB short of a rank")
        else:
            lacks.append(f"{room.node_id} takes {room.capacity(need)}")
    fits = sum(room.capacity(need) for room in order)
    return NoFit(
        message=f"{ranks} ranks of {need // MIB} MiB each do not fit ({fits} do): " + "; ".join(lacks),
        too_few_runners=sum(room.runners_free for room in order) < ranks,
    )
