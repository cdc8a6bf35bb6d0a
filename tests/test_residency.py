"""Residency (issue #29): an instance can be parked, and is brought back by a request.

What this file proves, layer by layer:

* the machine (`fsm.instance`): Ready → Parking → Parked → Pending (waking) → … → Ready, no retry spent
  on the way; park refused while busy or while a failed generation is retried, ignored once parking or
  parked; unpark ignored unless parked, refused while parking; a rank failing while parking costs nothing;
  give_up only where runners would start, whatever the budget;
* the cluster and its simulated world (`fsm.cluster`, `fsm.world`): a request's start and end set
  ``last_used``; an instance idle for its keep-alive is parked by the plan (never one with a request in
  flight or waiting; never one kept forever), its runners stopped as PARKED; a request for it unparks it
  and is served by a new generation; `Cluster.hold` overrides the keep-alive until the next request;
  keep-alives and ``last_used`` survive a snapshot, and bad ones are refused naming the field;
* the plan: nothing is created on a node while another instance there is still parking; nothing is
  downloaded for a parked instance;
* admission (`fsm.admit`): eviction names the least recently used idle instances with a finite keep-alive,
  only as many as needed; parked instances reserve nothing; `admit_unpark` fits a parked instance back on
  its nodes, evicting if it must; and a Hypothesis property holds eviction to fitting, and to LRU order.
"""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fsm
from fsm import Limits, ModelFacts, Refusal, admit, admit_unpark
from fsm import runner as rn
from fsm.admit import MIB
from fsm.cluster import Cluster
from fsm.instance import (
    Delete,
    GiveUp,
    InstanceRetry,
    Park,
    RankCreated,
    RankFailed,
    RankFailedWhileStopping,
    RankReady,
    RankStopped,
    RetryPolicy,
    Start,
    Unpark,
)
from fsm.view import ClusterView, InstanceView, PendingRequest, RetryStatus, RunnerStatus, Slot
from fsm.world import World

S = fsm.InstanceState
CRASH = fsm.Failure.signalled(9)
CORRUPT = fsm.Failure.exception("SafetensorError", "bad header", retryable=False)
NO_FDS = fsm.Failure.host("no file descriptors left to spawn a runner")  # uncharged


# -- the machine ---------------------------------------------------------------------------------------------


def generation(i: InstanceRetry, now: float) -> None:
    """Start the next generation and create every rank."""
    i.apply(Start("inst", now, i.generation + 1))
    for rank in range(i.world_size):
        i.apply(RankCreated("inst", now, i.generation, rank))


def all_ready(i: InstanceRetry, now: float) -> None:
    for rank in range(i.world_size):
        i.apply(RankReady("inst", now, i.generation, rank))


def reap(i: InstanceRetry, now: float) -> None:
    for rank in range(i.world_size):
        i.apply(RankStopped("inst", now, i.generation, rank))


def ready(world_size: int = 2, policy: RetryPolicy | None = None) -> InstanceRetry:
    i = InstanceRetry("inst", world_size=world_size, policy=policy)
    generation(i, 0.0)
    all_ready(i, 1.0)
    assert i.instance_state is S.READY
    return i


def with_history() -> InstanceRetry:
    """Ready at generation 3, after one charged and one uncharged failed generation (attempts 1, uncharged 1)."""
    i = InstanceRetry("inst", world_size=2)
    generation(i, 0.0)
    i.apply(RankFailed("inst", 1.0, 1, 0, failure=CRASH))
    reap(i, 1.0)
    generation(i, i.deadline)
    i.apply(RankFailed("inst", 10.0, 2, 1, failure=NO_FDS))
    reap(i, 10.0)
    generation(i, i.deadline)
    all_ready(i, 20.0)
    assert (i.instance_state, i.generation, i.attempts, i.uncharged) == (S.READY, 3, 1, 1)
    return i


def in_state(leaf: str) -> InstanceRetry:
    """An instance in ``leaf`` (one of the residency-relevant ones)."""
    i = ready()
    if leaf in ("parking", "parked"):
        i.apply(Park("inst", 2.0))
        if leaf == "parked":
            reap(i, 3.0)
    elif leaf in ("recovering", "backing_off"):
        i.apply(RankFailed("inst", 2.0, 1, 0, failure=CRASH))
        if leaf == "backing_off":
            reap(i, 3.0)
    elif leaf == "pending":
        i = InstanceRetry("inst", world_size=2)
    elif leaf == "starting":
        i = InstanceRetry("inst", world_size=2)
        generation(i, 0.0)
    assert i.leaf == leaf
    return i


