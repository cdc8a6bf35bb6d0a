"""fsm.cluster.Cluster: how runner transitions reach their instance, and its refusals."""

from __future__ import annotations

import attrs
import pytest

import fsm
from fsm import download as dl
from fsm import runner as rn
from fsm.cluster import Cluster, LogEntry
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


@pytest.mark.parametrize("fatal", [False, True])
def test_a_rank_that_died_before_our_stop_is_the_cause_its_peers_lost_connection_only_reported(fatal):
    cluster = two_rank_cluster()
    lost = fsm.Failure.peer_lost("RuntimeError: [ring] connection to a peer was lost")
    cluster.runner_event(rn.Fail("i/0", 1, failure=lost), 1.0)  # rank 0 reports first: one retry charged
    cluster.execute(fsm.StopRunner("i/1", 1, fsm.StopReason.SIBLING_FAILED), 1.0)
    if fatal:  # even a cause that would end the instance costs nothing once we were stopping it
        cause = fsm.Failure.exception("FileNotFoundError", "model.safetensors", retryable=False)
        cluster.runner_event(rn.Fail("i/1", 1, failure=cause), 1.1)
        cluster.runner_event(rn.Exited("i/1", 1, exit_code=1), 1.2)
    else:  # killed before our stop reached it
        cause = fsm.Failure.signalled(9)
        cluster.runner_event(rn.Exited("i/1", 1, exit_code=-9, stop_delivered=False), 1.2)
    machine = cluster.instance("i")
    assert (machine.leaf, machine.attempts, machine.delete_reason) == ("recovering", 1, None)
    assert machine.last_failure == cause


def test_forget_only_a_deleted_instance_without_live_runners():
    cluster = two_rank_cluster()
    with pytest.raises(fsm.InvalidConfig, match="not deleted"):
        cluster.forget("i")
    failed = fsm.Failure.exception("RuntimeError", "boom", retryable=True)
    cluster.runner_event(rn.Fail("i/0", 1, failure=failed), 0.5)  # a retry spent: the budget forget must drop
    assert cluster.instance("i").attempts == 1
    cluster.delete("i", 1.0)
    with pytest.raises(fsm.InvalidConfig, match="live runners"):
        cluster.forget("i")
    for rid in ("i/0", "i/1"):
        cluster.execute(fsm.StopRunner(rid, 1, fsm.StopReason.INSTANCE_GONE), 1.0)
        cluster.runner_event(rn.Exited(rid, 1, exit_code=0), 1.0)
    cluster.forget("i")
    assert cluster.instances == {} and cluster.runners == {}
    cluster.place("i", "org/m", SLOTS)  # a fresh placement starts with a fresh budget, in a first generation
    assert (cluster.instance("i").attempts, cluster.instance("i").generation) == (0, 0)
    assert cluster.runners == {}


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
    for node in ("a", "b"):  # the model is on both nodes: runners wait for nothing else
        restored.execute(fsm.StartDownload(node, "org/m"), 10.0)
        restored.download_event(node, dl.Complete("org/m", 10.0))
    actions = fsm.plan(restored.view(), "a", 10.0)
    assert fsm.CreateRunner("i", "i/0", "a", 0, 2, 2, "org/m") in actions


def test_recover_mid_recovery_finishes_the_teardown_and_keeps_the_deadline_rule():
    cluster = two_rank_cluster()
    cluster.runner_event(rn.Exited("i/1", 1, exit_code=-9), 1.0)  # rank 1 died; rank 0 still alive
    restored = Cluster.from_dict(cluster.to_dict())
    restored.recover(now=4.0)
    machine = restored.instance("i")
    assert (machine.instance_state, machine.attempts, machine.deadline) == (fsm.InstanceState.BACKING_OFF, 1, 6.0)


# -- snapshots: Cluster.from_dict refuses what no cluster could be, naming the field ----------------


def snapshot_data() -> dict:
    """Two instances (i: ranks on a and b; j: one rank on a), their runners, and downloads on two nodes."""
    cluster = two_rank_cluster()
    cluster.place("j", "org/m", [fsm.Slot(0, "a", "j/0")])
    cluster.execute(fsm.StartGeneration("j", 1), 0.0)
    cluster.execute(fsm.CreateRunner("j", "j/0", "a", 0, 1, 1, "org/m"), 0.0)
    cluster.execute(fsm.StartDownload("a", "org/m"), 0.5)
    cluster.execute(fsm.StartDownload("b", "org/m"), 0.5)
    return cluster.to_dict()


