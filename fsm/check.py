"""A bounded model checker for the composed system.

Theory of operation
-------------------
The system is what the daemon runs, with the world made explicit: the planner,
one instance of N ranks (one node per rank), its runners, its downloads, the
retry policy and a discrete clock, plus an adversary. From each state the
checker takes every event there is:

* ``plan NODE`` — that node runs `fsm.plan` and executes every action (`Cluster.execute`);
* ``complete OP`` — a pending completion arrives (`fsm.world`); ``fail OP`` — a download fails;
* ``crash R`` / ``error R`` / ``fatal R`` / ``host R`` — runner R exits, reports a retryable error,
  a non-retryable one, or a failure of the host (uncharged: a ring port taken); the adversary, and
  which kinds is configurable (``host`` is opt-in: free retries make the space much larger);
* ``tick`` — the clock jumps to the next deadline (backoff, download retry, budget reset);
* ``delete`` — the user deletes the instance;
* ``submit`` — a chat request arrives (up to ``requests`` of them): it must be forwarded to Ready
  runners of the current generation, or cancelled with a Deleted instance, and never left waiting;
* ``park`` — the instance is parked by someone else than its plan (an operator, or an eviction for
  another instance starting), up to ``parks`` times, in whatever state it is; with a ``keep_alive`` the
  plan parks it by itself once idle that long, and a request that comes for it unparks it.

With ``instances`` set, several instances of the model ("i", "j" …, each its own placement of ``ranks``
ranks on the same nodes) share each node's memory, ``node_memory`` ranks of it. The first is placed at
the start; the events above name the instance they concern (``submit j``, ``crash j/0``, ``delete i``), and

* ``place X`` — the user places instance X: `fsm.admit` with eviction decides, as the daemon's placer
  does; admitted, the idle instances it names are parked first (evicted), least recently used first;
  refused, nothing changes (the user is told why, and may try again later).

A parked instance a request waits for comes back only once `fsm.admit_unpark` finds it room, evicting idle
instances for it, as the daemon's executor does before its plan's unpark; until then its requests wait. So
an eviction while the other instance starts, a request for the evicted one, and a failure while it comes back
all come from these real events, and the plan's rule that nothing starts on a node while an evicted instance
is still parking there is what keeps the memory within the budget.

With ``hosts`` set, the ranks live on a cluster of that many nodes (a node per host, as on etcd), and the adversary also
hits whole nodes (up to ``node_failures`` times):

* ``kill N`` — the node dies with its runners; ``cut N`` — it is cut off (a partition), its runners
  running on. Either way the controller gives its runners up at once, as failures of the host;
* ``heal N`` — a cut node's link returns: its agent stops what it ran, and it joins again;

and the cluster answers by itself (progress events):

* ``fence N`` — a cut node kills its runners (its own clock, at TTL − margin);
* ``expire N`` — a node's lease expires, with the runner keys on it; only once it has fenced itself (the
  premise of fencing: its clock runs at a bounded rate, so TTL − margin comes first);
* ``confirm`` — the controller reads the runner keys: a given-up runner whose key is gone has exited
  (`exod.cluster.remote.Fleet`). With ``waits_for_keys`` off (a planted bug) it says so at once.

A new generation is placed again off nodes whose lease expired (`fsm.place_again`'s rule: ranks on live
nodes stay, the others go where the fewest ranks are). Not modelled: `place_again` also spreads an instance
packed onto fewer nodes once a node is back; that chooses where a generation goes, after every runner of
the last one is gone, which no invariant here depends on.

It explores breadth-first, so the first violation found has a shortest trace,
and checks these invariants (numbered as the specs number them) on every transition and state:

1. Shutdown and Deleted are absorbing; no runner is created for a Deleted instance.
2. Failed is left only to Shutdown.
3. Each backoff delay lies in [min(initial, cap), cap] (jitter: [0, cap]) and, jitter off,
   never decreases within a failure streak.
4. Charged generations started per streak ≤ max_failures + 1 (a start after a host failure is free;
   invariant 5 holds it to the backoff all the same).
5. No start before its deadline.
6. Never two generations alive at once, never more than N live runners; with hosts, never two generations
   of processes running at once, counting those that run on, unknown, on a cut node. Under one_for_one
   (``RetryPolicy.strategy``) the ranks are replicas, each restarted alone (``RestartRank``): the rule is
   per rank, never two processes of one rank, and a rank's restart waits for its own deadline (5).
7. An event of an older incarnation changes nothing (probed in every state).
8. The budget resets iff Ready continuously for ≥ reset_after.
9. Determinism: a sample of transitions is recomputed and must agree.
10. No deadlock: in every state, some progress event (plan, complete, tick) changes the state,
    unless the instance is Ready with every rank Ready, Parked, or Deleted with every runner reaped
    (and no request waits: a request for a parked instance is served, never refused).
11. A parked instance has no live process.
12. Parking and unparking spend no retry (a rank failing while its instance parks charges nothing).
13. An instance is parked only while no request is in flight on its runners.
14. Eviction parks only idle instances: admission names only Ready instances with no request in flight
    on their runners or waiting for them, and a finite keep-alive (checked as the eviction is made).
15. A node's memory is never over-committed: the ranks of the runners alive on a node (of every
    instance, an evicted or deleted one's until they are reaped) fit its ``node_memory``, and so do the
    ranks admitted there (instances placed and not parked).

With several instances, 1–13 hold for each instance, and 10 for all together: a request for a parked
instance is served once another instance frees its room.

The machines stay the single source of truth: a transition is computed by the
real python-statemachine classes, re-pointed at each state with `reload`
instead of being rebuilt (the only thing "compiled" is that shortcut, and a
property test holds it equal to `from_snapshot`). Variants — a planner or a
machine with a bug planted — plug in through `CheckConfig`.
"""

from __future__ import annotations

import contextlib
import enum
import random
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from fsm import actions as act
from fsm import download as dl
from fsm import instance as inst
from fsm import runner as rn
from fsm.admit import Admission, Limits, ModelFacts
from fsm.admit import admit as default_admit
from fsm.admit import admit_unpark as default_admit_unpark
from fsm.cluster import Cluster, RunnerEntry
from fsm.download import DownloadLifecycle, DownloadState
from fsm.errors import FsmError
from fsm.failure import Failure
from fsm.instance import InstanceRetry, InstanceState, RestartStrategy, RetryPolicy
from fsm.owed import Owed, Report
from fsm.placement import MIB
from fsm.plan import plan as default_plan
from fsm.runner import RunnerLifecycle, RunnerPhase, RunnerState
from fsm.view import Slot
from fsm.world import InvariantViolated, World, applies, check_runners, complete

INSTANCE = "i"  # the first instance; with ``instances`` > 1 the others are "j", "k" …
MODEL = "org/model"
MAX_INSTANCES = 4
RANK_BYTES = 1024 * MIB  # what one rank needs (`fsm.admit`): the runner floor and its share of the weights
_PARKED = (InstanceState.PARKING.value, InstanceState.PARKED.value)


class Fault(enum.Enum):
    """What the adversary does to a healthy runner."""

    CRASH = "crash"  # the process exits (SIGKILL)
    ERROR = "error"  # it reports a retryable error
    FATAL = "fatal"  # it reports a non-retryable one
    HOST = "host"  # it reports a failure of the host, not the model: uncharged (a ring port taken)


FAULTS = (Fault.CRASH, Fault.ERROR, Fault.FATAL)  # the default adversary; Fault.HOST is opt-in


# -- the events of the composed system; str() is the label in a trace ---------------------------


@attrs.frozen
class Plan:
    """One node (or, coarse, every node once) runs `fsm.plan` and executes every action."""

    node: str | None = None

    def __str__(self) -> str:
        return "plan" if self.node is None else f"plan {self.node}"