def test_park_and_unpark_go_round_to_a_new_generation_spending_no_retry():
    i = with_history()
    budget = (i.attempts, i.uncharged)

    out = i.apply(Park("inst", 30.0))
    assert out.accepted and i.instance_state is S.PARKING
    assert (i.attempts, i.uncharged) == budget and i.ready_since is None and not i.waking

    i.apply(RankStopped("inst", 31.0, 3, 0))
    assert i.instance_state is S.PARKING  # rank 1 is still alive
    out = i.apply(RankStopped("inst", 32.0, 3, 1))
    assert i.instance_state is S.PARKED and ("auto", "parking", "parked") in [
        (s.event, s.source, s.target) for s in out.steps
    ]
    assert (i.attempts, i.uncharged) == budget and i.deadline is None

    out = i.apply(Unpark("inst", 40.0))
    assert out.accepted and i.instance_state is S.PENDING and i.waking is True
    assert InstanceRetry.from_dict(i.to_dict()).waking is True  # it survives a snapshot
    assert (i.attempts, i.uncharged) == budget

    generation(i, 41.0)  # no backoff: parking was no failure
    assert (i.instance_state, i.generation, i.waking) == (S.STARTING, 4, True)
    all_ready(i, 42.0)
    assert (i.instance_state, i.waking, i.ready_since) == (S.READY, False, 42.0)
    assert (i.attempts, i.uncharged) == budget


def test_a_pending_instance_parks_at_once_and_a_starting_one_goes_through_parking():
    pending = in_state("pending")
    pending.apply(Park("inst", 1.0))
    assert pending.instance_state is S.PARKED
    starting = in_state("starting")
    starting.apply(Park("inst", 1.0))
    assert starting.instance_state is S.PARKING


def test_park_is_refused_while_requests_are_in_flight_and_changes_nothing():
    i = ready()
    before = i.to_dict()
    with pytest.raises(fsm.IllegalTransition, match="requests are in flight"):
        i.apply(Park("inst", 5.0, busy=2))
    assert i.to_dict() == before
    assert i.apply(Park("inst", 5.0, busy=0)).accepted


@pytest.mark.parametrize("leaf", ["recovering", "backing_off"])
def test_park_is_refused_while_a_failed_generation_is_retried(leaf):
    i = in_state(leaf)
    before = i.to_dict()
    with pytest.raises(fsm.IllegalTransition, match="a failed generation is being retried"):
        i.apply(Park("inst", 5.0))
    assert i.to_dict() == before


@pytest.mark.parametrize("leaf", ["parking", "parked"])
def test_park_is_ignored_once_parking_or_parked(leaf):
    i = in_state(leaf)
    before = i.to_dict()
    out = i.apply(Park("inst", 5.0))
    assert not out.accepted and "already" in out.note
    assert i.to_dict() == before


@pytest.mark.parametrize("leaf", ["pending", "starting", "ready", "recovering", "backing_off"])
def test_unpark_is_ignored_unless_parked(leaf):
    i = in_state(leaf)
    out = i.apply(Unpark("inst", 5.0))
    assert not out.accepted and "not parked" in out.note
    assert i.leaf == leaf and not i.waking


def test_unpark_is_refused_while_parking():
    i = in_state("parking")
    with pytest.raises(fsm.IllegalTransition, match="still being stopped"):
        i.apply(Unpark("inst", 5.0))
    assert i.instance_state is S.PARKING and not i.waking


@pytest.mark.parametrize("event", [RankFailed, RankFailedWhileStopping])
@pytest.mark.parametrize("failure", [CRASH, CORRUPT], ids=["crash", "non_retryable"])
def test_a_rank_failing_while_parking_charges_nothing_and_parking_goes_on(event, failure):
    i = with_history()
    i.apply(Park("inst", 30.0))
    budget = (i.attempts, i.uncharged)
    i.apply(event("inst", 31.0, 3, 0, failure=failure))
    assert i.instance_state is S.PARKING and (i.attempts, i.uncharged) == budget
    reap(i, 32.0)
    assert i.instance_state is S.PARKED and (i.attempts, i.uncharged) == budget
    assert i.deadline is None and i.delete_reason is None


@pytest.mark.parametrize("leaf", ["parking", "parked"])
def test_delete_from_parking_or_parked(leaf):
    i = in_state(leaf)
    i.apply(Delete("inst", 9.0))
    assert i.instance_state is S.DELETED and i.delete_reason is fsm.DeleteReason.REQUESTED and not i.waking


def spent(leaf: str, max_retries: int) -> InstanceRetry:
    """An instance in ``leaf`` whose policy was lowered since to ``max_retries`` (its budget spent)."""
    i = InstanceRetry("inst", world_size=1, policy=RetryPolicy(max_failures=5))
    for _ in range(max_retries):
        generation(i, i.deadline or 0.0)
        i.apply(RankFailed("inst", i.clock, i.generation, 0, failure=CRASH))
        reap(i, i.clock)
    if leaf != "backing_off":
        generation(i, i.deadline)
        all_ready(i, i.clock)
        if leaf in ("parked", "pending"):
            i.apply(Park("inst", i.clock))
            reap(i, i.clock)
        if leaf == "pending":
            i.apply(Unpark("inst", i.clock))
    assert i.leaf == leaf and i.attempts == max_retries
    return InstanceRetry.from_snapshot(i.snapshot(), policy=RetryPolicy(max_failures=max_retries))


