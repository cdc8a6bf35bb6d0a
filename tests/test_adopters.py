"""`fsm` as a newcomer's supervisor meets it (#49): a restart while a replica backs off, re-attach per replica,
reports that come twice, clocks that step, snapshots that keep their watchdogs, read-only views, a driver
whose adapter raises."""

from __future__ import annotations

import inspect

import pytest

import fsm
from fsm import driver as drv
from fsm import runner as rn
from fsm.conformance import replay
from fsm.world import World

BACKOFF = fsm.Backoff(10.0, 2.0, 60.0, jitter=False)
REPLICAS = fsm.RetryPolicy(backoff=BACKOFF, max_failures=5, strategy=fsm.RestartStrategy.ONE_FOR_ONE)
RING = fsm.RetryPolicy(backoff=BACKOFF, max_failures=5)
CRASH = fsm.Failure.signalled(9)


def cluster_of(policy: fsm.RetryPolicy, ranks: int = 2, **kwargs) -> World:
    cluster = fsm.Cluster(**kwargs)
    slots = [fsm.Slot(rank, f"n{rank}", f"r{rank}") for rank in range(ranks)]
    cluster.place("i", "m", slots, policy=policy, local=True)
    world = World(cluster, [s.node_id for s in slots])
    world.settle()
    assert cluster.instance("i").instance_state is fsm.InstanceState.READY
    return world


def quiet(world: World) -> None:
    """Plan and complete everything due *now*: time does not move."""
    for _ in range(100):
        acted = any([world.step(node) for node in world.nodes])
        if not (world.deliver_all() or acted):
            return
    raise AssertionError("no quiescence")


def one_replica_backing_off() -> tuple[World, float]:
    """Two replicas; r1 crashed at 0 and was reaped: it may restart at its deadline, 10 s later."""
    world = cluster_of(REPLICAS)
    world.cluster.runner_event(rn.Fail("r1", 1, failure=CRASH), world.now)
    quiet(world)
    m = world.cluster.instance("i")
    assert m.instance_state is fsm.InstanceState.DEGRADED and m.live_ranks == {0}
    return world, m.rank_deadlines[1]


def restarted(world: World, now: float, adopt: tuple[str, ...] = (), **restore) -> World:
    """The supervisor is killed and started again at ``now``: from its snapshot, recovered, planning again."""
    cluster = fsm.Cluster.from_dict(world.cluster.to_dict(), **restore)
    cluster.recover(now, adopt=adopt)
    again = World(cluster, world.nodes, now=now)
    quiet(again)
    return again


def restarts_of(world: World, runner_id: str) -> list[float]:
    return [t for t, a in world.executed if isinstance(a, fsm.CreateRunner) and a.runner_id == runner_id]


# -- 1. a restart neither refills nor skips a replica's backoff ---------------------------------------------


@pytest.mark.parametrize("adopt", [(), ("r0",)], ids=["nothing adopted", "the healthy one adopted"])
def test_a_supervisor_restarted_while_a_replica_backs_off_restarts_it_only_at_its_deadline(adopt):
    world, deadline = one_replica_backing_off()
    assert deadline == 10.0
    again = restarted(world, 2.0, adopt)
    assert restarts_of(again, "r1") == []  # not at 2.0: the backoff is not skipped
    m = again.cluster.instance("i")
    assert m.rank_deadlines[1] == deadline and m.attempts == 1
    again.settle()
    assert restarts_of(again, "r1") == [deadline]  # nor refilled: at its deadline, not 10 s after the restart
    assert again.cluster.instance("i").instance_state is fsm.InstanceState.READY


def test_a_ring_restarted_while_backing_off_still_waits_its_deadline():
    world = cluster_of(RING)
    world.cluster.runner_event(rn.Fail("r1", 1, failure=CRASH), world.now)
    quiet(world)
    m = world.cluster.instance("i")
    assert m.instance_state is fsm.InstanceState.BACKING_OFF
    again = restarted(world, 2.0)
    assert not [a for _, a in again.executed if isinstance(a, fsm.CreateRunner)]
    again.settle()
    assert {t for t, a in again.executed if isinstance(a, fsm.CreateRunner)} == {m.deadline}