def _share_runner_id(data: dict) -> None:
    data["instances"]["j"]["slots"][0]["runner_id"] = "i/1"
    del data["runners"]["j/0"]


def _add_slot(data: dict) -> None:
    data["instances"]["i"]["slots"].append({"rank": 2, "node_id": "c", "runner_id": "i/2"})


BAD_SNAPSHOTS = [
    (lambda d: d.update(bogus=1), r"^unknown keys \['bogus'\]"),
    (lambda d: d.pop("runners"), r"^runners: missing"),
    (lambda d: d["instances"]["i"].pop("model_id"), r"^instances\.i: missing keys \['model_id'\]"),
    (lambda d: d["instances"]["i"].update(extra=1), r"^instances\.i: unknown keys \['extra'\]"),
    (lambda d: d.update(instances=[]), r"^instances: expected a dict keyed by id"),
    (lambda d: d["instances"].update({1: d["instances"]["j"]}), r"^instances: expected a dict keyed by id"),
    (lambda d: d["instances"]["i"]["machine"].update(instance_id="a"), r"instances\.i\.machine\.instance_id"),
    (lambda d: d["instances"]["i"]["machine"].update(instance_id="z"), r"instances\.i\.machine\.instance_id"),
    (lambda d: d["instances"]["i"]["slots"].pop(), r"instances\.i\.machine\.world_size: 2, but 1 slots"),
    (_add_slot, r"instances\.i\.machine\.world_size: 2, but 3 slots"),
    (_share_runner_id, r"instances\.j\.slots: runner id 'i/1' is also in instance 'i'"),
    (lambda d: d["instances"]["i"]["slots"][1].update(rank=0), r"^instances\.i\.slots: .*rank"),
    (lambda d: d["instances"]["i"]["slots"][1].update(rank="1"), r"^instances\.i\.slots: .*rank.*expected an int"),
    (lambda d: d["instances"]["i"]["slots"].append(5), r"^instances\.i\.slots: "),
    (lambda d: d["instances"]["i"]["machine"].update(clock=float("nan")), r"^instances\.i\.machine: "),
    (lambda d: d["runners"]["i/0"].update(instance_id=5), r"^runners\.i/0\.instance_id: expected a str"),
    (lambda d: d["runners"]["i/0"].update(node_id=5), r"^runners\.i/0\.node_id: expected a str"),
    (lambda d: d["runners"]["i/0"].update(instance_id="zzz"), r"^runners\.i/0\.instance_id: no instance 'zzz'"),
    (lambda d: d["runners"]["i/0"].update(instance_id="j"), r"^runners\.i/0: 'i/0' is in no slot of instance 'j'"),
    (lambda d: d["runners"]["i/1"].update(node_id="a"), r"^runners\.i/1\.node_id: 'a', but its slot is on 'b'"),
    (lambda d: d["runners"]["i/1"].update(node_id="c"), r"^runners\.i/1\.node_id: 'c', but its slot is on 'b'"),
    (lambda d: d["runners"]["i/1"]["machine"].update(runner_id="i/0"), r"^runners\.i/1\.machine\.runner_id"),
    (lambda d: d["runners"]["i/1"]["machine"].update(runner_id="i/2"), r"^runners\.i/1\.machine\.runner_id"),
    (lambda d: d["runners"]["i/1"]["machine"].update(rank=0), r"^runners\.i/1\.machine\.rank: 0, but"),
    (lambda d: d["runners"]["i/0"]["machine"].update(rank=1), r"^runners\.i/0\.machine\.rank: 1, but"),
    (lambda d: d["runners"]["i/1"]["machine"].update(world_size=3), r"^runners\.i/1\.machine\.world_size: 3"),
    (lambda d: d["runners"]["i/1"]["machine"].update(incarnation=7), r"^runners\.i/1\.machine\.incarnation: 7"),
    (lambda d: d["runners"]["i/1"]["machine"].update(in_flight=-1), r"^runners\.i/1\.machine: "),
    (lambda d: d["downloads"].append(d["downloads"][0]), r"^downloads\[2\]: a second download of 'org/m' on 'a'"),
    (lambda d: d["downloads"][1].update(node_id=None), r"^downloads\[1\]\.node_id: expected a str"),
    (lambda d: d["downloads"][0]["machine"].update(attempts=-1), r"^downloads\[0\]\.machine: "),
    (lambda d: d.update(downloads={}), r"^downloads: expected a list"),
]


