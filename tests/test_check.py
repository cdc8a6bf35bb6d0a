"""fsm.check: the model checker proves the real machines, and finds each seed's original bug when planted."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fsm
from fsm import runner as rn
from fsm._machine import Outcome, Step
from fsm.check import CheckConfig, check


def test_the_real_system_is_exhaustively_correct_for_two_ranks_and_five_retries():
    result = check(CheckConfig(ranks=2, policy=fsm.RetryPolicy(max_failures=5)))
    assert result.ok, result.report()
    assert result.exhaustive and result.horizon is not None
    # the space covers every ending, a full give-up included
    assert {"ready", "deleted:retries_exhausted", "deleted:non_retryable", "deleted:requested"} <= result.reached
    assert result.states > 10_000


def test_the_transition_table_changes_nothing_but_speed():
    config = CheckConfig(policy=fsm.RetryPolicy(max_failures=2))
    fast, slow = check(config), check(attrs.evolve(config, transition_table=False))
    assert (fast.states, fast.transitions, fast.reached) == (slow.states, slow.transitions, slow.reached)
    assert fast.ok and slow.ok


# -- the seeds' bugs, planted in copies ------------------------------------------------------


class RevivingRunner(rn.RunnerLifecycle):
    """exo before 000: `connect` accepted from Failed, reviving the runner."""

    def apply(self, event: rn.RunnerEvent) -> Outcome:
        if isinstance(event, rn.Connect) and self.leaf == "failed":
            self.reload(attrs.evolve(self.snapshot(), leaf="joining"))
            return Outcome(True, (Step("connect", "failed", "joining"),))
        return super().apply(event)


def reviving_plan(view, node_id, now):
    """…and a planner that, like exo's, connects runners that are Idle *or Failed*."""
    actions = fsm.plan(view, node_id, now)
    for runner in view.runners.values():
        failed = runner.state is fsm.RunnerState.FAILED
        if runner.node_id == node_id and failed and runner.endpoint is not None:  # its ring known, like exo's
            actions.append(fsm.ConnectRunner(runner.runner_id, runner.incarnation))
    return actions


def no_sibling_stop_plan(view, node_id, now):
    """exo before 000: a runner is not stopped when its sibling failed (no one_for_all)."""
    dropped = (fsm.StopReason.SIBLING_FAILED, fsm.StopReason.RECOVERING)
    return [a for a in fsm.plan(view, node_id, now) if not (isinstance(a, fsm.StopRunner) and a.reason in dropped)]


def waits_for_siblings_plan(view, node_id, now):
    """000 without its exception: nobody is created while a sibling failed, even if we failed too."""

    def blocked(action):
        if not isinstance(action, fsm.CreateRunner):
            return False
        siblings = [s for s in view.instances[action.instance_id].slots if s.runner_id != action.runner_id]
        return any((r := view.runners.get(s.runner_id)) is not None and r.failed for s in siblings)

    return [a for a in fsm.plan(view, node_id, now) if not blocked(a)]


def found(config: CheckConfig, invariant: str) -> tuple[str, ...]:
    result = check(config)
    assert not result.ok, f"the planted bug was not found: {result.report()}"
    assert result.violation.invariant.startswith(invariant), result.report()
    assert result.violation.trace and "shortest trace" in result.report()
    return result.violation.trace


def test_connect_from_failed_is_found():
    trace = found(CheckConfig(runner_cls=RevivingRunner, plan=reviving_plan), "2 Failed left only to Shutdown")
    assert any(e.startswith(("error", "crash")) for e in trace)


def test_missing_sibling_failed_rule_is_found_as_a_deadlock():
    trace = found(CheckConfig(plan=no_sibling_stop_plan), "10 no deadlock")
    assert any(e.startswith(("error", "crash", "fatal")) for e in trace)


def test_both_failed_without_the_failed_before_exception_is_found_as_a_deadlock():
    trace = found(CheckConfig(plan=waits_for_siblings_plan, deletes=False), "10 no deadlock")
    assert sum(e.startswith(("error", "crash")) for e in trace) >= 2  # both ranks had to fail


# -- host failures: free, but never early ------------------------------------------------------------

HOST_FAULTS = CheckConfig(ranks=2, policy=fsm.RetryPolicy(max_failures=2), faults=("crash", "host"), horizon=30.0)


def test_host_failures_spend_no_retry_and_still_wait_the_backoff():
    result = check(HOST_FAULTS)
    assert result.ok, result.report()
    assert result.exhaustive and {"ready", "deleted:retries_exhausted"} <= result.reached