# -- 2. re-attach per replica ---------------------------------------------------------------------------------


def test_re_attach_adopts_each_live_replica_and_restarts_only_the_missing_one_for_free():
    world = cluster_of(REPLICAS)
    again = restarted(world, 5.0, adopt=("r0",))  # r1's process went with the old supervisor
    m = again.cluster.instance("i")
    assert again.cluster.runner("r0").incarnation == 1 and again.cluster.runner("r0").alive  # kept as it was
    assert not [a for _, a in again.executed if isinstance(a, fsm.StopRunner) and a.runner_id == "r0"]
    assert restarts_of(again, "r1") == [5.0]  # at once: no backoff for a process the supervisor lost
    assert (m.attempts, m.uncharged, m.instance_state) == (0, 0, fsm.InstanceState.READY)
    assert m.rank_generations == [1, 2]


def test_re_attach_with_every_replica_alive_keeps_them_all_and_starts_nothing():
    world = cluster_of(REPLICAS, ranks=3)
    again = restarted(world, 5.0, adopt=("r0", "r1", "r2"))
    assert not again.executed
    assert again.cluster.instance("i").rank_generations == [1, 1, 1]


def test_an_adopted_replica_that_was_not_ready_is_stopped_and_restarted_charging_nothing():
    cluster = fsm.Cluster()
    cluster.place("i", "m", [fsm.Slot(0, "n0", "r0"), fsm.Slot(1, "n1", "r1")], policy=REPLICAS, local=True)
    world = World(cluster, ["n0", "n1"])
    for _ in range(3):  # created and loading, not Ready yet
        for node in world.nodes:
            world.step(node)
    assert {r.state for r in cluster.runners().values()} == {rn.RunnerState.LOADING}
    again = restarted(world, 1.0, adopt=("r0", "r1"))  # alive, but mid-load: its old supervisor drove it
    assert sorted(a.runner_id for _, a in again.executed if isinstance(a, fsm.StopRunner)) == ["r0", "r1"]
    again.settle()
    m = again.cluster.instance("i")
    assert (m.instance_state, m.attempts) == (fsm.InstanceState.READY, 0)  # a host failure: never charged


def test_a_ring_keeps_its_all_or_nothing_rule():
    world = cluster_of(RING)
    again = restarted(world, 5.0, adopt=("r0",))  # half a ring cannot serve
    stopped = [a.runner_id for _, a in again.executed if isinstance(a, fsm.StopRunner)]
    assert stopped == ["r0"]
    m = again.cluster.instance("i")
    assert (m.generation, m.attempts, m.uncharged) == (2, 0, 0)  # a new generation, charged nothing


def test_a_lost_rank_is_refused_for_a_ring():
    world = cluster_of(RING)
    with pytest.raises(fsm.IllegalTransition, match="one_for_one"):
        world.cluster.instance_event(fsm.instance.RankLost("i", world.now, 1, 0))


# -- 3. duplicate and stale reports --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "late",
    [
        rn.Exited("r1", 1, exit_code=0),  # the second watcher's report of the same exit
        rn.Fail("r1", 1, failure=CRASH),  # a failure reported after the reap
        rn.Warmed("r1", 1),  # a report from a process already failed and reaped
        rn.Exited("r1", 0, exit_code=1),  # an older incarnation
    ],
    ids=["second exit", "fail after reap", "late progress", "old incarnation"],
)
def test_a_duplicate_or_stale_report_is_an_ignored_outcome_logged_never_an_exception(late):
    world = cluster_of(REPLICAS)
    cluster = world.cluster
    cluster.runner_event(rn.Exited("r1", 1, exit_code=-9), world.now)
    before = cluster.to_dict()
    outcome = cluster.runner_event(late, world.now)
    assert not outcome.accepted and outcome.note
    assert cluster.to_dict() == before
    entry = cluster.log[-1]
    assert (entry.event, entry.key, entry.source, entry.target) == ("ignored", "r1", "stopped", "stopped")
    assert late.name in entry.cause
    assert replay(cluster.log).divergence is None  # an ignored entry moves no machine


