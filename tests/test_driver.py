"""fsm.Driver: the library's loop, with adapters as a runtime would write them (synchronous and async)."""

from __future__ import annotations

import asyncio

import pytest

import fsm
from fsm import runner as rn

SLOTS = [fsm.Slot(0, "a", "i/0"), fsm.Slot(1, "b", "i/1")]
POLICY = fsm.RetryPolicy(backoff=fsm.Backoff(2.0, 2.0, 8.0), max_failures=2)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """Starts nothing: records each call, and publishes ring endpoints at once (``create_runner``'s answer)."""

    def __init__(self) -> None:
        self.calls: list[fsm.Action] = []

    def create_runner(self, action):
        self.calls.append(action)
        return f"{action.node_id}:{7000 + action.rank}"

    def __getattr__(self, name):
        return self.calls.append


def answer_everything(driver: fsm.Driver) -> None:
    """The world keeps its side of the contract for everything owed, then the driver goes on."""
    for op in driver.owed():
        match op.report:
            case fsm.Report.DOWNLOAD:
                driver.downloaded(op.key, op.model_id)
            case fsm.Report.CONNECTED:
                driver.report(rn.Connected(op.key, op.incarnation))
            case fsm.Report.LOADED:
                driver.report(rn.WeightsLoaded(op.key, op.incarnation))
            case fsm.Report.WARMED:
                driver.report(rn.Warmed(op.key, op.incarnation))
            case fsm.Report.EXITED:
                driver.report(rn.Exited(op.key, op.incarnation, exit_code=0))


def settle(driver: fsm.Driver, clock: Clock, until=lambda: False) -> None:
    for _ in range(50):
        driver.reconcile()
        if until():
            return
        if driver.owed():
            answer_everything(driver)
        elif (wake := driver.next_wakeup()) is not None:
            clock.now = wake
        else:
            return
    raise AssertionError(f"not settled: {driver.cluster.view()}")


def test_a_driver_brings_two_ranks_up_and_owes_nothing_once_ready():
    cluster, clock, world = fsm.Cluster(), Clock(), Recorder()
    cluster.place("i", "org/m", SLOTS, policy=POLICY)
    driver = fsm.Driver(cluster, world, clock)
    first = driver.reconcile()
    assert [type(a) for a in first.taken] == [fsm.StartGeneration, fsm.StartDownload, fsm.StartDownload]
    assert driver.owed() == [fsm.Owed(fsm.Report.DOWNLOAD, n, model_id="org/m") for n in ("a", "b")]
    settle(driver, clock)
    assert cluster.instance("i").instance_state is fsm.InstanceState.READY
    assert {e.endpoint for e in cluster.runners.values()} == {"a:7000", "b:7001"}  # create_runner's answer
    kinds = [type(a).__name__ for a in world.calls]
    assert kinds.count("CreateRunner") == kinds.count("ConnectRunner") == kinds.count("WarmUp") == 2
    assert "StartGeneration" not in kinds  # it moves only the machines: no handler is called for it
    assert driver.owed() == [] and driver.next_wakeup() is None and driver.reconcile().taken == ()


def test_a_failure_is_stopped_backed_off_and_restarted_at_the_wakeup():
    cluster, clock, world = fsm.Cluster(), Clock(), Recorder()
    cluster.place("i", "org/m", SLOTS, policy=POLICY)
    driver = fsm.Driver(cluster, world, clock)
    settle(driver, clock)
    clock.now = 10.0
    driver.report(rn.Exited("i/1", 1, exit_code=-9))  # rank 1 killed
    stop = driver.reconcile().taken
    assert stop == (fsm.StopRunner("i/0", 1, fsm.StopReason.RECOVERING),)  # one_for_all
    assert driver.owed() == [fsm.Owed(fsm.Report.EXITED, "i/0", 1)]
    driver.report(rn.Exited("i/0", 1, exit_code=0))
    assert driver.reconcile().taken == ()  # backing off
    assert driver.next_wakeup() == 12.0
    machine = cluster.instance("i")
    settle(driver, clock, until=lambda: machine.instance_state is fsm.InstanceState.READY)
    assert (machine.generation, machine.attempts, clock.now) == (2, 1, 12.0)
    assert driver.next_wakeup() == 12.0 + POLICY.reset_after  # the budget's reset, seen when it comes
    settle(driver, clock)
    assert (machine.attempts, clock.now) == (0, 12.0 + POLICY.reset_after)


