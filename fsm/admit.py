"""Admission: what a placement may ask for, decided once, up front, before anything is stored.

Every refusal of a placement lives here, as one pure function of the request, what is known of the
model, the cluster as it stands and the limits: the API, the CLI and the config file all ask it, so
they cannot disagree, and a refused request changes nothing. What it admits, it admits for good: a
restart restores the placement and never asks again, so nothing multiplies.

The reasons, by the answer a client gets:

* ``UNKNOWN_MODEL`` — the model is not on this node and cannot be fetched (not cached while offline);
* ``TOO_MANY_RANKS`` — more ranks than the model can be split into (layers for a pipeline, attention
  heads for tensor parallelism) or than ``ranks_per_instance``: it could never run as asked;
* ``LIMIT_REACHED`` — ``runners_per_node`` or ``instances_per_model`` would be exceeded;
* ``NO_MEMORY`` — no node has the memory for a rank's share of the weights plus a runner's floor.

A model that is fetchable but not yet on the node is admitted with what can be checked without its
files (the limits); its runners wait for its download (`fsm.plan`).

Reservations count admitted placements, not live processes: an instance that is backing off still
holds its ranks, so a crash loop never frees room for a flood. A parked instance (`fsm.instance`) holds
nothing: it takes its room again when it is unparked (`admit_unpark`), and may find it taken.

Eviction (``evict=True``): a placement or an unpark that does not fit names the idle instances to park
first, least recently used first, until it fits: Ready, nothing in flight or waiting, and a finite
keep-alive (one kept forever is never evicted: forever means forever). If parking all of them is not
enough, it is refused as without eviction, saying what each node lacks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from fsm._validate import integer
from fsm.errors import InvalidConfig
from fsm.instance import InstanceState
from fsm.placement import MIB, NodeRoom, NoFit, place
from fsm.view import ClusterView, InstanceView

_PARKED = (InstanceState.PARKING, InstanceState.PARKED)


class Refusal(enum.Enum):
    """Why `admit` refused a placement (an API maps them to 404, 422 and 409)."""

    UNKNOWN_MODEL = "unknown_model"  #: the model is not to be had (`UnknownModel` says where the caller looked)
    TOO_MANY_RANKS = "too_many_ranks"  #: more ranks than the limits allow or the model splits into
    LIMIT_REACHED = "limit_reached"  #: a count limit is reached (instances of the model, runners per node)
    NO_MEMORY = "no_memory"  #: no set of nodes has the memory for a rank's share of the weights


@attrs.frozen
class ModelFacts:
    """What admission needs to know of a model, read from its files by the caller."""

    layers: int = attrs.field(validator=integer(InvalidConfig, at_least=1))
    attention_heads: int = attrs.field(validator=integer(InvalidConfig, at_least=1))
    kv_heads: int = attrs.field(validator=integer(InvalidConfig, at_least=1))
    pipeline: bool = attrs.field(validator=attrs.validators.instance_of(bool))  # else tensor parallel
    weight_bytes: int = attrs.field(validator=integer(InvalidConfig))

    def max_ranks(self) -> int:
        """The most ranks the model can be split into."""
        if self.pipeline:
            return self.layers
        return max(n for n in range(1, self.attention_heads + 1) if self.splits_into(n))

    def splits_into(self, ranks: int) -> bool:
        """Whether the model divides evenly over ``ranks`` (layers for a pipeline, attention and KV heads for
        tensor parallelism): an uneven split cannot load, so `admit` refuses it up front."""
        if self.pipeline:
            return ranks <= self.layers
        return self.attention_heads % ranks == 0 and self.kv_heads % ranks == 0


@attrs.frozen
class UnknownModel:
    """The caller looked for the model and it is not to be had; ``reason`` says where it looked."""

    reason: str


@attrs.frozen
class Limits:
    """Per-node and per-instance ceilings; `Limits.for_memory` sizes them from the host."""

    runners_per_node: int = attrs.field(validator=integer(InvalidConfig, at_least=1))
    ranks_per_instance: int = attrs.field(validator=integer(InvalidConfig, at_least=1))
    instances_per_model: int = attrs.field(validator=integer(InvalidConfig, at_least=1))
    runner_floor_bytes: int = attrs.field(default=512 * MIB, validator=integer(InvalidConfig, at_least=1))

    @classmethod
    def for_memory(cls, memory_bytes: int, *, runner_floor_bytes: int = 512 * MIB) -> Limits:
        """Defaults for a node with ``memory_bytes``: as many runners as fit at the floor each.

        Not the core count: a 3-rank test instance must run on a 2-core machine.
        """
        runners = max(1, memory_bytes // runner_floor_bytes)
        return cls(
            runners_per_node=runners,
            ranks_per_instance=min(runners, 64),
            instances_per_model=8,
            runner_floor_bytes=runner_floor_bytes,
        )


@attrs.frozen
class Admission:
    """The answer: admitted with a node for each rank, or refused with the reason and what to do."""

    nodes: tuple[str, ...] = ()
    refusal: Refusal | None = None
    message: str = ""
    evict: tuple[str, ...] = ()  # instances to park first (least recently used first): then it fits

    @property
    def admitted(self) -> bool:
        """Whether ``nodes`` may be placed on (after parking ``evict``); if not, ``refusal`` and ``message`` say
        why and what the user can do."""
        return self.refusal is None


def admit(
    model_id: str,
    ranks: int,
    *,
    model: ModelFacts | UnknownModel | None,
    view: ClusterView,
    nodes: Mapping[str, int],
    limits: Limits,
    facts: Mapping[str, ModelFacts] | None = None,
    cached: Mapping[str, Iterable[str]] | None = None,
    pin: Sequence[str] | None = None,
    evict: bool = False,
) -> Admission:
    """May ``ranks`` ranks of ``model_id`` be placed now, and where?

    ``model`` is what is known of the requested model: its facts, `UnknownModel`, or None when it is
    fetchable but not on the node yet. ``nodes`` maps each node to its memory in bytes; ``facts`` gives
    the facts of models already placed (a model missing there reserves only the runner floor per rank);
    ``cached`` the models each node holds; ``pin`` the only nodes to use. Where the ranks go is
    `fsm.placement.place`: distinct nodes first, those holding the model first, then the most room.
    ``evict``: if it does not fit, park idle instances first (the module docstring); ``Admission.evict``.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise InvalidConfig(f"ranks must be an int >= 1, got {ranks!r}")
    if not nodes:
        raise InvalidConfig("admission needs at least one node")
    facts = dict(facts or {})
    if isinstance(model, UnknownModel):
        return _refuse(Refusal.UNKNOWN_MODEL, f"model {model_id!r} is not available: {model.reason}")
    if (too_many := _too_many_ranks(model_id, ranks, model, len(nodes), limits)) is not None:
        return _refuse(Refusal.TOO_MANY_RANKS, too_many)
    live = _reserving(view)
    same_model = sum(1 for inst in view.instances.values() if _placed(inst) and inst.model_id == model_id)
    if same_model >= limits.instances_per_model:
        return _refuse(
            Refusal.LIMIT_REACHED,
            f"model {model_id!r} already has {same_model} instances (instances_per_model = "
            f"{limits.instances_per_model}); delete one first, or raise [limits] instances_per_model",
        )
    need = _rank_bytes(model, ranks, limits)

    def fit(reserving: list[InstanceView]) -> tuple[tuple[str, ...] | NoFit, dict[str, int]]:
        rooms, runners = _rooms(reserving, nodes, limits, facts, cached or {})
        return place(model_id, ranks, need, rooms, pin=pin), runners

    return _admitted(fit, live, _evictable(view) if evict else [], ranks, limits)