@pytest.mark.parametrize("leaf", ["ready", "parked"])
def test_give_up_is_refused_where_no_runner_would_start_even_with_a_spent_budget(leaf):
    i = spent(leaf, 2)
    with pytest.raises(fsm.IllegalTransition, match=f"only where it would start runners, not in {leaf}"):
        i.apply(GiveUp("inst", i.clock + 1))
    assert i.leaf == leaf
    again = InstanceRetry("inst", world_size=1)  # `reload` applies the lowered policy the same way
    again.reload(i.snapshot())
    with pytest.raises(fsm.IllegalTransition):
        again.apply(GiveUp("inst", i.clock + 1))


@pytest.mark.parametrize("leaf", ["backing_off", "pending"])
def test_give_up_is_accepted_where_a_start_would_come_next_with_a_spent_budget(leaf):
    i = spent(leaf, 2)
    assert i.apply(GiveUp("inst", i.clock + 1)).accepted
    assert i.delete_reason is fsm.DeleteReason.RETRIES_EXHAUSTED and not i.waking


# -- the cluster in a simulated world ------------------------------------------------------------------------

TWO = [Slot(0, "a", "i/0"), Slot(1, "b", "i/1")]


def quiet(world: World, max_rounds: int = 200) -> None:
    """Plan, execute and complete until nothing is left to do *now* (`World.settle` would also move time on
    to the next deadline, park_at included)."""
    for _ in range(max_rounds):
        acted = any([world.step(node) for node in world.nodes])
        if not (world.deliver_all() or acted):
            return
    raise AssertionError("no quiescence")


def world_with(keep_alive: float | None = 5.0, slots=TWO) -> World:
    cluster = Cluster()
    cluster.place("i", "org/m", slots, keep_alive=keep_alive)
    world = World(cluster, sorted({s.node_id for s in slots}), 0.0)
    quiet(world)
    assert cluster.instance("i").instance_state is S.READY
    return world


def planned(world: World, now: float) -> list[fsm.Action]:
    view = world.view()
    return [a for node in world.nodes for a in fsm.plan(view, node, now)]


def serve(world: World, request_id: str, start: float, end: float | None) -> None:
    """A request forwarded at ``start`` and finished at ``end`` (None: left in flight)."""
    world.now = start
    world.submit(request_id, "i")
    taken = world.step("a")
    assert any(isinstance(a, fsm.ForwardRequest) and a.request_id == request_id for a in taken), taken
    if end is not None:
        world.now = end
        assert world.deliver_all()


def parks(actions: list[fsm.Action]) -> list[fsm.Action]:
    return [a for a in actions if isinstance(a, fsm.ParkInstance)]


def test_requests_set_last_used_and_an_idle_instance_is_parked_after_its_keep_alive():
    world = world_with(keep_alive=5.0)
    cluster = world.cluster
    assert cluster.instances["i"].last_used is None and world.view().instances["i"].park_at == 0.0 + 5.0

    world.now = 1.0
    world.submit("r1", "i")
    world.step("a")
    assert cluster.instances["i"].last_used == 1.0  # RequestStarted
    world.now = 2.0
    world.deliver_all()
    assert cluster.instances["i"].last_used == 2.0  # RequestFinished

    view = world.view().instances["i"]
    assert (view.keep_alive, view.last_used, view.park_at) == (5.0, 2.0, 7.0)
    assert world.next_time() == 7.0  # next_deadline names park_at
    assert fsm.next_deadline(world.view(), "a", 2.0) == 7.0
    world.advance(6.99)
    assert parks(planned(world, 6.99)) == []
    quiet(world)
    assert cluster.instance("i").instance_state is S.READY

    world.advance(7.0)
    assert fsm.plan(world.view(), "a", 7.0)[0] == fsm.ParkInstance("i", fsm.ParkReason.IDLE)
    assert parks(fsm.plan(world.view(), "b", 7.0)) == []  # the leader (rank 0's node) parks it
    quiet(world)
    machine = cluster.instance("i")
    assert machine.instance_state is S.PARKED and (machine.attempts, machine.uncharged) == (0, 0)
    assert not cluster.has_live_runners("i")
    stops = [a for _, a in world.executed if isinstance(a, fsm.StopRunner)]
    assert sorted(a.runner_id for a in stops) == ["i/0", "i/1"]
    assert {a.reason for a in stops} == {fsm.StopReason.PARKED}
    assert world.view().instances["i"].residency is fsm.Residency.PARKED
    assert world.next_time() is None  # nothing more to wait for: a parked instance waits for a request


