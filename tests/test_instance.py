"""InstanceRetry: every rule of DESIGN §3.2, one test each."""

from __future__ import annotations

import pytest

import fsm
from fsm.instance import (
    Delete,
    GiveUp,
    InstanceRetry,
    RankCreated,
    RankFailed,
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
    i = started(policy=RetryPolicy(max_retries=max_retries))
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
    i = started(policy=RetryPolicy(max_retries=8))
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
    i = started(policy=RetryPolicy(reset_after=100.0, max_retries=2))
    fail_generation(i, 1.0)
    next_generation(i)
    make_ready(i, 10.0)
    fail_generation(i, 500.0)  # would exhaust a budget of 2 without the reset
    assert i.instance_state is fsm.InstanceState.BACKING_OFF
    assert i.attempts == 1
    assert i.deadline == 502.0  # a fresh streak starts with `initial` again


def test_no_reset_when_ready_was_interrupted():
    i = started(policy=RetryPolicy(reset_after=100.0, max_retries=5))
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
    i = started(policy=RetryPolicy(max_retries=3))
    fail_generation(i, 1.0)
    with pytest.raises(fsm.IllegalTransition, match="budget"):
        i.apply(GiveUp("inst", 2.0))
    # a restart with a lower budget: the planner's GiveUp is accepted
    lowered = InstanceRetry.from_dict(i.to_dict(), policy=RetryPolicy(max_retries=1))
    lowered.apply(GiveUp("inst", 2.0))
    assert lowered.delete_reason is fsm.DeleteReason.RETRIES_EXHAUSTED


def test_jitter_is_full_bounded_and_reproducible_from_the_seed():
    policy = RetryPolicy(backoff=fsm.Backoff(jitter=True), max_retries=10)

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
        ({"max_retries": 0}, "max_retries"),
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
        {**good, "version": 2},
        {**good, "leaf": "exploded"},
        {**good, "extra": 1},
        {k: v for k, v in good.items() if k != "instance_id"},
        [],
    ):
        with pytest.raises(fsm.SnapshotError):
            InstanceRetry.from_dict(bad)


def test_resume_after_a_daemon_restart_starts_a_new_generation_for_free():
    from fsm.instance import Resume

    i = started(policy=RetryPolicy(max_retries=2))
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
