"""InstanceRetry: every rule of DESIGN §3.2, one test each."""

from __future__ import annotations

import math

import attrs
import pytest

import fsm
from fsm.instance import (
    Delete,
    GiveUp,
    InstanceRetry,
    RankCreated,
    RankFailed,
    RankFailedWhileStopping,
    RankReady,
    RankStopped,
    RetryPolicy,
    Start,
    Tick,
)

CRASH = fsm.Failure.signalled(9)
CORRUPT = fsm.Failure.exception("SafetensorError", "bad header", retryable=False)


def started(world_size: int = 2, policy: RetryPolicy | None = None, now: float = 0.0, **kw) -> InstanceRetry:
    i = InstanceRetry("inst", world_size=world_size, policy=policy, **kw)
    i.apply(Start("inst", now, 1))
    for rank in range(world_size):
        i.apply(RankCreated("inst", now, 1, rank))
    return i


def make_ready(i: InstanceRetry, now: float) -> None:
    for rank in range(i.world_size):
        i.apply(RankReady("inst", now, i.generation, rank))


def fail_generation(i: InstanceRetry, now: float, failures=(CRASH,)) -> None:
    """Fail ranks of the current generation, then reap every rank."""
    gen = i.generation
    for rank, failure in enumerate(failures):
        i.apply(RankFailed("inst", now, gen, rank, failure=failure))
    for rank in range(i.world_size):
        i.apply(RankStopped("inst", now, gen, rank))


def next_generation(i: InstanceRetry) -> None:
    now = i.deadline
    i.apply(Start("inst", now, i.generation + 1))
    for rank in range(i.world_size):
        i.apply(RankCreated("inst", now, i.generation, rank))


def test_happy_path_reaches_ready_only_when_every_rank_is_ready():
    i = started()
    i.apply(RankReady("inst", 1.0, 1, 0))
    assert i.instance_state is fsm.InstanceState.STARTING
    out = i.apply(RankReady("inst", 2.0, 1, 1))
    assert i.instance_state is fsm.InstanceState.READY
    assert out.steps[-1].target == "ready"
    assert i.ready_since == 2.0


def test_one_for_all_recovering_until_every_rank_is_reaped():
    i = started(world_size=3)
    i.apply(RankFailed("inst", 1.0, 1, 2, failure=CRASH))
    assert i.instance_state is fsm.InstanceState.RECOVERING
    i.apply(RankStopped("inst", 1.1, 1, 2))
    i.apply(RankStopped("inst", 1.2, 1, 0))
    assert i.instance_state is fsm.InstanceState.RECOVERING  # rank 1 still alive
    i.apply(RankStopped("inst", 1.5, 1, 1))
    assert i.instance_state is fsm.InstanceState.BACKING_OFF
    assert i.deadline == 1.5 + 2.0  # armed when the generation is fully reaped


def test_several_failures_in_one_generation_cost_one_retry():
    i = started(world_size=3)
    fail_generation(i, 1.0, failures=(CRASH, fsm.Failure.peer_failed(0), CRASH))
    assert i.attempts == 1


def test_start_refused_before_the_deadline_and_machine_unchanged():
    i = started()
    fail_generation(i, 10.0)
    before = i.to_dict()
    with pytest.raises(fsm.IllegalTransition, match="deadline"):
        i.apply(Start("inst", 11.9, 2))
    assert i.to_dict() == before
    i.apply(Start("inst", 12.0, 2))
    assert (i.instance_state, i.generation) == (fsm.InstanceState.STARTING, 2)


@pytest.mark.parametrize("max_retries", [1, 3, 5])
def test_retries_exhausted_after_exactly_max_retries_failed_generations(max_retries):
    i = started(policy=RetryPolicy(max_failures=max_retries))
    delays = []
    for n in range(1, max_retries + 1):
        t = 100.0 * n
        fail_generation(i, t)
        if n < max_retries:
            assert i.instance_state is fsm.InstanceState.BACKING_OFF
            delays.append(i.deadline - t)
            next_generation(i)
    assert i.instance_state is fsm.InstanceState.DELETED
    assert i.delete_reason is fsm.DeleteReason.RETRIES_EXHAUSTED
    assert i.attempts == max_retries
    assert i.generation == max_retries
    assert delays == [2.0, 4.0, 8.0, 16.0][: max_retries - 1]


def test_default_delay_sequence_is_2_4_8_16_30_30():
    i = started(policy=RetryPolicy(max_failures=8))
    delays = []
    for n in range(1, 8):
        fail_generation(i, 1000.0 * n)
        delays.append(i.deadline - 1000.0 * n)
        next_generation(i)
    assert delays == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_non_retryable_cause_deletes_at_once_with_zero_retries():
    i = started()
    i.apply(RankFailed("inst", 1.0, 1, 1, failure=CORRUPT))
    assert i.instance_state is fsm.InstanceState.DELETED
    assert i.delete_reason is fsm.DeleteReason.NON_RETRYABLE
    assert i.attempts == 0
    assert i.last_failure == CORRUPT


def test_non_retryable_cause_arriving_while_recovering_deletes():
    i = started()
    i.apply(RankFailed("inst", 1.0, 1, 0, failure=fsm.Failure.peer_failed(1)))
    i.apply(RankFailed("inst", 1.1, 1, 1, failure=CORRUPT))
    assert i.delete_reason is fsm.DeleteReason.NON_RETRYABLE


def test_rank_stopping_without_failure_counts_as_a_failure():
    i = started()
    i.apply(RankStopped("inst", 1.0, 1, 0))
    assert i.instance_state is fsm.InstanceState.RECOVERING
    assert i.attempts == 1
    assert i.last_failure is not None


def test_failure_before_any_rank_was_created_backs_off_at_once():
    i = InstanceRetry("inst", world_size=2)
    i.apply(Start("inst", 0.0, 1))
    i.apply(RankFailed("inst", 1.0, 1, 0, failure=fsm.Failure(fsm.FailureKind.SPAWN, "no such executable")))
    assert i.instance_state is fsm.InstanceState.BACKING_OFF
    assert i.deadline == 3.0


def test_budget_resets_after_ready_for_reset_after():
    policy = RetryPolicy(reset_after=100.0)
    i = started(policy=policy)
    fail_generation(i, 1.0)
    next_generation(i)
    make_ready(i, 10.0)
    assert i.attempts == 1
    i.apply(Tick("inst", 109.9))
    assert i.attempts == 1  # not yet
    i.apply(Tick("inst", 110.0))
    assert i.attempts == 0


def test_reset_is_applied_before_counting_a_late_failure_without_ticks():
    i = started(policy=RetryPolicy(reset_after=100.0, max_failures=2))
    fail_generation(i, 1.0)
    next_generation(i)
    make_ready(i, 10.0)
    fail_generation(i, 500.0)  # would exhaust a budget of 2 without the reset
    assert i.instance_state is fsm.InstanceState.BACKING_OFF
    assert i.attempts == 1
    assert i.deadline == 502.0  # a fresh streak starts with `initial` again


def test_no_reset_when_ready_was_interrupted():
    i = started(policy=RetryPolicy(reset_after=100.0, max_failures=5))
    fail_generation(i, 1.0)
    next_generation(i)
    make_ready(i, 10.0)
    fail_generation(i, 60.0)  # ready for 50 s only
    assert i.attempts == 2
    next_generation(i)
    make_ready(i, 70.0)
    i.apply(Tick("inst", 160.0))  # 150 s after the first Ready, 90 s after the last
    assert i.attempts == 2


