"""Hypothesis stateful tests for each machine alone: random events, invariants after every step."""

from __future__ import annotations

import attrs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import fsm
from fsm import download as dl
from fsm import instance as it
from fsm import runner as rn

SETTINGS = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

FAILURES = st.sampled_from(
    [
        fsm.Failure.signalled(9),
        fsm.Failure.exited(1),
        fsm.Failure.stalled("weights", 30),
        fsm.Failure.peer_failed(0),
        fsm.Failure.exception("ValueError", "corrupt", retryable=False),
    ]
)


class RunnerMachine(RuleBasedStateMachine):
    """Any event, any order: the machine either moves legally or refuses and stays put."""

    def __init__(self) -> None:
        super().__init__()
        self.m: rn.RunnerLifecycle | None = None
        self.reaped = False

    @rule(world_size=st.integers(1, 4), data=st.data())
    @precondition(lambda self: self.m is None)
    def create(self, world_size, data):
        rank = data.draw(st.integers(0, world_size - 1))
        self.m = rn.RunnerLifecycle("r", rank=rank, world_size=world_size, incarnation=3)

    def _send(self, event: rn.RunnerEvent) -> None:
        assert self.m is not None
        before = self.m.to_dict()
        try:
            out = self.m.apply(event)
        except fsm.IllegalTransition:
            assert self.m.to_dict() == before, "a refused event changed the machine"
            return
        for step in out.steps:
            if step.source == "failed":
                assert step.target == "stopped", f"Failed left to {step.target}"
            if step.target == "joining":
                assert before["leaf"] == "idle" and self.m.world_size > 1, "connect from elsewhere than Idle"
            assert not self.reaped, "a reaped runner moved"
        if not self.m.alive:
            self.reaped = True

    @rule(
        kind=st.sampled_from(
            [
                rn.Connect,
                rn.Connected,
                rn.Load,
                rn.WeightsLoaded,
                rn.WarmUp,
                rn.Warmed,
                rn.RequestStarted,
                rn.RequestFinished,
                rn.Stop,
            ]
        )
    )
    @precondition(lambda self: self.m is not None)
    def plain_event(self, kind):
        self._send(kind("r", 3))

    @rule(loaded=st.integers(0, 8))
    @precondition(lambda self: self.m is not None)
    def progress(self, loaded):
        self._send(rn.Progress("r", 3, layers_loaded=loaded, layers_total=8))

    @rule(failure=FAILURES)
    @precondition(lambda self: self.m is not None)
    def fail(self, failure):
        self._send(rn.Fail("r", 3, failure=failure))

    @rule(code=st.sampled_from([0, 1, -9, -15]))
    @precondition(lambda self: self.m is not None)
    def exited(self, code):
        was_stopping = self.m.leaf == "stopping"
        was_alive = self.m.alive
        had_failure = self.m.failure
        self._send(rn.Exited("r", 3, exit_code=code))
        assert self.m.leaf == "stopped", "an exit always ends in Shutdown.stopped"
        if was_stopping:
            assert self.m.failure == had_failure, "a clean stop recorded a failure"
        elif was_alive and had_failure is None:
            assert self.m.failure is not None, "an unexpected exit was not a failure"

    @rule(kind=st.sampled_from([rn.Connect, rn.Stop, rn.Load]))
    @precondition(lambda self: self.m is not None)
    def stale(self, kind):
        before = self.m.to_dict()
        assert not self.m.apply(kind("r", 2)).accepted
        assert self.m.to_dict() == before

    @rule()
    @precondition(lambda self: self.m is not None)
    def round_trip(self):
        restored = rn.RunnerLifecycle.from_dict(self.m.to_dict())
        assert restored.to_dict() == self.m.to_dict()
        assert restored.path == self.m.path
        self.m = restored

    @invariant()
    def consistent(self):
        if self.m is None:
            return
        assert (self.m.leaf == "busy") == (self.m.in_flight > 0)
        assert 0 <= self.m.layers_loaded <= max(self.m.layers_total, 0) or self.m.layers_total == 0
        if self.m.runner_state is fsm.RunnerState.FAILED:
            assert self.m.failure is not None
        if self.m.leaf == "stopped":
            assert self.m.is_terminated is False  # Shutdown.stopped is final inside Shutdown
            assert self.m.enabled_events() == []