class ChargesNothing(fsm.InstanceRetry):
    """An instance that counts every failure as uncharged, whoever caused it: the budget never runs out."""

    def _count_failure(self, failure):
        self.uncharged += 1
        self.last_failure = failure
        self.ready_since = None


def ignores_the_backoff_plan(view, node_id, now):
    """A planner that restarts a backing-off instance at once (what exo's tight loops did)."""
    actions = fsm.plan(view, node_id, now)
    for inst in view.instances.values():
        alive = any(r is not None and r.alive for _, r in view.slot_runners(inst))
        if inst.leader == node_id and inst.retry.state is fsm.InstanceState.BACKING_OFF and not alive:
            actions.append(fsm.StartGeneration(inst.instance_id, inst.retry.generation + 1))
    return actions


def test_an_instance_that_charges_nothing_is_found_starting_too_many_generations():
    trace = found(attrs.evolve(HOST_FAULTS, ranks=1, faults=("crash",), instance_cls=ChargesNothing), "4 creations")
    assert sum(e.startswith("crash") for e in trace) == 3  # max_failures + 1 charged starts, then one too many


def test_restarting_before_the_backoff_after_a_host_failure_is_found():
    trace = found(attrs.evolve(HOST_FAULTS, ranks=1, faults=("host",), plan=ignores_the_backoff_plan), "5 no start")
    assert any(e.startswith("host") for e in trace)


# -- reload, the checker's shortcut, is from_snapshot ------------------------------------------

EVENTS = st.sampled_from(
    [
        lambda i: rn.Connect("r", i),
        lambda i: rn.Connected("r", i),
        lambda i: rn.Load("r", i),
        lambda i: rn.Progress("r", i, layers_loaded=1, layers_total=2),
        lambda i: rn.WeightsLoaded("r", i),
        lambda i: rn.WarmUp("r", i),
        lambda i: rn.Warmed("r", i),
        lambda i: rn.RequestStarted("r", i),
        lambda i: rn.RequestFinished("r", i),
        lambda i: rn.Fail("r", i, failure=fsm.Failure.signalled(9)),
        lambda i: rn.Stop("r", i),
        lambda i: rn.Exited("r", i, exit_code=0),
    ]
)


@settings(max_examples=150, deadline=None)
@given(st.lists(EVENTS, max_size=15), st.integers(1, 3))
def test_reload_agrees_with_from_snapshot_on_every_reachable_state(events, world_size):
    reference = rn.RunnerLifecycle("r", world_size=world_size, incarnation=1)
    pooled = rn.RunnerLifecycle("r", world_size=world_size, incarnation=1)
    pooled.apply(rn.Fail("r", 1, failure=fsm.Failure.signalled(15)))  # somewhere else entirely
    pooled.apply(rn.Exited("r", 1, exit_code=0))
    for make in events:
        pooled.reload(reference.snapshot())
        fresh = rn.RunnerLifecycle.from_snapshot(reference.snapshot())
        assert (pooled.to_dict(), pooled.path) == (fresh.to_dict(), fresh.path)
        outcomes = []
        for machine in (pooled, fresh, reference):
            try:
                outcomes.append(machine.apply(make(1)))
            except fsm.IllegalTransition as exc:
                outcomes.append(type(exc))
        assert outcomes[0] == outcomes[1] == outcomes[2]
        assert pooled.to_dict() == fresh.to_dict() == reference.to_dict()


def test_requests_are_forwarded_finished_or_cancelled_and_only_to_ready_runners():
    result = check(CheckConfig(requests=1, policy=fsm.RetryPolicy(max_failures=2)))
    assert result.ok and result.exhaustive, result.report()


def eager_plan(view, node_id, now):
    """A planner that forwards requests without waiting for every rank to be Ready."""
    actions = fsm.plan(view, node_id, now)
    for request in view.requests:
        for runner in view.runners.values():
            if (
                runner.node_id == node_id
                and runner.alive
                and not any(isinstance(a, fsm.ForwardRequest) and a.runner_id == runner.runner_id for a in actions)
            ):
                actions.append(fsm.ForwardRequest(request.request_id, runner.runner_id, runner.incarnation))
    return actions


def test_forwarding_to_a_runner_that_is_not_ready_is_found():
    found(CheckConfig(requests=1, policy=fsm.RetryPolicy(max_failures=2), plan=eager_plan), "requests go to Ready")


