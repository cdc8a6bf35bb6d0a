"""The instance retry policy: one instance = one model placed on N ranks.

Theory of operation
-------------------
::

    Pending → Starting → Ready → Recovering → BackingOff → Starting … → Deleted
                           Ready → Parking → Parked → Pending → Starting …
                           Ready → Degraded → Ready  (one_for_one: a rank restarted alone)

Two compound states group what is handled alike: **Alive** (everything but
Deleted: ``delete`` from anywhere, ``tick`` anywhere, ``give_up`` wherever the
planner would start runners) and, inside it, **Generation running** (Starting,
Ready, and one_for_one's Degraded: a rank's failure or exit ends the
generation the same way from each, unless one_for_one restarts the rank
alone). The leaves, not the compounds, are the states (``InstanceState``,
snapshots); a leaf's own transitions are tried before its compound's.

* **one_for_all**: a failure of any rank ends the whole generation. The
  instance goes to Recovering, where every rank of that generation is stopped;
  only when the last one has been reaped does it go on to BackingOff (an
  eventless transition: the joint condition "nothing alive" triggers it).
  The next generation starts from BackingOff, so two generations never coexist.
* Several ranks failing in one generation cost **one** retry: further
  failures of a generation already Recovering are absorbed. ``last_failure``
  is the first *cause*: a consequence reported first (``FailureKind.PEER``: a
  rank that lost its connection to the one that died) gives way to it, and
  when that cause is the host's (a lost node), the retry the consequence was
  charged is given back: the generation was the host's failure. A consequence
  never gives up by itself; the budget it spends is given up on once the
  generation is reaped, if no host cause gave it back meanwhile.
* Backoff before generation n+1 is ``policy.backoff.delay(n)``; the deadline
  is armed when the old generation is fully reaped, and ``start`` is refused
  before it.
* Give-up: the failure that makes ``max_failures`` failed generations goes to
  Deleted(retries_exhausted); a non-retryable cause goes to
  Deleted(non_retryable) at once, whatever the count.
* Uncharged: a generation ended by the host rather than the model (a spawn
  that found no fds or disk, a ring port taken: ``Failure.charged`` is
  False) is counted in ``uncharged``, never in ``attempts``: it waits out the
  backoff like any other (its delay grows with both counts, so there is no
  tight loop) but never brings the instance closer to giving up.
* Poison: a generation ended with a request in its batch that was in the batch
  at an earlier death too (``FailureKind.POISON``, found by the daemon) is
  uncharged like the host's, and gives back one retry: the one that earlier
  death was charged, where the budget still holds it. The request, not the
  model, killed both; the daemon refuses it from then on.
* Reset: the count returns to 0 once the instance has been Ready continuously
  for ``reset_after``. Every event's ``now`` is observed before the event is
  handled, so a failure long after Ready counts against a fresh budget even if
  no tick came in between.
* Deleted is final and absorbs every later event (late exits, timers).
* Resume: after a daemon restart, a Starting or Ready instance whose runners
  were reaped as orphans starts a new generation at once, without charging
  the budget: the daemon, not the model, lost that generation.
* Time is always the caller's ``now``; jitter draws from an RNG seeded by
  (seed, instance, attempt), so the same events, clock and seed give the same
  schedule, also after a restore.

* **one_for_one** (``RetryPolicy.strategy``, for ranks that are independent
  replicas, not a ring): a rank's failure or unannounced exit takes
  Generation running to **Degraded**, where the failed rank alone is stopped,
  waits out its own backoff once reaped, and is restarted by ``start_rank``
  as the instance's next generation number (so each rank has its own
  generation: ``rank_generations``, and an event of a rank's older process is
  ignored as ever); the other ranks serve on. Degraded goes back to Ready once
  every rank is. Each failed rank costs one retry of the instance's budget
  (there are no peers, so no failure is a consequence), and the failure that
  spends it, or one no retry can mend, ends the instance as in one_for_all.

Stopping runners is not this machine's job: the planner reads its state and
emits the stop actions (Recovering, Parking or Deleted ⇒ stop every live rank).

Residency (parking) is part of this machine, not a machine of its own
-----------------------------------------------------------------------
An instance nobody uses can be *parked*: its runners stopped on purpose, its
placement and its budget kept, and started again (a new generation, download
first, by the same rules) when a request comes for it (``unpark``). It is a
pair of leaves here, Parking (its ranks being stopped) and Parked (none
alive), because residency and retries are not independent: a generation
cannot be running and parked at once, and what a rank's failure means depends
on which it is (while Parking it is absorbed and charges nothing: the stop
was ours). As two machines, every event would need a guard looking at the
other's state, and the pair "parked, starting" would exist to be forbidden;
as one, it cannot be written.

* ``park`` takes Generation running to Parking only while no request is in
  flight on its runners (guard ``idle``: the cluster counts them), and Pending
  straight to Parked (nothing alive); it is refused while a failed generation
  is retried (Recovering, Backing off: its backoff and budget rule it) and
  ignored once parking or parked.
* Parking → Parked when the last rank is reaped (eventless, like Recovering).
* ``unpark`` takes Parked back to Pending: the next generation starts there.
* Neither spends a retry (``attempts`` and ``uncharged`` are untouched), and
  ``waking`` marks an unparked instance until it is Ready (what users see as
  "unparking").

*When* to park (idle for its keep-alive, or evicted for a newer demand) is the
planner's and admission's to decide (`fsm.plan`, `fsm.admit`), not this
machine's.

"""

from __future__ import annotations

import enum
import random
import warnings
from typing import Any, ClassVar

import attrs
from statemachine import State

from fsm._machine import Lifecycle, Outcome
from fsm._validate import finite, integer, is_count, is_time, ranks_problem, show
from fsm.backoff import Backoff
from fsm.errors import IncarnationMismatch, InvalidConfig, InvalidEvent, SnapshotError
from fsm.failure import Failure, FailureKind


class InstanceState(enum.Enum):
    """Where an instance is in its retry lifecycle (the states of `InstanceRetry`)."""

    PENDING = "pending"  #: placed (or unparked), its next generation not started yet: the plan downloads, then starts
    STARTING = "starting"  #: a generation's ranks are being created and brought up
    READY = "ready"  #: every rank of the generation is Ready: it serves requests
    RECOVERING = "recovering"  #: a rank failed: every rank of the generation is being stopped (one_for_all)
    BACKING_OFF = "backing_off"  #: the failed generation is reaped; the next starts once the backoff ends
    DEGRADED = "degraded"  #: one_for_one: a rank failed and is restarted alone; the Ready ranks serve on
    PARKING = "parking"  #: parked on purpose, its runners being stopped (a failure now costs nothing)
    PARKED = "parked"  #: no process, placement and budget kept; a request unparks it
    DELETED = "deleted"  #: final: deleted by its user or given up on (``delete_reason`` says which)