@pytest.mark.parametrize(("edit", "message"), BAD_SNAPSHOTS)
def test_a_snapshot_no_cluster_could_be_is_refused_naming_the_field(edit, message):
    data = snapshot_data()
    edit(data)
    with pytest.raises(fsm.SnapshotError, match=message):
        Cluster.from_dict(data)


def test_a_snapshot_with_runners_of_an_older_generation_restores_exactly():
    cluster = two_rank_cluster()
    cluster.instance_event(fsm.instance.Resume("i", 1.0))  # generation 2 while the runners of 1 live
    data = cluster.to_dict()
    assert Cluster.from_dict(data).to_dict() == data


def test_an_old_snapshot_with_requests_restores_without_them():
    data = snapshot_data()
    restored = Cluster.from_dict({**data, "requests": [{"request_id": "q", "instance_id": "i"}]})
    assert restored.to_dict() == data


# -- the rest of the public surface --------------------------------------------------------------


def test_a_log_entry_round_trips_through_its_record():
    entry = LogEntry(1.5, "runner", "i/0", "fail", "ready", "failed", "boom")
    assert LogEntry.from_record(entry.as_record()) == entry
    record = {k: v for k, v in entry.as_record().items() if k != "cause"}  # a record written without a cause
    assert LogEntry.from_record(record) == attrs.evolve(entry, cause="")


def test_every_step_is_logged_creates_downloads_and_failure_causes_included():
    cluster = two_rank_cluster()
    assert [(e.key, e.event, e.target) for e in cluster.log if e.machine == "runner"][:1] == [("i/0", "create", "idle")]
    cluster.execute(fsm.StartDownload("a", "org/m"), 0.5)
    cluster.download_event("a", fsm.download.DownloadFailed("org/m", 0.6, "offline"))
    downloads = [(e.key, e.event, e.source, e.target, e.cause) for e in cluster.log if e.machine == "download"]
    assert downloads == [
        ("a:org/m", "begin", "pending", "ongoing", ""),
        ("a:org/m", "fail", "ongoing", "failed", "offline"),
    ]
    cluster.runner_event(rn.Fail("i/1", 1, failure=fsm.Failure.stalled("joining", 5)), 1.0)
    fails = [e for e in cluster.log if e.machine == "runner" and e.event == "fail"]
    assert len(fails) == 1 and fails[0].cause == cluster.runner("i/1").failure.message != ""
    cluster.runner_event(rn.Exited("i/1", 1, exit_code=-15), 2.0)
    assert [e.cause for e in cluster.log if e.key == "i/1"][-1] == ""  # the failure was logged once, with its cause


def test_a_cancelled_request_is_accepted_with_its_reason_and_moves_no_machine():
    cluster = two_rank_cluster()
    before = cluster.to_dict()
    outcome = cluster.execute(fsm.CancelRequest("q", "i", "instance gone"), 1.0)
    assert outcome == fsm.Outcome(accepted=True, note="instance gone")
    assert cluster.to_dict() == before


def test_the_view_carries_the_pending_requests():
    cluster = two_rank_cluster()
    requests = [fsm.PendingRequest("q1", "i"), fsm.PendingRequest("q2", "i")]
    assert cluster.view(requests).requests == tuple(requests)


def test_an_unknown_instance_is_an_invalid_event():
    with pytest.raises(fsm.InvalidEvent, match="no instance 'nope'"):
        Cluster().instance("nope")
    with pytest.raises(fsm.InvalidEvent, match="no instance 'nope'"):
        Cluster().delete("nope", 0.0)


def test_downloads_follow_the_clusters_download_policy():
    policy = fsm.Backoff(initial=7.0, factor=2.0, cap=70.0)
    cluster = Cluster(policy)
    cluster.execute(fsm.StartDownload("a", "org/m"), 0.0)
    cluster.download_event("a", fsm.download.DownloadFailed("org/m", 1.0, "offline"))
    assert cluster.downloads[("a", "org/m")].retry_at == 8.0