class InstanceMachine(RuleBasedStateMachine):
    """Random rank events, stale and current generations, clock jumps, deletes, restores."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = it.RetryPolicy(backoff=fsm.Backoff(1.0, 2.0, 8.0), max_failures=4, reset_after=50.0)
        self.m = it.InstanceRetry("i", world_size=2, policy=self.policy)
        self.now = 0.0
        self.streak_delays: list[float] = []
        self.deleted = False
        self.starts_in_streak = 0

    def _send(self, event: it.InstanceEvent) -> None:
        before = self.m.to_dict()
        before_attempts = self.m.attempts
        try:
            out = self.m.apply(event)
        except (fsm.IllegalTransition, fsm.IncarnationMismatch, fsm.InvalidEvent):
            assert self.m.to_dict() == before
            return
        if self.deleted:
            assert not out.accepted and self.m.to_dict() == before, "Deleted did not absorb"
        if self.m.attempts < before_attempts:  # a reset
            assert before["leaf"] == "ready" and before["ready_since"] is not None
            assert self.m.clock - before["ready_since"] >= self.policy.reset_after
            self.streak_delays.clear()
            self.starts_in_streak = 0
        for step in out.steps:
            if step.target == "backing_off":
                delay = self.m.deadline - self.m.clock
                ceiling = self.policy.backoff.ceiling(self.m.attempts)
                assert min(1.0, 8.0) <= delay <= 8.0
                assert delay == ceiling
                assert not self.streak_delays or delay >= self.streak_delays[-1], "delays decreased in a streak"
                self.streak_delays.append(delay)
            if step.target == "starting":
                assert before["deadline"] is None or self.m.clock >= before["deadline"], "started before deadline"
                self.starts_in_streak += 1
                assert self.starts_in_streak <= self.policy.max_failures + 1
        self.deleted = self.m.is_deleted

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0, 60.0]))
    def advance(self, dt):
        self.now += dt
        engine = it.InstanceRetry.from_dict(self.m.to_dict(), policy=self.policy)
        self._send(it.Tick("i", self.now))
        if not engine.is_deleted:  # `apply` takes a tick past the engine where it can: the engine's tick agrees
            engine._observe(self.now)
            engine._fire("tick")
            assert engine.to_dict() == self.m.to_dict()

    @rule(delta=st.sampled_from([-1, 0, 0, 1]))
    def start(self, delta):
        self._send(it.Start("i", self.now, max(self.m.generation + delta, 0)))

    @rule(
        rank=st.integers(0, 1),
        gen_delta=st.sampled_from([-1, 0, 0, 0]),
        kind=st.sampled_from(["created", "ready", "stopped"]),
    )
    def rank_event(self, rank, gen_delta, kind):
        cls = {"created": it.RankCreated, "ready": it.RankReady, "stopped": it.RankStopped}[kind]
        self._send(cls("i", self.now, self._generation(rank, gen_delta), rank))

    def _generation(self, rank: int, delta: int) -> int:
        """The generation a rank event names: the instance's, give or take (one_for_one: the rank's own)."""
        return max(self.m.generation + delta, 0)

    @rule(rank=st.integers(0, 1), gen_delta=st.sampled_from([-1, 0, 0]), failure=FAILURES)
    def rank_failed(self, rank, gen_delta, failure):
        before_state, before_attempts = self.m.leaf, self.m.attempts
        self._send(it.RankFailed("i", self.now, self._generation(rank, gen_delta), rank, failure=failure))
        assert self.m.attempts <= before_attempts + 1, "one failure cost more than one retry"
        if before_state == "recovering" and self.m.leaf != "deleted":
            assert self.m.attempts == before_attempts, "a second failure in one generation cost a retry"

    @rule(rank=st.integers(0, 1), gen_delta=st.sampled_from([-1, 0, 0]), failure=FAILURES)
    def rank_failed_while_stopping(self, rank, gen_delta, failure):
        before_state, before_attempts = self.m.leaf, self.m.attempts
        generation = self._generation(rank, gen_delta)
        self._send(it.RankFailedWhileStopping("i", self.now, generation, rank, failure=failure))
        assert (self.m.leaf, self.m.attempts) == (before_state, before_attempts), "a stop we asked for cost a retry"

    @rule()
    def delete(self):
        self._send(it.Delete("i", self.now))
        assert self.m.is_deleted

    @rule()
    def round_trip(self):
        restored = it.InstanceRetry.from_dict(self.m.to_dict())
        assert restored.to_dict() == self.m.to_dict()
        self.m = restored

    @invariant()
    def bounded(self):
        assert 0 <= self.m.attempts <= self.policy.max_failures
        if self.m.leaf == "backing_off":
            assert self.m.deadline is not None and not self.m.live_ranks
        if self.m.is_deleted:
            assert self.m.deadline is None and self.m.delete_reason is not None
        if self.m.attempts == self.policy.max_failures:
            assert self.m.delete_reason is fsm.DeleteReason.RETRIES_EXHAUSTED

    @invariant()
    def reset_when_ready_long_enough(self):  # 8, the "if" half (the "only if" half is checked in _send)
        m = self.m
        if m.leaf == "ready" and m.ready_since is not None and m.clock - m.ready_since >= self.policy.reset_after:
            assert m.attempts == 0


class OneForOneMachine(InstanceMachine):
    """The same, with the ranks as independent replicas: each rank's events name its own generation, and a
    failed rank is restarted alone (`StartRank`)."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = attrs.evolve(self.policy, strategy=it.RestartStrategy.ONE_FOR_ONE)
        self.m = it.InstanceRetry("i", world_size=2, policy=self.policy)

    def _generation(self, rank: int, delta: int) -> int:
        return max(self.m.rank_generations[rank] + delta, 0)

    @rule(rank=st.integers(0, 1))
    def bring_up(self, rank):
        """A rank's process comes up and is Ready: what a replica does between its failures."""
        self._send(it.RankCreated("i", self.now, self.m.rank_generations[rank], rank))
        self._send(it.RankReady("i", self.now, self.m.rank_generations[rank], rank))

    @precondition(lambda self: self.m.leaf == "degraded")
    @rule(rank=st.integers(0, 1))
    def reap_and_wait(self, rank):
        """A failed rank's process is reaped and its backoff waited out, so that restarts are explored."""
        if rank in self.m.failed_ranks and rank in self.m.live_ranks:
            self._send(it.RankStopped("i", self.now, self.m.rank_generations[rank], rank))
        deadline = self.m.rank_deadlines.get(rank)
        if deadline is not None and deadline > self.now:
            self.now = deadline

    @rule(rank=st.integers(0, 1), delta=st.sampled_from([0, 0, 1]))
    def start_rank(self, rank, delta):
        deadline, alive, others = (
            self.m.rank_deadlines.get(rank),
            rank in self.m.live_ranks,
            list(self.m.rank_generations),
        )
        generation = self.m.generation
        self._send(it.StartRank("i", self.now, generation + 1 + delta, rank))
        if self.m.generation != generation:  # taken
            assert deadline is not None and self.now >= deadline and not alive, "restarted before its backoff"
            others[rank] = generation + 1
            assert self.m.rank_generations == others, "a restart touched another rank"

    @rule(rank=st.integers(0, 1), gen_delta=st.sampled_from([-1, 0, 0]))
    def rank_lost(self, rank, gen_delta):
        """A supervisor restart lost this rank's process (`Cluster.recover`): charged nothing, due at once, and a
        late report of its exit re-arms no backoff."""
        before = (self.m.attempts, self.m.uncharged, dict(self.m.rank_deadlines))
        taken = self.m.generation
        self._send(it.RankLost("i", self.now, self._generation(rank, gen_delta), rank))
        if self.m.rank_deadlines != before[2] and rank in self.m.rank_deadlines:
            assert (self.m.attempts, self.m.uncharged) == before[:2], "a lost rank was charged"
            assert self.m.rank_deadlines[rank] == self.m.clock and rank not in self.m.live_ranks
            self._send(it.RankStopped("i", self.now + 1, self.m.rank_generations[rank], rank))
            assert self.m.rank_deadlines.get(rank) == self.m.clock - 1 or self.m.leaf == "deleted"
        assert self.m.generation == taken

    @invariant()
    def replicas_apart(self):
        m = self.m
        assert not (m.failed_ranks & m.ready_ranks)
        assert set(m.rank_deadlines) == {r for r in m.failed_ranks if r not in m.live_ranks}
        assert (m.leaf == "degraded") or not m.failed_ranks
        assert m.leaf not in ("recovering", "backing_off"), "one_for_one ended a whole generation"
        assert max(m.rank_generations) == m.generation or m.generation == 0 or m.leaf in ("parked", "pending")


class DownloadMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = dl.DownloadLifecycle("org/model")
        self.now = 0.0

    @rule(
        kind=st.sampled_from([dl.Begin, dl.Complete, dl.Retry, dl.LoadStarted, dl.Invalidate]),
        dt=st.sampled_from([0.0, 0.25, 1.0, 20.0]),
    )
    def event(self, kind, dt):
        self.now += dt
        before = self.m.to_dict()
        try:
            self.m.apply(kind("org/model", self.now))
        except fsm.IllegalTransition:
            assert self.m.to_dict() == before
            return
        if kind is dl.Retry:
            assert before["retry_at"] is None or self.now >= before["retry_at"], "retried before its backoff"
        if kind is dl.LoadStarted:
            assert self.m.attempts == 0 and self.m.retry_at is None

    @rule()
    def fail(self):
        attempts = self.m.attempts
        try:
            self.m.apply(dl.DownloadFailed("org/model", self.now, "offline"))
        except fsm.IllegalTransition:
            return
        assert self.m.attempts == attempts + 1
        assert self.m.retry_at == self.now + self.m.policy.delay(self.m.attempts)

    @rule()
    def round_trip(self):
        restored = dl.DownloadLifecycle.from_dict(self.m.to_dict())
        assert restored.to_dict() == self.m.to_dict()
        self.m = restored


TestRunnerMachine = RunnerMachine.TestCase
TestRunnerMachine.settings = SETTINGS
TestInstanceMachine = InstanceMachine.TestCase
TestInstanceMachine.settings = SETTINGS
TestOneForOneMachine = OneForOneMachine.TestCase
TestOneForOneMachine.settings = SETTINGS
TestDownloadMachine = DownloadMachine.TestCase
TestDownloadMachine.settings = SETTINGS