def unpublished_connect_plan(view, node_id, now):
    """A planner without the ring guard: it connects every Idle rank of a whole generation at once."""
    actions = [a for a in fsm.plan(view, node_id, now) if not isinstance(a, fsm.ConnectRunner)]
    for runner in view.runners.values():
        if runner.node_id == node_id and runner.state is fsm.RunnerState.IDLE:
            actions.append(fsm.ConnectRunner(runner.runner_id, runner.incarnation))
    return actions


def test_connecting_before_every_rank_endpoint_is_published_is_found():
    trace = found(CheckConfig(plan=unpublished_connect_plan), "connect only once every rank's endpoint is published")
    assert not any(e.startswith("published") for e in trace[-2:])


# -- several hosts: nodes die, are cut off, heal; leases expire ----------------------------------------

NODES = CheckConfig(
    ranks=2, hosts=3, node_failures=2, faults=(), deletes=False, policy=fsm.RetryPolicy(max_failures=1), horizon=30.0
)


def test_three_nodes_two_ranks_two_node_failures_never_run_two_generations_and_always_settle():
    """Kills, cuts and heals in every order, with leases expiring only after a cut node fenced itself."""
    result = check(NODES)
    assert result.ok, result.report()
    assert result.exhaustive and "ready" in result.reached


def test_node_failures_with_runner_faults_and_deletes_hold_too():
    result = check(attrs.evolve(NODES, node_failures=1, faults=("crash", "error"), deletes=True))
    assert result.ok, result.report()
    assert result.exhaustive and {"ready", "deleted:requested"} <= result.reached


def test_a_controller_that_does_not_wait_for_the_old_generations_keys_is_found():
    """It takes a lost runner for exited at once: the next generation starts on a live node while the old
    one still runs on a cut node that has not fenced itself yet."""
    trace = found(attrs.evolve(NODES, waits_for_keys=False), "6 one generation at a time, on the hosts")
    assert any(e.startswith("cut") for e in trace) and len(trace) <= 10
    assert not any(e.startswith("fence") for e in trace)


def test_the_nodes_need_at_least_one_per_rank_and_node_failures_need_nodes():
    with pytest.raises(ValueError, match="at least ranks"):
        CheckConfig(ranks=3, hosts=2)
    with pytest.raises(ValueError, match="needs hosts"):
        CheckConfig(node_failures=1)


def test_policy_variants_are_explored_as_themselves():
    """The give-up rule and the budget reset are policy fields (#27), and the checker sees them: never giving
    up reaches no retries_exhausted deletion within a horizon where two retries are long spent, never
    refilling reaches no reset, each in a space of its own; a planted budget that refills anyway is found."""
    backoff = fsm.Backoff(1.0, 2.0, 4.0)  # a third failed generation starts by t = 7: past the default's give-up
    base = CheckConfig(ranks=2, horizon=8.0, policy=fsm.RetryPolicy(backoff, max_failures=2, reset_after=10.0))
    never = check(attrs.evolve(base, policy=attrs.evolve(base.policy, max_failures=None)))
    spent = check(attrs.evolve(base, policy=attrs.evolve(base.policy, reset_after=None), horizon=None))
    default, refilling = check(base), check(attrs.evolve(base, horizon=None))  # horizon None: past a reset
    assert all(r.ok and r.exhaustive for r in (never, spent, default, refilling)), never.report()
    assert "deleted:retries_exhausted" in default.reached and "deleted:retries_exhausted" not in never.reached
    assert never.states != default.states and spent.states != refilling.states

    class RefillsAnyway(fsm.InstanceRetry):
        def _observe(self, now: float) -> None:
            super()._observe(now)
            if self.leaf == "ready":
                self.attempts = self.uncharged = 0

    planted = check(
        attrs.evolve(base, policy=attrs.evolve(base.policy, reset_after=None), horizon=None, instance_cls=RefillsAnyway)
    )
    assert planted.violation is not None and planted.violation.invariant.startswith("8 "), planted.report()


# -- residency: parking and unparking (issue #29) ------------------------------------------------

# One rank, parked by its plan the moment it is idle (keep-alive 0) and once more from outside (an operator,
# or an eviction for another instance that starts), two requests: requests come while it parks, while it is
# parked and while it comes back; a rank fails while it parks and while it comes back.
PARKING = CheckConfig(ranks=1, requests=2, parks=1, keep_alive=0.0, policy=fsm.RetryPolicy(max_failures=2))


FAULT_KINDS = ("crash", "error", "fatal")