@attrs.frozen
class CompleteAll:
    """Every pending completion arrives (coarse)."""

    def __str__(self) -> str:
        return "complete"


@attrs.frozen
class FailDownloads:
    """Every pending download fails (coarse)."""

    def __str__(self) -> str:
        return "fail downloads"


@attrs.frozen
class Deliver:
    """One pending completion arrives, or (``ok`` False, downloads only) fails."""

    index: int
    ok: bool = True

    def __str__(self) -> str:
        return f"{'complete' if self.ok else 'fail'} {self.index}"


@attrs.frozen
class Tick:
    """The clock jumps to the next deadline."""

    def __str__(self) -> str:
        return "tick"


@attrs.frozen
class Inject:
    """The adversary hits a runner."""

    fault: Fault
    runner_id: str

    def __str__(self) -> str:
        return f"{self.fault.value} {self.runner_id}"


def _named(what: str, instance: str | None) -> str:
    return what if instance is None else f"{what} {instance}"


@attrs.frozen
class Delete:
    """The user deletes an instance (None: the only one)."""

    instance: str | None = None

    def __str__(self) -> str:
        return _named("delete", self.instance)


@attrs.frozen
class Submit:
    """A chat request arrives for an instance (None: the only one)."""

    instance: str | None = None

    def __str__(self) -> str:
        return _named("submit", self.instance)


@attrs.frozen
class Park:
    """Someone other than the plan parks an instance (an operator; with one instance, an eviction for another)."""

    instance: str | None = None

    def __str__(self) -> str:
        return _named("park", self.instance)


@attrs.frozen
class Place:
    """The user places an instance (one after the first): `fsm.admit` with eviction decides."""

    instance: str

    def __str__(self) -> str:
        return f"place {self.instance}"


class NodeFault(enum.Enum):
    """What the adversary does to a whole node (with ``hosts``)."""

    KILL = "kill"  # the host dies, its runners with it
    CUT = "cut"  # the host is cut off: its runners run on until it fences itself


@attrs.frozen
class HitNode:
    fault: NodeFault
    node: str

    def __str__(self) -> str:
        return f"{self.fault.value} {self.node}"


@attrs.frozen
class Heal:
    """A cut node's link returns."""

    node: str

    def __str__(self) -> str:
        return f"heal {self.node}"


@attrs.frozen
class Fence:
    """A cut node kills its runners: it could not renew its lease for TTL − margin."""

    node: str

    def __str__(self) -> str:
        return f"fence {self.node}"


@attrs.frozen
class Expire:
    """A node's lease expires, and the runner keys on it go."""

    node: str

    def __str__(self) -> str:
        return f"expire {self.node}"


@attrs.frozen
class Confirm:
    """The controller reads the runner keys: each runner given up with its node whose key is gone exited."""

    def __str__(self) -> str:
        return "confirm"


Event = (
    Plan | CompleteAll | FailDownloads | Deliver | Tick | Inject | Delete | Submit | HitNode | Heal | Fence | Expire
) | (Confirm | Park | Place)

UP, CUT, DEAD = "up", "cut", "dead"  # a node's link, with hosts
NEVER_GIVE_UP_HORIZON = 4  # with max_failures None: time runs as far as that many failed generations take


def _faults(values: Any) -> tuple[Fault, ...]:
    return tuple(Fault(v) for v in values)


def instance_ids(count: int) -> tuple[str, ...]:
    """The instances' ids: "i", then "j", "k" …"""
    return tuple(chr(ord(INSTANCE) + k) for k in range(count))


def _owner(runner_id: str) -> str:
    return runner_id.split("/", 1)[0]


def _wanted(request_id: str) -> str:
    """The instance a request is for (its id ends with it: ``req0@i``)."""
    return request_id.rsplit("@", 1)[1]


@attrs.frozen
class CheckConfig:
    """What `check` explores: one instance of ``ranks`` ranks under ``policy`` (or ``instances`` of them sharing
    ``node_memory``), the adversary's ``faults`` (and ``deletes``, ``download_failures``, ``requests``), bounded
    by ``depth`` events and ``max_states``; the planner, admission, cluster and machine classes to check (a
    variant with a bug planted plugs in here); ``hosts`` and ``node_failures`` put the ranks on a cluster whose
    nodes fail."""

    ranks: int = 2
    policy: RetryPolicy = attrs.field(factory=RetryPolicy)
    depth: int = 200
    max_states: int = 400_000
    faults: tuple[Fault, ...] = attrs.field(default=FAULTS, converter=_faults)
    deletes: bool = True
    download_failures: int = 1  # failed downloads the adversary may cause (each retry is a new state)
    plan: Callable[..., list[act.Action]] = default_plan
    runner_cls: type[RunnerLifecycle] = RunnerLifecycle
    instance_cls: type[InstanceRetry] = InstanceRetry
    download_cls: type[DownloadLifecycle] = DownloadLifecycle
    determinism_samples: int = 200
    requests: int = 0  # chat requests the adversary may send (each is forwarded, finished or cancelled)
    parks: int = 0  # parks from outside the plan (an operator, an eviction), at any moment
    keep_alive: float | None = None  # the instance's keep-alive: the plan parks it once idle that long
    transition_table: bool = True  # memoize each machine's transitions (see _TransitionTable)
    # The clock stops here: time is unbounded (a budget that resets can fail and recover forever), so the
    # space is finite only up to a horizon. None: one budget reset plus a whole give-up fit before it.
    horizon: float | None = None

    @property
    def time_horizon(self) -> float:
        if self.horizon is not None:
            return self.horizon
        backoff = self.policy.backoff
        retries = self.policy.max_failures or NEVER_GIVE_UP_HORIZON  # never giving up: as far as that many
        give_up = sum(backoff.ceiling(n) for n in range(1, retries + 1))
        return (self.policy.reset_after or 0.0) + give_up + 1.0

    # A cluster of ``hosts`` nodes (≥ ranks; rank r starts on node r), hit by the adversary up to
    # ``node_failures`` times (kill or cut). 0: one node per rank, and no node ever fails.
    hosts: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    node_failures: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    # The controller's fencing rule: a runner given up with its node has exited only once its key is gone
    # (`exod.cluster.remote.Fleet`). False plants the bug the rule prevents.
    waits_for_keys: bool = True
    # Several instances of the model ("i", "j" …), each ``ranks`` ranks on the same nodes (rank r on node r):
    # the first placed at the start, each other when the user places it (``place``).
    instances: int = attrs.field(default=1, validator=[attrs.validators.ge(1), attrs.validators.le(MAX_INSTANCES)])
    # How many ranks a node's memory holds (None: every rank placed, so admission never needs to evict).
    node_memory: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    admit: Callable[..., Admission] = default_admit  # placements (`fsm.admit`, with eviction)
    admit_unpark: Callable[..., Admission] = default_admit_unpark  # a parked instance's way back
    cluster_cls: type[Cluster] = Cluster  # the rules that tie the machines together (`fsm.cluster`)

    def __attrs_post_init__(self) -> None:
        if self.hosts and self.hosts < self.ranks:
            raise ValueError(f"hosts ({self.hosts}) must be 0 or at least ranks ({self.ranks})")
        if self.node_failures and not self.hosts:
            raise ValueError("node_failures needs hosts: the nodes that may fail")
        if self.instances > 1 and self.hosts:
            raise ValueError("several instances are checked with one node per rank: leave hosts 0")
        if self.instances > 1 and self.keep_alive is None and (self.node_memory or self.instances) < self.instances:
            raise ValueError(
                "instances kept loaded forever are never evicted, so a request for one that does not fit would "
                "wait for ever (the daemon fails it at its queue timeout): give a keep_alive, or the node_memory "
                "for every instance"
            )

    # True: all pending completions arrive in one event, each node plans once per "plan" event, and
    # time only passes when nothing else can happen (a discrete clock with maximal progress). This keeps
    # the space small enough to be exhaustive; False explores each completion and each node on its own.
    coarse: bool = True

    @property
    def nodes(self) -> list[str]:
        return [f"n{r}" for r in range(self.hosts or self.ranks)]