def test_a_request_in_flight_keeps_an_instance_loaded_past_its_keep_alive():
    world = world_with(keep_alive=5.0)
    serve(world, "r1", 1.0, None)  # forwarded, never finished
    world.advance(100.0)
    assert parks(planned(world, 100.0)) == []
    assert world.cluster.instance("i").instance_state is S.READY
    assert world.deliver_all()  # it ends at 100: keep-alive counts from there
    assert world.view().instances["i"].park_at == 105.0


def test_a_request_waiting_keeps_an_instance_loaded_past_its_keep_alive():
    world = world_with(keep_alive=5.0)
    world.advance(50.0)
    world.submit("r1", "i")  # in the book, not forwarded yet
    actions = planned(world, 50.0)
    assert parks(actions) == [] and any(isinstance(a, fsm.ForwardRequest) for a in actions)


def test_a_request_for_a_parked_instance_unparks_it_and_a_new_generation_serves_it():
    world = world_with(keep_alive=5.0)
    cluster = world.cluster
    world.advance(5.0)
    quiet(world)
    assert cluster.instance("i").instance_state is S.PARKED

    world.advance(20.0)
    world.submit("r2", "i")
    assert [a for a in fsm.plan(world.view(), "a", 20.0) if isinstance(a, fsm.UnparkInstance)] == [
        fsm.UnparkInstance("i")
    ]
    assert not any(isinstance(a, fsm.UnparkInstance) for a in fsm.plan(world.view(), "b", 20.0))
    world.step("a")
    machine = cluster.instance("i")
    assert machine.instance_state is S.PENDING and machine.waking
    assert world.view().instances["i"].residency is fsm.Residency.UNPARKING
    assert world.view().instances["i"].retry.waking is True

    quiet(world)
    assert (machine.instance_state, machine.generation, machine.waking) == (S.READY, 2, False)
    assert (machine.attempts, machine.uncharged) == (0, 0)
    forwarded = [a for _, a in world.executed if isinstance(a, fsm.ForwardRequest) and a.request_id == "r2"]
    assert forwarded and all(a.incarnation == 2 for a in forwarded)
    assert world.requests == {}
    assert cluster.instances["i"].last_used == 20.0


def test_hold_zero_parks_once_idle_and_the_next_request_brings_back_its_own_keep_alive():
    world = world_with(keep_alive=5.0)
    cluster = world.cluster
    serve(world, "r1", 1.0, None)
    cluster.hold("i", 0.0)  # the request's own keep-alive: unload when done
    assert parks(planned(world, 1.0)) == []  # still in flight
    world.now = 2.0
    world.deliver_all()
    assert world.view().instances["i"].park_at == 2.0
    assert fsm.plan(world.view(), "a", 2.0)[0] == fsm.ParkInstance("i", fsm.ParkReason.IDLE)
    quiet(world)
    assert cluster.instance("i").instance_state is S.PARKED
    assert cluster.instances["i"].keep_alive_now == 0.0  # held until the next request

    world.advance(3.0)
    world.submit("r2", "i")
    quiet(world)
    assert cluster.instance("i").instance_state is S.READY and world.requests == {}
    assert cluster.instances["i"].keep_alive_now == 5.0  # RequestStarted brought back its own
    assert world.view().instances["i"].keep_alive == 5.0
    assert "keep_alive_now" not in cluster.to_dict()["instances"]["i"]


def test_an_instance_kept_forever_is_never_parked():
    world = world_with(keep_alive=None)
    serve(world, "r1", 1.0, 2.0)
    assert world.view().instances["i"].park_at is None
    world.settle()  # every deadline there is: none parks it
    assert world.cluster.instance("i").instance_state is S.READY and world.next_time() is None
    world.advance(1e9)
    assert parks(planned(world, 1e9)) == []
    world.cluster.hold("i", None)
    assert parks(planned(world, 1e9)) == []


def snapshot_cluster() -> Cluster:
    """i: keep-alive 5 held forever by its last request; j: kept forever, held 3 s; k: defaults. Used at 1..4."""
    cluster = Cluster()
    cluster.place("i", "org/m", [Slot(0, "a", "i/0")], keep_alive=5.0, local=True)
    cluster.place("j", "org/m", [Slot(0, "a", "j/0")], local=True)
    cluster.place("k", "org/m", [Slot(0, "a", "k/0")], keep_alive=0.5, local=True)
    world = World(cluster, ["a"], 0.0)
    quiet(world)
    for n, iid in enumerate(["i", "j"]):
        world.now = 1.0 + 2 * n
        world.submit(f"r-{iid}", iid)
        world.step("a")
        world.now += 1.0
        world.deliver_all()
    cluster.hold("i", None)
    cluster.hold("j", 3.0)
    return cluster


