"""The heartbeat as the planner keeps it (`fsm.watchdog`): pure, the times are inputs.

A runner whose process stops answering its heartbeat fails as stalled, charged, once the limit passed since its
last answer (`Cluster.heard`) while its caller listened (`Cluster.listened`), whatever its phase; never before,
never while it answers, never for its caller's own break (``resumed``: answers may wait unread), never before
its first answer unless it is Ready (taken over), never while it joins its ring, never once it failed or was
asked to stop. The real processes, SIGSTOPped: tests/test_runner_liveness.py.
"""

from __future__ import annotations

import pytest
from test_driver import POLICY, SLOTS, Clock, Recorder, settle

import fsm
from fsm import runner as rn

LIMIT = 2.0
LIMITS = fsm.PhaseLimits(heartbeat=LIMIT)


def ready(slots=SLOTS) -> tuple[fsm.Cluster, Clock, fsm.Driver]:
    cluster, clock = fsm.Cluster(limits=LIMITS), Clock()
    cluster.place("i", "org/m", slots, policy=POLICY)
    driver = fsm.Driver(cluster, Recorder(), clock)
    settle(driver, clock, until=lambda: cluster.instance("i").instance_state is fsm.InstanceState.READY)
    return cluster, clock, driver


def listen(cluster: fsm.Cluster, at: float, *, resumed: bool = False) -> list[bool]:
    return [cluster.listened(slot.runner_id, 1, at, resumed=resumed) for slot in SLOTS]


def test_a_runner_that_stops_answering_fails_as_stalled_once_the_limit_passed_charged():
    cluster, clock, driver = ready()
    assert listen(cluster, clock.now) == [False, False]  # no answer yet: not watched (not started, maybe)
    for slot in SLOTS:
        assert cluster.heard(slot.runner_id, 1, clock.now)
    heard_at = clock.now
    for step in range(1, 5):  # rank 0 answers on; rank 1 is stopped
        clock.now = heard_at + step * LIMIT / 5
        assert cluster.heard("i/0", 1, clock.now)
        assert listen(cluster, clock.now) == [False, False]
        assert driver.reconcile().taken == ()
    clock.now = heard_at + LIMIT - 0.01
    assert listen(cluster, clock.now) == [False, False] and driver.reconcile().taken == ()  # never before
    clock.now = heard_at + LIMIT + 0.1
    assert driver.reconcile().taken == ()  # time alone does not say: its caller listened only until before
    assert driver.next_wakeup() is None
    assert listen(cluster, clock.now) == [False, True]  # listened past it: missed
    done = driver.reconcile()
    assert fsm.FailUnresponsive("i/1", 1, pytest.approx(LIMIT + 0.1)) in done.taken
    assert not any(isinstance(a, fsm.FailUnresponsive) and a.runner_id == "i/0" for a in done.taken)
    failure = cluster.runner("i/1").failure
    assert failure is not None and failure.kind is fsm.FailureKind.STALL and failure.charged
    assert failure.message == "missed its heartbeat: its process answered none for 2.1 s"
    machine = cluster.instance("i")
    assert machine.attempts == 1 and machine.last_failure == failure
    assert fsm.StopRunner("i/1", 1, fsm.StopReason.RUNNER_FAILED) in done.taken  # then stopped like any failure
    clock.now += 10 * LIMIT
    listen(cluster, clock.now)
    assert not any(isinstance(a, fsm.FailUnresponsive) for a in driver.reconcile().taken)  # failed once


def test_a_break_in_the_callers_listening_is_not_the_runners_silence():
    """Its caller paused past the limit (the answers wait unread): on resuming it listens a whole limit
    again, and the answers it then reads keep the runner alive."""
    cluster, clock, driver = ready(SLOTS[:1])
    cluster.heard("i/0", 1, clock.now)
    cluster.listened("i/0", 1, clock.now)
    clock.now += 5 * LIMIT  # paused
    assert not cluster.listened("i/0", 1, clock.now, resumed=True)
    assert driver.reconcile().taken == ()
    clock.now += LIMIT / 10
    cluster.heard("i/0", 1, clock.now)  # the answer that waited is read
    clock.now += LIMIT - 0.01
    assert not cluster.listened("i/0", 1, clock.now) and driver.reconcile().taken == ()
    clock.now += LIMIT  # and then it is silent for real
    assert cluster.listened("i/0", 1, clock.now)
    assert [type(a) for a in driver.reconcile().taken][:1] == [fsm.FailUnresponsive]


