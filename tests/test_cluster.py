"""fsm.cluster.Cluster: how runner transitions reach their instance, and its refusals."""

from __future__ import annotations

import pytest

import fsm
from fsm import runner as rn
from fsm.cluster import Cluster
from fsm.world import World

SLOTS = [fsm.Slot(0, "a", "i/0"), fsm.Slot(1, "b", "i/1")]


def two_rank_cluster() -> Cluster:
    cluster = Cluster()
    cluster.place("i", "org/m", SLOTS)
    cluster.execute(fsm.StartGeneration("i", 1), 0.0)
    for slot in SLOTS:
        cluster.execute(fsm.CreateRunner("i", slot.runner_id, slot.node_id, slot.rank, 2, 1, "org/m"), 0.0)
    return cluster


def test_runner_failure_reaches_the_instance_and_reaping_arms_the_backoff():
    cluster = two_rank_cluster()
    cluster.runner_event(rn.Fail("i/1", 1, failure=fsm.Failure.stalled("joining", 5)), 1.0)
    assert cluster.instance("i").instance_state is fsm.InstanceState.RECOVERING
    assert cluster.instance("i").last_failure.kind is fsm.FailureKind.STALL
    cluster.runner_event(rn.Exited("i/1", 1, exit_code=-15), 2.0)
    cluster.execute(fsm.StopRunner("i/0", 1, fsm.StopReason.SIBLING_FAILED), 2.0)
    cluster.runner_event(rn.Exited("i/0", 1, exit_code=0), 3.0)
    machine = cluster.instance("i")
    assert (machine.instance_state, machine.deadline) == (fsm.InstanceState.BACKING_OFF, 5.0)
    assert cluster.runner("i/0").failure is None  # stopped on request: not a failure
    logged = [(e.machine, e.key, e.source, e.target) for e in cluster.log]
    assert ("instance", "i", "recovering", "backing_off") in logged
    assert ("runner", "i/1", "failed", "stopped") in logged


def test_place_refuses_duplicates_and_shared_runner_ids():
    cluster = Cluster()
    cluster.place("i", "org/m", SLOTS)
    with pytest.raises(fsm.InvalidConfig, match="already exists"):
        cluster.place("i", "org/m", SLOTS)
    with pytest.raises(fsm.InvalidConfig, match="runner ids"):
        cluster.place("j", "org/m", SLOTS)
    with pytest.raises(fsm.InvalidConfig, match="ranks"):
        cluster.place("k", "org/m", [fsm.Slot(1, "a", "k/1")])
    assert list(cluster.instances) == ["i"]


def test_create_refuses_a_second_live_incarnation():
    cluster = two_rank_cluster()
    cluster.instance_event(fsm.instance.Resume("i", 1.0))  # generation 2 starts while generation 1 lives
    with pytest.raises(fsm.InvalidEvent, match="alive"):
        cluster.execute(fsm.CreateRunner("i", "i/0", "a", 0, 2, 2, "org/m"), 1.0)
    assert cluster.runner("i/0").incarnation == 1


def test_create_against_a_pending_instance_refuses_first_and_changes_nothing():
    cluster = Cluster()
    cluster.place("i", "org/m", SLOTS)
    before = cluster.to_dict()
    with pytest.raises(fsm.InvalidEvent, match="pending"):
        cluster.execute(fsm.CreateRunner("i", "i/0", "a", 0, 2, 1, "org/m"), 0.0)
    assert cluster.to_dict() == before and cluster.log == []


def test_a_late_create_after_the_generation_ended_is_not_accepted_and_leaves_no_phantom():
    cluster = two_rank_cluster()
    cluster.delete("i", 1.0)
    del cluster.log[:]
    before = cluster.to_dict()
    outcome = cluster.execute(fsm.CreateRunner("i", "i/0", "a", 0, 2, 1, "org/m"), 2.0)
    assert not outcome.accepted
    assert cluster.to_dict() == before and cluster.log == []

    torn_down = Cluster()
    torn_down.place("j", "org/m", [fsm.Slot(0, "a", "j/0"), fsm.Slot(1, "a", "j/1")])
    torn_down.execute(fsm.StartGeneration("j", 1), 0.0)
    torn_down.execute(fsm.CreateRunner("j", "j/0", "a", 0, 2, 1, "org/m"), 0.0)
    torn_down.runner_event(rn.Exited("j/0", 1, exit_code=-9), 1.0)  # gen 1 fails and is reaped: backing off
    late = torn_down.execute(fsm.CreateRunner("j", "j/1", "a", 1, 2, 1, "org/m"), 1.5)
    assert not late.accepted and "j/1" not in torn_down.runners  # no phantom Idle runner
    assert torn_down.instance("j").instance_state is fsm.InstanceState.BACKING_OFF
    world = World(torn_down, ["a"], 1.5)
    world.settle()
    assert torn_down.instance("j").instance_state is fsm.InstanceState.READY  # and it starts again


def _completed_download(cluster: Cluster, node: str, failures: int) -> None:
    for n in range(failures):
        cluster.execute(fsm.StartDownload(node, "org/m"), float(n * 100))
        cluster.download_event(node, fsm.download.DownloadFailed("org/m", float(n * 100), "offline"))
    cluster.execute(fsm.StartDownload(node, "org/m"), 1000.0)
    cluster.download_event(node, fsm.download.Complete("org/m", 1000.0))