@attrs.frozen
class Violation:
    invariant: str
    message: str
    trace: tuple[str, ...]

    def report(self) -> str:
        steps = "\n".join(f"  {i + 1:3}. {event}" for i, event in enumerate(self.trace))
        head = f"invariant violated: {self.invariant}\n  {self.message}"
        return f"{head}\nshortest trace ({len(self.trace)} events):\n{steps}"


@attrs.frozen
class CheckResult:
    states: int
    transitions: int
    depth: int  # the deepest level explored
    exhaustive: bool  # every reachable state before the time horizon was explored (no depth or state limit hit)
    seconds: float  # 0.0 unless the caller passed a timer (fsm reads no clock)
    violation: Violation | None = None
    horizon: float | None = None  # states past this time were not explored
    reached: frozenset[str] = frozenset()  # instance outcomes seen: "ready", "deleted:retries_exhausted", …
    # The interleavings explored, as (where, what) pairs of the transitions that changed the state: where is
    # the instance's leaf ("unparking" while an unparked instance is on its way back to Ready), what is the
    # event's kind ("submit", "crash", "park", "plan", …). Outcomes alone would not miss one that is lost.
    explored: frozenset[tuple[str, str]] = frozenset()
    # With several instances, the same with where each other instance was: (where, what, beside); "absent"
    # before it is placed. An eviction is ("ready", "evict", where the instance it made room for went).
    beside: frozenset[tuple[str, str, str]] = frozenset()

    @property
    def ok(self) -> bool:
        return self.violation is None

    def report(self) -> str:
        scope = "exhaustive" if self.exhaustive else "bounded (depth or state limit reached)"
        if self.horizon is not None:
            scope += f" up to t={self.horizon:g} s"
        head = f"{self.states} states, {self.transitions} transitions, depth {self.depth}, {scope}" + (
            f", {self.seconds:.1f} s ({self.states / self.seconds:,.0f} states/s)" if self.seconds else ""
        )
        return head + ("\nall invariants hold" if self.ok else "\n" + self.violation.report())  # type: ignore[union-attr]


@attrs.frozen
class _State:
    """Everything that matters, hashable: equal states are explored once."""

    instance: Any
    runners: tuple[tuple[str, Any], ...]
    downloads: tuple[tuple[str, Any], ...]
    pending: tuple[Owed, ...]
    now: float
    streak_delay: float  # the last backoff delay of the current streak (invariant 3)
    streak_starts: int  # charged generations started in the current streak (invariant 4)
    requests: tuple[str, ...] = ()  # chat requests waiting in the cluster (not yet forwarded or cancelled)
    submitted: int = 0  # requests the adversary has sent so far
    # with hosts:
    placement: tuple[str, ...] = ()  # the node of each rank (it moves between generations)
    hosts: tuple[tuple[str, str, bool], ...] = ()  # (node, link, lease alive)
    lost: tuple[tuple[str, int, str, bool], ...] = ()  # runners given up with their node: (id, inc, node, key)
    ghosts: tuple[tuple[str, int, str], ...] = ()  # their processes, still running on a cut node
    node_faults: int = 0  # node faults the adversary has caused so far
    parks: int = 0  # parks from outside the plan so far
    last_used: float | None = None  # when a request last started or ended on the instance
    others: tuple[_Seat, ...] = ()  # with instances: the instances after the first ("j" …)


@attrs.frozen
class _Seat:
    """An instance after the first: its machine (None until it is placed), the nodes admission gave its ranks,
    its own failure streak (invariants 3 and 4) and last use."""

    instance: Any = None
    nodes: tuple[str, ...] = ()
    streak_delay: float = 0.0
    streak_starts: int = 0
    last_used: float | None = None


class _Fail(Exception):
    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(message)
        self.invariant = invariant
        self.event: str | None = None  # the event whose transition broke it (None: the state itself)


class _TransitionTable:
    """The machines' transitions, filled in lazily by the machines themselves.

    ``(class, snapshot, event) → (snapshot', outcome or error)``, each entry computed once by the real
    python-statemachine class; every later visit is a lookup. This is the only "compilation" the checker
    does, and it cannot disagree with the classes: they wrote it (a test holds it to that anyway).
    """

    def __init__(self) -> None:
        self.entries: dict[tuple[type, Any, Any], tuple[Any, Any]] = {}
        self.hits = 0

    def install(self, machine: Any) -> Any:
        if "apply" in vars(machine):
            return machine
        original = type(machine).apply

        def apply(event: Any) -> Any:
            key = (type(machine), machine.snapshot(), event)
            entry = self.entries.get(key)
            if entry is None:
                try:
                    result: Any = original(machine, event)
                except Exception as exc:  # refused: remembered as refused, the machine unchanged
                    result = exc
                entry = self.entries[key] = (machine.snapshot(), result)
            else:
                self.hits += 1
                machine.reload(entry[0])
            if isinstance(entry[1], Exception):
                raise entry[1]
            return entry[1]

        object.__setattr__(machine, "apply", apply)  # python-statemachine guards its own __setattr__
        return machine


class _PooledCluster(Cluster):
    """A Cluster whose machines are reused objects, re-pointed with `reload`, stepping through the table."""

    def __init__(self, config: CheckConfig, table: _TransitionTable | None) -> None:
        super().__init__(
            runner_cls=config.runner_cls, instance_cls=config.instance_cls, download_cls=config.download_cls
        )
        self.pool: dict[str, RunnerLifecycle] = {}
        self.table = table

    def adopt(self, machine: Any) -> Any:
        return machine if self.table is None else self.table.install(machine)

    def _new_runner(self, action: act.CreateRunner) -> RunnerLifecycle:
        machine = self.pool.get(action.runner_id)
        if machine is None:
            return self.adopt(super()._new_runner(action))
        machine.reload(rn.RunnerSnapshot(action.runner_id, action.incarnation, action.rank, action.world_size, "idle"))
        return machine

    def _download(self, node_id: str, model_id: str) -> DownloadLifecycle:
        return self.adopt(super()._download(node_id, model_id))


def _pooled(cluster_cls: type[Cluster]) -> type[_PooledCluster]:
    """The pooled cluster over ``cluster_cls`` (a variant with a rule planted keeps its own)."""
    if cluster_cls is Cluster:
        return _PooledCluster
    return type(f"_Pooled{cluster_cls.__name__}", (_PooledCluster, cluster_cls), {})


class _World(World):
    """`World` with the daemon's executor's last look before an action (`exod.executor.Executor.before`)."""

    admits: Callable[[act.Action], bool] | None = None

    def _look(self, action: act.Action) -> bool:
        if self.admits is not None and not self.admits(action):
            return False  # held back this round: the machines do not move
        return super()._look(action)