def test_a_create_for_an_older_generation_is_ignored_not_refused():
    cluster = two_rank_cluster()
    cluster.instance_event(fsm.instance.Resume("i", 1.0))  # generation 2 starts
    machine = cluster.instance("i")
    assert (machine.instance_state, machine.generation) == (fsm.InstanceState.STARTING, 2)
    before = cluster.to_dict()
    late = cluster.execute(fsm.CreateRunner("i", "i/0", "a", 0, 2, 1, "org/m"), 1.5)
    assert not late.accepted and cluster.to_dict() == before


def test_recover_stops_every_live_runner_even_after_a_dead_one():
    cluster = two_rank_cluster()
    cluster.runner_event(rn.Exited("i/0", 1, exit_code=-9), 1.0)  # the first runner is already gone
    cluster.recover(2.0)
    assert not cluster.runner("i/1").alive


def test_place_passes_the_seed_and_the_options_are_keyword_only():
    cluster = Cluster()
    cluster.place("i", "org/m", SLOTS)
    cluster.place("j", "org/m", [fsm.Slot(0, "a", "j/0")], seed=7)
    assert (cluster.instance("i").seed, cluster.instance("j").seed) == (0, 7)
    with pytest.raises(TypeError):
        cluster.place("k", "org/m", [fsm.Slot(0, "a", "k/0")], None)  # type: ignore[misc]
    with pytest.raises(TypeError):
        Cluster(None, rn.RunnerLifecycle)  # type: ignore[misc]


def _ready(cluster: Cluster, rid: str, now: float) -> list[fsm.InstanceState]:
    """Walk a runner to Ready; the instance's state after each event."""
    states = []
    events = [rn.Connect, rn.Connected, rn.Load, rn.WeightsLoaded, rn.WarmUp, rn.Warmed]
    for event in events:
        cluster.runner_event(event(rid, 1), now)
        states.append(cluster.instance("i").instance_state)
    return states


def test_the_instance_is_ready_only_when_its_last_rank_is():
    cluster = two_rank_cluster()
    assert _ready(cluster, "i/0", 1.0) == [fsm.InstanceState.STARTING] * 6
    assert _ready(cluster, "i/1", 2.0) == [fsm.InstanceState.STARTING] * 5 + [fsm.InstanceState.READY]
    cluster.runner_event(rn.RequestStarted("i/0", 1), 3.0)
    cluster.runner_event(rn.RequestFinished("i/0", 1), 3.0)
    machine = cluster.instance("i")
    assert (machine.instance_state, machine.attempts) == (fsm.InstanceState.READY, 0)
    ranked = [(e.event, e.target) for e in cluster.log if e.machine == "instance"]
    assert ranked.count(("rank_ready", "starting")) + ranked.count(("rank_ready", "ready")) <= 2


def test_a_slot_whose_incarnation_already_ran_is_not_created_again_even_from_a_snapshot():
    stopped = two_rank_cluster()
    stopped.execute(fsm.StopRunner("i/0", 1, fsm.StopReason.INSTANCE_GONE), 1.0)
    stopped.runner_event(rn.Exited("i/0", 1, exit_code=0), 1.0)
    data = two_rank_cluster().to_dict()  # the instance still Starting generation 1
    data["runners"]["i/0"] = stopped.to_dict()["runners"]["i/0"]  # but rank 0's generation-1 process is gone
    cluster = Cluster.from_dict(data)
    before = cluster.to_dict()
    with pytest.raises(fsm.InvalidEvent, match="still alive or newer"):
        cluster.execute(fsm.CreateRunner("i", "i/0", "a", 0, 2, 1, "org/m"), 2.0)
    assert cluster.to_dict() == before


def test_recover_resumes_only_a_generation_that_had_runners():
    """A graceful stop recovers (the runners stopped, the instance resumed): a restart then resumes nothing more."""
    cluster = two_rank_cluster()
    cluster.recover(now=5.0)  # the graceful stop
    assert cluster.instance("i").generation == 2
    again = Cluster.from_dict(cluster.to_dict())
    again.recover(now=9.0)  # the restart: generation 2 has no runner yet, so it lost nothing
    assert (again.instance("i").generation, again.instance("i").instance_state) == (2, fsm.InstanceState.STARTING)
    fresh = Cluster()
    fresh.place("j", "org/m", SLOTS)
    fresh.execute(fsm.StartGeneration("j", 1), 0.0)
    fresh.recover(now=1.0)  # started, no runner created yet: keeps its generation
    assert fresh.instance("j").generation == 1


