"""The composed system under Hypothesis: planner + one instance + N runners + downloads + a fake clock.

Random interleavings of planner runs, completions, failures in any phase,
stale incarnations, clock jumps, deletes and serialize/restore; every
invariant of DESIGN §3.5 is checked after every step.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import fsm
from fsm import runner as rn
from fsm.cluster import Cluster
from fsm.owed import Owed, Report
from fsm.world import World, applies, check_runners

POLICY = fsm.RetryPolicy(backoff=fsm.Backoff(1.0, 2.0, 8.0), max_failures=4, reset_after=40.0)
MODEL = "org/model"


class System(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.world: World
        self.inputs: list[tuple] = []  # for the determinism replay
        self.creations_in_streak = 0
        self.generation_seen = 0
        self.deleted = False
        self.stopped: set[tuple[str, int]] = set()

    @initialize(ranks=st.integers(1, 3), spread=st.booleans(), local=st.booleans())
    def place(self, ranks, spread, local):
        self.world = self._fresh_world(ranks, spread, local)
        self.inputs.append(("place", ranks, spread, local))

    @staticmethod
    def _fresh_world(ranks: int, spread: bool, local: bool) -> World:
        """``local``: the model is on its nodes already (nothing downloaded)."""
        nodes = [f"n{r}" for r in range(ranks)] if spread else ["n0"]
        cluster = Cluster()
        slots = [fsm.Slot(r, nodes[r] if spread else "n0", f"i/{r}") for r in range(ranks)]
        cluster.place("i", MODEL, slots, policy=POLICY, local=local)
        return World(cluster, nodes)

    # -- inputs --------------------------------------------------------------------

    def _do(self, *entry) -> None:
        self.inputs.append(entry)
        apply_input(self.world, entry)

    @rule(node=st.integers(0, 2))
    def run_planner(self, node):
        self._do("plan", node % len(self.world.nodes))

    @rule(data=st.data(), ok=st.booleans())
    @precondition(lambda self: self.world.pending)
    def complete(self, data, ok):
        self._do("deliver", data.draw(st.integers(0, len(self.world.pending) - 1)), ok)

    @rule(rank=st.integers(0, 2), how=st.sampled_from(["kill", "exit0", "exception", "fatal", "stall"]))
    def fail_runner(self, rank, how):
        self._do("fail", rank, how)

    @rule(how=st.sampled_from(["kill", "exception"]))
    def every_rank_fails(self, how):
        """All ranks fail together: one retry, and no deadlock between the nodes."""
        for rank in range(3):
            self._do("fail", rank, how)

    @rule(rank=st.integers(0, 2))
    def stale_event(self, rank):
        entry = self.world.cluster.runners.get(f"i/{rank % 3}")
        machine = None if entry is None else entry.machine
        if machine is None or machine.incarnation == 0:
            return
        before = self.world.cluster.to_dict()
        out = self.world.cluster.runner_event(rn.Stop(machine.runner_id, machine.incarnation - 1), self.world.now)
        assert not out.accepted and self.world.cluster.to_dict() == before  # 7

    @rule(dt=st.sampled_from([0.1, 1.0, 2.5, 8.0, 45.0]))
    def advance_clock(self, dt):
        self._do("advance", dt)

    @rule()
    def request(self):
        self._do("request")

    @rule()
    def delete(self):
        self._do("delete")

    @rule()
    def restart(self):
        """The daemon restarts: every machine goes through its dict form."""
        before = self.world.cluster.to_dict()
        restored = Cluster.from_dict(before)
        assert restored.to_dict() == before
        restored.log = self.world.cluster.log  # the transition log is persisted on its own
        self.world.cluster = restored

    @rule()
    def eventually_ready_or_deleted(self):
        """10: from here, a benign world reaches Ready or Deleted, and every runner of a Deleted instance stops."""
        probe = World(Cluster.from_dict(self.world.cluster.to_dict()), self.world.nodes, self.world.now)
        probe.pending = list(self.world.pending)
        probe.requests = dict(self.world.requests)
        probe.settle()
        machine = probe.cluster.instance("i")
        assert machine.instance_state in (fsm.InstanceState.READY, fsm.InstanceState.DELETED), machine.leaf
        if machine.is_deleted:
            assert not any(m.alive for m in machines(probe.cluster))
        else:
            assert all(m.runner_state is fsm.RunnerState.READY for m in machines(probe.cluster))

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def absorbing_states(self):  # 1
        machine = self.world.cluster.instance("i")
        if self.deleted:
            assert machine.is_deleted
        self.deleted = machine.is_deleted
        for m in machines(self.world.cluster):
            key = (m.runner_id, m.incarnation)
            if key in self.stopped:
                assert m.phase is fsm.RunnerPhase.STOPPED, "Shutdown was left"
            if m.phase is fsm.RunnerPhase.STOPPED:
                self.stopped.add(key)

    @invariant()
    def failed_only_to_shutdown(self):  # 2
        for entry in self.world.cluster.log:
            if entry.machine == "runner" and entry.source == "failed":
                assert entry.target == "stopped"

    @invariant()
    def one_generation_at_most_n(self):  # 6, the same check the model checker makes
        check_runners(self.world.cluster)

    @invariant()
    def creations_per_streak(self):  # 4 (and 3 is checked on the instance machine alone)
        machine = self.world.cluster.instance("i")
        if machine.attempts == 0:
            self.creations_in_streak = 0 if machine.generation == self.generation_seen else 1
        elif machine.generation != self.generation_seen:
            self.creations_in_streak += machine.generation - self.generation_seen
        self.generation_seen = machine.generation
        assert self.creations_in_streak <= POLICY.max_failures + 1

    @invariant()
    def owed_is_read_from_the_state(self):
        """`Cluster.owed`, derived from the state alone, names exactly the reports the world holds that still
        mean something (a publish stops being owed once its runner failed or is being stopped)."""
        cluster = self.world.cluster

        def meant(op: Owed) -> bool:
            if not applies(cluster, op):
                return False
            if op.report is Report.PUBLISHED:
                machine = cluster.runner(op.key)
                return not machine.stop_requested and machine.runner_state in (
                    fsm.RunnerState.IDLE,
                    fsm.RunnerState.CONNECTING,
                )
            return True

        assert set(cluster.owed()) == {op for op in self.world.pending if meant(op)}

    @invariant()
    def budget_bounded(self):
        machine = self.world.cluster.instance("i")
        assert machine.attempts <= POLICY.max_failures

    def teardown(self) -> None:
        """9: replaying the same inputs gives the same states."""
        if not self.inputs:
            return
        _, ranks, spread, local = self.inputs[0]
        replay = self._fresh_world(ranks, spread, local)
        for entry in self.inputs[1:]:
            apply_input(replay, entry)
        assert replay.cluster.log == self.world.cluster.log
        assert replay.cluster.to_dict() == self.world.cluster.to_dict()


def machines(cluster: Cluster) -> list[fsm.RunnerLifecycle]:
    return [entry.machine for entry in cluster.runners.values()]


def apply_input(world: World, entry: tuple) -> None:
    kind, *args = entry
    cluster = world.cluster
    if kind == "plan":
        world.step(world.nodes[args[0]])
    elif kind == "deliver":
        index, ok = args
        if index < len(world.pending):
            world.deliver(index, ok=ok)
    elif kind == "fail":
        rank, how = args
        entry = cluster.runners.get(f"i/{rank}")
        machine = None if entry is None else entry.machine
        if machine is None or not machine.alive:
            return
        rid, inc = machine.runner_id, machine.incarnation
        if how == "kill":
            cluster.runner_event(rn.Exited(rid, inc, exit_code=-9), world.now)
        elif how == "exit0":
            cluster.runner_event(rn.Exited(rid, inc, exit_code=0), world.now)
        elif machine.runner_state is not fsm.RunnerState.FAILED:
            failure = {
                "exception": fsm.Failure.exception("RuntimeError", "boom"),
                "fatal": fsm.Failure.exception("FileNotFoundError", "model.safetensors", retryable=False),
                "stall": fsm.Failure.stalled(machine.leaf, 30.0),
            }[how]
            cluster.runner_event(rn.Fail(rid, inc, failure=failure), world.now)
    elif kind == "advance":
        world.now += args[0]
        cluster.instance_event(fsm.instance.Tick("i", world.now))
    elif kind == "request":
        world.submit(f"req{len(cluster.log)}", "i")
    elif kind == "delete":
        cluster.delete("i", world.now)


TestSystem = System.TestCase
TestSystem.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