def test_a_snapshot_keeps_keep_alives_the_one_in_force_and_last_used():
    cluster = snapshot_cluster()
    data = cluster.to_dict()
    i, j, k = (data["instances"][x] for x in "ijk")
    assert (i["keep_alive"], i["keep_alive_now"], i["last_used"]) == (5.0, None, 2.0)  # None: forever, for now
    assert "keep_alive" not in j and (j["keep_alive_now"], j["last_used"]) == (3.0, 4.0)
    assert k["keep_alive"] == 0.5 and "keep_alive_now" not in k and "last_used" not in k

    restored = Cluster.from_dict(data)
    assert restored.to_dict() == data
    for iid in "ijk":
        a, b = cluster.instances[iid], restored.instances[iid]
        assert (a.keep_alive, a.keep_alive_now, a.last_used) == (b.keep_alive, b.keep_alive_now, b.last_used)
    assert restored.instances["i"].keep_alive == 5.0 and restored.instances["i"].keep_alive_now is None
    view = restored.view().instances
    assert (view["i"].keep_alive, view["i"].park_at) == (None, None)
    assert (view["j"].keep_alive, view["j"].last_used) == (3.0, 4.0)


@pytest.mark.parametrize("field", ["keep_alive", "keep_alive_now", "last_used"])
@pytest.mark.parametrize("value", [-1, -0.5, "5", True, math.inf, math.nan, [5]])
def test_a_snapshot_with_a_bad_keep_alive_or_last_used_is_refused_naming_the_field(field, value):
    data = snapshot_cluster().to_dict()
    data["instances"]["k"][field] = value
    with pytest.raises(fsm.SnapshotError, match=rf"instances\.k\.{field}\b"):
        Cluster.from_dict(data)


@pytest.mark.parametrize("keep_alive", [-1, -0.001, math.inf, -math.inf, math.nan, True, "5"])
def test_place_and_hold_refuse_a_keep_alive_that_is_no_finite_number_of_seconds(keep_alive):
    cluster = Cluster()
    with pytest.raises(fsm.InvalidConfig, match="keep_alive"):
        cluster.place("i", "org/m", TWO, keep_alive=keep_alive)
    assert cluster.instances == {}
    cluster.place("i", "org/m", TWO, keep_alive=1.0)
    with pytest.raises(fsm.InvalidConfig, match="keep_alive"):
        cluster.hold("i", keep_alive)
    assert cluster.instances["i"].keep_alive_now == 1.0


# -- the plan ------------------------------------------------------------------------------------------------


def test_no_runner_starts_on_a_node_where_another_instance_is_still_parking():
    cluster = Cluster()
    cluster.place("p", "org/m", [Slot(0, "a", "p/0")], keep_alive=100.0, local=True)
    world = World(cluster, ["a", "b"], 0.0)
    quiet(world)
    world.now = 1.0
    assert cluster.park("p", 1.0).accepted  # an operator parks it
    cluster.place("n", "org/m", [Slot(0, "a", "n/0"), Slot(1, "b", "n/1")], local=True)
    for node in world.nodes:
        world.step(node)  # stops p/0 (its exit now owed), starts n's generation
    assert cluster.instance("p").instance_state is S.PARKING
    assert cluster.instance("n").instance_state is S.STARTING
    for _ in range(3):
        for node in world.nodes:
            world.step(node)
    created = [a for _, a in world.executed if isinstance(a, fsm.CreateRunner) and a.instance_id == "n"]
    assert [a.node_id for a in created] == ["b"]  # b has no parking instance; a waits
    assert not any(isinstance(a, fsm.CreateRunner) for a in fsm.plan(world.view(), "a", 1.0))

    world.deliver_all()  # p/0 is reaped (and b's runner does what it was told)
    assert cluster.instance("p").instance_state is S.PARKED
    assert fsm.CreateRunner("n", "n/0", "a", 0, 2, 1, "org/m") in fsm.plan(world.view(), "a", 1.0)
    quiet(world)
    assert cluster.instance("n").instance_state is S.READY and cluster.instance("p").instance_state is S.PARKED


def test_the_parking_gate_by_hand_and_nothing_is_downloaded_for_a_parked_instance():
    parking = InstanceView("p", "org/p", (Slot(0, "a", "p/0"),), RetryStatus(S.PARKING, generation=1))
    new = InstanceView("n", "org/n", (Slot(0, "a", "n/0"),), RetryStatus(S.STARTING, generation=1))
    p0 = RunnerStatus("p/0", "p", "a", 0, 1, rn.RunnerState.SHUTDOWN, rn.RunnerPhase.STOPPING, stop_requested=True)
    done = [fsm.DownloadStatus("a", m, fsm.DownloadState.COMPLETED) for m in ("org/p", "org/n")]
    view = ClusterView.build(instances=[parking, new], runners=[p0], downloads=done)
    assert not any(isinstance(a, fsm.CreateRunner) for a in fsm.plan(view, "a", 0.0))

    parked = attrs.evolve(parking, retry=RetryStatus(S.PARKED, generation=1))
    reaped = attrs.evolve(p0, phase=rn.RunnerPhase.STOPPED)
    view = ClusterView.build(instances=[parked, new], runners=[reaped], downloads=done)
    assert [a for a in fsm.plan(view, "a", 0.0) if isinstance(a, fsm.CreateRunner)] == [
        fsm.CreateRunner("n", "n/0", "a", 0, 1, 1, "org/n")
    ]

    for state in (S.PARKING, S.PARKED):  # no download for it, even never started
        alone = attrs.evolve(parking, retry=RetryStatus(state, generation=1))
        assert not any(
            isinstance(a, fsm.StartDownload) for a in fsm.plan(ClusterView.build(instances=[alone]), "a", 0.0)
        )
    pending = attrs.evolve(parking, retry=RetryStatus(S.PENDING, generation=1))  # control: one unparked does
    assert fsm.StartDownload("a", "org/p") in fsm.plan(ClusterView.build(instances=[pending]), "a", 0.0)


