"""The fault schedule: which fault, where, when and for how long, drawn from a seed and nothing else.

A schedule is a pure function of its seed and of what this machine can do (`Abilities`), so that
``exod chaos --seed N`` on another day injects the same faults in the same order. Targets are named by role
(the controller, an agent, an etcd member, the leader, a rank of an instance) and resolved when the fault is
injected, since pids and the controller's name are not known in advance.
"""

from __future__ import annotations

import enum
import random

import attrs


class Area(enum.Enum):
    RUNNER = "runner"
    DAEMON = "daemon"
    NETWORK = "network"
    ETCD = "etcd"
    STORAGE = "storage"


class Kind(enum.Enum):
    """Every fault the campaign knows; the area is the part before the first dash."""

    RUNNER_KILL = "runner-sigkill"
    RUNNER_PAUSE = "runner-sigstop"
    DAEMON_KILL = "daemon-sigkill"  # and restarted after the hold
    DAEMON_PAUSE = "daemon-sigstop"  # for the hold: shorter or longer than the lease TTL
    DAEMON_TERM = "daemon-sigterm"  # and restarted after the hold
    NETWORK_ETCD = "network-cut-from-etcd"
    NETWORK_PEERS = "network-cut-from-peers"
    NETWORK_ALL = "network-cut-off"
    NETWORK_DEAF = "network-deaf-to-etcd"  # one way: etcd's packets do not arrive, the node's still leave
    ETCD_KILL = "etcd-kill-member"  # and restarted after the hold
    ETCD_PAUSE = "etcd-pause-member"
    ETCD_PAUSE_ALL = "etcd-pause-all"  # every member, for less than the lease TTL
    STORAGE_FULL = "storage-state-dir-full"
    STORAGE_FDS = "storage-fd-limit"
    STORAGE_MODEL_GONE = "storage-model-removed"  # a model's files gone from the cache for a while (a cleanup)

    @property
    def area(self) -> Area:
        return Area(self.value.partition("-")[0])


@attrs.frozen
class Armed:
    """A runner's own fault (`exod.runner.faults`), armed in one node's ``[[fault]]``: it fires in every runner of
    that rank and generation the node starts, whatever the instance. No signal makes a process exit 0 or raise:
    these are the runner's faults that only the runner can commit."""

    node: int
    fault: str  # PHASE:KIND
    rank: int
    generation: int


# exit 0 once Ready, raise while loading, hang once Ready: on the agents, in generations the other faults reach
ARMED = (
    Armed(2, "ready:exit0", 0, 2),
    Armed(3, "loading:exception", 0, 3),
    Armed(2, "ready:hang", 1, 3),
    Armed(3, "warming_up:sigkill", 1, 2),
)


class Role(enum.Enum):
    CONTROLLER = "controller"
    AGENT = "agent"  # a node that is not the controller
    NAMESPACED = "namespaced"  # the node in a network namespace, whatever its role now
    MEMBER = "member"  # an etcd member that is not the leader
    LEADER = "leader"  # etcd's leader
    RANK = "rank"  # a runner of an instance
    RANK_AGENT = "rank-agent"  # a node that is not the controller and holds a runner now
    MODEL = "model"  # a model in the cache the nodes share


@attrs.frozen
class Abilities:
    """What this machine lets the campaign do; faults it cannot inject are not drawn (and the report says why)."""

    namespaces: bool = False  # network faults need a node in a namespace
    tmpfs: bool = False  # a state dir that can fill up
    nodes: int = 3
    members: int = 3

    def kinds(self) -> tuple[Kind, ...]:
        return tuple(k for k in Kind if self.why_not(k) is None)

    def why_not(self, kind: Kind) -> str | None:
        if kind.area is Area.NETWORK and not self.namespaces:
            return "no network namespace can be made here (needs root and iproute2)"
        if kind is Kind.STORAGE_FULL and not self.tmpfs:
            return "no tmpfs can be mounted here (needs root)"
        if kind in (Kind.ETCD_KILL, Kind.ETCD_PAUSE) and self.members < 3:
            return "a member's loss is only survivable with 3 members"
        return None


@attrs.frozen
class Step:
    """One fault: injected ``at`` seconds into the campaign, undone ``hold`` seconds later."""

    at: float
    kind: Kind
    role: Role
    pick: int  # which of the role's candidates, modulo their number when injected
    hold: float

    def text(self) -> str:
        return f"t+{self.at:6.1f}s {self.kind.value} on {self.role.value}#{self.pick} for {self.hold:.1f}s"