class RestartStrategy(enum.Enum):
    """What a rank's failure takes down (Erlang/OTP's supervisor strategies, by their names)."""

    ONE_FOR_ALL = "one_for_all"  #: the whole generation: its ranks are one ring, which a lost rank hangs
    ONE_FOR_ONE = "one_for_one"  #: that rank alone: the ranks are independent replicas, each a world of one


class DeleteReason(enum.Enum):
    """Why an instance reached Deleted: asked by its user, out of retries, or a failure no retry can mend."""

    REQUESTED = "requested"  #: its user deleted it (`Cluster.delete`)
    RETRIES_EXHAUSTED = "retries_exhausted"  #: ``max_failures`` generations failed (charged failures only)
    NON_RETRYABLE = "non_retryable"  #: a failure with ``retryable=False``: retrying cannot mend it


_UNSET: Any = object()


@attrs.frozen(init=False)
class RetryPolicy:
    """How an instance retries: the backoff, the budget, and when the budget refills.

    ``max_failures``: how many charged failures (failed generations of one_for_all, failed replicas of
    one_for_one) the instance takes; the one that makes ``max_failures`` gives up (Deleted,
    ``retries_exhausted``). So ``max_failures=N`` allows N-1 retries: 1 retries nothing, 5 (the default)
    retries four times; 0 is refused. A host's or a poison request's failure is not charged and never counts.
    ``None``: never give up on a retryable failure (a non-retryable one still ends the instance; the backoff
    still grows to its cap). ``reset_after=None``: the budget never refills.

    ``max_retries`` is its old name, with the same meaning (it never counted retries): accepted with a
    `DeprecationWarning`, as keyword (it wins over ``max_failures``, so that ``attrs.evolve(policy,
    max_retries=N)`` still works) and as attribute.

    ``strategy``: one_for_all (the default) when the ranks are one ring — a ring that lost a rank hangs in
    its next collective, so they restart together; one_for_one when they are independent replicas (each
    process a world of one, no ring): a failed rank is stopped and restarted alone, after its own backoff,
    while the others serve on (`InstanceState.DEGRADED`). Either way the budget is the instance's: each
    failed generation of one_for_all, each failed rank of one_for_one, counts one failure.
    """

    backoff: Backoff = attrs.field(factory=Backoff, validator=attrs.validators.instance_of(Backoff))
    max_failures: int | None = attrs.field(default=5, validator=integer(InvalidConfig, at_least=1, optional=True))
    reset_after: float | None = attrs.field(
        default=600.0, validator=attrs.validators.optional(finite(InvalidConfig, above=0))
    )
    strategy: RestartStrategy = attrs.field(
        default=RestartStrategy.ONE_FOR_ALL, validator=attrs.validators.instance_of(RestartStrategy)
    )

    def __init__(
        self,
        backoff: Backoff = _UNSET,
        max_failures: int | None = _UNSET,
        reset_after: float | None = 600.0,
        strategy: RestartStrategy = RestartStrategy.ONE_FOR_ALL,
        *,
        max_retries: int | None = _UNSET,
    ) -> None:
        if (
            max_retries is not _UNSET
        ):  # given with max_failures too, it wins: attrs.evolve(p, max_retries=N) passes both
            warnings.warn(_RENAMED, DeprecationWarning, stacklevel=2)
            max_failures = max_retries
        self.__attrs_init__(  # type: ignore[attr-defined]
            Backoff() if backoff is _UNSET else backoff,
            5 if max_failures is _UNSET else max_failures,
            reset_after,
            strategy,
        )

    @property
    def max_retries(self) -> int | None:
        """Deprecated: `max_failures`, which it always meant (charged failures before giving up, not retries)."""
        warnings.warn(_RENAMED, DeprecationWarning, stacklevel=2)
        return self.max_failures


_RENAMED = (
    "RetryPolicy.max_retries is now max_failures, with the same meaning: the charged failures after which the "
    "instance gives up (N allows N-1 retries)"
)


def budget_exhausted(failed_generations: int, max_failures: int | None) -> bool:
    """The give-up rule, in one place: the machine and the planner both ask it (None: never)."""
    return max_failures is not None and failed_generations >= max_failures


# -- events -----------------------------------------------------------------------


@attrs.frozen
class InstanceEvent:
    """Base of the instance's events: every one names its instance and carries the caller's ``now``."""

    name: ClassVar[str]
    instance_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    now: float = attrs.field(validator=finite(InvalidEvent))

    def payload(self) -> dict[str, Any]:
        """The event's fields the machine's guards and callbacks take (as keyword arguments of ``send``)."""
        return {}


@attrs.frozen
class Start(InstanceEvent):
    """Start ``generation`` (1 for the first); refused before the backoff deadline."""

    name = "start"
    generation: int = attrs.field(validator=integer(InvalidEvent))


@attrs.frozen
class StartRank(InstanceEvent):
    """one_for_one: start rank ``rank`` alone, as ``generation`` (the instance's next); refused before the
    rank's backoff deadline, or while its failed process is alive."""

    name = "start_rank"
    generation: int = attrs.field(validator=integer(InvalidEvent))
    rank: int = attrs.field(validator=integer(InvalidEvent))

    def payload(self) -> dict[str, Any]:
        """The rank, whose own deadline and liveness the guard reads."""
        return {"rank": self.rank}


@attrs.frozen
class RankEvent(InstanceEvent):
    """Base of what one rank of one generation did; an event of an older generation than the rank's is
    ignored (one_for_all: the instance's; one_for_one: the rank's own, its last restart)."""

    generation: int = attrs.field(validator=integer(InvalidEvent))
    rank: int = attrs.field(validator=integer(InvalidEvent))

    def payload(self) -> dict[str, Any]:
        """The rank, which the machine counts among the live or ready ones."""
        return {"rank": self.rank}


@attrs.frozen
class RankCreated(RankEvent):
    """A rank's process was created (`Cluster.execute` of a CreateRunner sends it): it is alive until stopped."""

    name = "rank_created"


@attrs.frozen
class RankReady(RankEvent):
    """A rank's runner reached Ready (the cluster forwards it); the instance is Ready once every rank is."""

    name = "rank_ready"