class _System:
    """The composed system at one state at a time; `successors` enumerates every event."""

    def __init__(self, config: CheckConfig, table: _TransitionTable | None = None) -> None:
        self.config = config
        self.cluster = _pooled(config.cluster_cls)(config, table)
        self.ids = instance_ids(config.instances)
        self.placements: dict[str, Any] = {}  # every instance's placement object, placed in a state or not
        for iid in self.ids:
            slots = [Slot(r, node, f"{iid}/{r}") for r, node in enumerate(config.nodes[: config.ranks])]
            self.cluster.place(iid, MODEL, slots, policy=config.policy, keep_alive=config.keep_alive)
            self.placements[iid] = self.cluster.instances[iid]
            self.cluster.adopt(self.placements[iid].machine)
        self.fresh = {iid: p.machine.snapshot() for iid, p in self.placements.items()}  # as placed
        self.placement = self.placements[INSTANCE]
        self.slots = list(self.placement.slots)
        # what admission is asked with: each rank needs RANK_BYTES; a node holds node_memory of them
        per_rank = RANK_BYTES // 2
        self.facts = ModelFacts(
            layers=config.ranks,
            attention_heads=config.ranks,
            kv_heads=config.ranks,
            pipeline=True,
            weight_bytes=config.ranks * (RANK_BYTES - per_rank),
        )
        self.limits = Limits(
            runners_per_node=config.instances * config.ranks,
            ranks_per_instance=config.ranks,
            instances_per_model=config.instances,
            runner_floor_bytes=per_rank,
        )
        held = config.node_memory or config.instances * config.ranks
        # one instance with no budget: admission admits every unpark as it is (no need to ask it)
        self.admitting = config.instances > 1 or config.node_memory is not None
        self.memory = {node: held * RANK_BYTES for node in config.nodes}
        self.world: World | None = None  # the world of the state loaded last
        self.evicted: list[str] = []  # the instances evicted by the event applied last
        self.download_objects: dict[str, Any] = {}
        self._stale_proven: set[Any] = set()
        # the cluster's nodes, with hosts (loaded from each state, captured into the next)
        self.links: dict[str, str] = {}
        self.leases: dict[str, bool] = {}
        self.lost: dict[tuple[str, int], tuple[str, bool]] = {}  # (id, inc) → (node, its key still there)
        self.ghosts: set[tuple[str, int, str]] = set()
        self.node_faults = 0
        self.parks = 0

    # -- state <-> cluster -----------------------------------------------------------------

    def initial(self) -> _State:
        others = tuple(_Seat() for _ in self.ids[1:])
        state = _State(self.placement.machine.snapshot(), (), (), (), 0.0, 0.0, 0, others=others)
        if not self.config.hosts:
            return state
        nodes = self.config.nodes
        placement = tuple(slot.node_id for slot in self.slots)
        state = attrs.evolve(state, placement=placement, hosts=tuple((node, UP, True) for node in nodes))
        world = self._world(state)  # the model is on every node already: node faults are what is explored
        for node in nodes:
            self.cluster.download_event(node, dl.Begin(MODEL, 0.0))
            self.cluster.download_event(node, dl.Complete(MODEL, 0.0))
        return self.capture(world, self._streaks(state), 0)

    @staticmethod
    def placed(state: _State) -> list[tuple[str, Any]]:
        """(id, snapshot) of each instance placed in ``state``, in order."""
        first = [(INSTANCE, state.instance)]
        if not state.others:
            return first
        return first + [
            (chr(ord(INSTANCE) + k), seat.instance) for k, seat in enumerate(state.others, 1) if seat.instance
        ]

    def _streaks(self, state: _State) -> dict[str, tuple[float, int]]:
        streaks = {INSTANCE: (state.streak_delay, state.streak_starts)}
        for iid, seat in zip(self.ids[1:], state.others, strict=True):
            streaks[iid] = (seat.streak_delay, seat.streak_starts)
        return streaks

    def load(self, state: _State) -> None:
        c = self.cluster
        c.now_seen = None  # re-pointed at a state of another history: its clock is the state's own
        self.placement.machine.reload(state.instance)
        if state.placement:
            self.placement.slots = tuple(
                attrs.evolve(slot, node_id=node) for slot, node in zip(self.slots, state.placement, strict=True)
            )
        self.links = {node: link for node, link, _ in state.hosts}
        self.leases = {node: lease for node, _, lease in state.hosts}
        self.lost = {(rid, inc): (node, key) for rid, inc, node, key in state.lost}
        self.ghosts = set(state.ghosts)
        self.node_faults = state.node_faults
        self.parks = state.parks
        self.placement.last_used = state.last_used
        self.placement.keep_alive_now = self.config.keep_alive
        if state.others:  # the instances placed in this state, in order (one instance: always the first alone)
            c.instances.clear()
            c.instances[INSTANCE] = self.placement
            for iid, seat in zip(self.ids[1:], state.others, strict=True):
                if seat.instance is not None:
                    self._seat(iid, seat.instance, seat.nodes, seat.last_used)
        live = dict(state.runners)
        for rid in list(c.runners):
            if rid not in live:
                c.pool.setdefault(rid, c.runners[rid].machine)
                del c.runners[rid]
        for rid, snap in live.items():
            machine = c.runners[rid].machine if rid in c.runners else c.pool.get(rid)
            if machine is None:
                machine = c.adopt(self.config.runner_cls.from_snapshot(snap))
            else:
                machine.reload(snap)
            c.pool[rid] = machine
            owner = _owner(rid)
            node = c.instances[owner].slots[snap.rank].node_id
            unpublished = Owed(Report.PUBLISHED, rid, snap.incarnation) in state.pending
            c.runners[rid] = RunnerEntry(machine, owner, node, None if unpublished else f"{node}:{snap.rank}")
        c.downloads.clear()
        for node, snap in state.downloads:
            machine = self.download_objects.get(node)
            if machine is None:
                machine = self.download_objects[node] = c.adopt(self.config.download_cls.from_snapshot(snap))
            else:
                machine.reload(snap)
            c.downloads[(node, MODEL)] = machine
        c.log.clear()

    def _seat(self, iid: str, snapshot: Any, nodes: tuple[str, ...], last_used: float | None) -> None:
        """Put instance ``iid`` in the cluster as ``snapshot`` says, its ranks on ``nodes`` (in id order)."""
        placement = self.placements[iid]
        placement.machine.reload(snapshot)
        placement.slots = tuple(attrs.evolve(s, node_id=n) for s, n in zip(placement.slots, nodes, strict=True))
        placement.last_used, placement.keep_alive_now = last_used, self.config.keep_alive
        self.cluster.instances[iid] = placement

    def capture(self, world: World, streaks: dict[str, tuple[float, int]], submitted: int) -> _State:
        c = self.cluster
        for (node, _), machine in c.downloads.items():
            self.download_objects.setdefault(node, machine)
        unreachable = set(self.lost)  # what was asked of them never comes back
        others = []
        for iid in self.ids[1:]:
            p = c.instances.get(iid)
            if p is None:
                others.append(_Seat())
            else:
                nodes = tuple(slot.node_id for slot in p.slots)
                others.append(_Seat(p.machine.snapshot(), nodes, *streaks[iid], p.last_used))
        streak_delay, starts = streaks[INSTANCE]
        return _State(
            self.placement.machine.snapshot(),
            tuple(sorted((rid, e.machine.snapshot()) for rid, e in c.runners.items())),
            tuple(sorted((node, m.snapshot()) for (node, _), m in c.downloads.items())),
            tuple(sorted(p for p in world.pending if applies(c, p) and (p.key, p.incarnation) not in unreachable)),
            world.now,
            streak_delay,
            starts,
            tuple(sorted(world.requests)),
            submitted,
            tuple(slot.node_id for slot in self.placement.slots) if self.config.hosts else (),
            tuple((node, self.links[node], self.leases[node]) for node in sorted(self.links)),
            tuple(sorted((rid, inc, node, key) for (rid, inc), (node, key) in self.lost.items())),
            tuple(sorted(self.ghosts)),
            self.node_faults,
            self.parks,
            self.placement.last_used,
            tuple(others),
        )

    # -- events ------------------------------------------------------------------------

    def successors(self, state: _State) -> Iterator[tuple[Event, _State, str, tuple[str, ...]]]:
        """(event, successor, label, the instances it evicted) for every event enabled in ``state``; raises
        _Fail on a violation."""
        planned = None
        for event in self.events(state):
            successor, label = self.apply(state, event)
            if isinstance(event, Plan):
                planned = successor
            yield event, successor, label, tuple(self.evicted)
        if self.config.coarse and not state.pending and planned == state and self._next_time(state) is not None:
            successor, label = self.apply(state, Tick())  # time passes only when nothing else can happen
            yield Tick(), successor, label, tuple(self.evicted)

    def beyond_horizon(self, state: _State) -> bool:
        return state.now > self.config.time_horizon

    def events(self, state: _State) -> Iterator[Event]:
        """Every event enabled in ``state`` (progress events first); coarse ticks are `successors`' to add."""
        downloads = [i for i, op in enumerate(state.pending) if op.report is Report.DOWNLOAD]
        if self.config.coarse:
            yield Plan()
            if state.pending:
                yield CompleteAll()
            if downloads and self._may_fail_download(state):
                yield FailDownloads()
        else:
            for node in self.config.nodes:
                yield Plan(node)
            for i in range(len(state.pending)):
                yield Deliver(i)
            if self._may_fail_download(state):
                yield from (Deliver(i, ok=False) for i in downloads)
            if self._next_time(state) is not None:
                yield Tick()
        several = len(self.ids) > 1
        placed = self.placed(state)
        if state.submitted < self.config.requests:
            yield from (Submit(iid if several else None) for iid, _ in placed)
        yield from self._node_events(state)
        yield from (Place(iid) for iid, seat in zip(self.ids[1:], state.others, strict=True) if seat.instance is None)
        deleted = InstanceState.DELETED.value
        live = [(iid, snap) for iid, snap in placed if snap.leaf != deleted]  # the adversary rests on a Deleted one
        if not live:
            return  # all that is left to prove is the teardown
        if state.parks < self.config.parks:
            yield from (Park(iid if several else None) for iid, snap in live if snap.leaf not in _PARKED)
        if state.node_faults < self.config.node_failures:
            for node, link, lease in state.hosts:
                if link == UP and lease:
                    yield from (HitNode(fault, node) for fault in NodeFault)
        hit = {iid for iid, _ in live}
        for rid, snap in state.runners:  # faults hit healthy runners (a failing one is already being torn down)
            healthy = snap.leaf != RunnerPhase.STOPPED.value and snap.failure is None and not snap.stop_requested
            if healthy and _owner(rid) in hit:
                yield from (Inject(fault, rid) for fault in self.config.faults)
        if self.config.deletes:
            yield from (Delete(iid if several else None) for iid, _ in live)

    @staticmethod
    def _node_events(state: _State) -> Iterator[Event]:
        """What the cluster does by itself about its nodes, and a cut node's link returning."""
        if any(not key for *_, key in state.lost):
            yield Confirm()
        ghosts = {node for *_, node in state.ghosts}
        for node, link, lease in state.hosts:
            if link == CUT and node in ghosts:
                yield Fence(node)
            if link != UP and lease and node not in ghosts:  # fenced (or dead) before its lease can expire
                yield Expire(node)
            if link == CUT:
                yield Heal(node)

    def _may_fail_download(self, state: _State) -> bool:
        return sum(snap.attempts for _, snap in state.downloads) < self.config.download_failures

    @staticmethod
    def progress(event: Event) -> bool:
        """Events that need no adversary: the system moving on by itself."""
        return isinstance(event, (Plan, CompleteAll, Tick, Confirm, Fence, Expire)) or (
            isinstance(event, Deliver) and event.ok
        )

    def _world(self, state: _State) -> World:
        self.load(state)
        if self.admitting:
            world: World = _World(self.cluster, self.config.nodes, state.now, plan=self.config.plan)
            world.admits = self._admits  # type: ignore[attr-defined]
        else:
            world = World(self.cluster, self.config.nodes, state.now, plan=self.config.plan)
        if self.config.hosts:
            world.before = self._place_again
        world.pending = list(state.pending)
        for request_id in state.requests:
            world.submit(request_id, _wanted(request_id))
        self.world = world
        return world

    def _next_time(self, state: _State) -> float | None:
        return self._world(state).next_time()

    def apply(self, state: _State, event: Event) -> tuple[_State, str]:
        """The successor of ``state`` under ``event``, and a readable label; raises _Fail on a violation."""
        try:
            return self._apply(state, event)
        except InvariantViolated as exc:
            failure = _Fail(exc.invariant, exc.message)
            failure.event = str(event)
            raise failure from exc
        except _Fail as exc:
            exc.event = str(event)
            raise

    def _apply(self, state: _State, event: Event) -> tuple[_State, str]:
        world = self._world(state)
        c = self.cluster
        streaks, submitted = self._streaks(state), state.submitted
        before = dict(self.placed(state))
        self.evicted = []
        label = str(event)
        match event:
            case Submit(iid):
                wanted = iid or INSTANCE
                world.submit(f"req{submitted}@{wanted}", wanted)
                submitted += 1
            case Plan(node):
                for each in [node] if node else self.config.nodes:
                    for iid, started in self._plan(world, each).items():
                        streaks[iid] = (streaks[iid][0], streaks[iid][1] + started)
            case CompleteAll():
                label = "complete " + ", ".join(str(op) for op in world.pending)
                world.deliver_all()
            case FailDownloads():
                for op in [op for op in world.pending if op.report is Report.DOWNLOAD]:
                    world.pending.remove(op)
                    complete(c, op, world.now, ok=False)
            case Deliver(index, ok):
                label = f"{'complete' if ok else 'fail'} {world.pending[index]}"
                world.deliver(index, ok=ok)
            case Tick():
                future = world.next_time()
                assert future is not None, "a tick is enabled only with a deadline ahead"
                world.advance(future)
                label = f"tick to t={future:g}"
            case Inject(fault, rid):
                machine = c.runner(rid)
                if fault is Fault.CRASH:
                    c.runner_event(rn.Exited(rid, machine.incarnation, exit_code=-9, stop_delivered=False), world.now)
                elif machine.runner_state is not RunnerState.FAILED:
                    if fault is Fault.HOST:
                        failure = Failure.host("[ring] Couldn't bind socket (error 98)")
                    else:
                        failure = Failure.exception("RuntimeError", "boom", retryable=fault is Fault.ERROR)
                    c.runner_event(rn.Fail(rid, machine.incarnation, failure=failure), world.now)
                label = f"{fault.value} {rid}#{machine.incarnation}"
            case Delete(iid):
                c.delete(iid or INSTANCE, world.now)
            case Park(iid):
                with contextlib.suppress(FsmError):  # refused (a request in flight, a retry under way): unchanged
                    if c.park(iid or INSTANCE, world.now, act.ParkReason.EVICTED).accepted:
                        self.parks += 1
            case Place(iid):
                try:
                    label = self._place(iid)
                except FsmError as exc:  # an eviction the machine refuses: the placer would fail with it
                    raise _Fail("actions apply", f"placing {iid} could not be applied: {exc}") from exc
            case HitNode(fault, node):
                self.node_faults += 1
                self.links[node] = DEAD if fault is NodeFault.KILL else CUT
                on_it = [rid for rid, e in c.runners.items() if e.node_id == node and e.machine.alive]
                for rid in [rid for rid in on_it if (rid, c.runner(rid).incarnation) not in self.lost]:
                    self._give_up(rid, node, key=True, running=fault is NodeFault.CUT, now=world.now)
            case Heal(node):  # its agent stops what it ran (their controller's stream is gone), and it rejoins
                self.links[node], self.leases[node] = UP, True
                self.ghosts = {g for g in self.ghosts if g[2] != node}
                self.lost = {k: (n, key and n != node) for k, (n, key) in self.lost.items()}
            case Fence(node):
                self.ghosts = {g for g in self.ghosts if g[2] != node}
            case Expire(node):
                self.leases[node] = False
                self.lost = {k: (n, key and n != node) for k, (n, key) in self.lost.items()}
            case Confirm():
                for rid, inc in [k for k, (_, key) in self.lost.items() if not key]:
                    self._confirm(rid, inc, world.now)
        self._check_hosts()
        for iid, placement in c.instances.items():  # a reset ends the streak
            prior, after = before.get(iid, self.fresh[iid]), placement.machine
            if after.attempts + after.uncharged < prior.attempts + prior.uncharged:
                streaks[iid] = (0.0, 0)
        self._check_transition(state, before, world.now, streaks)
        for iid, (_, starts) in streaks.items():
            if self.config.policy.max_failures is not None and starts > self.config.policy.max_failures + 1:
                where = "" if len(self.ids) == 1 else f" of {iid}"
                raise _Fail("4 creations per streak", f"{starts} generations{where} started in one failure streak")
        self._check_memory()
        if self.evicted and not isinstance(event, Place):
            label += f" (evicting {', '.join(self.evicted)})"
        return self.capture(world, streaks, submitted), label

    def _plan(self, world: World, node: str) -> dict[str, int]:
        """Plan and execute on ``node`` (`World.step` checks 1, 5 and 6 per action); returns the charged
        generations it started, by instance: the first, and each retry after a failure that was not the host's."""
        mark = len(world.cluster.log)
        try:
            actions = world.step(node)
        except InvariantViolated:
            raise
        except Exception as exc:
            action = world.executed[-1][1] if world.executed else None
            raise _Fail("actions apply", f"an action could not be applied after {action}: {exc}") from exc
        for action in actions:  # a runner asked of a node out of reach: never spawned, so it has no key
            if isinstance(action, act.CreateRunner) and self.links.get(action.node_id, UP) != UP:
                self._give_up(action.runner_id, action.node_id, key=False, running=False, now=world.now)
        charged = {}
        backing_off = InstanceState.BACKING_OFF.value
        for iid in world.cluster.instances:
            last = world.cluster.instance(iid).last_failure  # a start leaves it: the previous generation's
            first = sum(
                isinstance(a, act.StartGeneration) and a.instance_id == iid and a.generation == 1 for a in actions
            )
            # a retry starts from Backing off; a start from Pending after an unpark follows no failure
            retries = [
                e for e in world.cluster.log[mark:] if e.key == iid and e.event == "start" and e.source == backing_off
            ]
            charged[iid] = first + (len(retries) if last is None or last.charged else 0)
        return charged

    # -- admission and eviction (with instances) ------------------------------------------------

    def _room(self) -> dict[str, Any]:
        """What the daemon's placer asks admission with (`exod.placer.Placer._facts`)."""
        assert self.world is not None
        c = self.cluster
        done = DownloadState.COMPLETED
        cached = {node: [MODEL] for (node, _), m in c.downloads.items() if m.download_state is done}
        return {
            "model": self.facts,
            "view": self.world.view(),
            "nodes": self.memory,
            "limits": self.limits,
            "facts": {MODEL: self.facts},
            "cached": cached,
        }

    def _admits(self, action: act.Action) -> bool:
        """The daemon's executor before an unpark: it goes on only once `fsm.admit_unpark` finds the instance
        room, parking first the idle instances it names; else it stays parked and its requests wait."""
        if not isinstance(action, act.UnparkInstance):
            return True
        answer = self.config.admit_unpark(action.instance_id, **self._room())
        if not answer.admitted:
            return False
        self._evict(answer, action.instance_id)
        return True

    def _place(self, iid: str) -> str:
        """The daemon's placer: placed where `fsm.admit` says, after parking the instances it names; or refused."""
        answer = self.config.admit(MODEL, self.config.ranks, evict=True, **self._room())
        if not answer.admitted:
            assert answer.refusal is not None
            return f"place {iid}: refused ({answer.refusal.value})"
        self._evict(answer, iid)
        self._seat(iid, self.fresh[iid], answer.nodes, None)
        order = {k: self.cluster.instances[k] for k in self.ids if k in self.cluster.instances}
        self.cluster.instances.clear()
        self.cluster.instances.update(order)
        return f"place {iid}" + (f" (evicting {', '.join(self.evicted)})" if self.evicted else "")

    def _evict(self, answer: Admission, newcomer: str) -> None:
        """Invariant 14, then the daemon's placer (`exod.placer.Placer.evict`): each instance admission names
        is parked for the memory of ``newcomer``."""
        assert self.world is not None
        view = self.world.view()
        waiting = {req.instance_id for req in view.requests}
        for iid in answer.evict:
            seen = view.instances.get(iid)
            in_flight = 0 if seen is None else sum(r.in_flight for _, r in view.slot_runners(seen) if r and r.alive)
            state = "absent" if seen is None else seen.retry.state.value
            if seen is None or iid == newcomer or state != InstanceState.READY.value or in_flight or iid in waiting:
                why = f"{in_flight} request(s) in flight" if in_flight else "a request waits for it"
                why = why if in_flight or iid in waiting else state
                raise InvariantViolated("14 eviction parks only idle instances", f"{iid} evicted for {newcomer}: {why}")
            if seen.keep_alive is None:
                raise InvariantViolated("14 eviction parks only idle instances", f"{iid} is kept forever")
            self.cluster.park(iid, self.world.now, act.ParkReason.EVICTED)
            self.evicted.append(iid)

    def _check_memory(self) -> None:
        """Invariant 15: on each node, the ranks of the live runners and the ranks admitted fit its memory."""
        if self.config.node_memory is None:
            return
        live: dict[str, list[str]] = {}
        for rid, entry in self.cluster.runners.items():
            if entry.machine.alive:
                live.setdefault(entry.node_id, []).append(rid)
        admitted: dict[str, list[str]] = {}
        idle = (InstanceState.PARKING, InstanceState.PARKED, InstanceState.DELETED)
        for placement in self.cluster.instances.values():
            if placement.machine.instance_state not in idle:
                for slot in placement.slots:
                    admitted.setdefault(slot.node_id, []).append(slot.runner_id)
        for what, ranks in (("live runners", live), ("ranks admitted", admitted)):
            for node, rids in sorted(ranks.items()):
                if len(rids) * RANK_BYTES > self.memory[node]:
                    raise _Fail(
                        "15 memory within the node's budget",
                        f"{what} on {node}: {', '.join(sorted(rids))}, but it holds {self.config.node_memory}",
                    )

    # -- the nodes (with hosts) ----------------------------------------------------------------

    def _give_up(self, rid: str, node: str, *, key: bool, running: bool, now: float) -> None:
        """The controller gives a runner up with its node: a failure of the host, at once; its exit once its
        key is gone (or at once, with the planted bug)."""
        machine = self.cluster.runner(rid)
        inc = machine.incarnation
        if machine.runner_state is not RunnerState.FAILED:
            failure = Failure.host(f"node {node} lost")
            self.cluster.runner_event(rn.Fail(rid, inc, failure=failure), now)
        self.lost[(rid, inc)] = (node, key)
        if running:
            self.ghosts.add((rid, inc, node))
        if not self.config.waits_for_keys:
            self._confirm(rid, inc, now)

    def _confirm(self, rid: str, inc: int, now: float) -> None:
        del self.lost[(rid, inc)]
        self.cluster.runner_event(rn.Exited(rid, inc, exit_code=-9, stop_delivered=False), now)

    def _place_again(self, action: act.Action) -> None:
        """Before a new generation, as the controller does: ranks on nodes whose lease expired move to live
        ones (fewest ranks first, then by name); if no node is live they stay, and fail as the host's."""
        if not isinstance(action, act.StartGeneration):
            return
        live = [node for node in self.config.nodes if self.leases[node]]
        nodes = [slot.node_id for slot in self.placement.slots]
        if not live or all(node in live for node in nodes) or self.cluster.has_live_runners(INSTANCE):
            return
        for rank, node in enumerate(nodes):
            if node not in live:
                nodes[rank] = min(live, key=lambda n: (sum(1 for m in nodes if m == n), n))
        self.cluster.move(INSTANCE, nodes)

    def _check_hosts(self) -> None:
        """Invariant 6 on the hosts: the processes that run, known or not, are of one generation (one_for_one:
        each rank's, for replicas restart one by one)."""
        if not self.config.hosts:
            return
        processes = {
            (rid, e.machine.incarnation)
            for rid, e in self.cluster.runners.items()
            if e.machine.alive and (rid, e.machine.incarnation) not in self.lost
        } | {(rid, inc) for rid, inc, _ in self.ghosts}
        if self.config.policy.strategy is RestartStrategy.ONE_FOR_ONE:
            by_rank: dict[str, set[int]] = {}
            for rid, inc in processes:
                by_rank.setdefault(rid, set()).add(inc)
            running = max(by_rank.values(), key=len, default=set())  # the rank with the most generations running
        else:
            running = {inc for _, inc in processes}
        if len(running) > 1:
            ghosts = ", ".join(f"{rid}#{inc} on {node}" for rid, inc, node in sorted(self.ghosts)) or "none"
            raise _Fail(
                "6 one generation at a time, on the hosts",
                f"generations {sorted(running)} run at once (still running on a cut node: {ghosts})",
            )

    # -- invariants --------------------------------------------------------------------------

    def _check_transition(
        self, pre: _State, before: dict[str, Any], now: float, streaks: dict[str, tuple[float, int]]
    ) -> None:
        """The invariants of one transition, for each instance; ``streaks`` (the last backoff delay and the
        starts of each instance's streak) are brought up to date."""
        c, policy = self.cluster, self.config.policy
        failed, stopping, stopped = RunnerState.FAILED.value, RunnerPhase.STOPPING.value, RunnerPhase.STOPPED.value
        for iid, snap in before.items():
            if snap.leaf == InstanceState.DELETED.value and not c.instance(iid).is_deleted:
                raise _Fail("1 absorbing Deleted", f"instance {iid} left Deleted for {c.instance(iid).leaf}")
        for entry in c.log:
            if entry.machine == "runner" and entry.source == failed and entry.target != stopped:
                raise _Fail("2 Failed left only to Shutdown", f"runner {entry.key}: failed → {entry.target}")
            # Shutdown's leaves; an error (or an exit that beat our stop) while stopping may still fail it
            shutdown = (stopping, stopped)
            if entry.machine == "runner" and entry.source in shutdown and entry.target not in (*shutdown, failed):
                raise _Fail("1 absorbing Shutdown", f"runner {entry.key}: {entry.source} → {entry.target}")
            if entry.machine == "runner" and entry.source == stopped:
                raise _Fail("1 absorbing Shutdown", f"runner {entry.key}: stopped → {entry.target}")
            if entry.machine == "instance" and entry.target == InstanceState.BACKING_OFF.value:
                delay = c.instance(entry.key).deadline - now  # type: ignore[operator]
                streak, starts = streaks[entry.key]
                low = 0.0 if policy.backoff.jitter else min(policy.backoff.initial, policy.backoff.cap)
                if not low <= delay <= policy.backoff.cap:
                    raise _Fail("3 backoff bounds", f"delay {delay:g} outside [{low:g}, {policy.backoff.cap:g}]")
                if not policy.backoff.jitter and delay < streak:
                    raise _Fail("3 backoff never decreases", f"delay {delay:g} after {streak:g} in one streak")
                streaks[entry.key] = (delay, starts)
        for iid, placement in c.instances.items():
            self._check_residency(iid, pre, before.get(iid, self.fresh[iid]), placement.machine)
        for rid, snap in pre.runners:
            entry = c.runners.get(rid)
            m = None if entry is None else entry.machine
            if snap.leaf == stopped and (m is None or (m.incarnation == snap.incarnation and m.alive)):
                raise _Fail("1 absorbing Shutdown", f"runner {rid} left Shutdown")
        check_runners(c)
        for iid, placement in c.instances.items():
            self._check_reset(before.get(iid, self.fresh[iid]), placement.machine, now)

    def _check_residency(self, iid: str, pre: _State, before: Any, after: InstanceRetry) -> None:
        """11, 12 and 13 for instance ``iid``."""
        c = self.cluster
        steps = [(e.event, e.target) for e in c.log if e.machine == "instance" and e.key == iid]
        if after.leaf == InstanceState.PARKED.value:
            alive = sorted(rid for rid, e in c.runners.items() if e.instance_id == iid and e.machine.alive)
            if alive:
                raise _Fail("11 parked means no process", f"instance parked while {alive} alive")
        parking = any(event in ("park", "unpark") or target == InstanceState.PARKED.value for event, target in steps)
        if parking and (after.attempts, after.uncharged) != (before.attempts, before.uncharged):
            raise _Fail(
                "12 parking spends no retry",
                f"attempts {before.attempts} → {after.attempts}, uncharged {before.uncharged} → {after.uncharged}",
            )
        busy = sorted(rid for rid, snap in pre.runners if snap.in_flight and _owner(rid) == iid)
        if any(event == "park" for event, _ in steps) and busy:
            raise _Fail("13 park only when idle", f"parked with requests in flight on {busy}")

    def _check_reset(self, before: Any, after: InstanceRetry, now: float) -> None:
        """8 for one instance."""
        policy = self.config.policy
        ready = InstanceState.READY.value
        if after.attempts + after.uncharged < before.attempts + before.uncharged:
            ready_for = None if before.ready_since is None else now - before.ready_since
            if (
                before.leaf != ready
                or ready_for is None
                or policy.reset_after is None
                or ready_for < policy.reset_after
            ):
                raise _Fail("8 reset iff Ready long enough", f"budget reset after {ready_for} s in {before.leaf}")
        ready_for = None if after.ready_since is None else now - after.ready_since
        spent = after.attempts or after.uncharged
        due = policy.reset_after is not None and ready_for is not None and ready_for >= policy.reset_after
        if after.leaf == ready and due and spent:
            raise _Fail("8 reset iff Ready long enough", f"Ready for {now - after.ready_since:g} s, no reset")

    def check_state(self, state: _State) -> None:
        """Invariant 7: an event of an older incarnation (or generation) changes nothing, whatever it says."""
        stale_failure = Failure.exception("RuntimeError", "late news", retryable=False)
        for rid, snap in state.runners:
            old = snap.incarnation - 1
            if old < 0 or (rid, snap) in self._stale_proven:
                continue  # a stale event is refused by the runner's machine alone: one probe per runner state
            self._stale_proven.add((rid, snap))
            for event in (
                rn.Stop(rid, old),
                rn.Exited(rid, old, exit_code=-9),
                rn.Fail(rid, old, failure=stale_failure),
            ):
                world = self._world(state)
                out = self.cluster.runner_event(event, state.now)
                after = self.capture(world, self._streaks(state), state.submitted)
                if out.accepted or after != state:
                    raise _Fail("7 stale events are no-ops", f"a stale {event.name} moved runner {rid}")
        for iid, snapshot in self.placed(state):
            # the rank run by the newest generation (one_for_all: every rank; one_for_one: the last restarted)
            generation, rank = max((g, r) for r, g in enumerate(snapshot.rank_generations))
            deleted = snapshot.leaf == InstanceState.DELETED.value
            if generation >= 2 and not deleted and snapshot not in self._stale_proven:
                self._stale_proven.add(snapshot)
                self.load(state)
                stale = inst.RankFailed(iid, state.now, generation - 1, rank, failure=stale_failure)
                if self.cluster.instance_event(stale).accepted or self.cluster.instance(iid).snapshot() != snapshot:
                    raise _Fail("7 stale events are no-ops", "a stale generation's failure moved the instance")

    def settled(self, state: _State) -> bool:
        if state.requests or state.pending or state.lost or state.ghosts:
            return False  # every request forwarded or cancelled, every completion in, every lost runner gone
        serving = (RunnerPhase.AVAILABLE.value, RunnerPhase.BUSY.value)
        for iid, m in self.placed(state):
            runners = [s for rid, s in state.runners if _owner(rid) == iid]
            if m.leaf in (InstanceState.DELETED.value, InstanceState.PARKED.value):
                if not all(s.leaf == RunnerPhase.STOPPED.value for s in runners):
                    return False
            elif not (
                m.leaf == InstanceState.READY.value
                and len(runners) == self.config.ranks
                and all(s.leaf in serving for s in runners)
            ):
                return False
        return True

    def interleavings(
        self, state: _State, event: Event, successor: _State, evicted: tuple[str, ...]
    ) -> Iterator[tuple[str, str, str | None]]:
        """What a transition that changed the state explored: (where, what, beside) for the instance the event
        concerns (each instance, for the system's own events), beside each other instance (None: the only one);
        and ("ready", "evict", where the instance it made room for went) for each eviction."""
        kind = _kind(event)
        if len(self.ids) == 1:
            yield _where(state.instance), kind, None
            return
        where = {iid: _where(snap) for iid, snap in self.placed(state)}
        for iid in self.ids:
            where.setdefault(iid, "absent")
        concerned = _concerns(event)
        for iid in [concerned] if concerned else self.ids:
            for other in self.ids:
                if other != iid:
                    yield where[iid], kind, where[other]
        if evicted:
            after = dict(self.placed(successor))
            newcomers = [iid for iid in self.ids if iid not in evicted and iid in after]
            for iid in evicted:
                for other in newcomers:
                    if after[other].leaf not in _PARKED and where[other] != _where(after[other]):
                        yield where[iid], "evict", _where(after[other])