def admit_unpark(
    instance_id: str,
    *,
    model: ModelFacts | UnknownModel | None,
    view: ClusterView,
    nodes: Mapping[str, int],
    limits: Limits,
    facts: Mapping[str, ModelFacts] | None = None,
    cached: Mapping[str, Iterable[str]] | None = None,
    evict: bool = True,
) -> Admission:
    """May the parked ``instance_id`` come back now? Its ranks keep their nodes (or, a node gone, go where
    `place_again` puts them); ``evict``: park idle instances first if it does not fit (``Admission.evict``).
    Refused with `Refusal.NO_MEMORY` (or `LIMIT_REACHED`) while it cannot: its requests wait, then fail."""
    inst = view.instances[instance_id]
    facts = dict(facts or {})
    known = model if isinstance(model, ModelFacts) else None
    need = _rank_bytes(known, inst.world_size, limits)
    where = [slot.node_id for slot in inst.slots]

    def fit(reserving: list[InstanceView]) -> tuple[tuple[str, ...] | NoFit, dict[str, int]]:
        rooms, runners = _rooms(reserving, nodes, limits, facts, cached or {})
        if not all(node in nodes for node in where):  # a node is gone: its ranks move at the next generation
            return place(inst.model_id, inst.world_size, need, rooms), runners
        short = [r for r in rooms if r.capacity(need) < where.count(r.node_id)]
        if not short:
            return tuple(where), runners
        return _no_fit_on(inst.world_size, need, short), runners

    others = [i for i in _reserving(view) if i.instance_id != instance_id]
    candidates = [i for i in _evictable(view) if i.instance_id != instance_id] if evict else []
    return _admitted(fit, others, candidates, inst.world_size, limits)