@attrs.frozen
class RankFailed(RankEvent):
    """A rank's runner failed (the cluster forwards it, with the cause): the generation ends, one retry spent."""

    name = "rank_failed"
    failure: Failure = attrs.field(kw_only=True, validator=attrs.validators.instance_of(Failure))

    def payload(self) -> dict[str, Any]:
        """The rank and the cause, which decides whether the failure is charged, retried or final."""
        return {"rank": self.rank, "failure": self.failure}


@attrs.frozen
class RankFailedWhileStopping(RankFailed):
    """A rank we were stopping failed on its own first (an exit that beat our stop, an error).

    The stop was ours, so it costs nothing and never deletes the instance; but it may be the *cause* that a
    peer's lost connection only reported, and the cause is what ``last_failure`` keeps.
    """

    name = "rank_failed_while_stopping"


@attrs.frozen
class RankStopped(RankEvent):
    """The rank's process was reaped."""

    name = "rank_stopped"


@attrs.frozen
class RankLost(RankEvent):
    """one_for_one, after a supervisor restart: this rank's process went with the old supervisor (it is gone),
    while its siblings were adopted. The rank is restarted alone at once: the supervisor, not the model, lost
    it, so it costs no retry and waits no backoff (`fsm.cluster.Cluster.recover` sends it)."""

    name = "rank_lost"


@attrs.frozen
class Resume(InstanceEvent):
    """The daemon restarted and reaped this generation's orphaned runners: start a fresh generation.

    The generation was lost to the daemon, not to the model, so it costs no retry.
    """

    name = "resume"


@attrs.frozen
class Tick(InstanceEvent):
    """Only time passes (lets a Ready instance's budget reset be observed)."""

    name = "tick"


@attrs.frozen
class Delete(InstanceEvent):
    """The user deletes the instance."""

    name = "delete"


@attrs.frozen
class Park(InstanceEvent):
    """Stop the instance's runners on purpose and keep it (refused while ``busy`` requests are in flight on
    them: `fsm.cluster.Cluster.park` counts them)."""

    name = "park"
    busy: int = attrs.field(default=0, kw_only=True, validator=integer(InvalidEvent))

    def payload(self) -> dict[str, Any]:
        """The requests in flight, which the ``idle`` guard refuses to cut short."""
        return {"busy": self.busy}


@attrs.frozen
class Unpark(InstanceEvent):
    """Bring a parked instance back: its next generation starts by the usual rules."""

    name = "unpark"


@attrs.frozen
class GiveUp(InstanceEvent):
    """The planner found the budget exhausted where it would otherwise start runners."""

    name = "give_up"


# -- snapshot ---------------------------------------------------------------------


@attrs.frozen
class InstanceSnapshot:
    """An instance's whole state as a value (`InstanceRetry.snapshot`): what survives a restart, budget included."""

    instance_id: str
    world_size: int
    policy: RetryPolicy
    seed: int
    leaf: str
    generation: int = 0
    attempts: int = 0
    uncharged: int = 0
    deadline: float | None = None
    ready_since: float | None = None
    clock: float | None = None
    live_ranks: tuple[int, ...] = ()
    ready_ranks: tuple[int, ...] = ()
    delete_reason: DeleteReason | None = None
    last_failure: Failure | None = None
    waking: bool = False  # unparked, not Ready yet
    rank_generations: tuple[int, ...] = ()  # the generation of each rank's process (one_for_all: all alike)
    failed_ranks: tuple[int, ...] = ()  # one_for_one: ranks that failed and wait for their own restart
    rank_deadlines: tuple[tuple[int, float], ...] = ()  # one_for_one: (rank, when it may restart), once reaped


_UNEXPECTED_STOP = Failure(FailureKind.EXIT, "a rank stopped without reporting a failure")