def check(config: CheckConfig | None = None, *, timer: Callable[[], float] | None = None) -> CheckResult:
    """Explore breadth-first up to ``config.depth``; the first violation found has a shortest trace.

    ``timer`` (e.g. ``time.perf_counter``) times the run for the report; fsm itself reads no clock.
    """
    config = config or CheckConfig()
    system = _System(config, _TransitionTable() if config.transition_table else None)
    timer = timer or (lambda: 0.0)
    start = timer()
    root = system.initial()
    parents: dict[_State, tuple[_State | None, str]] = {root: (None, "")}
    frontier = deque([(root, 0)])
    transitions, deepest, truncated, truncated_by_time = 0, 0, False, False
    progress_from: dict[_State, list[_State]] = {}  # reverse progress edges, for the liveness check
    open_states: set[_State] = set()  # settled, or with a future past the horizon or the bounds
    samples: list[tuple[_State, Event, _State]] = []
    explored: set[tuple[str, str]] = set()
    beside: set[tuple[str, str, str]] = set()
    rng = random.Random(0)

    def trace(state: _State, last: str | None = None) -> tuple[str, ...]:
        labels = [] if last is None else [last]
        while parents[state][0] is not None:
            parent, label = parents[state]
            labels.append(label)
            state = parent  # type: ignore[assignment]
        return tuple(reversed(labels))

    def failed(state: _State, exc: _Fail, last: str | None = None) -> CheckResult:
        violation = Violation(exc.invariant, str(exc), trace(state, last))
        return CheckResult(len(parents), transitions, deepest, False, timer() - start, violation)

    while frontier:
        state, depth = frontier.popleft()
        deepest = max(deepest, depth)
        try:
            system.check_state(state)
        except _Fail as exc:
            return failed(state, exc)
        moved = False
        results = system.successors(state)
        while True:
            try:
                event, successor, label, evicted = next(results)
            except StopIteration:
                break
            except _Fail as exc:
                return failed(state, exc, getattr(exc, "event", None))
            transitions += 1
            if successor != state:
                for where, what, other in system.interleavings(state, event, successor, evicted):
                    explored.add((where, what))
                    if other is not None:
                        beside.add((where, what, other))
                if system.progress(event):
                    moved = True
                    progress_from.setdefault(successor, []).append(state)
            if len(samples) < config.determinism_samples and rng.random() < 0.05:
                samples.append((state, event, successor))
            if successor in parents:
                continue
            if system.beyond_horizon(successor):
                truncated_by_time = True
                open_states.add(state)  # its future lies past the horizon: assumed live
                continue
            if depth + 1 > config.depth or len(parents) >= config.max_states:
                truncated = True
                open_states.add(state)
                continue
            parents[successor] = (state, label)
            frontier.append((successor, depth + 1))
        if not moved and not system.settled(state):
            return failed(state, _Fail("10 no deadlock", f"stuck: {_stuck(system, state)}"))
        if system.settled(state):
            open_states.add(state)
    # 10, globally: every state reaches a settled one by progress events alone (no livelock in a cycle).
    live = set(open_states)
    work = deque(live)
    while work:
        for predecessor in progress_from.get(work.popleft(), ()):
            if predecessor not in live:
                live.add(predecessor)
                work.append(predecessor)
    for state in parents:
        if state not in live:
            why = f"livelock: {_stuck(system, state)} never settles without help"
            return failed(state, _Fail("10 no deadlock", why))
    for state, event, successor in samples:  # 9: the same state and event give the same successor
        again, _ = system.apply(state, event)
        if again != successor:
            return failed(state, _Fail("9 determinism", f"{event} gave two different successors"), event)
    horizon = config.time_horizon if truncated_by_time else None
    reached = frozenset(outcome for s in parents for outcome in _outcomes(system, s))
    seconds = timer() - start
    return CheckResult(
        len(parents),
        transitions,
        deepest,
        not truncated,
        seconds,
        None,
        horizon,
        reached,
        frozenset(explored),
        frozenset(beside),
    )