def test_the_callers_last_look_may_hold_an_action_back():
    cluster, clock, world = fsm.Cluster(), Clock(), Recorder()
    cluster.place("i", "org/m", SLOTS[:1])
    driver = fsm.Driver(cluster, world, clock, before=lambda a: not isinstance(a, fsm.StartDownload))
    done = driver.reconcile()
    assert done.taken == (fsm.StartGeneration("i", 1),)
    assert [s.action for s in done.skipped] == [fsm.StartDownload("a", "org/m")]
    assert world.calls == [] and cluster.downloads == {}  # held back: the machines did not move either


def test_a_refusal_of_the_machines_is_skipped_with_its_error_and_the_rest_goes_on():
    cluster, clock, world = fsm.Cluster(), Clock(), Recorder()
    cluster.place("i", "org/m", SLOTS[:1])
    bogus = fsm.ConnectRunner("nobody", 1)
    driver = fsm.Driver(cluster, world, clock, plan=lambda view, node, now: [bogus, *fsm.plan(view, node, now)])
    done = driver.reconcile()
    assert done.skipped[0].action == bogus and isinstance(done.skipped[0].error, fsm.InvalidEvent)
    assert fsm.StartGeneration("i", 1) in done.taken


def test_a_plan_that_never_empties_says_it_did_not_settle():
    cluster, clock = fsm.Cluster(), Clock()
    cluster.place("i", "org/m", SLOTS[:1])
    again = fsm.CancelRequest("r", "gone", "instance does not exist")  # accepted every round
    driver = fsm.Driver(cluster, Recorder(), clock, plan=lambda *_: [again], max_rounds=3)
    done = driver.reconcile()
    assert (done.settled, len(done.taken)) == (False, 3)


def test_async_handlers_are_handed_back_to_the_caller_to_await():
    started: list[str] = []

    class Async(Recorder):
        async def start_download(self, action):
            await asyncio.sleep(0)
            started.append(action.node_id)
            driver.downloaded(action.node_id, action.model_id)

    cluster, clock = fsm.Cluster(), Clock()
    cluster.place("i", "org/m", SLOTS[:1])
    driver = fsm.Driver(cluster, Async(), clock)

    async def main() -> None:
        done = driver.reconcile()
        assert len(done.work) == 1 and started == []  # nothing ran inside the driver
        await asyncio.gather(*done.work)

    asyncio.run(main())
    assert started == ["a"] and cluster.downloads[("a", "org/m")].download_state is fsm.DownloadState.COMPLETED


@pytest.mark.parametrize("nodes", [["a"], lambda: ["a"]])
def test_a_driver_plans_only_for_its_nodes(nodes):
    cluster, clock, world = fsm.Cluster(), Clock(), Recorder()
    cluster.place("i", "org/m", SLOTS)
    fsm.Driver(cluster, world, clock, nodes=nodes).reconcile()
    assert fsm.StartDownload("b", "org/m") not in world.calls and fsm.StartDownload("a", "org/m") in world.calls


def test_a_last_look_that_changes_the_cluster_is_planned_again_in_the_same_reconcile():
    """exod's model gone from the cache: the load is held back and the download invalidated, and the download
    that this calls for is taken at once, not at the next report (which would never come)."""
    cluster, clock, world = fsm.Cluster(), Clock(), Recorder()
    cluster.place("i", "org/m", SLOTS[:1])
    before = fsm.Driver(cluster, world, clock, before=lambda a: not isinstance(a, fsm.LoadModel))
    settle(before, clock)  # downloaded, its runner created and waiting to load
    assert [type(a) for a in fsm.plan(before.view(), "a", 0.0)] == [fsm.LoadModel]

    def gone(action: fsm.Action) -> bool:
        if isinstance(action, fsm.LoadModel):
            cluster.download_event("a", fsm.download.Invalidate("org/m", clock.now))
            return False
        return True

    driver = fsm.Driver(cluster, world, clock, before=gone)
    done = driver.reconcile()
    assert [type(s.action) for s in done.skipped] == [fsm.LoadModel]
    assert done.taken == (fsm.StartDownload("a", "org/m"),) and done.settled


def test_a_local_placement_downloads_nothing_and_owes_no_download():
    """A model already on its nodes (a directory the caller owns) is a placement option, not a fake download."""
    cluster, clock, world = fsm.Cluster(), Clock(), Recorder()
    cluster.place("i", "local/m", SLOTS, policy=POLICY, local=True)
    driver = fsm.Driver(cluster, world, clock)
    settle(driver, clock, until=lambda: cluster.instance("i").instance_state is fsm.InstanceState.READY)
    assert not [a for a in world.calls if isinstance(a, fsm.StartDownload)]
    assert cluster.downloads == {} and cluster.instance("i").generation == 1
    restored = fsm.Cluster.from_dict(cluster.to_dict())
    assert restored.to_dict() == cluster.to_dict() and restored.view().instances["i"].local
    bad = cluster.to_dict()
    bad["instances"]["i"]["local"] = "yes"
    with pytest.raises(fsm.SnapshotError, match=r"instances\.i\.local: expected a bool"):
        fsm.Cluster.from_dict(bad)