def test_user_delete_from_every_state_cancels_the_timer():
    for setup in ("pending", "starting", "ready", "recovering", "backing_off"):
        i = InstanceRetry("inst", world_size=1)
        if setup != "pending":
            i.apply(Start("inst", 0.0, 1))
            i.apply(RankCreated("inst", 0.0, 1, 0))
        if setup == "ready":
            make_ready(i, 1.0)
        if setup in ("recovering", "backing_off"):
            i.apply(RankFailed("inst", 1.0, 1, 0, failure=CRASH))
        if setup == "backing_off":
            i.apply(RankStopped("inst", 1.0, 1, 0))
            assert i.deadline is not None
        assert i.leaf == setup
        i.apply(Delete("inst", 2.0))
        assert i.instance_state is fsm.InstanceState.DELETED
        assert i.delete_reason is fsm.DeleteReason.REQUESTED
        assert i.deadline is None


def test_deleted_absorbs_every_later_event():
    i = started()
    i.apply(Delete("inst", 1.0))
    before = i.to_dict()
    for event in (
        RankFailed("inst", 2.0, 1, 0, failure=CRASH),
        RankStopped("inst", 2.0, 1, 0),
        RankReady("inst", 2.0, 1, 1),
        Tick("inst", 3.0),
        Start("inst", 4.0, 2),
        Delete("inst", 5.0),
        GiveUp("inst", 5.0),
    ):
        assert not i.apply(event).accepted
    assert i.to_dict() == before


def test_stale_generation_events_are_no_ops():
    i = started()
    fail_generation(i, 1.0)
    next_generation(i)
    before = i.to_dict()
    out = i.apply(RankFailed("inst", 5.0, 1, 0, failure=CRASH))
    assert not out.accepted and "stale" in out.note
    assert i.to_dict() == before


def test_event_for_a_future_generation_is_a_routing_error():
    i = started()
    with pytest.raises(fsm.IncarnationMismatch):
        i.apply(RankFailed("inst", 1.0, 7, 0, failure=CRASH))


def test_give_up_only_when_the_budget_is_spent():
    i = started(policy=RetryPolicy(max_failures=3))
    fail_generation(i, 1.0)
    with pytest.raises(fsm.IllegalTransition, match="budget"):
        i.apply(GiveUp("inst", 2.0))
    # a restart with a lower budget: the planner's GiveUp is accepted
    lowered = InstanceRetry.from_dict(i.to_dict(), policy=RetryPolicy(max_failures=1))
    lowered.apply(GiveUp("inst", 2.0))
    assert lowered.delete_reason is fsm.DeleteReason.RETRIES_EXHAUSTED


def test_jitter_is_full_bounded_and_reproducible_from_the_seed():
    policy = RetryPolicy(backoff=fsm.Backoff(jitter=True), max_failures=10)

    def schedule(seed: int) -> list[float]:
        i = started(policy=policy, seed=seed)
        out = []
        for n in range(1, 7):
            fail_generation(i, 100.0 * n)
            out.append(i.deadline - 100.0 * n)
            next_generation(i)
        return out

    a, b, c = schedule(1), schedule(1), schedule(2)
    assert a == b
    assert a != c
    ceilings = [2, 4, 8, 16, 30, 30]
    assert all(0 <= d <= cap for d, cap in zip(a, ceilings, strict=True))


def test_snapshot_mid_backoff_keeps_attempts_and_deadline():
    i = started(seed=4)
    fail_generation(i, 10.0)
    restored = InstanceRetry.from_dict(i.to_dict())
    assert (restored.leaf, restored.attempts, restored.deadline, restored.generation) == ("backing_off", 1, 12.0, 1)
    with pytest.raises(fsm.IllegalTransition):
        restored.apply(Start("inst", 11.0, 2))  # waits out the remaining deadline, not a fresh one
    restored.apply(Start("inst", 12.0, 2))
    assert restored.instance_state is fsm.InstanceState.STARTING


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size"),
        ({"policy": "fast"}, "RetryPolicy"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_construction(kwargs, message):
    with pytest.raises(fsm.InvalidConfig, match=message):
        InstanceRetry("inst", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_failures": 0}, "max_failures"),
        ({"reset_after": 0}, "reset_after"),
        ({"reset_after": float("nan")}, "reset_after"),
    ],
)
def test_invalid_policy(kwargs, message):
    with pytest.raises(fsm.InvalidConfig, match=message):
        RetryPolicy(**kwargs)


def test_bad_events_raise_and_change_nothing():
    i = started()
    before = i.to_dict()
    with pytest.raises(fsm.InvalidEvent):
        i.apply(RankReady("inst", 1.0, 1, 5))  # rank out of range
    with pytest.raises(fsm.InvalidEvent):
        i.apply(RankReady("other", 1.0, 1, 0))
    with pytest.raises(fsm.InvalidEvent):
        RankReady("inst", float("inf"), 1, 0)
    with pytest.raises(fsm.UnknownEvent):
        i._fire("explode")
    with pytest.raises(fsm.IllegalTransition):
        i.apply(GiveUp("inst", 99.0))
    assert i.to_dict() == before  # the refused GiveUp did not even advance the clock


def test_snapshot_rejects_bad_input():
    good = started().to_dict()
    for bad in (
        {**good, "machine": "runner"},
        {**good, "version": 6},
        {**good, "version": 0},
        {**good, "version": 1},  # version 1 had no `uncharged`
        {**good, "version": 2},  # nor version 2 `waking`
        {**good, "version": 3},  # nor version 3 the per-rank fields of one_for_one
        {**good, "waking": 1},
        {**good, "waking": True, "leaf": "parked", "live_ranks": []},  # wakes only once unparked
        {**good, "leaf": "parking", "live_ranks": []},  # parking ends when the last rank is reaped
        {**good, "leaf": "exploded"},
        {**good, "extra": 1},
        {k: v for k, v in good.items() if k != "instance_id"},
        [],
    ):
        with pytest.raises(fsm.SnapshotError):
            InstanceRetry.from_dict(bad)


def test_resume_after_a_daemon_restart_starts_a_new_generation_for_free():
    from fsm.instance import Resume

    i = started(policy=RetryPolicy(max_failures=2))
    fail_generation(i, 1.0)
    next_generation(i)
    make_ready(i, 5.0)
    i.apply(Resume("inst", 6.0))
    assert (i.instance_state, i.generation, i.attempts) == (fsm.InstanceState.STARTING, 3, 1)
    i.apply(Resume("inst", 7.0))
    assert (i.generation, i.attempts) == (4, 1)
    for state in ("pending", "backing_off"):
        j = InstanceRetry("inst", world_size=1)
        if state == "backing_off":
            j.apply(Start("inst", 0.0, 1))
            j.apply(RankCreated("inst", 0.0, 1, 0))
            j.apply(RankFailed("inst", 0.0, 1, 0, failure=CRASH))
            j.apply(RankStopped("inst", 0.0, 1, 0))
        before = j.to_dict()
        with pytest.raises(fsm.IllegalTransition):
            j.apply(Resume("inst", 1.0))
        assert j.to_dict() == before


# -- snapshots: what no instance could be is refused, naming the field; what one could be is taken --------


def instance_in(leaf: str) -> InstanceRetry:
    """A 2-rank instance driven to ``leaf``, with every time field it can have there set."""
    i = InstanceRetry("inst", world_size=2, seed=3)
    if leaf == "pending":
        return i
    i.apply(Start("inst", 1.0, 1))
    i.apply(RankCreated("inst", 1.0, 1, 0))
    i.apply(RankCreated("inst", 1.0, 1, 1))
    if leaf == "starting":
        i.apply(RankReady("inst", 1.5, 1, 1))
    if leaf in ("ready", "recovering", "backing_off", "deleted"):
        make_ready(i, 2.0)
    if leaf in ("recovering", "backing_off"):
        i.apply(RankFailed("inst", 3.0, 1, 0, failure=CRASH))
    if leaf == "backing_off":
        i.apply(RankStopped("inst", 4.0, 1, 0))
        i.apply(RankStopped("inst", 4.0, 1, 1))
    if leaf == "deleted":
        i.apply(Delete("inst", 5.0))
    assert i.leaf == leaf
    return i


