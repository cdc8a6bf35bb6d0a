"""Two instances sharing a node under Hypothesis: one parked (by its keep-alive, an operator, or an eviction
for the other) while the other starts, requests for either at any moment, failures in any phase, restarts.

What `fsm.check` cannot reach with its one instance: the rules between instances. After every step: a parked
instance has no live process; no runner is created on a node while another instance there is still parking
(the memory it frees is not free until its processes are gone); parking and unparking spend no retry; and
from any state a benign world serves every request, each instance ending Ready, Parked or Deleted.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import fsm
from fsm import runner as rn
from fsm.cluster import Cluster
from fsm.world import World, check_runners

POLICY = fsm.RetryPolicy(backoff=fsm.Backoff(1.0, 2.0, 8.0), max_failures=3, reset_after=40.0)
IDS = ("a", "b")
RESTING = (fsm.InstanceState.READY, fsm.InstanceState.PARKED, fsm.InstanceState.DELETED)


class Residency(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.world: World
        self.spent: dict[str, tuple[int, int]] = {}
        self.seen_log = 0
        self.seen_create = 0
        self.leaf: dict[str, str] = {}  # each instance's leaf, as the log has it so far
        self.keep: float | None = None

    @initialize(ranks=st.integers(1, 2), keep=st.sampled_from([None, 0.0, 3.0]))
    def place(self, ranks, keep):
        """Instance a on node n0 (its second rank on n1); b comes later (`place_b`), on the same nodes."""
        self.keep = keep
        self.world = World(Cluster(), ["n0", "n1"])
        self._place("a", ranks)
        while self.world.cluster.instance("a").instance_state is not fsm.InstanceState.READY:  # a serves first
            self.world.step("n0")
            self.world.step("n1")
            self.world.deliver_all()

    def _place(self, iid: str, ranks: int) -> None:
        slots = [fsm.Slot(r, ("n0", "n1")[r], f"{iid}/{r}") for r in range(ranks)]
        self.world.cluster.place(iid, f"org/{iid}", slots, policy=POLICY, keep_alive=self.keep, local=True)
        self.spent[iid] = (0, 0)

    @rule(ranks=st.integers(1, 2), evict=st.booleans())
    @precondition(lambda self: "b" not in self.world.cluster.instances)
    def place_b(self, ranks, evict):
        """A second model placed (on demand, say), parking a first if asked: the eviction admission names."""
        if evict:
            self.park("a", fsm.ParkReason.EVICTED)
        self._place("b", ranks)
        for _ in range(4):  # and the daemon plans at once, as a placement wakes it
            self.world.step("n0")

    # -- inputs --------------------------------------------------------------------

    @rule(node=st.sampled_from(["n0", "n1"]), rounds=st.integers(1, 4))
    def plan(self, node, rounds):
        """The node plans and acts, several rounds at once as a daemon does (`fsm.Driver.reconcile`)."""
        for _ in range(rounds):
            self.world.step(node)

    @rule(data=st.data())
    @precondition(lambda self: self.world.pending)
    def complete(self, data):
        self.world.deliver(data.draw(st.integers(0, len(self.world.pending) - 1)))

    @rule(iid=st.sampled_from(IDS), rank=st.integers(0, 1), how=st.sampled_from(["kill", "exception", "fatal"]))
    def fail_runner(self, iid, rank, how):
        entry = self.world.cluster.runners.get(f"{iid}/{rank}")
        if entry is None or not entry.machine.alive:
            return
        m = entry.machine
        if how == "kill":
            self.world.cluster.runner_event(rn.Exited(m.runner_id, m.incarnation, exit_code=-9), self.world.now)
        elif m.runner_state is not fsm.RunnerState.FAILED:
            failure = fsm.Failure.exception("RuntimeError", "boom", retryable=how == "exception")
            self.world.cluster.runner_event(rn.Fail(m.runner_id, m.incarnation, failure=failure), self.world.now)

    @rule(iid=st.sampled_from(IDS), reason=st.sampled_from(list(fsm.ParkReason)))
    def park(self, iid, reason):
        """From outside the plan: an operator, or an eviction for the other instance (which may be starting)."""
        if iid not in self.world.cluster.instances:
            return
        try:
            self.world.cluster.park(iid, self.world.now, reason)
        except fsm.IllegalTransition as exc:  # a request in flight, or a retry under way: refused, unchanged
            assert exc.why

    @rule(iid=st.sampled_from(IDS))
    def request(self, iid):
        if iid not in self.world.cluster.instances:
            return
        self.world.submit(f"req{len(self.world.cluster.log)}-{iid}", iid)

    @rule(dt=st.sampled_from([0.5, 2.0, 5.0, 20.0]))
    def advance_clock(self, dt):
        self.world.advance(self.world.now + dt)

    @rule(iid=st.sampled_from(IDS))
    def delete(self, iid):
        if iid in self.world.cluster.instances:
            self.world.cluster.delete(iid, self.world.now)

    @rule()
    def restart(self):
        """The daemon restarts: its machines through their dict form, its runners killed (`Cluster.recover`)."""
        restored = Cluster.from_dict(self.world.cluster.to_dict())
        restored.log = self.world.cluster.log
        restored.recover(self.world.now)
        self.world.cluster = restored
        self.world.pending.clear()  # what was owed went with the old daemon's runners

    @rule()
    def every_request_is_served(self):
        """10, across instances: from here a benign world serves every request (a parked instance comes back),
        and each instance rests Ready, Parked or Deleted."""
        probe = World(Cluster.from_dict(self.world.cluster.to_dict()), self.world.nodes, self.world.now)
        probe.pending, probe.requests = list(self.world.pending), dict(self.world.requests)
        probe.settle()  # time goes on to each deadline: backoffs end, keep-alives run out
        assert created_while_parking(probe.cluster, probe.cluster.log, dict(self.leaf)) == []
        assert not probe.requests, f"requests left waiting: {sorted(probe.requests)}"
        for iid in probe.cluster.instances:
            assert probe.cluster.instance(iid).instance_state in RESTING, probe.cluster.instance(iid).leaf

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def parked_means_no_process(self):  # 11
        for iid, placement in self.world.cluster.instances.items():
            if placement.machine.instance_state is fsm.InstanceState.PARKED:
                alive = [s.runner_id for s in placement.slots if self.world.cluster.runners.get(s.runner_id)]
                assert not any(self.world.cluster.runner(r).alive for r in alive), f"{iid} parked with {alive}"

    @invariant()
    def no_runner_created_where_another_parks(self):
        """Read from the log the machines wrote (what they took, not what a stale plan asked)."""
        assert created_while_parking(self.world.cluster, self.world.cluster.log[self.seen_create :], self.leaf) == []
        self.seen_create = len(self.world.cluster.log)

    @invariant()
    def parking_spends_no_retry(self):  # 12
        log = self.world.cluster.log
        for entry in log[self.seen_log :]:
            if entry.machine == "instance" and (entry.event in ("park", "unpark") or entry.target == "parked"):
                m = self.world.cluster.instance(entry.key)
                assert (m.attempts, m.uncharged) == self.spent[entry.key] or _failed_since(log, entry), entry
        self.seen_log = len(log)
        self.spent = {iid: (p.machine.attempts, p.machine.uncharged) for iid, p in self.world.cluster.instances.items()}

    @invariant()
    def one_generation_at_most_n(self):  # 6
        check_runners(self.world.cluster)


def created_while_parking(cluster: Cluster, entries: list, leaf: dict[str, str]) -> list[str]:
    """Runners the log says were created on a node while another instance there was Parking (``leaf``: each
    instance's leaf before ``entries``, brought up to date)."""
    found = []
    for e in entries:
        if e.machine == "instance":
            leaf[e.key] = e.target
        elif e.machine == "runner" and e.event == "create":
            owner = e.key.split("/")[0]
            node = next(s.node_id for s in cluster.instances[owner].slots if s.runner_id == e.key)
            for iid, placement in cluster.instances.items():
                here = any(slot.node_id == node for slot in placement.slots)
                if iid != owner and here and leaf.get(iid) == fsm.InstanceState.PARKING.value:
                    found.append(f"{e.key} created on {node} while {iid} parks there")
    return found


def _failed_since(log: list, park: object) -> bool:
    """A failure later in the same step may have counted (the step's entries after the park)."""
    after = log[log.index(park) + 1 :]
    return any(e.machine == "instance" and e.key == park.key and e.target == "recovering" for e in after)


TestResidency = Residency.TestCase
TestResidency.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