def test_parking_and_unparking_are_exhaustively_correct():
    """Exhaustive over the interleavings that matter, not only its endings: a request arriving while the
    instance parks, is parked and comes back; each fault while it parks and while it comes back (unparking);
    a download failing and an eviction while it comes back."""
    result = check(PARKING)
    assert result.ok, result.report()
    assert result.exhaustive
    assert {"parking", "parked", "ready", "deleted:retries_exhausted"} <= result.reached
    wanted = {(where, "submit") for where in ("parking", "parked", "unparking")}
    wanted |= {(where, fault) for where in ("parking", "unparking") for fault in FAULT_KINDS}
    wanted |= {("unparking", "fail"), ("unparking", "park")}
    assert wanted <= result.explored, sorted(wanted - result.explored)


def test_a_keep_alive_parks_a_two_rank_instance_by_its_plan_and_a_request_brings_it_back():
    result = check(CheckConfig(ranks=2, requests=1, keep_alive=3.0, policy=fsm.RetryPolicy(max_failures=2)))
    assert result.ok and result.exhaustive, result.report()
    assert {"parking", "parked"} <= result.reached


class BusyParking(fsm.InstanceRetry):
    """A machine whose park ignores the requests in flight."""

    @staticmethod
    def idle(busy: int) -> bool:
        return True


class ChargedParking(fsm.InstanceRetry):
    """A machine whose park spends a retry."""

    def _park(self) -> None:
        super()._park()
        self.attempts += 1


class ForgetfulParking(fsm.InstanceRetry):
    """A machine that forgets its live ranks when it parks: it is parked with its processes still running."""

    def _park(self) -> None:
        super()._park()
        self.live_ranks.clear()


def never_unparks_plan(view, node_id, now):
    return [a for a in fsm.plan(view, node_id, now) if not isinstance(a, fsm.UnparkInstance)]


def parks_busy_plan(view, node_id, now):
    """A planner that parks a Ready instance as soon as a request is in flight on it."""
    actions = fsm.plan(view, node_id, now)
    for inst in view.instances.values():
        busy = any(r is not None and r.in_flight for _, r in view.slot_runners(inst))
        if inst.retry.state is fsm.InstanceState.READY and busy:
            actions.append(fsm.ParkInstance(inst.instance_id, fsm.ParkReason.IDLE))
    return actions


@pytest.mark.parametrize(
    ("config", "invariant", "needs"),
    [
        (attrs.evolve(PARKING, instance_cls=BusyParking, keep_alive=None), "13 park only when idle", "submit"),
        (attrs.evolve(PARKING, instance_cls=ChargedParking), "12 parking spends no retry", "park"),
        (attrs.evolve(PARKING, instance_cls=ForgetfulParking), "11 parked means no process", "park"),
        (attrs.evolve(PARKING, plan=never_unparks_plan), "10 no deadlock", "submit"),
    ],
    ids=["busy", "charged", "forgetful", "never-unparks"],
)
def test_a_residency_bug_is_found(config, invariant, needs):
    """Each found, on a shortest trace that parks the instance (or sends the request the bug needs)."""
    assert needs in found(config, invariant)


def test_a_plan_that_parks_a_busy_instance_is_refused_by_the_machine_and_found():
    found(attrs.evolve(PARKING, plan=parks_busy_plan, keep_alive=None), "actions apply")


# -- two instances sharing a node's memory (issue #29): eviction, for real ---------------------------------

# Two instances of one rank on one node that holds one rank: placing the second, or unparking either, goes
# through `fsm.admit` / `fsm.admit_unpark` and evicts the other when it is idle. Two requests (one can be in
# flight on one instance while the other's waits); a rank may report an error (its process lives on, Failed,
# until it is stopped), which spends the one retry; a keep-alive of 1 s, so that an idle instance is there to
# evict before its plan parks it; the clock up to t=4 s (every future ends before).
TWO = CheckConfig(
    instances=2,
    ranks=1,
    node_memory=1,
    requests=2,
    keep_alive=1.0,
    horizon=4.0,
    faults=("error",),
    deletes=False,
    download_failures=0,
    policy=fsm.RetryPolicy(fsm.Backoff(1.0, 2.0, 2.0), max_failures=1, reset_after=None),
)