LEAVES = ["pending", "starting", "ready", "recovering", "backing_off", "deleted"]

BAD_INSTANCE_SNAPSHOTS = [
    ("ready", {"instance_id": ""}, "instance_id"),
    ("ready", {"instance_id": 7}, "instance_id"),
    ("pending", {"world_size": 0}, "world_size"),
    ("ready", {"world_size": True}, "world_size"),
    ("ready", {"policy": "fast"}, "policy"),
    ("ready", {"seed": 1.5}, "seed"),
    ("ready", {"seed": True}, "seed"),
    ("ready", {"generation": -1}, "generation"),
    ("ready", {"attempts": -1}, "attempts"),
    ("recovering", {"attempts": 0}, "attempts"),
    ("backing_off", {"attempts": 0}, "attempts"),
    ("backing_off", {"deadline": math.nan}, "deadline"),
    ("backing_off", {"deadline": math.inf}, "deadline"),
    ("backing_off", {"deadline": "5"}, "deadline"),
    ("ready", {"ready_since": -math.inf}, "ready_since"),
    ("ready", {"clock": math.nan}, "clock"),
    ("starting", {"live_ranks": (2,)}, "live_ranks"),
    ("starting", {"live_ranks": (1, 0)}, "live_ranks"),
    ("starting", {"live_ranks": (0, 0)}, "live_ranks"),
    ("starting", {"live_ranks": (-1, 0)}, "live_ranks"),
    ("starting", {"live_ranks": (True,)}, "live_ranks"),
    ("starting", {"live_ranks": "01"}, "live_ranks"),
    ("starting", {"live_ranks": (0, 5)}, "live_ranks"),
    ("starting", {"live_ranks": (True,), "ready_ranks": ()}, "live_ranks"),
    ("pending", {"ready_ranks": (True,)}, "ready_ranks"),
    ("pending", {"live_ranks": (0.5,)}, "live_ranks"),
    ("pending", {"live_ranks": (-1,)}, "live_ranks"),
    ("pending", {"ready_ranks": (-2, -3)}, "ready_ranks"),
    ("ready", {"ready_ranks": (0, 2)}, "ready_ranks"),
    ("ready", {"ready_ranks": (1, 1)}, "ready_ranks"),
    ("recovering", {"live_ranks": ()}, "live_ranks"),
    ("starting", {"ready_ranks": (0, 1)}, "ready_ranks"),
    ("deleted", {"deadline": 5.0}, "deadline"),
    ("deleted", {"ready_since": 2.0}, "deadline and ready_since"),
    ("deleted", {"delete_reason": None}, "delete_reason"),
    ("pending", {"ready_since": 1.0}, "ready_since"),
    ("recovering", {"ready_since": 1.0}, "ready_since"),
    ("backing_off", {"ready_since": 1.0}, "ready_since"),
    ("deleted", {"delete_reason": "requested"}, "delete_reason"),
    ("ready", {"delete_reason": fsm.DeleteReason.REQUESTED}, "delete_reason"),
    ("pending", {"delete_reason": fsm.DeleteReason.NON_RETRYABLE}, "delete_reason"),
    ("backing_off", {"delete_reason": fsm.DeleteReason.REQUESTED}, "delete_reason"),
    ("backing_off", {"attempts": 3, "uncharged": -1}, "uncharged"),
    ("ready", {"last_failure": "boom"}, "last_failure"),
]


@pytest.mark.parametrize(("leaf", "changes", "field"), BAD_INSTANCE_SNAPSHOTS)
def test_an_impossible_snapshot_is_refused_naming_the_field(leaf, changes, field):
    snapshot = attrs.evolve(instance_in(leaf).snapshot(), **changes)
    with pytest.raises(fsm.SnapshotError) as info:
        InstanceRetry.from_snapshot(snapshot)
    assert str(info.value).startswith(f"invalid instance snapshot: {field}")
    machine = instance_in("backing_off")
    before = machine.to_dict()
    with pytest.raises(fsm.SnapshotError):
        machine.reload(snapshot)
    assert machine.to_dict() == before


class Count(int):
    """An int subclass (an IntEnum member, say): a count all the same."""


@pytest.mark.parametrize("leaf", LEAVES)
def test_a_snapshot_with_ints_for_times_and_int_subclasses_restores_the_same(leaf):
    """The slow path of the snapshot check takes what the fast one leaves to it: int times, lists, subclasses."""
    machine = instance_in(leaf)
    plain = machine.snapshot()

    def whole(t):
        return None if t is None else int(t) if t == int(t) else t

    variants = [
        attrs.evolve(
            plain,
            instance_id=type("InstanceId", (str,), {})(plain.instance_id),
            world_size=Count(plain.world_size),
            seed=Count(plain.seed),
            generation=Count(plain.generation),
            attempts=Count(plain.attempts),
        ),
        attrs.evolve(
            plain,
            deadline=whole(plain.deadline),
            ready_since=whole(plain.ready_since),
            clock=whole(plain.clock),
        ),
        attrs.evolve(plain, live_ranks=list(plain.live_ranks), ready_ranks=list(plain.ready_ranks)),
        attrs.evolve(
            plain, live_ranks=tuple(map(Count, plain.live_ranks)), ready_ranks=tuple(map(Count, plain.ready_ranks))
        ),
    ]
    for variant in variants:
        restored = InstanceRetry.from_snapshot(variant)
        assert restored.snapshot() == plain
        reloaded = instance_in("pending")
        reloaded.reload(variant)
        assert reloaded.snapshot() == plain
        reference = InstanceRetry.from_snapshot(plain)
        for event in (Tick("inst", 100.0), Delete("inst", 101.0)):
            assert restored.apply(event) == reference.apply(event)
            assert restored.snapshot() == reference.snapshot()


# -- the typed door: ranges, generations, the clock ------------------------------------------------


def test_a_rank_equal_to_world_size_is_out_of_range():
    i = started(world_size=2)
    before = i.to_dict()
    for event in (
        RankCreated("inst", 1.0, 1, 2),
        RankReady("inst", 1.0, 1, 2),
        RankStopped("inst", 1.0, 1, 2),
        RankFailed("inst", 1.0, 1, 2, failure=CRASH),
    ):
        with pytest.raises(fsm.InvalidEvent, match="rank 2 out of range for world_size 2"):
            i.apply(event)
    assert i.to_dict() == before


def test_starting_the_current_generation_again_is_ignored_and_skipping_one_is_an_error():
    i = started(world_size=1)
    before = i.to_dict()
    out = i.apply(Start("inst", 5.0, 1))
    assert not out.accepted and out.note == "generation 1 already started"
    assert i.to_dict() == before
    with pytest.raises(fsm.InvalidEvent, match="next generation is 2, not 3"):
        i.apply(Start("inst", 5.0, 3))
    assert i.to_dict() == before


def test_the_clock_never_runs_backwards():
    i = started(world_size=1)
    i.apply(Tick("inst", 10.0))
    i.apply(Tick("inst", 4.0))
    assert i.clock == 10.0
    fail_generation(i, 3.0)  # late-stamped: the backoff runs from the clock, not from the stamp
    assert i.deadline == 12.0
    with pytest.raises(fsm.IllegalTransition, match=r"backoff deadline 12.0 not reached \(now 10.0\)"):
        i.apply(Start("inst", 5.0, 2))
    i.apply(Tick("inst", 12.0))
    i.apply(Start("inst", 5.0, 2))  # stamped before the deadline, but the clock has passed it
    assert (i.instance_state, i.generation, i.clock) == (fsm.InstanceState.STARTING, 2, 12.0)


