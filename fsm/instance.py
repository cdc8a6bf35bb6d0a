"""The instance retry policy: one instance = one model placed on N ranks.

Theory of operation
-------------------
::

    Pending → Starting → Ready → Recovering → BackingOff → Starting … → Deleted
                           Ready → Parking → Parked → Pending → Starting …

Two compound states group what is handled alike: **Alive** (everything but
Deleted: ``delete`` from anywhere, ``tick`` anywhere, ``give_up`` wherever the
planner would start runners) and, inside it, **Generation running** (Starting
and Ready: a rank's failure or exit ends the generation the same way from
both). The leaves, not the compounds, are the states (``InstanceState``,
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
* Give-up: the failure that makes ``max_retries`` failed generations goes to
  Deleted(retries_exhausted); a non-retryable cause goes to
  Deleted(non_retryable) at once, whatever the count.
* Uncharged: a generation ended by the host rather than the model (a spawn
  that found no fds or disk, a ring port taken: ``Failure.charged`` is
  False) is counted in ``uncharged``, never in ``attempts``: it waits out the
  backoff like any other (its delay grows with both counts, so there is no
  tight loop) but never brings the instance closer to giving up.
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
    PARKING = "parking"  #: parked on purpose, its runners being stopped (a failure now costs nothing)
    PARKED = "parked"  #: no process, placement and budget kept; a request unparks it
    DELETED = "deleted"  #: final: deleted by its user or given up on (``delete_reason`` says which)


class DeleteReason(enum.Enum):
    """Why an instance reached Deleted: asked by its user, out of retries, or a failure no retry can mend."""

    REQUESTED = "requested"  #: its user deleted it (`Cluster.delete`)
    RETRIES_EXHAUSTED = "retries_exhausted"  #: ``max_retries`` generations failed (charged failures only)
    NON_RETRYABLE = "non_retryable"  #: a failure with ``retryable=False``: retrying cannot mend it


@attrs.frozen
class RetryPolicy:
    """How an instance retries: the backoff, the budget, and when the budget refills.

    ``max_retries=None``: never give up on a retryable failure (a non-retryable one still ends the instance;
    the backoff still grows to its cap). ``reset_after=None``: the budget never refills.

    There is no restart-strategy field, on purpose: an instance's ranks are one ring, and a ring that lost a
    rank hangs in its next collective, so they restart together (one_for_all) whatever a policy said.
    Replicas that need no ring are independent (one_for_one): place each as a 1-rank instance, which gives
    each its own generation, fence and budget.
    """

    backoff: Backoff = attrs.field(factory=Backoff, validator=attrs.validators.instance_of(Backoff))
    max_retries: int | None = attrs.field(default=5, validator=integer(InvalidConfig, at_least=1, optional=True))
    reset_after: float | None = attrs.field(
        default=600.0, validator=attrs.validators.optional(finite(InvalidConfig, above=0))
    )


def budget_exhausted(failed_generations: int, max_retries: int | None) -> bool:
    """The give-up rule, in one place: the machine and the planner both ask it (None: never)."""
    return max_retries is not None and failed_generations >= max_retries


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
class RankEvent(InstanceEvent):
    """Base of what one rank of one generation did; an event of an older generation is ignored."""

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


_UNEXPECTED_STOP = Failure(FailureKind.EXIT, "a rank stopped without reporting a failure")


class InstanceRetry(Lifecycle):
    """Retry policy of one instance. See the module docstring."""

    machine_name = "instance"
    snapshot_type = InstanceSnapshot
    snapshot_version = 3  # 2 added `uncharged`, 3 `waking` (and the leaves parking and parked)

    class alive(State.Compound):
        pending = State(initial=True)

        class running(State.Compound, name="Generation running"):
            starting = State(initial=True)
            ready = State()

        recovering = State()
        backing_off = State("Backing off")
        parking = State()
        parked = State()

    deleted = State(final=True)

    # python-statemachine tries the active leaf's transitions before its ancestors' (each in declaration
    # order). No leaf declares an event that its compound handles here (rank_failed, rank_stopped and
    # rank_failed_while_stopping on `running`; tick and delete on `alive`), so the compound's alternatives are
    # tried exactly as they were on each leaf. A compound's "stay" is targetless (`to(None)`): an internal
    # self-transition of a compound would exit and re-enter it, back at its initial child.
    start = alive.pending.to(alive.running, on="_begin_generation") | alive.backing_off.to(
        alive.running, cond="deadline_passed", on="_begin_generation"
    )
    rank_created = (
        alive.running.starting.to.itself(internal=True, on="_rank_alive")
        | alive.recovering.to.itself(internal=True, on="_rank_alive")
        | alive.parking.to.itself(internal=True, on="_rank_alive")
    )
    rank_ready = (
        alive.running.starting.to.itself(internal=True, on="_rank_ready")
        | alive.running.ready.to.itself(internal=True)
        | alive.recovering.to.itself(internal=True)
        | alive.backing_off.to.itself(internal=True)
        | alive.parking.to.itself(internal=True)
    )
    alive.running.starting.to(alive.running.ready, cond="all_ranks_ready", on="_mark_ready")
    rank_failed = (
        alive.running.to(deleted, cond="non_retryable", on="_give_up_non_retryable")
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
        alive.running.to(deleted, cond="last_allowed_failure", on="_stopped_and_exhausted")
        | alive.running.to(alive.recovering, on="_stopped_unexpectedly")
        | alive.recovering.to.itself(internal=True, on="_rank_gone")
        | alive.backing_off.to.itself(internal=True, on="_rank_gone")
        | alive.parking.to.itself(internal=True, on="_rank_gone")
    )
    alive.recovering.to(alive.backing_off, cond="nothing_alive", on="_arm_timer")
    alive.parking.to(alive.parked, cond="nothing_alive")
    resume = alive.running.starting.to.itself(on="_begin_generation") | alive.running.ready.to(
        alive.running.starting, on="_begin_generation"
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
        snap = _snapshot or InstanceSnapshot(instance_id, world_size, policy or RetryPolicy(), seed, leaf="pending")
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
        return self.leaf in _WAITING_TO_START and budget_exhausted(self.attempts, self.policy.max_retries)

    @staticmethod
    def idle(busy: int) -> bool:
        """No request in flight on its runners: parking never cuts one short."""
        return busy == 0

    @property
    def last_allowed_failure(self) -> bool:
        """One more charged failure would spend the budget: the instance gives up on it instead of retrying."""
        return budget_exhausted(self.attempts + 1, self.policy.max_retries)

    def last_charged_failure(self, failure: Failure) -> bool:
        """A charged cause that spends the budget: the instance gives up at once. Not a consequence (a peer
        lost): its cause, still to come, may be the host's and give the retry back."""
        return failure.charged and failure.kind is not FailureKind.PEER and self.last_allowed_failure

    @staticmethod
    def non_retryable(failure: Failure) -> bool:
        """A cause no retry can mend: Deleted at once, whatever the budget says."""
        return not failure.retryable

    # -- actions -------------------------------------------------------------

    def _begin_generation(self) -> None:
        self.generation += 1
        self.deadline = None
        self.live_ranks.clear()
        self.ready_ranks.clear()

    def _rank_alive(self, rank: int) -> None:
        self.live_ranks.add(rank)

    def _rank_ready(self, rank: int) -> None:
        self.ready_ranks.add(rank)

    def _mark_ready(self) -> None:
        self.ready_since = self.clock
        self.waking = False

    def _park(self) -> None:
        self.ready_since = None  # a ready streak ends; the budget (attempts, uncharged) is kept as it is
        self.ready_ranks.clear()
        self.waking = False

    def _unpark(self) -> None:
        self.waking = True

    def _count_failure(self, failure: Failure) -> None:
        if failure.charged:
            self.attempts += 1
        else:
            self.uncharged += 1
        self.last_failure = failure
        self.ready_since = None

    def _another_failure(self, failure: Failure) -> None:
        """The generation has failed already: this failure costs nothing more. But the first report may be a
        consequence (a peer that lost its connection) of this one (the rank that was killed): keep the cause."""
        consequence = self.last_failure is not None and self.last_failure.kind is FailureKind.PEER
        if consequence and failure.kind is not FailureKind.PEER:
            if not failure.charged:  # the host's failure after all (found by the fault campaign, #26)
                self.attempts -= 1
                self.uncharged += 1
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
        if event == "start" and self.leaf == "backing_off":
            return f"backoff deadline {self.deadline} not reached (now {self.clock})"
        if event == "give_up":
            if not budget_exhausted(self.attempts, self.policy.max_retries):
                return f"budget not exhausted ({self.attempts} of {self.policy.max_retries} failed generations)"
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
        if isinstance(event, Start):
            if event.generation <= self.generation:
                return Outcome.ignored(f"generation {event.generation} already started")
            if event.generation != self.generation + 1:
                raise InvalidEvent(f"next generation is {self.generation + 1}, not {event.generation}")
        if isinstance(event, RankEvent):
            if event.rank >= self.world_size:
                raise InvalidEvent(f"rank {event.rank} out of range for world_size {self.world_size}")
            if event.generation < self.generation:
                return Outcome.ignored(f"stale generation {event.generation} < {self.generation}")
            if event.generation > self.generation:
                raise IncarnationMismatch(
                    f"instance {self.instance_id!r} is at generation {self.generation}, event names {event.generation}"
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
        return body

    @classmethod
    def from_snapshot(cls, snapshot: InstanceSnapshot, policy: RetryPolicy | None = None) -> InstanceRetry:
        """Restore; pass ``policy`` to apply a changed configuration to a restored instance."""
        cls.check_snapshot(snapshot)
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
        return None


# Leaves with an eventless transition of their own (Starting → Ready, Recovering → Backing off, Parking →
# Parked): a tick goes through the engine there, which looks at the transition's condition again.
_SETTLING = frozenset(
    s.id for s in InstanceRetry.states_map.values() if not s.states and any(t.is_eventless for t in s.transitions)
)
# Leaves only a failed generation leads to: the retry it cost is counted, and arms the backoff timer.
_AFTER_A_FAILURE = frozenset({InstanceState.RECOVERING.value, InstanceState.BACKING_OFF.value})
# Leaves where ready_since may be set: Ready, and Starting after a Resume (Ready then sets a new one).
_READY_STREAK = frozenset({InstanceState.READY.value, InstanceState.STARTING.value})
_BACKING_OFF, _DELETED, _RECOVERING, _STARTING, _PARKING, _PARKED = (
    InstanceState.BACKING_OFF.value,
    InstanceState.DELETED.value,
    InstanceState.RECOVERING.value,
    InstanceState.STARTING.value,
    InstanceState.PARKING.value,
    InstanceState.PARKED.value,
)
# Where the planner would start runners next (and gives a spent budget up instead).
_WAITING_TO_START = frozenset({InstanceState.PENDING.value, _STARTING, _BACKING_OFF})
# Where an unparked instance may be on its way back to Ready.
_WAKING = frozenset({InstanceState.PENDING.value, _STARTING, _RECOVERING, _BACKING_OFF})


def _plain_ranks(ranks: tuple[int, ...], world_size: int) -> bool:
    """Exact ints, ascending, distinct, below world_size (the fast path of `ranks_problem`)."""
    previous = -1
    for rank in ranks:
        if type(rank) is not int or rank <= previous:
            return False
        previous = rank
    return previous < world_size