def test_recover_looks_only_at_the_runners_of_each_instance():
    cluster = Cluster()
    for iid in ("a", "i", "z"):
        cluster.place(iid, "org/m", [fsm.Slot(0, "n", f"{iid}/0")])
        cluster.execute(fsm.StartGeneration(iid, 1), 0.0)
    cluster.execute(fsm.CreateRunner("i", "i/0", "n", 0, 1, 1, "org/m"), 0.0)
    cluster.recover(now=1.0)
    assert [cluster.instance(iid).generation for iid in ("a", "i", "z")] == [1, 2, 1]  # only i had runners


def test_move_puts_the_ranks_elsewhere_between_generations_only():
    cluster = two_rank_cluster()
    with pytest.raises(fsm.InvalidConfig, match="still has live runners"):
        cluster.move("i", ["c", "b"])
    cluster.runner_event(rn.Exited("i/0", 1, exit_code=-9), 1.0)
    cluster.execute(fsm.StopRunner("i/1", 1, fsm.StopReason.SIBLING_FAILED), 1.0)
    cluster.runner_event(rn.Exited("i/1", 1, exit_code=0), 1.5)
    with pytest.raises(fsm.InvalidConfig, match="has 2 ranks, not 1"):
        cluster.move("i", ["c"])
    cluster.move("i", ["c", "b"])
    assert [s.node_id for s in cluster.instances["i"].slots] == ["c", "b"]
    assert cluster.runners["i/0"].node_id == "c"  # the reaped runner's entry follows its slot
    assert Cluster.from_dict(cluster.to_dict()).to_dict() == cluster.to_dict()  # still a cluster that can be


def test_a_stall_on_the_caller_names_what_is_owed():
    """Two ranks created and no endpoint published: nothing to plan, no deadline, and `owed` says why."""
    cluster = Cluster()
    cluster.place("i", "org/m", SLOTS)
    world = World(cluster, ["a", "b"])
    world.step("a")  # generation 1, and the model's download on each node
    world.step("b")
    assert cluster.owed() == [fsm.Owed(fsm.Report.DOWNLOAD, n, model_id="org/m") for n in ("a", "b")]
    world.deliver_all()
    world.step("a")  # the runners are created; nobody publishes their endpoints
    world.step("b")
    view = cluster.view()
    assert [fsm.plan(view, node, 0.0) for node in ("a", "b")] == [[], []]
    assert fsm.next_deadline(view, "a", 0.0) is None and fsm.next_deadline(view, "b", 0.0) is None
    assert cluster.owed() == [fsm.Owed(fsm.Report.PUBLISHED, "i/0", 1), fsm.Owed(fsm.Report.PUBLISHED, "i/1", 1)]
    assert cluster.owed("b") == [fsm.Owed(fsm.Report.PUBLISHED, "i/1", 1)]
    assert "Cluster.publish" in cluster.owed()[0].explain()
    cluster.publish("i/0", 1, "a:1")
    cluster.publish("i/1", 1, "b:1")
    assert [type(a) for a in fsm.plan(cluster.view(), "a", 0.0)] == [fsm.ConnectRunner]
    assert cluster.owed() == []  # the connect is still to be executed: the planner's turn, not the caller's


def test_owed_after_each_action_is_what_the_contract_says():
    table = {
        fsm.CreateRunner("i", "i/0", "a", 0, 2, 1, "m"): fsm.Owed(fsm.Report.PUBLISHED, "i/0", 1),
        fsm.CreateRunner("i", "i/0", "a", 0, 1, 1, "m"): None,  # one rank: no ring to publish
        fsm.ConnectRunner("i/0", 1): fsm.Owed(fsm.Report.CONNECTED, "i/0", 1),
        fsm.LoadModel("i/0", 1, "m"): fsm.Owed(fsm.Report.LOADED, "i/0", 1),
        fsm.WarmUp("i/0", 1): fsm.Owed(fsm.Report.WARMED, "i/0", 1),
        fsm.StopRunner("i/0", 1, fsm.StopReason.RUNNER_FAILED): fsm.Owed(fsm.Report.EXITED, "i/0", 1),
        fsm.ForwardRequest("r", "i/0", 1): fsm.Owed(fsm.Report.FINISHED, "i/0", 1),
        fsm.StartDownload("a", "m"): fsm.Owed(fsm.Report.DOWNLOAD, "a", model_id="m"),
        fsm.StartGeneration("i", 1): None,
        fsm.DeleteInstance("i", fsm.DeleteReason.REQUESTED): None,
        fsm.CancelRequest("r", "i", "gone"): None,
    }
    assert {action: fsm.owed_after(action) for action in table} == table
    assert str(fsm.Owed(fsm.Report.DOWNLOAD, "a", model_id="m")) == "download m@a"