def test_two_instances_sharing_a_node_are_exhaustively_correct():
    """Every invariant holds for each instance, eviction parks only idle ones, the node never holds more than
    its memory, and every request is served; and the interleavings issue #29 names were explored: an eviction
    (for a placement and for an unpark) while the other instance starts, the evicted one parking while the other
    waits to start (an error of its rank meanwhile), a request for the parked one beside the other Ready (it
    must evict) or starting (it must wait), and a failure while unparking."""
    result = check(TWO)
    assert result.ok, result.report()
    assert result.exhaustive and result.horizon is None, result.report()
    assert {"parked", "j:parked", "ready", "j:ready", "deleted:retries_exhausted"} <= result.reached
    wanted = {
        ("ready", "evict", "pending"),  # placing j parks the idle i
        ("ready", "evict", "unparking"),  # a request for a parked one parks the idle other
        ("parking", "plan", "unparking"),  # the evicted one is still stopping: the other's plan waits
        ("parking", "complete", "unparking"),  # its process is reaped: now the other may start
        ("parking", "error", "unparking"),  # its rank fails while it parks and the other waits
        ("unparking", "submit", "parking"),  # a request for the one coming back, while the other parks
        ("parked", "submit", "ready"),  # a request for the parked one, the other Ready: it must evict
        ("parked", "submit", "unparking"),  # … the other starting: it must wait
        ("parked", "submit", "starting"),
        ("unparking", "error", "parked"),  # a failure while unparking
    }
    assert wanted <= result.beside, sorted(wanted - result.beside)
    assert result.states > 10_000


def test_several_instances_are_checked_on_one_node_per_rank_and_never_kept_forever_in_too_little_memory():
    with pytest.raises(ValueError, match="leave hosts 0"):
        CheckConfig(instances=2, ranks=1, hosts=2)
    with pytest.raises(ValueError, match="keep_alive"):
        CheckConfig(instances=2, ranks=1, node_memory=1)
    assert CheckConfig(instances=2, ranks=1, node_memory=2).keep_alive is None  # both fit: nothing is evicted


def blind_to_requests(admission):
    """An admission (`fsm.admit` or `fsm.admit_unpark`) that does not see the requests in flight: it takes an
    instance busy serving for an idle one, and names it to evict."""

    def admit(*args, view, **inputs):
        quiet = {rid: attrs.evolve(r, in_flight=0) for rid, r in view.runners.items()}
        return admission(*args, view=attrs.evolve(view, runners=quiet), **inputs)

    return admit


@pytest.mark.parametrize("which", ["admit", "admit_unpark"])
def test_an_eviction_of_an_instance_serving_a_request_is_found(which):
    """14, for a placement and for an unpark: the shortest trace serves a request on the instance it evicts."""
    planted = {which: blind_to_requests(getattr(fsm, which))}
    result = check(attrs.evolve(TWO, **planted))
    assert not result.ok and result.violation.invariant == "14 eviction parks only idle instances", result.report()
    assert "request(s) in flight" in result.violation.message
    trace = result.violation.trace
    assert trace[-1].startswith("place j" if which == "admit" else "plan") and any(
        e.startswith("submit") for e in trace
    )


class ImpatientCluster(fsm.Cluster):
    """A cluster that creates a runner on a node while another instance there is still parking (the plan's rule,
    held at execution, left out)."""

    def _create_runner(self, action, now):
        kept = dict(self.instances)
        for iid, placement in kept.items():
            if iid != action.instance_id and placement.machine.instance_state is fsm.InstanceState.PARKING:
                del self.instances[iid]
        try:
            return super()._create_runner(action, now)
        finally:
            self.instances.clear()
            self.instances.update(kept)


def impatient_plan(view, node_id, now):
    """`fsm.plan` without `_create_runners`' wait for a parking instance's processes to be reaped."""
    actions = fsm.plan(view, node_id, now)
    parking = fsm.InstanceState.PARKING
    unseen = attrs.evolve(view, instances={k: v for k, v in view.instances.items() if v.retry.state is not parking})
    starts = [a for a in fsm.plan(unseen, node_id, now) if isinstance(a, fsm.CreateRunner) and a not in actions]
    return actions + starts


def test_a_start_before_the_evicted_instances_runners_are_reaped_is_found():
    """15: the evicted instance's runner still stops on the node when the newcomer's is created there."""
    trace = found(attrs.evolve(TWO, plan=impatient_plan, cluster_cls=ImpatientCluster), "15 memory within")
    evictions = [(n, event.split("evicting ")[1].rstrip(")")) for n, event in enumerate(trace) if "evicting" in event]
    assert evictions, trace
    n, evicted = evictions[-1]
    assert not any(f"exited {evicted}/0" in event for event in trace[n:])  # never reaped before the violation