LIMITS = fsm.PhaseLimits(connect=5.0, load_progress=3.0, warm_up=4.0, stop_grace=2.0)


def test_watchdogs_are_deadlines_the_planner_keeps():
    """A rank silent in a phase past its limit fails as stalled (charged); a stop outliving its grace is killed;
    progress while loading moves the deadline on. No watchdog of the caller's own."""
    cluster, clock, world = fsm.Cluster(limits=LIMITS), Clock(), Recorder()
    cluster.place("i", "org/m", SLOTS, policy=POLICY)
    driver = fsm.Driver(cluster, world, clock)
    for _ in range(3):  # downloads, creations, connects: then rank 0 joins and rank 1 says nothing
        driver.reconcile()
        for op in driver.owed():
            if op.report is fsm.Report.DOWNLOAD:
                driver.downloaded(op.key, op.model_id)
    driver.report(rn.Connected("i/0", 1))
    assert driver.next_wakeup() == 5.0  # rank 1's connect limit, from when it began to join
    clock.now = 5.0
    done = driver.reconcile()
    assert fsm.FailStalled("i/1", 1, "joining", 5.0) in done.taken
    machine = cluster.instance("i")
    assert machine.attempts == 1 and machine.last_failure == fsm.Failure.stalled("joining", 5.0)
    assert fsm.StopRunner("i/0", 1, fsm.StopReason.RECOVERING) in done.taken
    assert driver.next_wakeup() == 7.0  # rank 0's stop grace (and rank 1, Failed, is being stopped too)
    clock.now = 7.0
    kills = [a for a in driver.reconcile().taken if isinstance(a, fsm.KillRunner)]
    assert kills == [fsm.KillRunner("i/0", 1), fsm.KillRunner("i/1", 1)] and world.calls[-2:] == kills
    assert driver.reconcile().taken == () and driver.next_wakeup() is None  # killed once, then Exited is owed
    assert {op.report for op in driver.owed()} == {fsm.Report.EXITED}


def test_progress_while_loading_moves_the_watchdog_on():
    cluster, clock, world = fsm.Cluster(limits=LIMITS), Clock(), Recorder()
    cluster.place("i", "org/m", SLOTS[:1], policy=POLICY)
    driver = fsm.Driver(cluster, world, clock)
    driver.reconcile()
    driver.downloaded("a", "org/m")
    driver.reconcile()  # created and told to load
    assert cluster.runner("i/0").phase is fsm.RunnerPhase.WEIGHTS and driver.next_wakeup() == 3.0
    clock.now = 2.5
    driver.report(rn.Progress("i/0", 1, layers_loaded=1, layers_total=4))
    assert driver.next_wakeup() == 5.5
    restored = fsm.Cluster.from_dict(cluster.to_dict(), limits=LIMITS)  # `since` is state, the limits configuration
    assert fsm.next_deadline(restored.view(), "a", 2.5) == 5.5
    clock.now = 5.5
    assert [type(a) for a in driver.reconcile().taken][:1] == [fsm.FailStalled]


def test_no_limits_no_watchdog():
    cluster, clock, world = fsm.Cluster(), Clock(), Recorder()
    cluster.place("i", "org/m", SLOTS[:1], policy=POLICY)
    driver = fsm.Driver(cluster, world, clock)
    driver.reconcile()
    driver.downloaded("a", "org/m")
    driver.reconcile()
    clock.now = 1e6
    assert driver.reconcile().taken == () and driver.next_wakeup() is None
    with pytest.raises(fsm.InvalidConfig, match="connect must be a finite number > 0"):
        fsm.PhaseLimits(connect=0.0)


def ready_cluster() -> tuple[fsm.Cluster, Clock, fsm.Driver]:
    cluster, clock, world = fsm.Cluster(), Clock(), Recorder()
    cluster.place("i", "org/m", SLOTS, policy=POLICY)
    driver = fsm.Driver(cluster, world, clock)
    settle(driver, clock, until=lambda: cluster.instance("i").instance_state is fsm.InstanceState.READY)
    for rank, slot in enumerate(SLOTS):
        assert cluster.attach(slot.runner_id, 1, fsm.Handle(pid=4000 + rank, started=17.5))
    return cluster, clock, driver