@pytest.mark.parametrize(
    "feed",
    [
        lambda c, t: c.instance_event(fsm.instance.Tick("i", t)),
        lambda c, t: c.runner_event(rn.Connect("i/0", 1), t),
        lambda c, t: c.download_event("a", dl.Begin("org/m", t)),
        lambda c, t: c.execute(fsm.StopRunner("i/0", 1, fsm.StopReason.INSTANCE_GONE), t),
        lambda c, t: c.delete("i", t),
        lambda c, t: c.recover(t),
    ],
    ids=["instance", "runner", "download", "execute", "delete", "recover"],
)
def test_a_clock_that_steps_back_is_clamped_never_refused(feed):
    """A wall clock stepped back (NTP, an operator) must not turn every report into an error: a reading earlier
    than one seen is taken as the latest seen (time stands still until the clock catches up; nothing fires
    early), exactly as if it had been read then."""
    stepped, steady = two_rank_cluster(), two_rank_cluster()
    for cluster in (stepped, steady):
        cluster.instance_event(fsm.instance.Tick("i", 5.0))
    feed(stepped, 4.0)
    feed(steady, 5.0)
    assert (stepped.to_dict(), stepped.log, stepped.now_seen) == (steady.to_dict(), steady.log, 5.0)


def test_a_refused_event_does_not_move_time():
    cluster = two_rank_cluster()
    with pytest.raises(fsm.InvalidEvent, match="no runner"):
        cluster.runner_event(rn.Connect("nobody", 1), 1e18)
    cluster.runner_event(rn.Connect("i/0", 1), 1.0)  # a bogus far-future time did not lock the cluster out
    assert cluster.now_seen == 1.0


def test_a_snapshot_says_its_clock_and_is_refused_on_another():
    boot1, boot2 = fsm.Clock.monotonic("boot-1"), fsm.Clock.monotonic("boot-2")
    cluster = Cluster(clock=boot1)
    cluster.place("i", "org/m", SLOTS)
    cluster.execute(fsm.StartGeneration("i", 1), 100.0)
    data = cluster.to_dict()
    assert (data["clock"], data["now"]) == ({"kind": "monotonic", "epoch": "boot-1"}, 100.0)
    with pytest.raises(fsm.SnapshotError, match="epoch 'boot-1', not on the monotonic clock of epoch 'boot-2'"):
        Cluster.from_dict(data, clock=boot2)  # a reboot: its deadlines would lie anywhere
    with pytest.raises(fsm.SnapshotError, match="not on wall time"):
        Cluster.from_dict(data, clock=fsm.Clock.wall())
    restored = Cluster.from_dict(data, clock=boot1)  # the same boot: time goes on from the snapshot's
    restored.recover(5.0)  # a supervisor that restarted its clock on the same boot: taken as the snapshot's 100
    assert restored.now_seen == 100.0
    old = {k: v for k, v in two_rank_cluster().to_dict().items() if k != "clock"}  # written before clocks
    assert Cluster.from_dict(old).clock == fsm.Clock.wall()
    with pytest.raises(fsm.SnapshotError, match=r"^clock: "):
        Cluster.from_dict({**data, "clock": {"kind": "sundial"}})


def test_a_clock_says_what_it_lacks():
    with pytest.raises(fsm.InvalidConfig, match="needs its epoch"):
        fsm.Clock(fsm.ClockKind.MONOTONIC)
    with pytest.raises(fsm.InvalidConfig, match="no epoch"):
        fsm.Clock(fsm.ClockKind.WALL, "boot-1")
    assert fsm.Clock.from_dict(fsm.Clock.monotonic("b").to_dict()) == fsm.Clock.monotonic("b")