def test_a_refused_event_leaves_the_budget_as_it_was_even_when_it_came_late():
    i = started(world_size=1, policy=RetryPolicy(reset_after=100.0))
    fail_generation(i, 1.0)
    next_generation(i)
    make_ready(i, 10.0)
    before = i.to_dict()
    with pytest.raises(fsm.IllegalTransition, match="budget not exhausted"):
        i.apply(GiveUp("inst", 500.0))  # would reset the budget, had it been accepted
    assert i.to_dict() == before
    assert (i.attempts, i.clock) == (1, 10.0)


def test_a_refusal_by_the_state_carries_no_hint():
    i = started(world_size=1)
    with pytest.raises(fsm.IllegalTransition) as info:
        i.apply(Start("inst", 1.0, 2))
    assert str(info.value) == "instance: event 'start' is not allowed in state 'alive.running.starting'"
    with pytest.raises(fsm.IllegalTransition) as info:
        InstanceRetry("inst").apply(fsm.instance.Resume("inst", 1.0))
    assert str(info.value) == "instance: event 'resume' is not allowed in state 'alive.pending'"


def test_deleting_cancels_the_timer_and_the_ready_streak():
    i = started(world_size=1)
    make_ready(i, 1.0)
    assert i.ready_since == 1.0
    i.apply(Delete("inst", 2.0))
    assert (i.deadline, i.ready_since, i.delete_reason) == (None, None, fsm.DeleteReason.REQUESTED)


# -- events that change no state report no step ----------------------------------------------------------


def test_events_that_leave_the_state_report_no_step():
    i = InstanceRetry("inst", world_size=3)
    assert i.apply(Tick("inst", 0.0)).steps == ()  # pending
    i.apply(Start("inst", 0.0, 1))
    for rank in range(3):
        assert i.apply(RankCreated("inst", 0.0, 1, rank)).steps == ()
    assert i.apply(RankReady("inst", 0.5, 1, 0)).steps == ()
    assert i.apply(Tick("inst", 0.6)).steps == ()  # starting
    i.apply(RankReady("inst", 1.0, 1, 1))
    assert i.apply(RankReady("inst", 1.0, 1, 2)).steps == (fsm.Step("auto", "starting", "ready"),)
    assert i.apply(RankReady("inst", 1.1, 1, 2)).steps == ()  # ready: a repeated report
    assert i.apply(Tick("inst", 1.2)).steps == ()  # ready
    assert i.apply(RankFailed("inst", 2.0, 1, 0, failure=CRASH)).steps == (
        fsm.Step("rank_failed", "ready", "recovering"),
    )
    assert i.apply(RankFailed("inst", 2.1, 1, 1, failure=CRASH)).steps == ()  # recovering
    assert i.apply(RankReady("inst", 2.2, 1, 2)).steps == ()
    assert i.apply(RankCreated("inst", 2.3, 1, 2)).steps == ()
    assert i.apply(Tick("inst", 2.4)).steps == ()
    assert i.apply(RankStopped("inst", 3.0, 1, 0)).steps == ()
    assert i.apply(RankStopped("inst", 3.0, 1, 1)).steps == ()
    assert i.apply(RankStopped("inst", 3.0, 1, 2)).steps == (fsm.Step("auto", "recovering", "backing_off"),)
    for event in (
        RankStopped("inst", 3.1, 1, 2),
        RankFailed("inst", 3.1, 1, 2, failure=CRASH),
        RankReady("inst", 3.1, 1, 2),
        Tick("inst", 3.2),
    ):
        assert i.apply(event).steps == ()  # backing_off
        assert i.leaf == "backing_off"
    assert i.attempts == 1


def test_resume_reports_the_fresh_start_of_starting():
    i = started(world_size=1)
    assert i.apply(fsm.instance.Resume("inst", 1.0)).steps == (fsm.Step("resume", "starting", "starting"),)
    assert (i.generation, i.live_ranks, i.ready_ranks) == (2, set(), set())


def test_a_snapshot_two_compounds_deep_round_trips_and_goes_on_the_same():
    """Ready lies in alive.running: a snapshot keeps only the leaf, and restoring (or reloading) it rebuilds the
    whole configuration, so the compounds' transitions (tick and delete on `alive`, rank_failed on `running`) are
    taken from the copy as from the original, with the same leaf-to-leaf steps."""
    i = started(world_size=1)
    make_ready(i, 1.0)
    assert (i.leaf, i.path) == ("ready", "alive.running.ready")
    data = i.to_dict()
    assert data["leaf"] == "ready"
    restored = InstanceRetry.from_dict(data)
    reloaded = InstanceRetry("inst", world_size=1)
    reloaded.reload(restored.snapshot())
    for copy in (restored, reloaded):
        assert (copy.path, copy.to_dict()) == (i.path, data)
    steps = []
    for event in (Tick("inst", 2.0), RankFailed("inst", 3.0, 1, 0, failure=CRASH), Delete("inst", 4.0)):
        expected = i.apply(event)
        for copy in (restored, reloaded):
            assert copy.apply(event) == expected
            assert copy.to_dict() == i.to_dict()
        steps.append(expected.steps)
    assert steps == [
        (),
        (fsm.Step("rank_failed", "ready", "recovering"),),
        (fsm.Step("delete", "recovering", "deleted"),),
    ]


def test_a_rank_created_late_while_recovering_must_be_reaped_before_backing_off():
    i = InstanceRetry("inst", world_size=2)
    i.apply(Start("inst", 0.0, 1))
    i.apply(RankCreated("inst", 0.0, 1, 0))
    i.apply(RankFailed("inst", 1.0, 1, 0, failure=CRASH))
    i.apply(RankCreated("inst", 1.5, 1, 1))  # its spawn was under way
    i.apply(RankStopped("inst", 2.0, 1, 0))
    assert i.instance_state is fsm.InstanceState.RECOVERING
    assert i.live_ranks == {1}
    i.apply(RankStopped("inst", 3.0, 1, 1))
    assert i.instance_state is fsm.InstanceState.BACKING_OFF
    assert i.deadline == 5.0


def test_events_refuse_an_instance_id_that_is_no_str():
    for make_event in (
        lambda: Tick(7, 1.0),
        lambda: Delete(None, 1.0),
        lambda: Start(b"inst", 1.0, 1),
        lambda: RankReady(7, 1.0, 1, 0),
    ):
        with pytest.raises(TypeError):
            make_event()


def test_world_size_policy_and_seed_are_keyword_only():
    with pytest.raises(TypeError):
        InstanceRetry("inst", 2)
    i = InstanceRetry(instance_id="inst", world_size=2, policy=RetryPolicy(max_failures=2), seed=9)
    assert (i.instance_id, i.world_size, i.policy.max_failures, i.seed) == ("inst", 2, 2, 9)


def test_a_deadline_of_exactly_zero_round_trips():
    i = started(world_size=1, now=-3.0)
    fail_generation(i, -2.0)
    assert (i.leaf, i.deadline) == ("backing_off", 0.0)
    restored = InstanceRetry.from_dict(i.to_dict())
    assert restored.to_dict() == i.to_dict()
    restored.apply(Start("inst", 0.0, 2))
    assert restored.generation == 2