def place_again(
    instance_id: str,
    *,
    model: ModelFacts | UnknownModel | None,
    view: ClusterView,
    nodes: Mapping[str, int],
    limits: Limits,
    facts: Mapping[str, ModelFacts] | None = None,
    cached: Mapping[str, Iterable[str]] | None = None,
) -> tuple[str, ...] | None:
    """Before a new generation of ``instance_id``: where its ranks go now, if a node it was on is not among
    the live ``nodes`` any more (its ranks move), or if its ranks share a node while a live node it is not on
    could take one (a node came back after its ranks were moved off it: they spread again, as a new
    placement would put them, never while a runner of it is alive, never before its first generation). None
    when it stays where it is, or nothing fits (its next generation then fails on the dead node, as the
    host's failure, and tries again after a backoff).
    """
    inst = view.instances[instance_id]
    where = [slot.node_id for slot in inst.slots]
    gone = not all(node in nodes for node in where)
    # packed onto fewer nodes than it could be, after a generation ran: a node came back (before its first,
    # it is where its placement put it, pinned there perhaps: `--nodes`)
    packed = inst.retry.generation >= 1 and len(set(where)) < len(where) and not set(nodes) <= set(where)
    if not gone and (not packed or any(r is not None and r.alive for _, r in view.slot_runners(inst))):
        return None
    others = [i for i in _reserving(view) if i is not inst]
    facts = dict(facts or {})
    known = model if isinstance(model, ModelFacts) else None
    rooms, _ = _rooms(others, nodes, limits, facts, cached or {})
    placement = place(inst.model_id, inst.world_size, _rank_bytes(known, inst.world_size, limits), rooms)
    if isinstance(placement, NoFit) or (not gone and len(set(placement)) <= len(set(where))):
        return None  # packed, but no placement spreads it further: it stays, not reshuffled for nothing
    return placement