def _stuck(system: _System, state: _State) -> str:
    """The instance(s) and runners of a state that does not settle, as a violation says them."""
    placed = system.placed(state)
    if len(system.ids) == 1:
        return f"instance {state.instance.leaf}, runners {_leaves(state)}"
    leaves = ", ".join(f"{iid} {snap.leaf}" for iid, snap in placed)
    waiting = f"; requests waiting: {', '.join(state.requests)}" if state.requests else ""
    return f"instances {leaves}, runners {_leaves(state)}{waiting}"


def _leaves(state: _State) -> str:
    return ", ".join(f"{rid}#{s.incarnation}:{s.leaf}" for rid, s in state.runners) or "none"


def _where(snapshot: Any) -> str:
    """An instance's leaf as users see it: an unparked instance on its way back to Ready is "unparking"."""
    return "unparking" if snapshot.waking else snapshot.leaf


def _kind(event: Event) -> str:
    return event.fault.value if isinstance(event, Inject) else str(event).split(" ", 1)[0]


def _concerns(event: Event) -> str | None:
    """The instance an event is about (None: the whole system's, or the only instance)."""
    match event:
        case Submit(iid) | Delete(iid) | Park(iid):
            return iid
        case Place(iid):
            return iid
        case Inject(_, rid):
            return _owner(rid)
    return None


def _outcomes(system: _System, state: _State) -> Iterator[str]:
    """How each instance stands ("ready", "deleted:retries_exhausted" …); after the first, prefixed "j:" …"""
    for iid, m in system.placed(state):
        outcome = f"deleted:{m.delete_reason.value}" if m.delete_reason is not None else m.leaf
        yield outcome if iid == INSTANCE else f"{iid}:{outcome}"