def test_a_rank_of_a_ready_instance_stopping_unreported_costs_one_retry():
    i = started(world_size=2)
    make_ready(i, 1.0)
    out = i.apply(RankStopped("inst", 2.0, 1, 0))
    assert out.steps == (fsm.Step("rank_stopped", "ready", "recovering"),)
    assert (i.attempts, i.live_ranks, i.ready_since) == (1, {1}, None)
    assert i.last_failure.kind is fsm.FailureKind.EXIT


def test_a_rank_stopping_unreported_on_the_last_retry_gives_up():
    i = started(world_size=2, policy=RetryPolicy(max_failures=1))
    make_ready(i, 1.0)
    i.apply(RankStopped("inst", 2.0, 1, 0))
    assert (i.instance_state, i.delete_reason, i.attempts) == (
        fsm.InstanceState.DELETED,
        fsm.DeleteReason.RETRIES_EXHAUSTED,
        1,
    )
    assert i.live_ranks == {1}


def test_start_is_allowed_any_time_after_the_deadline():
    i = started(world_size=1)
    fail_generation(i, 10.0)
    assert i.deadline == 12.0
    i.apply(Start("inst", 500.0, 2))
    assert (i.instance_state, i.generation) == (fsm.InstanceState.STARTING, 2)


def test_the_default_policy_allows_five_failed_generations_and_refills_after_ten_minutes():
    policy = RetryPolicy()
    assert (policy.max_failures, policy.reset_after, policy.backoff) == (5, 600.0, fsm.Backoff())
    i = started(world_size=1)
    for n in range(1, 5):
        fail_generation(i, 100.0 * n)
        next_generation(i)
    fail_generation(i, 1000.0)
    assert (i.instance_state, i.attempts) == (fsm.InstanceState.DELETED, 5)


def test_the_guards_read_as_booleans():
    i = started(world_size=2, policy=RetryPolicy(max_failures=2))
    assert (i.all_ranks_ready, i.nothing_alive, i.deadline_passed) == (False, False, True)
    assert (i.budget_spent, i.last_allowed_failure) == (False, False)
    fail_generation(i, 1.0)
    assert (i.nothing_alive, i.deadline_passed) == (True, False)
    assert (i.budget_spent, i.last_allowed_failure) == (False, True)
    next_generation(i)
    make_ready(i, 5.0)
    assert (i.all_ranks_ready, i.deadline_passed) == (True, True)


def test_an_instance_ready_since_time_zero_round_trips():
    i = started(world_size=1, now=0.0)
    make_ready(i, 0.0)
    assert (i.leaf, i.ready_since, i.clock) == ("ready", 0.0, 0.0)
    restored = InstanceRetry.from_dict(i.to_dict())
    assert restored.to_dict() == i.to_dict()


def test_give_up_while_starting_records_that_the_retries_are_exhausted():
    i = started(world_size=1, policy=RetryPolicy(max_failures=3))
    fail_generation(i, 1.0)
    next_generation(i)
    lowered = InstanceRetry.from_dict(i.to_dict(), policy=RetryPolicy(max_failures=1))
    assert lowered.leaf == "starting"
    out = lowered.apply(GiveUp("inst", 5.0))
    assert out.steps == (fsm.Step("give_up", "starting", "deleted"),)
    assert (lowered.delete_reason, lowered.attempts) == (fsm.DeleteReason.RETRIES_EXHAUSTED, 1)


@pytest.mark.parametrize("generation", [-1, "1", 1.0, True, None])
def test_a_rank_event_refuses_a_generation_that_is_no_count(generation):
    with pytest.raises(fsm.InvalidEvent, match="generation"):
        RankReady("inst", 1.0, generation, 0)


def test_the_default_seed_is_zero():
    assert InstanceRetry("inst").seed == 0
    assert InstanceRetry("inst").retry_delay(3) == InstanceRetry("inst", seed=0).retry_delay(3)


@pytest.mark.parametrize("generation", [-1, "1", 1.0, None])
def test_start_refuses_a_generation_that_is_no_count(generation):
    with pytest.raises(fsm.InvalidEvent, match="generation"):
        Start("inst", 1.0, generation)


def test_the_budget_refills_only_while_ready():
    from fsm.instance import Resume

    i = started(world_size=1, policy=RetryPolicy(reset_after=100.0))
    fail_generation(i, 1.0)
    next_generation(i)
    make_ready(i, 10.0)
    i.apply(Resume("inst", 20.0))  # starting again, the streak broken by the daemon's restart
    i.apply(Tick("inst", 500.0))
    assert (i.leaf, i.attempts) == ("starting", 1)


def test_reload_takes_the_policy_of_the_snapshot():
    lenient = instance_in("backing_off").snapshot()
    strict = attrs.evolve(lenient, policy=RetryPolicy(max_failures=1))
    machine = InstanceRetry.from_snapshot(lenient)
    machine.reload(strict)
    assert machine.policy == RetryPolicy(max_failures=1)
    assert machine.budget_spent


def test_a_backing_off_snapshot_with_a_live_rank_is_refused():
    m = InstanceRetry("i", world_size=2)
    m.apply(Start("i", 0.0, 1))
    m.apply(RankCreated("i", 0.0, 1, 0))
    m.apply(RankFailed("i", 1.0, 1, 0, failure=fsm.Failure.signalled(9)))
    m.apply(RankStopped("i", 1.5, 1, 0))
    assert m.instance_state is fsm.InstanceState.BACKING_OFF
    bad = {**m.to_dict(), "live_ranks": [1]}
    with pytest.raises(fsm.SnapshotError, match="live_ranks"):
        InstanceRetry.from_dict(bad)


# -- what the mutants of fsm/instance.py showed untested ----------------------------------------------


def snapshots_of_a_long_life() -> list[fsm.InstanceSnapshot]:
    """Every snapshot instances take along the lives the daemon sees: 1 and 3 ranks, failures, resets, each end."""
    snapshots = []

    def send(i: InstanceRetry, event) -> None:
        i.apply(event)
        snapshots.append(i.snapshot())

    one = InstanceRetry("a", world_size=1, policy=RetryPolicy(max_failures=3, reset_after=50.0), seed=4)
    snapshots.append(one.snapshot())
    for generation, now in ((1, 1.0), (2, 20.0), (3, 40.0)):
        send(one, Start("a", now, generation))
        send(one, RankCreated("a", now, generation, 0))
        send(one, RankReady("a", now + 0.5, generation, 0))
        send(one, RankFailed("a", now + 1.0, generation, 0, failure=CRASH))
        send(one, RankStopped("a", now + 1.5, generation, 0))
        send(one, Tick("a", now + 15.0))
    send(one, GiveUp("a", 60.0))

    three = InstanceRetry("inst", world_size=3, policy=RetryPolicy(reset_after=5.0))
    send(three, Start("inst", 1.0, 1))
    for rank in range(3):
        send(three, RankCreated("inst", 1.0, 1, rank))
    send(three, RankStopped("inst", 2.0, 1, 1))  # a failure by stopping, then the others reaped
    send(three, RankStopped("inst", 2.5, 1, 0))
    send(three, RankStopped("inst", 3.0, 1, 2))
    send(three, Start("inst", 30.0, 2))
    for rank in range(3):
        send(three, RankCreated("inst", 30.0, 2, rank))
        send(three, RankReady("inst", 31.0, 2, rank))
    send(three, Tick("inst", 40.0))  # ready for reset_after: the budget refills
    send(three, RankFailed("inst", 41.0, 2, 2, failure=CORRUPT))
    send(three, Delete("inst", 42.0))

    host = InstanceRetry("h", world_size=1, policy=RetryPolicy(max_failures=2))  # the host's failures, then a crash
    for generation, failure in ((1, PORT_TAKEN), (2, CRASH)):
        send(host, Start("h", 10.0 * generation, generation))
        send(host, RankCreated("h", 10.0 * generation, generation, 0))
        send(host, RankFailed("h", 10.0 * generation + 1, generation, 0, failure=failure))
        send(host, RankStopped("h", 10.0 * generation + 2, generation, 0))

    asked = InstanceRetry("b", world_size=2)
    send(asked, Start("b", 0.25, 1))
    send(asked, RankCreated("b", 0.25, 1, 0))
    send(asked, Delete("b", 0.75))
    return snapshots