def test_an_answer_after_the_plan_is_made_wins():
    """The plan said fail; an answer came before the action was taken: nothing fails."""
    cluster, clock, _ = ready(SLOTS[:1])
    cluster.heard("i/0", 1, clock.now)
    cluster.listened("i/0", 1, clock.now)
    late = clock.now + LIMIT
    assert cluster.listened("i/0", 1, late)
    (action,) = [a for a in fsm.plan(cluster.view(), "a", late) if isinstance(a, fsm.FailUnresponsive)]
    cluster.heard("i/0", 1, late)
    outcome = cluster.execute(action, late)
    assert not outcome.accepted and "answered" in outcome.note
    assert cluster.runner("i/0").failure is None


def test_joining_a_ring_is_not_watched_and_the_watch_starts_again_once_joined():
    """A ring's init may hold the interpreter while it waits for its peers: no answer comes, and the connect
    limit watches it. Joined, the runner has a whole limit to answer again."""
    cluster, clock = fsm.Cluster(limits=LIMITS), Clock()
    cluster.place("i", "org/m", SLOTS, policy=POLICY)
    driver = fsm.Driver(cluster, Recorder(), clock)
    for _ in range(3):  # downloads, creations, connects (`test_driver`'s watchdog test)
        driver.reconcile()
        for op in driver.owed():
            if op.report is fsm.Report.DOWNLOAD:
                driver.downloaded(op.key, op.model_id)
    cluster.heard("i/0", 1, clock.now)
    cluster.listened("i/0", 1, clock.now)
    assert cluster.runner("i/0").phase is fsm.RunnerPhase.JOINING
    clock.now += 10 * LIMIT
    assert not cluster.listened("i/0", 1, clock.now)
    assert not any(isinstance(a, fsm.FailUnresponsive) and a.runner_id == "i/0" for a in driver.reconcile().taken)
    driver.report(rn.Connected("i/0", 1))
    clock.now += LIMIT - 0.01
    assert not cluster.listened("i/0", 1, clock.now)  # joined: a whole limit to answer again
    clock.now += 0.01
    assert cluster.listened("i/0", 1, clock.now)


def test_a_stale_incarnation_is_not_heard_and_a_stopping_runner_is_not_watched():
    cluster, clock, driver = ready(SLOTS[:1])
    assert not cluster.heard("i/0", 0, clock.now) and not cluster.heard("i/9", 1, clock.now)
    cluster.heard("i/0", 1, clock.now)
    cluster.listened("i/0", 1, clock.now)
    driver.cluster.execute(fsm.StopRunner("i/0", 1, fsm.StopReason.INSTANCE_GONE), clock.now)
    clock.now += 10 * LIMIT
    assert not cluster.listened("i/0", 1, clock.now)
    assert fsm.plan(cluster.view(), "a", clock.now) == []  # the stop's grace is the caller's here


def test_the_limit_is_validated_like_the_others():
    with pytest.raises(fsm.InvalidConfig, match="heartbeat must be a finite number > 0"):
        fsm.PhaseLimits(heartbeat=0.0)
    with pytest.raises(fsm.InvalidConfig, match="heartbeat must be a finite number > 0"):
        fsm.PhaseLimits(heartbeat=float("inf"))


def test_a_ready_runner_never_heard_is_watched_from_when_its_caller_began_to_listen():
    """A caller that took a Ready runner over from another (a new controller) has heard nothing from it yet;
    stopped, it never answers: it fails a limit after the caller began to listen, not never. A runner still
    starting, never heard, is left to the start's own limits."""
    cluster, clock, driver = ready(SLOTS[:1])
    began = clock.now
    assert not cluster.listened("i/0", 1, began)
    clock.now = began + LIMIT - 0.01
    assert not cluster.listened("i/0", 1, clock.now) and driver.reconcile().taken == ()
    clock.now = began + LIMIT + 0.1
    assert cluster.listened("i/0", 1, clock.now)
    assert [type(a) for a in driver.reconcile().taken][:1] == [fsm.FailUnresponsive]

    starting, starting_clock = fsm.Cluster(limits=LIMITS), Clock()
    starting.place("j", "org/m", SLOTS[:1], policy=POLICY)
    settle(fsm.Driver(starting, Recorder(), starting_clock), starting_clock, until=lambda: "i/0" in starting.runners)
    assert starting.instance("j").instance_state is not fsm.InstanceState.READY
    assert not starting.listened("i/0", 1, 0.0)
    assert not starting.listened("i/0", 1, 100 * LIMIT)  # never heard, not Ready: not this watch's