def _too_many_ranks(model_id: str, ranks: int, model: ModelFacts | None, nodes: int, limits: Limits) -> str | None:
    """Why ``ranks`` could never run, naming every bound they exceed, the tightest first (None: none does).

    One bound: its own message and remedy. Several: one message naming them all and the most ranks all of
    them allow, since naming one that does not bind (``ranks_per_instance = 3`` for a model of 2 layers)
    would send the user to raise a limit that cannot help."""
    runners = limits.runners_per_node * nodes  # however empty the nodes, no more ranks than this run
    exceeded: list[tuple[int, str, str | None]] = []  # (the most it allows, what it is, the setting raising it)
    if model is not None and not model.splits_into(ranks):
        exceeded.append((model.max_ranks(), _split(model_id, model), None))
    if ranks > runners:
        what = f"the {runners} runners {nodes} node(s) may run (runners_per_node = {limits.runners_per_node})"
        exceeded.append((runners, what, "runners_per_node"))
    if ranks > limits.ranks_per_instance:
        what = f"ranks_per_instance = {limits.ranks_per_instance}"
        exceeded.append((limits.ranks_per_instance, what, "ranks_per_instance"))
    exceeded.sort(key=lambda bound: bound[0])  # stable: the model first among equals
    if not exceeded:
        return None
    settings = [setting for _, _, setting in exceeded]
    if settings == [None] and model is not None:  # the model alone
        tensor = "" if model.pipeline else ", and the rank count must divide the heads"
        split = f"model {model_id!r} cannot be split into {ranks} ranks ({_parts(model)})"
        return f"{split}; at most {model.max_ranks()}{tensor}"
    if len(exceeded) == 1:
        return f"{ranks} ranks is more than {exceeded[0][1]}; ask for fewer, or raise [limits] {settings[0]}"
    cap = exceeded[0][0] if model is None else min(exceeded[0][0], model.max_ranks())
    most = next(n for n in range(cap, 0, -1) if model is None or model.splits_into(n))
    raise_them = "" if None in settings else f", or raise [limits] {' and '.join(map(str, settings))}"
    *first, last = [what for _, what, _ in exceeded]
    return f"{ranks} ranks is more than {', '.join(first)} and {last} allow; ask for at most {most}{raise_them}"


def _parts(model: ModelFacts) -> str:
    """What a model is split by: its layers (a pipeline), or its heads (tensor parallelism)."""
    if model.pipeline:
        return f"its {model.layers} layers"
    return f"its {model.attention_heads} attention heads and {model.kv_heads} key/value heads"


def _split(model_id: str, model: ModelFacts) -> str:
    return f"model {model_id!r} ({_parts(model)}{'' if model.pipeline else ', which the rank count must divide'})"


def _placed(inst: InstanceView) -> bool:
    return inst.retry.state is not InstanceState.DELETED


def _reserving(view: ClusterView) -> list[InstanceView]:
    """The instances that hold their ranks' room: placed and not parked (a parking one's room is freed as its
    processes go; the plan starts nothing on its nodes until they have)."""
    return [i for i in view.instances.values() if _placed(i) and i.retry.state not in _PARKED]


def _evictable(view: ClusterView) -> list[InstanceView]:
    """Idle instances that may be parked for another's memory, least recently used first: Ready, no request
    in flight or waiting, a finite keep-alive."""
    waiting = {req.instance_id for req in view.requests}

    def in_flight(inst: InstanceView) -> bool:
        return any(r is not None and r.alive and r.in_flight for _, r in view.slot_runners(inst))

    idle = [
        i
        for i in view.instances.values()
        if i.retry.state is InstanceState.READY
        and i.keep_alive is not None
        and i.instance_id not in waiting
        and not in_flight(i)
    ]
    return sorted(idle, key=_last_use)


def _last_use(inst: InstanceView) -> tuple[float, str]:
    times = [t for t in (inst.last_used, inst.retry.ready_since) if t is not None]
    return (max(times, default=float("-inf")), inst.instance_id)


_Fit = Callable[[list[InstanceView]], tuple[tuple[str, ...] | NoFit, dict[str, int]]]