def test_a_load_the_runner_refuses_does_not_reset_the_download_backoff():
    cluster = two_rank_cluster()  # runners Idle, multi-rank: `load` is refused before they join
    _completed_download(cluster, "a", failures=2)
    with pytest.raises(fsm.IllegalTransition):
        cluster.execute(fsm.LoadModel("i/0", 1, "org/m"), 1001.0)
    assert cluster.downloads[("a", "org/m")].attempts == 2  # the files never proved good

    cluster.runner_event(rn.Connect("i/0", 1), 1001.0)
    cluster.runner_event(rn.Connected("i/0", 1), 1001.0)
    cluster.execute(fsm.LoadModel("i/0", 1, "org/m"), 1002.0)
    assert cluster.downloads[("a", "org/m")].attempts == 0  # a real load start resets it


def test_a_load_before_the_download_completed_is_refused_and_changes_nothing():
    cluster = two_rank_cluster()
    cluster.runner_event(rn.Connect("i/0", 1), 1.0)
    cluster.runner_event(rn.Connected("i/0", 1), 1.0)
    before = cluster.to_dict()
    with pytest.raises(fsm.InvalidEvent, match="download"):
        cluster.execute(fsm.LoadModel("i/0", 1, "org/m"), 2.0)
    assert cluster.to_dict() == before


def test_a_failure_while_stopping_on_request_costs_the_instance_nothing():
    cluster = two_rank_cluster()
    cluster.runner_event(rn.Exited("i/1", 1, exit_code=-9), 1.0)  # one retry charged for this generation
    cluster.execute(fsm.StopRunner("i/0", 1, fsm.StopReason.SIBLING_FAILED), 1.0)
    fatal = fsm.Failure.exception("FileNotFoundError", "model.safetensors", retryable=False)
    cluster.runner_event(rn.Fail("i/0", 1, failure=fatal), 1.5)
    assert cluster.runner("i/0").runner_state is fsm.RunnerState.FAILED  # recorded on the runner
    cluster.runner_event(rn.Exited("i/0", 1, exit_code=1), 2.0)
    machine = cluster.instance("i")
    assert (machine.instance_state, machine.attempts) == (fsm.InstanceState.BACKING_OFF, 1)
    assert machine.delete_reason is None


def test_an_exit_that_beat_our_stop_is_the_runners_failure_but_charges_nothing_more():
    cluster = two_rank_cluster()
    cluster.runner_event(rn.Exited("i/1", 1, exit_code=-9), 1.0)
    cluster.execute(fsm.StopRunner("i/0", 1, fsm.StopReason.SIBLING_FAILED), 1.0)
    cluster.runner_event(rn.Exited("i/0", 1, exit_code=3, detail="boom", stop_delivered=False), 1.2)
    runner = cluster.runner("i/0")
    assert not runner.alive and runner.failure == fsm.Failure.exited(3, "boom")
    machine = cluster.instance("i")
    assert (machine.instance_state, machine.attempts) == (fsm.InstanceState.BACKING_OFF, 1)


def test_forget_only_a_deleted_instance_without_live_runners():
    cluster = two_rank_cluster()
    with pytest.raises(fsm.InvalidConfig, match="not deleted"):
        cluster.forget("i")
    cluster.delete("i", 1.0)
    with pytest.raises(fsm.InvalidConfig, match="live runners"):
        cluster.forget("i")
    for rid in ("i/0", "i/1"):
        cluster.execute(fsm.StopRunner(rid, 1, fsm.StopReason.INSTANCE_GONE), 1.0)
        cluster.runner_event(rn.Exited(rid, 1, exit_code=0), 1.0)
    cluster.forget("i")
    assert cluster.instances == {} and cluster.runners == {}
    cluster.place("i", "org/m", SLOTS)  # a fresh placement starts with a fresh budget
    assert cluster.instance("i").attempts == 0


def test_round_trip_through_dict():
    cluster = two_rank_cluster()
    cluster.execute(fsm.StartDownload("a", "org/m"), 0.5)
    restored = Cluster.from_dict(cluster.to_dict())
    assert restored.to_dict() == cluster.to_dict()
    assert restored.view() == cluster.view()


def test_snapshot_with_impossible_values_is_a_snapshot_error():
    data = fsm.RunnerLifecycle("r").to_dict()
    with pytest.raises(fsm.SnapshotError, match="rank"):
        fsm.RunnerLifecycle.from_dict({**data, "rank": 3})


def test_recover_after_a_daemon_restart_charges_no_retry():
    cluster = two_rank_cluster()
    for rid in ("i/0", "i/1"):
        cluster.runner_event(rn.Connect(rid, 1), 0.5)
    restored = Cluster.from_dict(cluster.to_dict())
    restored.recover(now=10.0)
    machine = restored.instance("i")
    assert (machine.instance_state, machine.generation, machine.attempts) == (fsm.InstanceState.STARTING, 2, 0)
    assert all(not restored.runner(rid).alive and restored.runner(rid).failure is None for rid in ("i/0", "i/1"))
    actions = fsm.plan(restored.view(), "a", 10.0)
    assert fsm.CreateRunner("i", "i/0", "a", 0, 2, 2, "org/m") in actions


def test_recover_mid_recovery_finishes_the_teardown_and_keeps_the_deadline_rule():
    cluster = two_rank_cluster()
    cluster.runner_event(rn.Exited("i/1", 1, exit_code=-9), 1.0)  # rank 1 died; rank 0 still alive
    restored = Cluster.from_dict(cluster.to_dict())
    restored.recover(now=4.0)
    machine = restored.instance("i")
    assert (machine.instance_state, machine.attempts, machine.deadline) == (fsm.InstanceState.BACKING_OFF, 1, 6.0)