def test_a_command_the_runner_refuses_is_still_the_callers_mistake():
    world = cluster_of(REPLICAS)
    with pytest.raises(fsm.IllegalTransition):
        world.cluster.runner_event(rn.Load("r0", 1), world.now)  # Ready already: a command, not a report


def test_a_driver_reports_the_same_exit_twice_without_raising():
    world = cluster_of(REPLICAS)
    d = fsm.Driver(world.cluster, object(), lambda: world.now)  # type: ignore[arg-type]
    assert d.report(rn.Exited("r0", 1, exit_code=-9)).accepted
    assert not d.report(rn.Exited("r0", 1, exit_code=-9)).accepted


# -- 4. clocks -------------------------------------------------------------------------------------------------


def test_a_snapshot_rebased_on_a_new_clock_keeps_what_was_left_of_a_backoff():
    """A reboot (monotonic time from 0 again) or a wall-clock step: from_dict(now=...) rebases every time."""
    world, deadline = one_replica_backing_off()
    assert deadline == 10.0
    world.advance(3.0)  # 7 s of the backoff left when the snapshot is written
    data = world.cluster.to_dict()
    boot2 = fsm.Clock.monotonic("boot-2")
    cluster = fsm.Cluster.from_dict(data, clock=boot2, now=500.0)
    assert cluster.clock == boot2 and cluster.now_seen == 500.0
    assert cluster.instance("i").rank_deadlines == {1: 507.0}
    cluster.recover(500.0, adopt=("r0",))
    again = World(cluster, world.nodes, now=500.0)
    again.settle()
    assert restarts_of(again, "r1") == [507.0]


def test_a_rebase_refuses_a_snapshot_that_does_not_say_when_it_was_written():
    data = {k: v for k, v in cluster_of(REPLICAS).cluster.to_dict().items() if k != "now"}
    with pytest.raises(fsm.SnapshotError, match=r"^now: missing"):
        fsm.Cluster.from_dict(data, now=5.0)


def test_a_wall_clock_step_back_does_not_crash_a_driver():
    world, deadline = one_replica_backing_off()
    clock = [world.now + 1.0]
    d = fsm.Driver(world.cluster, object(), lambda: clock[0])  # type: ignore[arg-type]
    clock[0] = -3600.0  # an hour back
    assert not d.report(rn.Exited("r1", 1, exit_code=0)).accepted  # a duplicate: ignored, not "time went back"
    assert not d.reconcile().taken  # nothing fires early
    assert d.next_wakeup() == deadline  # the deadline stands: it does not move with the clock


# -- 6. snapshots keep the watchdogs ---------------------------------------------------------------------------


def test_a_snapshot_keeps_the_phase_limits_and_the_stop_grace():
    limits = fsm.PhaseLimits(connect=30.0, load_progress=60.0, warm_up=20.0, stop_grace=5.0, heartbeat=15.0)
    world = cluster_of(REPLICAS, limits=limits)
    data = world.cluster.to_dict()
    assert fsm.Cluster.from_dict(data).limits == limits  # no limits= given: the snapshot's, not none
    other = fsm.PhaseLimits(stop_grace=1.0)
    assert fsm.Cluster.from_dict(data, limits=other).limits == other  # configuration changed on restart


def test_an_old_snapshot_without_limits_is_refused_rather_than_unwatched():
    data = {k: v for k, v in cluster_of(REPLICAS).cluster.to_dict().items() if k != "limits"}
    with pytest.raises(fsm.SnapshotError, match=r"^limits: missing"):
        fsm.Cluster.from_dict(data)
    assert fsm.Cluster.from_dict(data, limits=fsm.PhaseLimits()).limits == fsm.PhaseLimits()
    with pytest.raises(fsm.SnapshotError, match=r"^limits: "):
        fsm.Cluster.from_dict({**data, "limits": {"stop_grace": -1}})


# -- 7. read-only views ----------------------------------------------------------------------------------------