def test_no_runner_starts_on_a_node_where_a_deleted_instance_still_has_a_process():
    """Found by the two-instance model checker (invariant 15): a rank reported an error that spent the last retry,
    the instance was deleted, admission gave its memory to a new placement at once, and the new instance's runner
    was created on the node while the failed one was still being stopped there."""
    gone = InstanceView("d", "org/d", (Slot(0, "a", "d/0"), Slot(1, "b", "d/1")), RetryStatus(S.DELETED, generation=1))
    new = InstanceView("n", "org/n", (Slot(0, "a", "n/0"), Slot(1, "b", "n/1")), RetryStatus(S.STARTING, generation=1))
    d0 = RunnerStatus("d/0", "d", "a", 0, 1, rn.RunnerState.SHUTDOWN, rn.RunnerPhase.STOPPING, stop_requested=True)
    d1 = RunnerStatus("d/1", "d", "b", 1, 1, rn.RunnerState.SHUTDOWN, rn.RunnerPhase.STOPPED, stop_requested=True)
    done = [fsm.DownloadStatus(node, "org/n", fsm.DownloadState.COMPLETED) for node in ("a", "b")]

    def created(node: str, *runners: RunnerStatus) -> list[fsm.Action]:
        view = ClusterView.build(instances=[gone, new], runners=list(runners), downloads=done)
        return [a for a in fsm.plan(view, node, 0.0) if isinstance(a, fsm.CreateRunner)]

    assert created("a", d0, d1) == []  # d/0 still runs on a
    assert created("b", d0, d1) == [fsm.CreateRunner("n", "n/1", "b", 1, 2, 1, "org/n")]  # d/1 is reaped on b
    reaped = attrs.evolve(d0, phase=rn.RunnerPhase.STOPPED)
    assert created("a", reaped, d1) == [fsm.CreateRunner("n", "n/0", "a", 0, 2, 1, "org/n")]


# -- admission -----------------------------------------------------------------------------------------------

GIB = 1024 * MIB
LIMITS = Limits(runners_per_node=8, ranks_per_instance=6, instances_per_model=8, runner_floor_bytes=512 * MIB)
NODE = {"node-x": 2 * GIB}  # four ranks of 512 MiB (a model unknown until downloaded: only the floor)


def resident(
    iid: str,
    last_used: float | None,
    *,
    nodes: tuple[str, ...] = ("node-x",),
    keep_alive: float | None = 60.0,
    state: fsm.InstanceState = S.READY,
    in_flight: int = 0,
) -> tuple[InstanceView, list[RunnerStatus]]:
    """A placed instance of its own model ``org/<iid>``, with its current runners (busy: ``in_flight``)."""
    slots = tuple(Slot(r, node, f"{iid}/{r}") for r, node in enumerate(nodes))
    retry = RetryStatus(state, generation=1, ready_since=0.0)
    view = InstanceView(iid, f"org/{iid}", slots, retry, keep_alive=keep_alive, last_used=last_used)
    runners = []
    if state is S.READY:
        phase = rn.RunnerPhase.BUSY if in_flight else rn.RunnerPhase.AVAILABLE
        runners = [
            RunnerStatus(s.runner_id, iid, s.node_id, s.rank, 1, rn.RunnerState.READY, phase, in_flight=in_flight)
            for s in slots
        ]
    return view, runners


def cluster_of(*instances: tuple[InstanceView, list[RunnerStatus]], waiting: tuple[str, ...] = ()) -> ClusterView:
    return ClusterView.build(
        instances=[v for v, _ in instances],
        runners=[r for _, rs in instances for r in rs],
        requests=[PendingRequest(f"req-{iid}", iid) for iid in waiting],
    )


def ask(ranks: int, view: ClusterView, *, evict: bool = True, nodes=NODE, model=None, facts=None) -> fsm.Admission:
    return admit("org/new", ranks, model=model, view=view, nodes=nodes, limits=LIMITS, facts=facts, evict=evict)