def test_every_snapshot_a_living_instance_takes_passes_the_cheap_check(monkeypatch):
    """reload is the model checker's hot path: the snapshots machines take never need the slow, wordy check."""
    snapshots = snapshots_of_a_long_life()
    seen = {(s.leaf, s.world_size, s.attempts, s.deadline is None, bool(s.live_ranks)) for s in snapshots}
    assert {leaf for leaf, *_ in seen} == set(LEAVES)
    assert {(1, False), (2, False), (0, True)} <= {(a, d) for _, _, a, d, _ in seen}
    assert {reason for reason in (s.delete_reason for s in snapshots) if reason} == set(fsm.DeleteReason)
    after_failures = {(s.attempts, s.uncharged) for s in snapshots if s.leaf in ("recovering", "backing_off")}
    assert {(0, 1), (1, 1), (1, 0), (2, 0)} <= after_failures

    def slow(cls, snapshot):
        raise AssertionError(f"took the slow check: {snapshot}")

    monkeypatch.setattr(InstanceRetry, "_snapshot_problem", classmethod(slow))
    machine = InstanceRetry("a")
    for snapshot in snapshots:
        machine.reload(snapshot)
        assert machine.snapshot() == snapshot
        assert InstanceRetry.from_snapshot(snapshot).snapshot() == snapshot


@pytest.mark.parametrize("leaf", LEAVES)
def test_a_restored_instance_has_every_field_of_the_original(leaf):
    original = instance_in(leaf)
    fields = ("generation", "attempts", "deadline", "ready_since", "clock", "live_ranks", "ready_ranks")
    fields += ("delete_reason", "last_failure", "world_size", "seed", "policy")
    for restored in (InstanceRetry.from_snapshot(original.snapshot()), InstanceRetry.from_dict(original.to_dict())):
        assert {f: getattr(restored, f) for f in fields} == {f: getattr(original, f) for f in fields}


def test_the_slow_check_takes_one_rank_and_a_start_with_no_rank_yet():
    one = InstanceRetry("inst", world_size=1)
    one.apply(Start("inst", 1.0, 1))
    two = InstanceRetry("inst", world_size=2)
    two.apply(Start("inst", 1.0, 1))
    for machine in (one, two):
        plain = machine.snapshot()
        slow = attrs.evolve(plain, world_size=Count(plain.world_size), clock=1)  # leaves the cheap check
        assert not InstanceRetry._snapshot_plainly_fine(slow)
        assert InstanceRetry.from_snapshot(slow).snapshot() == plain


def test_a_policy_refuses_a_backoff_that_is_no_backoff_and_takes_any_positive_reset():
    with pytest.raises(TypeError, match="backoff"):
        RetryPolicy(backoff=2.0)
    assert RetryPolicy(reset_after=0.5).reset_after == 0.5


def test_rank_events_refuse_a_rank_that_is_no_count_and_failures_that_are_none():
    for rank in (-1, 1.0, True, "0"):
        with pytest.raises(fsm.InvalidEvent):
            RankReady("inst", 1.0, 1, rank)
    with pytest.raises(TypeError):
        RankFailed("inst", 1.0, 1, 0, CRASH)  # the failure is keyword-only: never mistaken for another field
    with pytest.raises(TypeError):
        RankFailed("inst", 1.0, 1, 0, failure="boom")


@pytest.mark.parametrize("leaf", ["starting", "ready"])
def test_a_non_retryable_failure_deletes_from_starting_and_from_ready_recording_why(leaf):
    i = started(world_size=2)
    if leaf == "ready":
        make_ready(i, 1.0)
    i.apply(RankFailed("inst", 2.0, 1, 1, failure=CORRUPT))
    reason = fsm.DeleteReason.NON_RETRYABLE
    assert (i.leaf, i.delete_reason, i.last_failure, i.attempts) == ("deleted", reason, CORRUPT, 0)
    assert i.apply(Tick("inst", 3.0)).note == "instance is deleted (non_retryable)"


@pytest.mark.parametrize("leaf", ["starting", "ready"])
@pytest.mark.parametrize("how", ["failed", "stopped"])
def test_the_last_allowed_failure_from_starting_or_ready_records_retries_exhausted(leaf, how):
    i = started(world_size=2, policy=RetryPolicy(max_failures=1))
    if leaf == "ready":
        make_ready(i, 1.0)
    if how == "failed":
        i.apply(RankFailed("inst", 2.0, 1, 0, failure=CRASH))
    else:
        i.apply(RankStopped("inst", 2.0, 1, 0))
    assert (i.leaf, i.delete_reason, i.attempts) == ("deleted", fsm.DeleteReason.RETRIES_EXHAUSTED, 1)
    assert i.last_failure == (CRASH if how == "failed" else fsm.instance._UNEXPECTED_STOP)
    assert i.live_ranks == ({0, 1} if how == "failed" else {1})


def test_give_up_from_pending_only_when_the_budget_is_spent():
    fresh = InstanceRetry("inst")
    with pytest.raises(fsm.IllegalTransition, match="budget not exhausted"):
        fresh.apply(GiveUp("inst", 1.0))
    assert fresh.leaf == "pending"
    snapshot = attrs.evolve(InstanceRetry("inst").snapshot(), attempts=5)
    i = InstanceRetry.from_snapshot(snapshot)
    i.apply(GiveUp("inst", 1.0))
    assert (i.leaf, i.delete_reason) == ("deleted", fsm.DeleteReason.RETRIES_EXHAUSTED)


def test_the_default_world_size_is_one_and_bad_ids_and_sizes_are_refused():
    assert InstanceRetry("inst").world_size == 1
    for bad in ("", 7, None):
        with pytest.raises(fsm.InvalidConfig, match="instance_id"):
            InstanceRetry(bad)
    for bad in (0, True, 1.0, "2"):
        with pytest.raises(fsm.InvalidConfig, match="world_size"):
            InstanceRetry("inst", world_size=bad)


def test_an_event_for_an_instance_whose_id_sorts_before_is_refused():
    i = started(world_size=1)
    for other in ("a", "insu", ""):
        with pytest.raises(fsm.InvalidEvent, match="sent to 'inst'"):
            i.apply(Tick(other, 1.0))


def test_starting_an_older_generation_is_ignored_and_the_hint_names_the_next_one():
    i = started(world_size=1)
    fail_generation(i, 1.0)
    next_generation(i)
    before = i.to_dict()
    out = i.apply(Start("inst", 50.0, 1))
    assert not out.accepted and out.note == "generation 1 already started"
    with pytest.raises(fsm.InvalidEvent, match="next generation is 3, not 5"):
        i.apply(Start("inst", 50.0, 5))
    assert i.to_dict() == before


# -- uncharged: the host's failures end a generation but spend no retry ------------------------------------

PORT_TAKEN = fsm.Failure.host("[ring] Couldn't bind socket (error 98): address in use")