def test_runner_and_instance_views_say_what_re_attach_needs_and_are_read_only():
    world = cluster_of(REPLICAS)
    world.cluster.attach("r0", 1, fsm.Handle(4242, 123.5))
    restored = fsm.Cluster.from_dict(world.cluster.to_dict())
    runners = restored.runners()
    r0 = runners["r0"]
    assert (r0.instance_id, r0.node_id, r0.rank, r0.incarnation, r0.alive) == ("i", "n0", 0, 1, True)
    assert r0.handle == fsm.Handle(4242, 123.5) and runners["r1"].handle is None
    assert r0.state is rn.RunnerState.READY
    with pytest.raises(TypeError):
        runners["r9"] = r0  # type: ignore[index]
    with pytest.raises(AttributeError):
        r0.alive = False  # type: ignore[misc]
    (inst,) = restored.instances().values()
    assert (inst.runner_ids, inst.strategy, inst.max_failures) == (("r0", "r1"), REPLICAS.strategy, 5)
    assert inst.state is fsm.InstanceState.READY


# -- 8. the driver survives its adapter --------------------------------------------------------------------


class Raising:
    """An adapter whose create_runner raises for r1 (a bug, a refused spawn); the rest records."""

    def __init__(self) -> None:
        self.calls: list[fsm.Action] = []

    def create_runner(self, action):
        self.calls.append(action)
        if action.runner_id == "r1":
            raise OSError("fork failed")
        return None

    def __getattr__(self, name):
        return self.calls.append


def test_a_handler_that_raises_fails_its_runner_and_the_loop_goes_on():
    cluster = fsm.Cluster()
    cluster.place("i", "m", [fsm.Slot(0, "n0", "r0"), fsm.Slot(1, "n1", "r1")], policy=REPLICAS, local=True)
    now = [0.0]
    d = fsm.Driver(cluster, Raising(), lambda: now[0])
    done = d.reconcile()  # no exception escapes
    (failed,) = done.failed
    assert isinstance(failed.action, fsm.CreateRunner) and failed.action.runner_id == "r1"
    assert isinstance(failed.error, OSError) and failed.reported is not None and failed.reported.accepted
    assert cluster.runner("r1").failure is not None and "fork failed" in cluster.runner("r1").failure.message
    assert cluster.runner("r0").alive and any(isinstance(a, fsm.LoadModel) for a in d.adapter.calls)


def test_the_driver_docstring_hands_trio_a_function_not_an_awaitable():
    doc = inspect.getdoc(drv)
    assert "nursery.start_soon(_await, work)" in doc and "``nursery.start_soon``" not in doc


def test_async_handlers_run_under_trio_as_the_docstring_says():
    trio = pytest.importorskip("trio")  # the daemon's event loop: installed with it
    started: list[str] = []

    class Async:
        async def create_runner(self, action):
            await trio.sleep(0)
            started.append(action.runner_id)

        def __getattr__(self, name):
            return lambda action: None

    async def _await(w):
        await w

    async def main():
        cluster = fsm.Cluster()
        cluster.place("i", "m", [fsm.Slot(0, "n0", "r0")], policy=REPLICAS, local=True)
        d = fsm.Driver(cluster, Async(), trio.current_time)
        async with trio.open_nursery() as nursery:
            for work in d.reconcile().work:
                nursery.start_soon(_await, work)

    trio.run(main)
    assert started == ["r0"]


# -- 5. the daemon's configuration: max_failures, and max_retries still read ---------------------------------


def test_exod_config_reads_max_failures_and_the_old_max_retries_with_a_warning(tmp_path):
    config = pytest.importorskip("exod.config")
    new, old, both = (tmp_path / f"{name}.toml" for name in ("new", "old", "both"))
    new.write_text("[retry]\nmax_failures = 2\n")
    old.write_text("[retry]\nmax_retries = 2\n")
    both.write_text("[retry]\nmax_failures = 2\nmax_retries = 2\n")
    assert config.load(new).daemon.policy.max_failures == 2
    with pytest.warns(DeprecationWarning, match="max_failures"):
        assert config.load(old).daemon.policy.max_failures == 2  # the same meaning: 2 failed generations
    with pytest.raises(config.ConfigError, match="only max_failures"):
        config.load(both)
    assert config.load(None).daemon.policy.max_failures == 5  # the seeds' cap keeps its meaning