FULL = (resident("i30", 30.0), resident("i10", 10.0), resident("i40", 40.0), resident("i20", 20.0))


def test_eviction_names_the_least_recently_used_idle_instances_only_as_many_as_needed():
    view = cluster_of(*FULL)
    assert ask(1, view) == fsm.Admission(nodes=("node-x",), evict=("i10",))
    assert ask(2, view) == fsm.Admission(nodes=("node-x", "node-x"), evict=("i10", "i20"))
    assert ask(4, view).evict == ("i10", "i20", "i30", "i40")


def test_without_eviction_a_full_node_refuses_as_before():
    answer = ask(1, cluster_of(*FULL), evict=False)
    assert answer.refusal is Refusal.NO_MEMORY and answer.evict == () and "node-x" in answer.message


def test_eviction_never_takes_a_busy_or_waited_for_or_forever_instance():
    view = cluster_of(
        resident("i10", 10.0, in_flight=1),  # a request in flight
        resident("i20", 20.0),  # a request waits for it
        resident("i30", 30.0, keep_alive=None),  # kept forever
        resident("i40", 40.0),
        waiting=("i20",),
    )
    assert ask(1, view).evict == ("i40",)
    refused = ask(2, view)  # only i40 may go: one rank's room
    assert refused.refusal is Refusal.NO_MEMORY and refused.evict == () and refused.nodes == ()


def test_eviction_gives_back_an_older_instance_that_a_newer_one_frees_enough_without():
    # i10 holds one rank, i20 two: two ranks need i20 alone (i10 first, then i20, then i10 given back)
    view = cluster_of(resident("i10", 10.0), resident("i20", 20.0, nodes=("node-x", "node-x")), resident("i30", 30.0))
    assert ask(2, view).evict == ("i20",)


def test_a_parked_instance_reserves_no_memory():
    parked = resident("i10", 10.0, state=S.PARKED)
    view = cluster_of(parked, *FULL[:1], *FULL[2:])  # i10 parked, three ready: one rank of room
    assert ask(1, view, evict=False) == fsm.Admission(nodes=("node-x",))
    assert ask(1, view) == fsm.Admission(nodes=("node-x",))  # no eviction needed
    assert ask(2, view).evict == ("i20",)  # a parked instance is never evicted again
    parking = resident("i10", 10.0, state=S.PARKING)
    assert ask(1, cluster_of(parking, *FULL[:1], *FULL[2:]), evict=False).admitted


def test_admit_unpark_fits_back_on_its_nodes_evicts_if_it_must_and_refuses_naming_the_node():
    two = {"node-x": 2 * GIB, "node-y": 2 * GIB}
    p = resident("p", 5.0, nodes=("node-y", "node-x"), state=S.PARKED)

    room = cluster_of(p, resident("i10", 10.0), resident("i20", 20.0))
    assert admit_unpark("p", model=None, view=room, nodes=two, limits=LIMITS) == fsm.Admission(
        nodes=("node-y", "node-x")
    )

    x_full = cluster_of(p, *FULL)  # node-x full of idle instances, node-y empty
    assert admit_unpark("p", model=None, view=x_full, nodes=two, limits=LIMITS) == fsm.Admission(
        nodes=("node-y", "node-x"), evict=("i10",)
    )
    without = admit_unpark("p", model=None, view=x_full, nodes=two, limits=LIMITS, evict=False)
    assert without.refusal is Refusal.NO_MEMORY

    stuck = cluster_of(p, *(resident(f"f{n}", float(n), keep_alive=None) for n in range(4)))
    answer = admit_unpark("p", model=None, view=stuck, nodes=two, limits=LIMITS)
    assert answer.refusal is Refusal.NO_MEMORY and answer.evict == ()
    assert "node-x has 0 MiB free" in answer.message and "node-y" not in answer.message


# -- a property of eviction --------------------------------------------------------------------------------

PROPERTY_LIMITS = Limits(runners_per_node=4, ranks_per_instance=3, instances_per_model=8, runner_floor_bytes=512 * MIB)
WEIGHTS = (0, 512 * MIB, GIB)


@st.composite
def clusters(draw):
    nodes = {
        f"n{i}": units * 512 * MIB for i, units in enumerate(draw(st.lists(st.integers(1, 8), min_size=1, max_size=3)))
    }
    count = draw(st.integers(0, 8))
    used = draw(st.lists(st.integers(0, 1000), min_size=count, max_size=count, unique=True))
    instances, facts = [], {}
    for n, last in enumerate(used):
        ranks = draw(st.integers(1, 2))
        where = tuple(draw(st.sampled_from(sorted(nodes))) for _ in range(ranks))
        state = draw(st.sampled_from([S.READY, S.READY, S.READY, S.PARKED, S.BACKING_OFF]))
        keep_alive = draw(st.one_of(st.none(), st.floats(0, 600)))
        busy = draw(st.sampled_from(["idle", "idle", "in_flight", "waiting"]))
        in_flight = 1 if busy == "in_flight" and state is S.READY else 0
        made = resident(f"i{n}", float(last), nodes=where, keep_alive=keep_alive, state=state, in_flight=in_flight)
        instances.append((made, busy == "waiting"))
        facts[f"org/i{n}"] = ModelFacts(24, 14, 2, pipeline=True, weight_bytes=draw(st.sampled_from(WEIGHTS)))
    view = cluster_of(*(i for i, _ in instances), waiting=tuple(i[0].instance_id for i, w in instances if w))
    new = draw(st.sampled_from([None, *(ModelFacts(24, 14, 2, pipeline=True, weight_bytes=w) for w in WEIGHTS)]))
    return nodes, view, facts, new, draw(st.integers(1, 3))