def _admitted(
    fit: _Fit, reserving: list[InstanceView], candidates: list[InstanceView], ranks: int, limits: Limits
) -> Admission:
    """Where ``fit`` puts the ranks, parking the fewest ``candidates`` it takes (`_evicting`); else refused."""
    (placement, runners), evicted = _evicting(fit, reserving, candidates)
    if isinstance(placement, NoFit):
        return _no_room(ranks, runners, placement, limits)
    return Admission(nodes=placement, evict=evicted)


def _evicting(
    fit: _Fit,
    reserving: list[InstanceView],
    candidates: list[InstanceView],
) -> tuple[tuple[tuple[str, ...] | NoFit, dict[str, int]], tuple[str, ...]]:
    """``fit`` with the fewest of ``candidates`` parked, taken least recently used first: add them until it
    fits, then give back every one it still fits without (the newest first)."""
    result = first = fit(reserving)
    chosen: list[InstanceView] = []
    for candidate in candidates:
        if not isinstance(result[0], NoFit):
            break
        chosen.append(candidate)
        result = fit([i for i in reserving if i not in chosen])
    if isinstance(result[0], NoFit):
        return first, ()  # refused as without eviction: what each node lacks as it stands
    for candidate in reversed(chosen[:-1]):
        without = [c for c in chosen if c is not candidate]
        again = fit([i for i in reserving if i not in without])
        if not isinstance(again[0], NoFit):
            chosen, result = without, again
    return result, tuple(c.instance_id for c in chosen)


def _rooms(
    live: Iterable[InstanceView],
    nodes: Mapping[str, int],
    limits: Limits,
    facts: Mapping[str, ModelFacts],
    cached: Mapping[str, Iterable[str]],
) -> tuple[list[NodeRoom], dict[str, int]]:
    """What each node can still give, after the ranks ``live`` instances reserve; and those runner counts."""
    runners = {node: 0 for node in nodes}
    used = {node: 0 for node in nodes}
    for inst in live:
        share = _rank_bytes(facts.get(inst.model_id), inst.world_size, limits)
        for slot in inst.slots:
            if slot.node_id in nodes:
                runners[slot.node_id] += 1
                used[slot.node_id] += share
    rooms = [
        NodeRoom(
            node,
            max(0, nodes[node] - used[node]),  # less than none: the memory or the limits were lowered since
            max(0, limits.runners_per_node - runners[node]),
            cached.get(node, ()),
        )
        for node in nodes
    ]
    return rooms, runners


def _rank_bytes(model: ModelFacts | None, ranks: int, limits: Limits) -> int:
    """What one rank needs: its share of the weights (unknown until downloaded: none) and the runner floor."""
    return limits.runner_floor_bytes + (0 if model is None else -(-model.weight_bytes // ranks))


def _no_fit_on(ranks: int, need: int, short: list[NodeRoom]) -> NoFit:
    lacks = "; ".join(
        f"{room.node_id} has {room.memory_free // MIB} MiB free and {room.runners_free} runner(s) to give"
        for room in short
    )
    return NoFit(f"{ranks} ranks of {need // MIB} MiB each do not fit back on their nodes: {lacks}", False)


def _no_room(ranks: int, runners: Mapping[str, int], no_fit: NoFit, limits: Limits) -> Admission:
    if no_fit.too_few_runners:
        return _refuse(
            Refusal.LIMIT_REACHED,
            f"{ranks} more runners would exceed runners_per_node = {limits.runners_per_node} "
            f"(running or reserved: {sum(runners.values())}); delete an instance first, "
            "or raise [limits] runners_per_node",
        )
    return _refuse(
        Refusal.NO_MEMORY,
        f"{no_fit.message} (a rank needs its share of the weights plus the {limits.runner_floor_bytes // MIB} MiB "
        "runner floor); use more ranks to shrink each share, or delete an instance first",
    )


def _refuse(refusal: Refusal, message: str) -> Admission:
    return Admission(refusal=refusal, message=message)