class InstanceRetry(Lifecycle):
    """Retry policy of one instance. See the module docstring."""

    machine_name = "instance"
    snapshot_type = InstanceSnapshot
    snapshot_version = 5  # 2 `uncharged`, 3 `waking` (parking, parked), 4 one_for_one's fields, 5 `max_failures`

    class alive(State.Compound):
        pending = State(initial=True)

        class running(State.Compound, name="Generation running"):
            starting = State(initial=True)
            ready = State()
            degraded = State()

        recovering = State()
        backing_off = State("Backing off")
        parking = State()
        parked = State()

    deleted = State(final=True)

    # python-statemachine tries the active leaf's transitions before its ancestors' (each in declaration
    # order). The leaves of `running` declare rank_failed and rank_stopped, which `running` handles, only for
    # one_for_one (a rank restarted alone, Degraded's own rank_stopped of a rank that had failed): guarded so
    # that one_for_all never takes them, and a failure that ends the instance falls through to the compound's.
    # Otherwise the compound's alternatives are tried exactly as they were on each leaf. A compound's "stay" is
    # targetless (`to(None)`): an internal self-transition of a compound would exit and re-enter it, back at its
    # initial child. (Declared on the compound, the leaves' edges into Degraded would be edges from a cluster
    # to a node inside it, which Graphviz cannot clip.)
    start = alive.pending.to(alive.running, on="_begin_generation") | alive.backing_off.to(
        alive.running, cond="deadline_passed", on="_begin_generation"
    )
    start_rank = alive.running.degraded.to.itself(internal=True, cond="rank_due", on="_restart_rank")
    rank_created = (
        alive.running.starting.to.itself(internal=True, on="_rank_alive")
        | alive.running.degraded.to.itself(internal=True, on="_replica_alive")
        | alive.recovering.to.itself(internal=True, on="_rank_alive")
        | alive.parking.to.itself(internal=True, on="_rank_alive")
    )
    rank_ready = (
        alive.running.starting.to.itself(internal=True, on="_rank_ready")
        | alive.running.degraded.to.itself(internal=True, on="_replica_ready")
        | alive.running.ready.to.itself(internal=True)
        | alive.recovering.to.itself(internal=True)
        | alive.backing_off.to.itself(internal=True)
        | alive.parking.to.itself(internal=True)
    )
    alive.running.starting.to(alive.running.ready, cond="all_ranks_ready", on="_mark_ready")
    alive.running.degraded.to(alive.running.ready, cond="all_ranks_ready", on="_mark_ready")
    rank_failed = (
        alive.running.starting.to(alive.running.degraded, cond="fails_alone", on="_fail_alone")
        | alive.running.ready.to(alive.running.degraded, cond="fails_alone", on="_fail_alone")
        | alive.running.degraded.to.itself(internal=True, cond="fails_alone", on="_fail_alone")
        | alive.running.to(deleted, cond="non_retryable", on="_give_up_non_retryable")
        | alive.recovering.to(deleted, cond="non_retryable", on="_give_up_non_retryable")
        | alive.running.to(deleted, cond="last_charged_failure", on="_give_up_exhausted")
        | alive.running.to(alive.recovering, on="_count_failure")
        | alive.recovering.to.itself(internal=True, on="_another_failure")
        | alive.backing_off.to.itself(internal=True)
        | alive.parking.to.itself(internal=True)  # its generation was ending on purpose: nothing charged
    )
    rank_failed_while_stopping = (
        alive.recovering.to.itself(internal=True, on="_another_failure")
        | alive.backing_off.to.itself(internal=True, on="_another_failure")
        | alive.running.to(None)
        | alive.parking.to.itself(internal=True)
    )
    rank_stopped = (
        alive.running.degraded.to.itself(internal=True, cond="was_failed", on="_failed_rank_gone")
        | alive.running.starting.to(alive.running.degraded, cond="stops_alone", on="_stopped_alone")
        | alive.running.ready.to(alive.running.degraded, cond="stops_alone", on="_stopped_alone")
        | alive.running.degraded.to.itself(internal=True, cond="stops_alone", on="_stopped_alone")
        | alive.running.to(deleted, cond="last_allowed_failure", on="_stopped_and_exhausted")
        | alive.running.to(alive.recovering, on="_stopped_unexpectedly")
        | alive.recovering.to.itself(internal=True, on="_rank_gone")
        | alive.backing_off.to.itself(internal=True, on="_rank_gone")
        | alive.parking.to.itself(internal=True, on="_rank_gone")
    )
    rank_lost = (
        alive.running.starting.to(alive.running.degraded, cond="one_for_one", on="_lose_alone")
        | alive.running.ready.to(alive.running.degraded, cond="one_for_one", on="_lose_alone")
        | alive.running.degraded.to.itself(internal=True, cond="one_for_one", on="_lose_alone")
    )
    alive.recovering.to(alive.backing_off, cond="nothing_alive", on="_arm_timer")
    alive.parking.to(alive.parked, cond="nothing_alive")
    resume = (
        alive.running.starting.to.itself(on="_begin_generation")
        | alive.running.ready.to(alive.running.starting, on="_begin_generation")
        | alive.running.degraded.to(alive.running.starting, on="_begin_generation")
    )
    tick = alive.to(None)
    # the planner sends it only where it would start runners (Pending, Starting, Backing off); refused elsewhere
    give_up = alive.to(deleted, cond="budget_spent", on="_give_up_exhausted")
    delete = alive.to(deleted, on="_deleted_by_user")
    park = alive.running.to(alive.parking, cond="idle", on="_park") | alive.pending.to(alive.parked, on="_park")
    unpark = alive.parked.to(alive.pending, on="_unpark")

    def __init__(
        self,
        instance_id: str,
        *,
        world_size: int = 1,
        policy: RetryPolicy | None = None,
        seed: int = 0,
        _snapshot: InstanceSnapshot | None = None,
    ) -> None:
        if not isinstance(instance_id, str) or not instance_id:
            raise InvalidConfig(f"instance_id must be a non-empty str, got {instance_id!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise InvalidConfig(f"world_size must be an int >= 1, got {world_size!r}")
        if policy is not None and not isinstance(policy, RetryPolicy):
            raise InvalidConfig(f"policy must be a RetryPolicy, got {type(policy).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidConfig(f"seed must be an int, got {seed!r}")
        snap = _snapshot or InstanceSnapshot(
            instance_id, world_size, policy or RetryPolicy(), seed, leaf="pending", rank_generations=(0,) * world_size
        )
        self._adopt(snap)
        self.policy = policy or snap.policy
        super().__init__(start_leaf=snap.leaf if _snapshot else None)

    def _adopt(self, snap: InstanceSnapshot) -> None:
        """Take the extended state from a snapshot (construction and `reload` share it)."""
        # straight into __dict__: python-statemachine checks every setattr, and `reload` is a hot path
        self.__dict__.update(
            policy=snap.policy,
            instance_id=snap.instance_id,
            world_size=snap.world_size,
            seed=snap.seed,
            generation=snap.generation,
            attempts=snap.attempts,
            uncharged=snap.uncharged,
            deadline=snap.deadline,
            ready_since=snap.ready_since,
            clock=snap.clock,
            live_ranks=set(snap.live_ranks),
            ready_ranks=set(snap.ready_ranks),
            delete_reason=snap.delete_reason,
            last_failure=snap.last_failure,
            waking=snap.waking,
            rank_generations=list(snap.rank_generations),
            failed_ranks=set(snap.failed_ranks),
            rank_deadlines=dict(snap.rank_deadlines),
        )

    # -- guards ---------------------------------------------------------------

    @property
    def deadline_passed(self) -> bool:
        """Guard of ``start`` from Backing off: no generation starts before its backoff ends."""
        return self.deadline is None or (self.clock is not None and self.clock >= self.deadline)

    @property
    def all_ranks_ready(self) -> bool:
        """The joint condition that makes Starting Ready: one rank ready is not an instance that can serve."""
        return len(self.ready_ranks) == self.world_size

    @property
    def nothing_alive(self) -> bool:
        """The joint condition that ends Recovering and Parking: two generations never run at once."""
        return not self.live_ranks

    @property
    def budget_spent(self) -> bool:
        """Out of retries where a start would come next (Pending, Starting, Backing off): the only place the
        planner gives up (elsewhere a generation runs or is torn down, and a host cause may still give a retry
        back)."""
        return self.leaf in _WAITING_TO_START and budget_exhausted(self.attempts, self.policy.max_failures)

    @staticmethod
    def idle(busy: int) -> bool:
        """No request in flight on its runners: parking never cuts one short."""
        return busy == 0

    @property
    def one_for_one(self) -> bool:
        """The ranks are independent replicas: a failure takes down its own rank only."""
        return self.policy.strategy is RestartStrategy.ONE_FOR_ONE

    def fails_alone(self, failure: Failure) -> bool:
        """one_for_one, and the failure ends neither the instance (non-retryable, the budget's last) nor more
        than its rank: the rank is restarted alone while the others serve on."""
        return self.one_for_one and failure.retryable and not self.last_charged_failure(failure)

    @property
    def stops_alone(self) -> bool:
        """one_for_one, and a rank's unannounced exit (charged) is not the budget's last."""
        return self.one_for_one and not self.last_allowed_failure

    def was_failed(self, rank: int) -> bool:
        """The rank's process had failed: its exit is the one the plan's stop brought, nothing more to charge."""
        return rank in self.failed_ranks

    def rank_due(self, rank: int) -> bool:
        """Guard of ``start_rank``: the rank failed, its process is reaped (never two of one rank at once)
        and its own backoff has run out."""
        deadline = self.rank_deadlines.get(rank)
        return (
            rank in self.failed_ranks
            and rank not in self.live_ranks
            and deadline is not None
            and self.clock is not None
            and self.clock >= deadline
        )

    @property
    def last_allowed_failure(self) -> bool:
        """One more charged failure would spend the budget: the instance gives up on it instead of retrying."""
        return budget_exhausted(self.attempts + 1, self.policy.max_failures)

    def last_charged_failure(self, failure: Failure) -> bool:
        """A charged cause that spends the budget: the instance gives up at once. Not a consequence (a peer
        lost) in a ring: its cause, still to come, may be the host's and give the retry back; replicas
        (one_for_one) have no peers, so there every failure is its own cause."""
        cause = failure.kind is not FailureKind.PEER or self.one_for_one
        return failure.charged and cause and self.last_allowed_failure

    @staticmethod
    def non_retryable(failure: Failure) -> bool:
        """A cause no retry can mend: Deleted at once, whatever the budget says."""
        return not failure.retryable

    # -- actions -------------------------------------------------------------

    def _begin_generation(self) -> None:
        self.generation += 1
        self.rank_generations[:] = [self.generation] * self.world_size
        self.deadline = None
        self.live_ranks.clear()
        self.ready_ranks.clear()
        self.failed_ranks.clear()
        self.rank_deadlines.clear()

    def _restart_rank(self, rank: int) -> None:
        self.generation += 1
        self.rank_generations[rank] = self.generation
        self.failed_ranks.discard(rank)
        del self.rank_deadlines[rank]

    def _fail_alone(self, rank: int, failure: Failure) -> None:
        self._count_failure(failure)
        self.failed_ranks.add(rank)
        self.ready_ranks.discard(rank)
        if rank not in self.live_ranks:  # reported after its exit: its backoff starts now
            self._arm_rank_timer(rank)

    def _failed_rank_gone(self, rank: int) -> None:
        if rank not in self.live_ranks:  # reaped already (a second report, or lost with the supervisor)
            return  # its deadline stands: a duplicate report neither refills nor skips a backoff
        self.live_ranks.discard(rank)
        self._arm_rank_timer(rank)

    def _lose_alone(self, rank: int) -> None:
        """The rank's process is gone with the old supervisor: due for a restart now, nothing charged."""
        self.failed_ranks.add(rank)
        self.ready_ranks.discard(rank)
        self.live_ranks.discard(rank)
        self.ready_since = None
        self.rank_deadlines[rank] = self.clock  # type: ignore[assignment]  # _observe has set it

    def _stopped_alone(self, rank: int) -> None:
        self._fail_alone(rank, _UNEXPECTED_STOP)
        self._failed_rank_gone(rank)

    def _arm_rank_timer(self, rank: int) -> None:
        """A failed rank waits out the instance's backoff, counted by every failure so far, once reaped."""
        assert self.clock is not None
        self.rank_deadlines[rank] = self.clock + self.retry_delay(self.attempts + self.uncharged)

    def _rank_alive(self, rank: int) -> None:
        self.live_ranks.add(rank)

    def _rank_ready(self, rank: int) -> None:
        self.ready_ranks.add(rank)

    def _replica_alive(self, rank: int) -> None:
        """A failed rank reported alive (its creation reported late) waits to be reaped before its backoff."""
        self._rank_alive(rank)
        self.rank_deadlines.pop(rank, None)

    def _replica_ready(self, rank: int) -> None:
        """A failed rank's process is never Ready again, whatever it reports late."""
        if rank not in self.failed_ranks:
            self._rank_ready(rank)

    def _mark_ready(self) -> None:
        self.ready_since = self.clock
        self.waking = False

    def _park(self) -> None:
        self.ready_since = None  # a ready streak ends; the budget (attempts, uncharged) is kept as it is
        self.ready_ranks.clear()
        self.failed_ranks.clear()  # every rank is stopped now, and all start together when unparked
        self.rank_deadlines.clear()
        self.waking = False

    def _unpark(self) -> None:
        self.waking = True

    def _count_failure(self, failure: Failure) -> None:
        if failure.charged:
            self.attempts += 1
        else:
            self.uncharged += 1
        self._give_back_poisoned(failure)
        self.last_failure = failure
        self.ready_since = None

    def _give_back_poisoned(self, failure: Failure) -> None:
        """A poison request's second death: the retry its first death was charged is given back, if still held."""
        if failure.kind is FailureKind.POISON and self.attempts > 0:
            self.attempts -= 1
            self.uncharged += 1

    def _another_failure(self, failure: Failure) -> None:
        """The generation has failed already: this failure costs nothing more. But the first report may be a
        consequence (a peer that lost its connection) of this one (the rank that was killed): keep the cause."""
        consequence = self.last_failure is not None and self.last_failure.kind is FailureKind.PEER
        if consequence and failure.kind is not FailureKind.PEER:
            if not failure.charged:  # the host's failure after all (found by the fault campaign, #26)
                self.attempts -= 1
                self.uncharged += 1
                self._give_back_poisoned(failure)
            self.last_failure = failure

    def _rank_gone(self, rank: int) -> None:
        self.live_ranks.discard(rank)

    def _stopped_unexpectedly(self, rank: int) -> None:
        self._count_failure(_UNEXPECTED_STOP)
        self._rank_gone(rank)

    def _stopped_and_exhausted(self, rank: int) -> None:
        self._rank_gone(rank)
        self._give_up_exhausted(_UNEXPECTED_STOP)

    def _arm_timer(self) -> None:
        assert self.clock is not None
        self.deadline = self.clock + self.retry_delay(self.attempts + self.uncharged)

    def _give_up_exhausted(self, failure: Failure | None = None) -> None:
        if failure is not None:
            self.attempts += 1
            self.last_failure = failure
        self.delete_reason = DeleteReason.RETRIES_EXHAUSTED

    def _give_up_non_retryable(self, failure: Failure) -> None:
        self.last_failure = failure
        self.delete_reason = DeleteReason.NON_RETRYABLE

    def _deleted_by_user(self) -> None:
        self.delete_reason = DeleteReason.REQUESTED

    def on_enter_deleted(self) -> None:
        """Deleted is final: no timer may fire after it, and no ready streak or unparking goes on."""
        self.deadline = None  # cancels the pending timer
        self.ready_since = None
        self.waking = False
        self.failed_ranks.clear()
        self.rank_deadlines.clear()

    # -- policy arithmetic ------------------------------------------------------

    def retry_delay(self, failed_generations: int) -> float:
        """The delay before the retry that follows ``failed_generations`` failures."""
        rng = random.Random(f"{self.seed}/{self.instance_id}/{failed_generations}")
        return self.policy.backoff.delay(failed_generations, rng)

    def _observe(self, now: float) -> None:
        """Advance the clock, applying the budget reset if Ready long enough."""
        self.clock = now if self.clock is None else max(self.clock, now)
        if (
            self.leaf == "ready"
            and self.ready_since is not None
            and (self.attempts or self.uncharged)
            and self.policy.reset_after is not None
            and self.clock - self.ready_since >= self.policy.reset_after
        ):
            self.attempts = self.uncharged = 0

    # -- the typed door ---------------------------------------------------------

    def _why_refused(self, event: str) -> str:
        if event == "start_rank":
            if self.leaf != _DEGRADED:
                return "only a one_for_one instance with a failed rank (degraded) restarts a rank alone"
            return (
                f"a rank restarts once it failed, its process is reaped and its backoff is over (failed "
                f"{sorted(self.failed_ranks)}, alive {sorted(self.live_ranks)}, deadlines {self.rank_deadlines}, "
                f"now {self.clock})"
            )
        if event == "rank_lost":
            return "only a one_for_one instance running a generation restarts a lost rank alone (a ring resumes)"
        if event == "start" and self.leaf == "backing_off":
            return f"backoff deadline {self.deadline} not reached (now {self.clock})"
        if event == "give_up":
            if not budget_exhausted(self.attempts, self.policy.max_failures):
                return f"budget not exhausted ({self.attempts} of {self.policy.max_failures} failed generations)"
            return f"an instance is given up on only where it would start runners, not in {self.leaf}"
        if event == "park" and self.leaf in (_RECOVERING, _BACKING_OFF):
            return "a failed generation is being retried: park it once it runs again, or delete it"
        if event == "park":
            return "requests are in flight on its runners: park it once they end"
        if event == "unpark" and self.leaf == _PARKING:
            return "its runners are still being stopped: unpark it once it is parked"
        return ""

    def apply(self, event: InstanceEvent) -> Outcome:
        """Handle an event; stale generations and anything after Deleted are ignored."""
        if not isinstance(event, InstanceEvent):
            raise InvalidEvent(f"expected an InstanceEvent, got {type(event).__name__}")
        if event.instance_id != self.instance_id:
            raise InvalidEvent(f"event for instance {event.instance_id!r} sent to {self.instance_id!r}")
        if self.is_deleted:
            return Outcome.ignored(f"instance is deleted ({self.delete_reason.value})")
        if isinstance(event, Park) and self.leaf in (_PARKING, _PARKED):
            return Outcome.ignored(f"instance is {self.leaf} already")
        if isinstance(event, Unpark) and self.leaf not in (_PARKING, _PARKED):
            return Outcome.ignored(f"instance is not parked ({self.leaf})")
        if isinstance(event, (Start, StartRank)):
            if event.generation <= self.generation:
                return Outcome.ignored(f"generation {event.generation} already started")
            if event.generation != self.generation + 1:
                raise InvalidEvent(f"next generation is {self.generation + 1}, not {event.generation}")
        if isinstance(event, (RankEvent, StartRank)) and event.rank >= self.world_size:
            raise InvalidEvent(f"rank {event.rank} out of range for world_size {self.world_size}")
        if isinstance(event, RankEvent):
            current = self.rank_generations[event.rank]
            if event.generation < current:
                return Outcome.ignored(f"stale generation {event.generation} < {current} of rank {event.rank}")
            if event.generation > current:
                raise IncarnationMismatch(
                    f"instance {self.instance_id!r} runs rank {event.rank} as generation {current}, event names "
                    f"{event.generation}"
                )
        clock, attempts, uncharged = self.clock, self.attempts, self.uncharged
        self._observe(event.now)
        if isinstance(event, Tick) and self.leaf not in _SETTLING:
            # a tick is declared targetless with no action: where no eventless transition waits on a condition,
            # observing its time is all the engine would do; drivers tick every instance every round
            return Outcome(accepted=True, steps=())
        try:
            return self._fire(event.name, **event.payload())
        except Exception:
            self.clock, self.attempts, self.uncharged = clock, attempts, uncharged  # a refused event changes nothing
            raise

    # -- views -------------------------------------------------------------------

    @property
    def instance_state(self) -> InstanceState:
        """The state as an enum, to compare with rather than the leaf's string."""
        return InstanceState(self.leaf)

    @property
    def is_deleted(self) -> bool:
        """Whether the instance is final: every later event is absorbed, and `Cluster.forget` may drop it."""
        return self.leaf == "deleted"

    def snapshot(self) -> InstanceSnapshot:
        """The whole state, budget and deadline included, so a restart neither refills nor skips a backoff."""
        return InstanceSnapshot(
            instance_id=self.instance_id,
            world_size=self.world_size,
            policy=self.policy,
            seed=self.seed,
            leaf=self.leaf,
            generation=self.generation,
            attempts=self.attempts,
            uncharged=self.uncharged,
            deadline=self.deadline,
            ready_since=self.ready_since,
            clock=self.clock,
            live_ranks=tuple(sorted(self.live_ranks)),
            ready_ranks=tuple(sorted(self.ready_ranks)),
            delete_reason=self.delete_reason,
            last_failure=self.last_failure,
            waking=self.waking,
            rank_generations=tuple(self.rank_generations),
            failed_ranks=tuple(sorted(self.failed_ranks)),
            rank_deadlines=tuple(sorted(self.rank_deadlines.items())),
        )

    @classmethod
    def _upgrade(cls, body: dict[str, Any], version: int) -> dict[str, Any]:
        if version == 1:
            if "uncharged" in body:
                raise SnapshotError("invalid instance snapshot: uncharged: version 1 has no such field")
            body = {**body, "uncharged": 0}  # version 1 charged every failure
        if version <= 2:
            if "waking" in body:
                raise SnapshotError(f"invalid instance snapshot: waking: version {version} has no such field")
            body = {**body, "waking": False}  # nothing was ever parked before version 3
        if version <= 3:
            for name in ("rank_generations", "failed_ranks", "rank_deadlines"):
                if name in body:
                    raise SnapshotError(f"invalid instance snapshot: {name}: version {version} has no such field")
            policy = body.get("policy")
            if isinstance(policy, dict) and "strategy" in policy:
                raise SnapshotError(f"invalid instance snapshot: policy.strategy: version {version} has no such field")
            generation, world_size = body.get("generation", 0), body.get("world_size", 1)
            ranks = [generation] * world_size if is_count(world_size) else []  # a bad size is refused later
            if isinstance(policy, dict):
                policy = {**policy, "strategy": RestartStrategy.ONE_FOR_ALL.value}
            body = {  # every rank ran the instance's generation: one_for_all was the only strategy
                **body,
                "policy": policy,
                "rank_generations": ranks,
                "failed_ranks": [],
                "rank_deadlines": [],
            }
        if version <= 4:  # max_retries was renamed max_failures, with the same meaning
            policy = body.get("policy")
            if isinstance(policy, dict) and "max_failures" in policy and "max_retries" in policy:
                raise SnapshotError("invalid instance snapshot: policy: max_retries and max_failures are one field")
            if isinstance(policy, dict) and "max_retries" in policy:
                renamed = {("max_failures" if k == "max_retries" else k): v for k, v in policy.items()}
                body = {**body, "policy": renamed}
        return body

    @classmethod
    def from_snapshot(cls, snapshot: InstanceSnapshot, policy: RetryPolicy | None = None) -> InstanceRetry:
        """Restore; pass ``policy`` to apply a changed configuration to a restored instance (its restart strategy
        only while none of its processes is alive: a ring's ranks and a replica are not spawned alike)."""
        cls.check_snapshot(snapshot)
        changed = policy is not None and policy.strategy is not snapshot.policy.strategy
        if changed and (snapshot.live_ranks or snapshot.leaf == _DEGRADED):
            raise InvalidConfig(
                f"instance {snapshot.instance_id!r} has live ranks {list(snapshot.live_ranks)} started as "
                f"{snapshot.policy.strategy.value}: change its restart strategy while none is alive (park it first)"
            )
        return cls(snapshot.instance_id, policy=policy, _snapshot=snapshot)

    @classmethod
    def _snapshot_plainly_fine(cls, s: InstanceSnapshot) -> bool:
        ws, gen, attempts, live, ready, reason = (
            s.world_size,
            s.generation,
            s.attempts,
            s.live_ranks,
            s.ready_ranks,
            s.delete_reason,
        )
        deleted = s.leaf == _DELETED
        return (
            type(s.instance_id) is str
            and s.instance_id != ""
            and type(ws) is int
            and ws >= 1
            and type(s.policy) is RetryPolicy
            and type(s.seed) is int
            and type(gen) is int
            and gen >= 0
            and type(attempts) is int
            and attempts >= 0
            and type(s.uncharged) is int
            and s.uncharged >= 0
            and (attempts + s.uncharged >= 1 or s.leaf not in _AFTER_A_FAILURE)
            # a float is finite iff x - x == 0 (inf - inf and nan - nan are nan)
            and (s.deadline is None or (type(s.deadline) is float and s.deadline - s.deadline == 0.0))
            and (s.ready_since is None or (type(s.ready_since) is float and s.ready_since - s.ready_since == 0.0))
            and (s.clock is None or (type(s.clock) is float and s.clock - s.clock == 0.0))
            and type(live) is tuple
            and (not live or _plain_ranks(live, ws))
            and type(ready) is tuple
            and (not ready or _plain_ranks(ready, ws))
            and (live or (s.leaf != _RECOVERING and s.leaf != _PARKING))  # eventless transitions leave these at once
            and not (live and s.leaf == _BACKING_OFF)
            and (len(ready) < ws or s.leaf != _STARTING)
            and (not deleted or s.deadline is None)
            and (s.ready_since is None or s.leaf in _READY_STREAK)
            and (type(reason) is DeleteReason if deleted else reason is None)
            and (s.last_failure is None or type(s.last_failure) is Failure)
            and (s.waking is False or (s.waking is True and s.leaf in _WAKING))
            and (not live or s.leaf != _PARKED)
            # one_for_all at rest: every rank of the instance's generation, none failed alone (else: the rule)
            and s.leaf != _DEGRADED
            and s.failed_ranks == ()
            and s.rank_deadlines == ()
            and type(s.rank_generations) is tuple
            and s.rank_generations == (gen,) * ws
            and all(type(g) is int for g in s.rank_generations)
            and s.policy.strategy is RestartStrategy.ONE_FOR_ALL
        )

    @classmethod
    def _snapshot_problem(cls, s: InstanceSnapshot) -> str | None:
        """What no instance could be: bad types or ranges, or fields that contradict the leaf."""
        if not isinstance(s.instance_id, str) or not s.instance_id:
            return f"instance_id must be a non-empty str, got {show(s.instance_id)}"
        if not is_count(s.world_size, 1):
            return f"world_size must be an int >= 1, got {show(s.world_size)}"
        if not isinstance(s.policy, RetryPolicy):
            return f"policy must be a RetryPolicy, got {type(s.policy).__name__}"
        if isinstance(s.seed, bool) or not isinstance(s.seed, int):
            return f"seed must be an int, got {show(s.seed)}"
        if not is_count(s.generation):
            return f"generation must be an int >= 0, got {show(s.generation)}"
        if not is_count(s.attempts):
            return f"attempts must be an int >= 0, got {show(s.attempts)}"
        if not is_count(s.uncharged):
            return f"uncharged must be an int >= 0, got {show(s.uncharged)}"
        if s.attempts == 0 and s.uncharged == 0 and s.leaf in _AFTER_A_FAILURE:
            return f"attempts or uncharged must be >= 1 in {s.leaf} (a failure brought it there), got 0 and 0"
        for name, value in (("deadline", s.deadline), ("ready_since", s.ready_since), ("clock", s.clock)):
            if not is_time(value):
                return f"{name} must be a finite number or None, got {show(value)}"
        problem = ranks_problem("live_ranks", s.live_ranks, s.world_size) or ranks_problem(
            "ready_ranks", s.ready_ranks, s.world_size
        )
        if problem:
            return problem
        if s.leaf == _RECOVERING and not s.live_ranks:
            return "live_ranks: recovering with no live rank is not a resting state (it goes on to backing_off)"
        if s.leaf == _BACKING_OFF and s.live_ranks:
            return "live_ranks: backing_off with a live rank cannot be (it is entered when the last rank is reaped)"
        if s.leaf == _STARTING and len(s.ready_ranks) == s.world_size:
            return "ready_ranks: starting with every rank ready is not a resting state (it goes on to ready)"
        if s.leaf == _DELETED and (s.deadline is not None or s.ready_since is not None):
            return (  # entering Deleted cancels both
                f"deadline and ready_since must be None when deleted, got {show(s.deadline)} and {show(s.ready_since)}"
            )
        if s.ready_since is not None and s.leaf not in _READY_STREAK:
            return f"ready_since must be None in {s.leaf} (only a ready streak sets it), got {show(s.ready_since)}"
        if s.delete_reason is None:
            if s.leaf == _DELETED:
                return "delete_reason: a deleted instance always carries its reason, got None"
        elif not isinstance(s.delete_reason, DeleteReason):
            return f"delete_reason must be a DeleteReason or None, got {show(s.delete_reason)}"
        elif s.leaf != _DELETED:
            return f"delete_reason must be None unless deleted (leaf {show(s.leaf)}), got {s.delete_reason.value!r}"
        if s.last_failure is not None and not isinstance(s.last_failure, Failure):
            return f"last_failure must be a Failure or None, got {type(s.last_failure).__name__}"
        if not isinstance(s.waking, bool):
            return f"waking must be a bool, got {show(s.waking)}"
        if s.waking and s.leaf not in _WAKING:
            return f"waking: only an unparked instance on its way to Ready wakes, not one {s.leaf}"
        if s.leaf == _PARKED and s.live_ranks:
            return "live_ranks: a parked instance has no live process (parking goes on until the last is reaped)"
        if s.leaf == _PARKING and not s.live_ranks:
            return "live_ranks: parking with no live rank is not a resting state (it goes on to parked)"
        return _ranks_apart_problem(s)


# Leaves with an eventless transition of their own (Starting → Ready, Recovering → Backing off, Parking →
# Parked): a tick goes through the engine there, which looks at the transition's condition again.
_SETTLING = frozenset(
    s.id for s in InstanceRetry.states_map.values() if not s.states and any(t.is_eventless for t in s.transitions)
)
# Leaves only a failed generation leads to: the retry it cost is counted, and arms the backoff timer.
_AFTER_A_FAILURE = frozenset({InstanceState.RECOVERING.value, InstanceState.BACKING_OFF.value})
# Leaves where ready_since may be set: Ready, and Starting after a Resume (Ready then sets a new one).
_READY_STREAK = frozenset({InstanceState.READY.value, InstanceState.STARTING.value})
_BACKING_OFF, _DELETED, _RECOVERING, _STARTING, _PARKING, _PARKED, _DEGRADED = (
    InstanceState.BACKING_OFF.value,
    InstanceState.DELETED.value,
    InstanceState.RECOVERING.value,
    InstanceState.STARTING.value,
    InstanceState.PARKING.value,
    InstanceState.PARKED.value,
    InstanceState.DEGRADED.value,
)
# Where the planner would start runners next (and gives a spent budget up instead).
_WAITING_TO_START = frozenset({InstanceState.PENDING.value, _STARTING, _BACKING_OFF, _DEGRADED})
# Where an unparked instance may be on its way back to Ready.
_WAKING = frozenset({InstanceState.PENDING.value, _STARTING, _RECOVERING, _BACKING_OFF, _DEGRADED})
# Where one_for_all's processes, if any, are all of the instance's generation.
_ONE_RING = frozenset({_STARTING, InstanceState.READY.value, _RECOVERING, _PARKING})


def _ranks_apart_problem(s: InstanceSnapshot) -> str | None:
    """What contradicts the per-rank fields: each rank's generation, and one_for_one's failed ranks."""
    gens = s.rank_generations
    if not isinstance(gens, tuple) or len(gens) != s.world_size or not all(is_count(g) for g in gens):
        return f"rank_generations must hold an int >= 0 per rank ({s.world_size}), got {show(gens)}"
    if any(g > s.generation for g in gens):
        return f"rank_generations: none may be past the instance's generation {s.generation}, got {list(gens)}"
    one_for_one = s.policy.strategy is RestartStrategy.ONE_FOR_ONE
    if not one_for_one and s.leaf in _ONE_RING and any(g != s.generation for g in gens):
        return f"rank_generations: one_for_all runs every rank as generation {s.generation}, got {list(gens)}"
    problem = ranks_problem("failed_ranks", s.failed_ranks, s.world_size)
    if problem:
        return problem
    if s.leaf == _DEGRADED and not one_for_one:
        return "leaf degraded: only a one_for_one instance restarts a rank alone"
    if s.leaf == _DEGRADED and len(s.ready_ranks) == s.world_size:
        return "ready_ranks: degraded with every rank ready is not a resting state (it goes on to ready)"
    if s.failed_ranks and s.leaf != _DEGRADED:
        return f"failed_ranks: only a degraded instance has ranks failed alone, not one {s.leaf}"
    if set(s.failed_ranks) & set(s.ready_ranks):
        return f"failed_ranks {list(s.failed_ranks)} and ready_ranks {list(s.ready_ranks)} overlap"
    deadlines = s.rank_deadlines
    if not isinstance(deadlines, tuple) or not all(
        isinstance(pair, tuple) and len(pair) == 2 and is_time(pair[1]) and pair[1] is not None for pair in deadlines
    ):
        return f"rank_deadlines must be (rank, finite time) pairs, got {show(deadlines)}"
    problem = ranks_problem("rank_deadlines", tuple(rank for rank, _ in deadlines), s.world_size)
    if problem:
        return problem
    waiting = {rank for rank in s.failed_ranks if rank not in s.live_ranks}
    if {rank for rank, _ in deadlines} != waiting:
        return (
            f"rank_deadlines: exactly the failed ranks already reaped ({sorted(waiting)}) wait for a deadline, "
            f"got {[rank for rank, _ in deadlines]}"
        )
    return None


def _plain_ranks(ranks: tuple[int, ...], world_size: int) -> bool:
    """Exact ints, ascending, distinct, below world_size (the fast path of `ranks_problem`)."""
    previous = -1
    for rank in ranks:
        if type(rank) is not int or rank <= previous:
            return False
        previous = rank
    return previous < world_size