_ROLES: dict[Area, tuple[Role, ...]] = {
    Area.RUNNER: (Role.RANK,),
    Area.DAEMON: (Role.CONTROLLER, Role.AGENT, Role.AGENT),
    Area.NETWORK: (Role.NAMESPACED,),
    Area.ETCD: (Role.LEADER, Role.MEMBER),
    Area.STORAGE: (Role.CONTROLLER, Role.AGENT),
}
_KIND_ROLES: dict[Kind, tuple[Role, ...]] = {Kind.STORAGE_MODEL_GONE: (Role.MODEL,)}


def draw(seed: int, duration: float, abilities: Abilities, *, ttl: float) -> tuple[Step, ...]:
    """The faults of a campaign of ``duration`` seconds: one every few seconds, sometimes two at once, sometimes
    one while the cluster still recovers from the last; holds both shorter and longer than the lease ``ttl``;
    and always the `LONG_FAULTS`. Faults stop at `fault_window` so the last heal leaves time to recover in."""
    rng = random.Random(seed)
    kinds = abilities.kinds()
    steps: list[Step] = []
    at = rng.uniform(1.0, 3.0)
    while at < fault_window(duration):
        for _ in range(2 if rng.random() < 0.2 else 1):  # several at once, now and then
            kind = rng.choice(kinds)
            role = rng.choice(_KIND_ROLES.get(kind, _ROLES[kind.area]))
            steps.append(Step(round(at, 1), kind, role, rng.randrange(1 << 16), round(_hold(rng, kind, ttl), 1)))
        # during recovery from the last one, or after it settled
        at += rng.uniform(0.5, ttl) if rng.random() < 0.4 else rng.uniform(ttl, 2 * ttl)
    return _with_long_faults(rng, steps, abilities, duration, ttl)


# The faults a campaign always holds (issue #47): a pause and a cut longer than the lease, on the controller and on
# an agent holding a rank, at these fractions of the fault window. Network faults reach only the namespaced node
# (node-1, the first controller): its cut comes first, while it is surely the controller; its cut as an agent
# comes after it lost that role and a later generation placed a rank on it again.
LONG_FAULTS: tuple[tuple[float, Kind, Role], ...] = (
    (0.0, Kind.NETWORK_ALL, Role.CONTROLLER),
    (0.3, Kind.DAEMON_PAUSE, Role.RANK_AGENT),
    (0.55, Kind.NETWORK_ALL, Role.RANK_AGENT),
    (0.8, Kind.DAEMON_PAUSE, Role.CONTROLLER),
)
LONG_HOLD = (1.5, 2.0)  # × the lease TTL: surely past it, whatever the renewal's margin


def long_faults(steps: tuple[Step, ...], ttl: float) -> list[Step]:
    """The steps of ``steps`` that pause or cut a node for longer than the lease ``ttl``."""
    return [s for s in steps if s.kind in (Kind.DAEMON_PAUSE, Kind.NETWORK_ALL) and s.hold > ttl]


def _with_long_faults(
    rng: random.Random, drawn: list[Step], abilities: Abilities, duration: float, ttl: float
) -> tuple[Step, ...]:
    """``drawn`` with the `LONG_FAULTS` the machine can inject added. A drawn fault on a node (its daemon, its
    links, its disk) that would still hold when one starts, or that starts while it lasts, is dropped, so that
    none claims its target first or deposes the controller it is aimed at; faults on runners, etcd and the
    model cache go on beside it."""
    window = fault_window(duration)
    first = drawn[0].at if drawn else 1.0
    forced = [
        Step(round(first + share * (window - first), 1), kind, role, rng.randrange(1 << 16), round(hold, 1))
        for share, kind, role in LONG_FAULTS
        if abilities.why_not(kind) is None
        for hold in [rng.uniform(*LONG_HOLD) * ttl]
    ]
    on_nodes = (Area.DAEMON, Area.NETWORK, Area.STORAGE)
    kept = [
        s
        for s in drawn
        if s.kind.area not in on_nodes
        or s.kind is Kind.STORAGE_MODEL_GONE
        or not any(s.at <= f.at + f.hold and f.at - 1.0 <= s.at + s.hold for f in forced)
    ]
    return tuple(sorted([*kept, *forced], key=lambda s: s.at))


def fault_window(duration: float) -> float:
    """Seconds from the start during which faults are drawn: the last 40% of a short run, the last two minutes
    of a long one, are left to recover in."""
    return max(0.6 * duration, duration - 120.0)


def _hold(rng: random.Random, kind: Kind, ttl: float) -> float:
    if kind is Kind.ETCD_PAUSE_ALL:
        return rng.uniform(0.2, 0.6) * ttl  # the "all members for less than the TTL"
    if kind is Kind.RUNNER_KILL:
        return 0.0  # nothing to undo
    return rng.uniform(0.3, 2.0) * ttl  # shorter and longer than a lease