def parked_view(view: ClusterView, iids) -> ClusterView:
    """``view`` with the instances ``iids`` parked (their runners gone)."""
    iids = set(iids)
    instances = [
        attrs.evolve(i, retry=attrs.evolve(i.retry, state=S.PARKED)) if i.instance_id in iids else i
        for i in view.instances.values()
    ]
    runners = [r for r in view.runners.values() if r.instance_id not in iids]
    return ClusterView.build(instances=instances, runners=runners, requests=list(view.requests))


def evictable_ids(view: ClusterView) -> list[str]:
    """Ready, nothing in flight or waiting, a finite keep-alive: oldest use first."""
    waiting = {r.instance_id for r in view.requests}
    busy = {r.instance_id for r in view.runners.values() if r.alive and r.in_flight}
    ok = [
        i
        for i in view.instances.values()
        if i.retry.state is S.READY and i.keep_alive is not None and i.instance_id not in waiting | busy
    ]
    return [i.instance_id for i in sorted(ok, key=lambda i: i.last_used)]


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_eviction_parks_only_evictable_instances_and_exactly_enough_of_them_oldest_first(case):
    nodes, view, facts, model, ranks = case

    def fits(parked: set[str]) -> fsm.Admission:
        v = parked_view(view, parked)
        return admit("org/new", ranks, model=model, view=v, nodes=nodes, limits=PROPERTY_LIMITS, facts=facts)

    plain = fits(set())
    answer = admit(
        "org/new", ranks, model=model, view=view, nodes=nodes, limits=PROPERTY_LIMITS, facts=facts, evict=True
    )
    candidates = evictable_ids(view)
    if plain.admitted:  # what fits evicts nothing
        assert answer == plain
        return
    if not answer.admitted:  # refused only when parking every candidate would not do either
        assert answer.evict == () and not fits(set(candidates)).admitted
        return
    evicted = set(answer.evict)
    assert answer.evict and len(evicted) == len(answer.evict)
    assert evicted <= set(candidates)  # Ready, idle, finite keep-alive
    assert list(answer.evict) == [c for c in candidates if c in evicted]  # least recently used first
    assert fits(evicted) == fsm.Admission(nodes=answer.nodes)  # parked, they make room for it, where it said
    for e in evicted:
        assert not fits(evicted - {e}).admitted  # each one is needed
        view_e = view.instances[e]
        for c in candidates:  # an older idle one it kept would not have done instead
            if c not in evicted and view.instances[c].last_used < view_e.last_used:
                assert not fits(evicted - {e} | {c}).admitted, (e, c)


def test_a_runner_is_not_created_while_another_instance_parks_on_its_node_even_from_a_stale_plan():
    """The plan's rule, held by the machines at execution: found by the two-instance Hypothesis test, where one
    plan's round parked an instance (its keep-alive run out) and created the other's runner in the same breath."""
    cluster = fsm.Cluster()
    cluster.place("a", "org/a", [fsm.Slot(0, "n0", "a/0")], local=True)
    cluster.place("b", "org/b", [fsm.Slot(0, "n0", "b/0")], local=True)
    world = World(cluster, ["n0"])
    quiet(world)
    assert cluster.instance("a").instance_state is fsm.InstanceState.READY
    cluster.delete("b", world.now)  # b again, from scratch, while a parks
    cluster.place("c", "org/c", [fsm.Slot(0, "n0", "c/0")], local=True)
    cluster.execute(fsm.StartGeneration("c", 1), world.now)
    cluster.park("a", world.now)
    create = fsm.CreateRunner("c", "c/0", "n0", 0, 1, 1, "org/c")
    refused = cluster.execute(create, world.now)
    assert not refused.accepted and "'a' is still parking on 'n0'" in refused.note
    assert "c/0" not in cluster.runners
    cluster.runner_event(fsm.runner.Stop("a/0", 1), world.now)  # a's runner is stopped and reaped: a is parked
    cluster.runner_event(fsm.runner.Exited("a/0", 1, exit_code=0), world.now)
    assert cluster.instance("a").instance_state is fsm.InstanceState.PARKED
    assert cluster.execute(create, world.now).accepted