def test_a_host_failure_ends_the_generation_waits_the_backoff_and_spends_no_retry():
    i = started(world_size=2, policy=RetryPolicy(max_failures=1))
    out = i.apply(RankFailed("inst", 1.0, 1, 1, failure=PORT_TAKEN))
    assert out.steps == (fsm.Step("rank_failed", "starting", "recovering"),)
    assert (i.attempts, i.uncharged, i.last_failure) == (0, 1, PORT_TAKEN)
    fail_generation(i, 2.0, failures=())
    assert (i.leaf, i.deadline) == ("backing_off", 4.0)  # the backoff of a first failure: 2 s
    with pytest.raises(fsm.IllegalTransition, match="backoff deadline"):
        i.apply(Start("inst", 3.0, 2))
    next_generation(i)
    i.apply(RankFailed("inst", 5.0, 2, 0, failure=PORT_TAKEN))  # max_failures=1: a charged one would give up
    fail_generation(i, 5.0, failures=())
    assert (i.leaf, i.attempts, i.uncharged, i.deadline) == ("backing_off", 0, 2, 9.0)  # the delay still grows
    assert not i.budget_spent


def test_a_charged_failure_after_host_ones_counts_alone_and_the_delay_counts_both():
    i = started(world_size=1, policy=RetryPolicy(max_failures=2))
    for now in (1.0, 10.0):
        i.apply(RankFailed("inst", now, i.generation, 0, failure=PORT_TAKEN))
        fail_generation(i, now, failures=())
        next_generation(i)
    i.apply(RankFailed("inst", 50.0, 3, 0, failure=CRASH))
    fail_generation(i, 50.0, failures=())
    assert (i.attempts, i.uncharged, i.deadline) == (1, 2, 58.0)  # the third failure of the streak: 8 s
    next_generation(i)
    i.apply(RankFailed("inst", 60.0, 4, 0, failure=CRASH))
    assert (i.leaf, i.delete_reason, i.attempts) == ("deleted", fsm.DeleteReason.RETRIES_EXHAUSTED, 2)


def test_a_ready_streak_refills_both_counts():
    i = started(world_size=1, policy=RetryPolicy(reset_after=100.0))
    i.apply(RankFailed("inst", 1.0, 1, 0, failure=PORT_TAKEN))
    fail_generation(i, 1.0, failures=())
    next_generation(i)
    i.apply(RankFailed("inst", 5.0, 2, 0, failure=CRASH))
    fail_generation(i, 5.0, failures=())
    next_generation(i)
    make_ready(i, 20.0)
    i.apply(Tick("inst", 119.0))
    assert (i.attempts, i.uncharged) == (1, 1)
    i.apply(Tick("inst", 120.0))
    assert (i.attempts, i.uncharged) == (0, 0)


POISONED = fsm.Failure.poisoned("runner killed by SIGSEGV; a poison request: it was in the batch twice")


def test_a_poison_requests_second_death_is_uncharged_and_gives_back_the_first():
    i = started(world_size=1, policy=RetryPolicy(max_failures=2))
    i.apply(RankFailed("inst", 1.0, 1, 0, failure=CRASH))  # its first death: nobody knew yet
    fail_generation(i, 1.0, failures=())
    next_generation(i)
    assert (i.attempts, i.uncharged) == (1, 0)
    i.apply(RankFailed("inst", 10.0, 2, 0, failure=POISONED))  # max_failures=2: a charged one would be the last
    fail_generation(i, 10.0, failures=())
    assert (i.leaf, i.attempts, i.uncharged, i.last_failure) == ("backing_off", 0, 2, POISONED)
    assert not POISONED.charged and not i.budget_spent


def test_a_poison_death_reported_after_its_consequence_gives_back_both_charges():
    i = started(world_size=2, policy=RetryPolicy(max_failures=3))
    i.apply(RankFailed("inst", 1.0, 1, 0, failure=CRASH))
    fail_generation(i, 1.0, failures=())
    next_generation(i)
    i.apply(RankFailed("inst", 10.0, 2, 0, failure=fsm.Failure.peer_lost("ring: connection reset")))
    assert (i.attempts, i.uncharged) == (2, 0)  # the consequence is charged until its cause is known
    i.apply(RankFailed("inst", 10.0, 2, 1, failure=POISONED))
    assert (i.attempts, i.uncharged, i.last_failure) == (0, 2, POISONED)


def test_a_poison_death_with_no_charge_left_to_give_back_is_only_uncharged():
    i = started(world_size=1)
    i.apply(RankFailed("inst", 1.0, 1, 0, failure=POISONED))  # its first death was another instance's
    assert (i.attempts, i.uncharged) == (0, 1)


def test_a_version_1_snapshot_is_read_as_charging_every_failure():
    i = started(world_size=1)
    i.apply(RankFailed("inst", 1.0, 1, 0, failure=CRASH))
    fail_generation(i, 1.0, failures=())
    old = {k: v for k, v in _as_version_3(i.to_dict()).items() if k not in ("uncharged", "waking")} | {"version": 1}
    restored = InstanceRetry.from_dict(old)
    assert restored.snapshot() == i.snapshot() and restored.to_dict()["version"] == 5
    with pytest.raises(fsm.SnapshotError, match="uncharged"):
        InstanceRetry.from_dict({**i.to_dict(), "version": 1})


def test_a_version_2_snapshot_is_read_as_never_parked():
    i = started(world_size=1)
    old = {k: v for k, v in _as_version_3(i.to_dict()).items() if k != "waking"} | {"version": 2}
    restored = InstanceRetry.from_dict(old)
    assert restored.snapshot() == i.snapshot() and not restored.waking
    with pytest.raises(fsm.SnapshotError, match="waking"):
        InstanceRetry.from_dict({**_as_version_3(i.to_dict()), "version": 2})


def _as_version_4(body: dict) -> dict:
    """What version 4 wrote: the policy's ``max_failures`` was called ``max_retries``."""
    policy = {("max_retries" if k == "max_failures" else k): v for k, v in body["policy"].items()}
    return body | {"version": 4, "policy": policy}


def _as_version_3(body: dict) -> dict:
    """What version 3 wrote: no per-rank fields, a policy with no strategy."""
    old = {
        k: v for k, v in _as_version_4(body).items() if k not in ("rank_generations", "failed_ranks", "rank_deadlines")
    }
    return old | {"version": 3, "policy": {k: v for k, v in old["policy"].items() if k != "strategy"}}


def test_a_version_4_snapshot_reads_max_retries_as_max_failures_the_same_count():
    i = started(world_size=1, policy=RetryPolicy(max_failures=3))
    old = _as_version_4(i.to_dict())
    assert old["policy"]["max_retries"] == 3 and "max_failures" not in old["policy"]
    restored = InstanceRetry.from_dict(old)
    assert restored.snapshot() == i.snapshot() and restored.policy.max_failures == 3
    with pytest.raises(fsm.SnapshotError, match="one field"):
        InstanceRetry.from_dict(old | {"policy": old["policy"] | {"max_failures": 3}})


def test_max_retries_is_the_deprecated_name_of_max_failures_with_the_same_meaning():
    with pytest.warns(DeprecationWarning, match="max_failures"):
        policy = RetryPolicy(max_retries=2)
    assert policy == RetryPolicy(max_failures=2)
    with pytest.warns(DeprecationWarning, match="max_failures"):
        assert policy.max_retries == 2
    with pytest.warns(DeprecationWarning):  # old code's attrs.evolve(policy, max_retries=N) passes both
        assert attrs.evolve(RetryPolicy(max_failures=5), max_retries=2) == policy
    i = started(world_size=1, policy=policy)  # 2 failed generations: one retry, then it gives up
    i.apply(RankFailed("inst", 1.0, 1, 0, failure=CRASH))
    assert i.instance_state is fsm.InstanceState.RECOVERING