def test_a_restarted_supervisor_adopts_a_whole_ready_generation_at_no_cost():
    """The caller found both processes alive (its handles say which): nothing is restarted, nothing charged."""
    cluster, clock, driver = ready_cluster()
    driver.reconcile()
    driver.cluster.execute(fsm.ForwardRequest("r1", "i/0", 1), clock.now)  # serving when the supervisor died
    restored = fsm.Cluster.from_dict(cluster.to_dict())
    assert restored.runners["i/1"].handle == fsm.Handle(4001, 17.5)
    restored.recover(clock.now + 1, adopt=["i/0", "i/1"])
    machine = restored.instance("i")
    assert (machine.instance_state, machine.generation, machine.attempts) == (fsm.InstanceState.READY, 1, 0)
    assert all(restored.runner(s.runner_id).runner_state is fsm.RunnerState.READY for s in SLOTS)
    assert restored.runner("i/0").in_flight == 0  # its request went with the old supervisor
    assert fsm.plan(restored.view(), "a", clock.now + 1) == [] and restored.owed() == []


def test_adopting_part_of_a_generation_resumes_it_and_the_plan_stops_what_was_adopted():
    cluster, clock, _ = ready_cluster()
    restored = fsm.Cluster.from_dict(cluster.to_dict())
    restored.recover(clock.now + 1, adopt=["i/0"])  # rank 1's process was gone
    machine = restored.instance("i")
    assert (machine.generation, machine.attempts) == (2, 0)  # resumed, uncharged: the retry rules unchanged
    assert restored.runner("i/0").alive and not restored.runner("i/1").alive
    stops = [a for a in fsm.plan(restored.view(), "a", clock.now + 1) if isinstance(a, fsm.StopRunner)]
    assert stops == [fsm.StopRunner("i/0", 1, fsm.StopReason.STALE_GENERATION)]


def test_adopting_a_runner_that_is_not_there_is_refused_and_changes_nothing():
    cluster, clock, _ = ready_cluster()
    before = cluster.to_dict()
    with pytest.raises(fsm.InvalidConfig, match=r"cannot adopt \['i/9'\]"):
        cluster.recover(clock.now + 1, adopt=["i/0", "i/9"])
    assert cluster.to_dict() == before
    assert not cluster.attach("i/0", 2, fsm.Handle(1, 0.0))  # not its incarnation
    bad = cluster.to_dict()
    bad["runners"]["i/0"]["handle"] = {"pid": "x", "started": 1.0}
    with pytest.raises(fsm.SnapshotError, match=r"^runners\.i/0\.handle: "):
        fsm.Cluster.from_dict(bad)


def test_one_for_one_is_independent_replicas_each_its_own_instance():
    """Restart strategies (#27): the ranks of an instance are one ring, so they restart together (one_for_all);
    replicas that need no ring are 1-rank instances each, and a failure restarts that one alone."""
    cluster, clock, world = fsm.Cluster(), Clock(), Recorder()
    for n in range(2):
        cluster.place(f"web-{n}", "org/m", [fsm.Slot(0, "a", f"web-{n}/0")], policy=POLICY)
    driver = fsm.Driver(cluster, world, clock)
    ready = fsm.InstanceState.READY
    settle(driver, clock, until=lambda: all(p.machine.instance_state is ready for p in cluster.instances.values()))
    driver.report(rn.Exited("web-1/0", 1, exit_code=-9))
    settle(driver, clock, until=lambda: cluster.instance("web-1").instance_state is ready)
    assert (cluster.instance("web-0").generation, cluster.instance("web-0").attempts) == (1, 0)  # untouched
    assert (cluster.instance("web-1").generation, cluster.instance("web-1").attempts) == (2, 1)
    assert not [a for a in world.calls if isinstance(a, fsm.StopRunner) and a.runner_id == "web-0/0"]


def test_a_refusal_in_the_callers_last_look_is_skipped_not_raised():
    """Found by the third 30-min campaign (seed 2059756477): two ranks on one node found their model gone in
    the same round; the second's last look invalidated a download the first had invalidated already, and the
    refusal escaped the driver and ended the daemon's controller."""
    cluster, clock, world = fsm.Cluster(), Clock(), Recorder()
    cluster.place("i", "org/m", SLOTS[:1])

    def refuses(action: fsm.Action) -> bool:
        if isinstance(action, fsm.StartDownload):
            raise fsm.IllegalTransition("download", "invalidate", "pending", "already pending")
        return True

    done = fsm.Driver(cluster, world, clock, before=refuses).reconcile()
    assert [type(s.error) for s in done.skipped] == [fsm.IllegalTransition]
    assert done.taken == (fsm.StartGeneration("i", 1),)