def test_a_version_3_snapshot_is_read_as_one_for_all_with_every_rank_of_its_generation():
    i = started(world_size=2)
    restored = InstanceRetry.from_dict(_as_version_3(i.to_dict()))
    assert restored.snapshot() == i.snapshot()
    assert restored.rank_generations == [1, 1] and restored.policy.strategy is fsm.RestartStrategy.ONE_FOR_ALL
    with pytest.raises(fsm.SnapshotError, match="rank_generations: version 3"):
        InstanceRetry.from_dict({**i.to_dict(), "version": 3})
    with pytest.raises(fsm.SnapshotError, match=r"policy\.strategy: version 3"):
        InstanceRetry.from_dict({**_as_version_3(i.to_dict()), "policy": i.to_dict()["policy"]})


@pytest.mark.parametrize("uncharged", [-1, 1.0, True, None])
def test_a_snapshot_refuses_an_uncharged_count_that_is_no_count(uncharged):
    snapshot = attrs.evolve(instance_in("backing_off").snapshot(), uncharged=uncharged)
    with pytest.raises(fsm.SnapshotError, match="uncharged must be an int >= 0"):
        InstanceRetry.from_snapshot(snapshot)


def test_backing_off_after_host_failures_alone_is_a_snapshot_an_instance_could_be():
    i = started(world_size=1)
    i.apply(RankFailed("inst", 1.0, 1, 0, failure=PORT_TAKEN))
    fail_generation(i, 1.0, failures=())
    assert (i.leaf, i.attempts, i.uncharged) == ("backing_off", 0, 1)
    assert InstanceRetry.from_dict(i.to_dict()).snapshot() == i.snapshot()


# -- the first cause, not its consequence ---------------------------------------------------------------------

PEER_LOST = fsm.Failure.peer_lost("RuntimeError: [ring] connection to a peer was lost")
KILLED = fsm.Failure.signalled(9)


@pytest.mark.parametrize("first", ["peer", "cause"])
def test_last_failure_is_the_cause_whichever_report_came_first(first):
    i = started(world_size=2)
    make_ready(i, 1.0)
    reports = [(0, PEER_LOST), (1, KILLED)] if first == "peer" else [(1, KILLED), (0, PEER_LOST)]
    for rank, failure in reports:
        i.apply(RankFailed("inst", 2.0, 1, rank, failure=failure))
    assert (i.leaf, i.attempts, i.last_failure) == ("recovering", 1, KILLED)  # one retry, blamed on the kill


NODE_LOST = fsm.Failure.host("NodeLost: node node-2 lost (node node-2's lease expired)")


@pytest.mark.parametrize("stopping", [False, True])
def test_a_consequence_whose_cause_is_the_hosts_gives_its_retry_back(stopping):
    """Found by the fault campaign (#26, seed 1): a node's daemon paused past its lease; its runner's watchdog
    ended the runner, the ranks on the other nodes lost their ring (a charged consequence, reported first),
    then the node was lost (the host's failure): the generation was charged to the model."""
    i = started(world_size=3)
    make_ready(i, 1.0)
    i.apply(RankFailed("inst", 2.0, 1, 0, failure=PEER_LOST))
    assert (i.attempts, i.uncharged) == (1, 0)  # a consequence, charged until its cause is known
    cause = RankFailedWhileStopping if stopping else RankFailed
    i.apply(cause("inst", 2.5, 1, 1, failure=NODE_LOST))
    assert (i.leaf, i.attempts, i.uncharged, i.last_failure) == ("recovering", 0, 1, NODE_LOST)
    i.apply(RankFailed("inst", 2.6, 1, 2, failure=PEER_LOST))
    i.apply(RankFailed("inst", 2.7, 1, 2, failure=KILLED))  # a later cause changes nothing more
    assert (i.attempts, i.uncharged, i.last_failure) == (0, 1, NODE_LOST)


def test_a_consequence_never_gives_up_by_itself_its_spent_budget_is_given_up_on_once_reaped():
    policy = RetryPolicy(max_failures=1)
    given_back = started(world_size=2, policy=policy)
    given_back.apply(RankFailed("inst", 1.0, 1, 0, failure=PEER_LOST))  # the last allowed failure, if charged
    assert given_back.leaf == "recovering"
    given_back.apply(RankFailed("inst", 1.1, 1, 1, failure=NODE_LOST))
    fail_generation(given_back, 1.2, failures=())
    assert (given_back.leaf, given_back.budget_spent) == ("backing_off", False)  # it will be retried
    spent = started(world_size=2, policy=policy)
    spent.apply(RankFailed("inst", 1.0, 1, 0, failure=PEER_LOST))
    spent.apply(RankFailed("inst", 1.1, 1, 1, failure=KILLED))
    fail_generation(spent, 1.2, failures=())
    assert (spent.leaf, spent.budget_spent) == ("backing_off", True)
    spent.apply(fsm.instance.GiveUp("inst", 1.3))  # what the planner sends at the cap
    assert (spent.leaf, spent.delete_reason) == ("deleted", fsm.instance.DeleteReason.RETRIES_EXHAUSTED)


def test_the_first_cause_stays_when_another_cause_follows():
    i = started(world_size=3)
    i.apply(RankFailed("inst", 2.0, 1, 0, failure=PEER_LOST))
    i.apply(RankFailed("inst", 2.0, 1, 1, failure=KILLED))
    i.apply(RankFailed("inst", 2.0, 1, 2, failure=fsm.Failure.exited(1)))
    assert i.last_failure == KILLED


@pytest.mark.parametrize("leaf", ["recovering", "backing_off"])
def test_a_failure_while_stopping_replaces_a_consequence_but_charges_and_deletes_nothing(leaf):
    i = started(world_size=2)
    make_ready(i, 1.0)
    i.apply(RankFailed("inst", 2.0, 1, 0, failure=PEER_LOST))
    if leaf == "backing_off":
        i.apply(RankStopped("inst", 2.0, 1, 0))
        i.apply(RankStopped("inst", 2.0, 1, 1))
    fatal = fsm.Failure.exception("FileNotFoundError", "model.safetensors", retryable=False)
    i.apply(RankFailedWhileStopping("inst", 2.5, 1, 1, failure=fatal))
    assert (i.leaf, i.attempts, i.delete_reason, i.last_failure) == (leaf, 1, None, fatal)
    i.apply(RankFailedWhileStopping("inst", 2.6, 1, 1, failure=KILLED))
    assert i.last_failure == fatal  # the first cause stays


def test_a_failure_while_stopping_a_live_generation_changes_nothing():
    i = started(world_size=2)
    make_ready(i, 1.0)
    before = i.snapshot()
    out = i.apply(RankFailedWhileStopping("inst", 1.0, 1, 1, failure=KILLED))
    assert out.accepted and i.snapshot() == before


def test_the_delay_after_a_charged_and_an_uncharged_failure_is_the_second_of_the_streak():
    i = started(world_size=1)
    i.apply(RankFailed("inst", 1.0, 1, 0, failure=PORT_TAKEN))
    fail_generation(i, 1.0, failures=())
    next_generation(i)
    i.apply(RankFailed("inst", 5.0, 2, 0, failure=CRASH))
    fail_generation(i, 5.0, failures=())
    assert (i.attempts, i.uncharged, i.deadline) == (1, 1, 9.0)  # delay(2) = 4 s: the streak's second failure


def test_the_slow_check_takes_a_generation_ended_by_the_host_alone():
    i = started(world_size=1)
    i.apply(RankFailed("inst", 1.0, 1, 0, failure=PORT_TAKEN))
    plain = i.snapshot()
    assert (plain.leaf, plain.attempts, plain.uncharged) == ("recovering", 0, 1)
    slow = attrs.evolve(plain, uncharged=Count(1))  # an int subclass leaves the cheap check
    assert not InstanceRetry._snapshot_plainly_fine(slow)
    assert InstanceRetry.from_snapshot(slow).snapshot() == plain
