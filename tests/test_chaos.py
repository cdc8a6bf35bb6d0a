"""The fault campaign (exod chaos, issue #26): its invariants catch what they are for, its schedule is the seed's,
and one short campaign with a fixed seed against a real cluster finds no violation."""

from __future__ import annotations

import itertools
import random
import resource
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from click.testing import CliRunner

from exod.chaos import campaign
from exod.chaos import invariants as inv
from exod.chaos.history import FaultRecord, History, InstanceSample, Operation, Outcome, ProcessLife
from exod.chaos.report import percentile, recoveries
from exod.chaos.rig import RigError
from exod.chaos.schedule import Abilities, Area, Kind, draw
from exod.cli.chaos import RIG_FAILED, chaos

BOUNDS = inv.Bounds(request_s=60.0, recovery_s=40.0)


def life(pid: int, gen: int, first: float, last: float, rank: int = 0, iid: str = "i1") -> ProcessLife:
    return ProcessLife(pid, "node-1", iid, rank, gen, first, last)


def sample(t: float, state: str = "ready", gen: int = 1, attempts: int = 0, *, iid: str = "i1", **kw) -> InstanceSample:
    return InstanceSample(t, iid, state, gen, attempts, 0, kw.get("deleted", False), kw.get("spent", False))


# -- 1. one generation at a time ----------------------------------------------------------


def test_two_generations_seen_in_one_sample_are_a_violation_and_a_handover_is_not():
    handover = [life(1, 1, 0.0, 5.0), life(2, 1, 0.0, 5.0, rank=1), life(3, 2, 5.03, 9.0)]
    assert inv.one_generation_at_a_time(handover) == []
    overlap = [*handover, life(4, 2, 4.97, 9.0, rank=1)]  # seen at 4.97 while generation 1 lived until 5.0
    [found] = inv.one_generation_at_a_time(overlap)
    assert found.invariant == 1 and "generation 1" in found.text and "generation 2" in found.text
    other_instance = [life(1, 1, 0.0, 5.0), life(2, 2, 1.0, 6.0, iid="i2")]
    assert inv.one_generation_at_a_time(other_instance) == []


# -- 2. nothing lost ------------------------------------------------------------------------


def place(iid: str, outcome: Outcome = Outcome.OK) -> Operation:
    return Operation("place", "node-2", 1.0, 1.5, outcome, "", iid)


def test_an_acknowledged_placement_that_vanished_is_lost_unless_a_client_deleted_it_or_its_budget_ended():
    deleted = {"machine": "instance", "id": "a", "event": "delete", "to": "deleted"}
    gave_up = {"machine": "instance", "id": "b", "event": "auto", "to": "deleted"}
    ops = [place("a"), place("b"), place("c"), place("d", Outcome.INDETERMINATE)]
    found = inv.nothing_lost(ops, [deleted, gave_up], kept={"b"})
    assert [v.text.split()[1] for v in found] == ["a", "c"]  # a: nobody asked; c: gone without a trace
    asked = Operation("delete", "node-3", 2.0, 2.1, Outcome.INDETERMINATE, "", "a")
    assert [v.text.split()[1] for v in inv.nothing_lost([*ops, asked], [deleted, gave_up], kept={"b"})] == ["c"]


# -- 3. every request ends --------------------------------------------------------------------


def test_a_hang_is_always_a_violation_a_broken_connection_only_where_nothing_was_wrong():
    history = History()
    history.fault(FaultRecord("daemon-sigkill", "node-1", 10.0, 12.0, ("node-1",)))
    history.operation(Operation("chat-openai", "node-1", 11.0, 11.1, Outcome.INDETERMINATE, "reset"))
    history.operation(Operation("chat-openai", "node-2", 11.0, 11.1, Outcome.INDETERMINATE, "reset"))
    history.operation(Operation("chat-anthropic-stream", "node-1", 20.0, 21.0, Outcome.MALFORMED, "unended"))
    history.operation(Operation("chat-openai", "node-1", 11.0, 80.0, Outcome.HUNG, ""))
    history.operation(Operation("chat-openai", "node-3", 30.0, 31.0, Outcome.REFUSED, "HTTP 503"))
    found = inv.every_request_ends(history, BOUNDS)
    assert [(v.text.split()[2], v.time) for v in found] == [("node-2,", 11.0), ("node-1,", 20.0), ("node-1:", 11.0)]


def test_a_change_made_but_not_stored_is_excused_only_while_etcd_was_held_or_cut_off():
    """Found by a 5-min campaign (seed 2074194091): a member paused while a placement was written; the
    controller's term ended before the write, and the answer was neither done nor undone, rightly. And by the
    CI campaign (seed 26): a park relayed to a controller deaf to etcd."""
    history = History()
    history.fault(FaultRecord("etcd-pause-member", "m1", 10.0, 13.0))
    history.fault(FaultRecord("network-deaf-to-etcd", "node-1", 30.0, 33.0, ("node-1",)))
    history.fault(FaultRecord("network-cut-from-peers", "node-1", 40.0, 43.0, ("node-1",)))
    unstored = f"{inv.NOT_STORED}: HTTP 503: instance i is placed but not stored yet"
    history.operation(Operation("place", "node-2", 12.0, 12.5, Outcome.INDETERMINATE, unstored, "i"))  # excused
    history.operation(Operation("place", "node-2", 20.0, 20.5, Outcome.INDETERMINATE, unstored, "j"))  # etcd well
    history.operation(Operation("chat-openai", "node-2", 12.0, 12.1, Outcome.INDETERMINATE, "reset"))  # not a write
    history.operation(Operation("park", "node-2", 31.0, 31.5, Outcome.INDETERMINATE, unstored, "i"))  # excused
    history.operation(Operation("park", "node-2", 41.0, 41.5, Outcome.INDETERMINATE, unstored, "i"))  # etcd reached
    found = inv.every_request_ends(history, BOUNDS)
    assert [v.time for v in found] == [20.0, 12.0, 41.0]


# -- 4. retries --------------------------------------------------------------------------------


def test_a_charge_without_a_runner_fault_is_a_hosts_fault_charged():
    processes = [life(1, 1, 0.0, 5.0), life(2, 2, 7.0, 20.0)]
    samples = [sample(1.0), sample(6.0, "backing_off", attempts=1), sample(8.0, gen=2, attempts=1)]
    [found] = inv.retries_charged(samples, processes, {}, {}, [], {}, settle=5.0)
    assert found.invariant == 4 and "a host's fault was charged" in found.text


def test_a_clean_kill_must_cost_one_retry_and_only_one():
    processes = [life(1, 1, 0.0, 5.0), life(2, 1, 0.0, 5.0, rank=1), life(3, 2, 7.0, 20.0)]
    kill = {1: 4.9}
    uncharged = [sample(1.0), sample(8.0, gen=2)]
    [found] = inv.retries_charged(uncharged, processes, kill, kill, [], {}, settle=5.0)
    assert "only 0 retries were charged" in found.text
    once = [sample(1.0), sample(6.0, "backing_off", attempts=1), sample(8.0, gen=2, attempts=1)]
    assert inv.retries_charged(once, processes, kill, kill, [], {}, settle=5.0) == []
    twice = [*once, sample(9.0, gen=2, attempts=2)]
    assert "2 retries charged" in inv.retries_charged(twice, processes, kill, kill, [], {}, settle=5.0)[0].text


def test_a_kill_beside_a_hosts_fault_may_go_uncharged_and_a_reset_budget_is_not_a_refund():
    processes = [life(1, 1, 0.0, 5.0), life(3, 2, 7.0, 20.0)]
    kill = {1: 4.9}
    cut = FaultRecord("network-cut-off", "node-1", 3.0, 8.0, ("node-1",))
    assert inv.retries_charged([sample(1.0), sample(8.0, gen=2)], processes, kill, kill, [cut], {}, settle=5.0) == []
    given_back = [sample(6.0, attempts=1), InstanceSample(7.0, "i1", "recovering", 1, 0, 1, False, False)]
    assert inv.retries_charged(given_back, processes, {}, {}, [], {}, settle=5.0) == []  # the host's, after all
    reset = [sample(6.0, attempts=1), sample(30.0, attempts=0), sample(31.0, attempts=1)]  # two charges
    assert "2 retries charged" in inv.retries_charged(reset, processes, kill, kill, [], {}, settle=5.0)[0].text


# -- 5. Ready after the last heal ----------------------------------------------------------------


def test_an_instance_not_ready_within_the_bound_after_the_last_heal_is_a_violation_unless_given_up():
    ok = [sample(50.0, "backing_off"), sample(70.0), sample(90.0)]
    assert inv.ready_after_the_last_heal(ok, healed=50.0, bounds=BOUNDS) == []
    late = [sample(50.0, "backing_off"), sample(95.0), sample(99.0)]
    assert "after 45.0s" in inv.ready_after_the_last_heal(late, healed=50.0, bounds=BOUNDS)[0].text
    flapped = [*ok, sample(99.0, "recovering")]
    assert "last seen recovering" in inv.ready_after_the_last_heal(flapped, healed=50.0, bounds=BOUNDS)[0].text
    spent = [sample(50.0, "backing_off"), sample(99.0, "deleted", spent=True, deleted=True)]
    assert inv.ready_after_the_last_heal(spent, healed=50.0, bounds=BOUNDS) == []
    # found by the 30-min campaign (seed 2059756477): deleted on its last retry and forgotten between two samples
    forgotten = [sample(40.0), sample(40.0, iid="i2"), sample(60.0, iid="i2"), sample(99.0, iid="i2")]
    assert inv.ready_after_the_last_heal(forgotten, healed=50.0, bounds=BOUNDS) == []


def test_an_instance_a_client_left_parked_need_not_be_ready_one_it_unparked_must():
    """The workload parks and unparks its own placements: parked by request is not a recovery that failed."""

    def asked(client: str, at: float, outcome: Outcome = Outcome.OK) -> Operation:
        return Operation(client, "node-1", at, at + 0.1, outcome, "", "i1")

    parked = [sample(50.0, "parked"), sample(99.0, "parked")]
    left = inv.left_parked([asked("place", 1.0), asked("park", 40.0)])
    assert left == {"i1"} and inv.ready_after_the_last_heal(parked, healed=50.0, bounds=BOUNDS, parked=left) == []
    for history in (
        [asked("park", 40.0), asked("unpark", 45.0)],  # unparked after: it must come back
        [asked("park", 40.0, Outcome.REFUSED)],  # the park was refused: it never was parked by request
    ):
        left = inv.left_parked(history)
        assert left == set()
        assert "last seen parked" in inv.ready_after_the_last_heal(parked, 50.0, BOUNDS, left)[0].text


# -- 6. the log and the readers ------------------------------------------------------------------


def entry(n: int) -> dict:
    return {"time": float(n), "machine": "runner", "id": "i1/0", "event": "e", "from": "a", "to": "b", "cause": ""}


def test_a_reader_must_be_sent_a_gap_free_prefix_of_the_log():
    log = [entry(n) for n in range(5)]
    good = {"r1": [{"seq": n + 1, **entry(n)} for n in range(3)]}
    assert inv.the_log_replays(None, good, log, start=1) == []
    gap = {"r1": [{"seq": 1, **entry(0)}, {"seq": 3, **entry(2)}]}
    assert "seq 3 where 2 was due" in inv.the_log_replays(None, gap, log, start=1)[0].text
    altered = {"r1": [{"seq": 1, **entry(0)}, {"seq": 2, **entry(7)}]}
    assert "as seq 2" in inv.the_log_replays(None, altered, log, start=1)[0].text
    assert "diverges" in inv.the_log_replays("entry 3: …", {}, log, start=1)[0].text


def test_leftovers_are_violations():
    assert [v.invariant for v in inv.nothing_left_behind(["mount /tmp/x", "process 12"])] == [7, 7]


# -- the schedule and the report -------------------------------------------------------------------


def test_a_seed_draws_the_same_schedule_and_another_seed_another():
    able = Abilities(namespaces=True, tmpfs=True)
    assert draw(7, 600, able, ttl=5) == draw(7, 600, able, ttl=5)
    assert draw(7, 600, able, ttl=5) != draw(8, 600, able, ttl=5)
    steps = draw(7, 600, able, ttl=5)
    assert {s.kind.area for s in steps} == set(Area)  # a long campaign reaches every area
    assert max(s.at for s in steps) < 600 - 120  # the faults leave time to recover
    assert any(b.at == a.at for a, b in itertools.pairwise(steps))  # several at once, now and then
    assert all(s.hold < 5 for s in steps if s.kind is Kind.ETCD_PAUSE_ALL)  # every member, less than a lease


def test_what_the_machine_cannot_do_is_never_drawn_and_says_why():
    plain = Abilities(namespaces=False, tmpfs=False)
    kinds = {s.kind for s in draw(3, 900, plain, ttl=5)}
    assert not {k for k in kinds if k.area is Area.NETWORK} and Kind.STORAGE_FULL not in kinds
    assert "root" in (plain.why_not(Kind.NETWORK_ALL) or "")


def test_recovery_is_measured_from_each_faults_end_to_every_instance_ready():
    samples = [sample(1.0), sample(2.0, "recovering"), sample(2.0, iid="i2"), sample(4.0), sample(4.0, iid="i2")]
    fault = FaultRecord("daemon-sigstop", "node-1", 1.5, 2.0, ("node-1",))
    assert recoveries(samples, [fault], ["i1", "i2"]) == [2.0]
    late = [*samples, sample(3.0, "recovering", iid="workload")]  # an instance of the workload's: not waited for
    assert recoveries(late, [fault], ["i1", "i2"]) == [2.0]
    assert percentile([1.0, 2.0, 3.0], 0.5) == 2.0 and percentile([1.0, 2.0, 3.0], 0.99) == 3.0


# -- a short campaign against a real cluster -------------------------------------------------------

CI_SEED = 26


def test_a_short_campaign_with_a_fixed_seed_finds_no_violation(tmp_path):
    """CI's campaign (≈ 3 minutes): a 3-member etcd, 3 nodes (node-1 in a namespace where one can be made),
    the workload, the faults seed 26 draws; exits 0 only when all seven invariants held."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "exod",
            "chaos",
            "--seed",
            str(CI_SEED),
            "--duration",
            "120",
            "--report",
            str(tmp_path / "reliability.md"),
            "--keep",
            str(tmp_path / "kept"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert f"seed {CI_SEED}: no violation" in done.stdout
    report = (tmp_path / "reliability.md").read_text()
    assert "**Violations: none**" in report and "### Transitions taken by real processes" in report
    assert (tmp_path / "kept" / "history.jsonl").stat().st_size > 0


# -- how the clients read an answer ------------------------------------------------------------------


def test_an_answer_is_ok_an_error_in_its_dialect_or_malformed():
    import httpx

    from exod.chaos.workload import _broken, _classify_json, _classify_stream

    openai_error = httpx.Response(503, json={"error": {"message": "no Ready instance", "type": "server_error"}})
    anthropic_error = httpx.Response(503, json={"type": "error", "error": {"type": "overloaded_error", "message": "x"}})
    assert _classify_json(httpx.Response(200, json={"choices": []}), "openai")[0] is Outcome.OK
    assert _classify_json(openai_error, "openai")[0] is Outcome.REFUSED
    assert _classify_json(openai_error, "anthropic")[0] is Outcome.MALFORMED  # the other dialect's shape
    assert _classify_json(anthropic_error, "anthropic")[0] is Outcome.REFUSED
    assert _classify_json(httpx.Response(502, text="Bad Gateway"), "openai")[0] is Outcome.MALFORMED
    # a delete made, its write refused (etcd away): not done, not undone — found by CI's campaign (seed 26)
    unstored = {"message": "cannot write the state; instance x is deleted but not stored yet", "code": "not_stored_yet"}
    assert _classify_json(httpx.Response(503, json={"error": unstored}), "openai")[0] is Outcome.INDETERMINATE
    done = ['data: {"choices": []}', "data: [DONE]"]
    failed = ['data: {"choices": []}', 'data: {"error": {"message": "runner failed"}}', "data: [DONE]"]
    assert _classify_stream(iter(done), "openai") == (Outcome.OK, "")
    assert _classify_stream(iter(failed), "openai") == (Outcome.REFUSED, "runner failed")
    assert _classify_stream(iter(failed[:2]), "openai")[0] is Outcome.REFUSED  # its error event is an end
    assert _classify_stream(iter(done[:1]), "openai")[0] is Outcome.MALFORMED  # it just stopped
    stop = ["event: message_start", 'data: {"type": "message_start"}', 'data: {"type": "message_stop"}']
    assert _classify_stream(iter(stop), "anthropic") == (Outcome.OK, "")
    assert _classify_stream(iter(stop[:2]), "anthropic")[0] is Outcome.MALFORMED
    assert _broken(httpx.ReadTimeout("slow"))[0] is Outcome.HUNG  # it took the request and said nothing
    assert _broken(httpx.ConnectTimeout("cut off"))[0] is Outcome.INDETERMINATE  # it could not be reached
    assert _broken(httpx.RemoteProtocolError("disconnected"))[0] is Outcome.INDETERMINATE


def test_a_fault_on_an_etcd_member_holds_that_member_alone_and_lets_it_go_when_undone():
    """A campaign's own bug (its first 30-minute run): picking the member claimed one per member it looked at
    and let one go, so after the first etcd fault every later one found its targets held."""
    import signal
    import types

    from exod.chaos.faults import Injector
    from exod.chaos.schedule import Role, Step

    members = [
        types.SimpleNamespace(name=f"m{n}", url="http://127.0.0.1:9", process=subprocess.Popen(["sleep", "60"]))
        for n in range(3)
    ]
    try:
        rig = types.SimpleNamespace(members=lambda: members)
        history = History()
        injector = Injector(rig, history, lambda: 0.0, dict)
        for pick in range(4):
            injector.start(Step(0.0, Kind.ETCD_PAUSE, Role.MEMBER, pick, 0.05))
            injector.join()
        injector.start(Step(0.0, Kind.ETCD_PAUSE_ALL, Role.LEADER, 0, 0.05))
        injector.join()
        assert [f.note for f in history.faults] == [""] * 5 and injector.errors == []
        assert [f.target for f in history.faults][-1] == "m0+m1+m2"
        assert all(m.process.poll() is None for m in members)  # paused, then continued
        assert not injector._busy
    finally:
        for m in members:
            m.process.send_signal(signal.SIGCONT)
            m.process.kill()
            m.process.wait()


def test_an_events_reader_of_a_quiet_log_sees_the_stop_at_the_next_keepalive():
    """Found by the 30-min campaign (seed 1452815653): `iter_sse` swallows comments, so a reader of a log with
    nothing new (the daemon sending only keepalives) never looked at the stop, and was left waiting."""
    import threading

    from exod.chaos.workload import until_stopped

    stop = threading.Event()
    seen: list[str] = []

    def lines():
        yield from ("id: 7", "event: transition", 'data: {"seq": 7}', "")
        stop.set()  # the campaign ends while the log is quiet
        while True:  # the daemon's keepalives, forever
            yield from (": keepalive", "")

    for event in until_stopped(lines(), stop):
        seen.append(event.event)
    assert seen == ["transition"]


def test_the_transitions_named_unreachable_are_real_transitions_of_the_machines():
    """A typo in the report's list would leave out of the goal a transition that does not exist, silently."""
    from exod.chaos.report import SELDOM, UNREACHABLE, rows_of
    from fsm.conformance import replay

    every, _, silent = rows_of(dict(replay([]).coverage))
    assert set(UNREACHABLE) <= every - silent, sorted(set(UNREACHABLE) - every)
    assert set(SELDOM) <= every - silent - set(UNREACHABLE), sorted(set(SELDOM) - every)


def test_a_transition_the_campaign_missed_says_what_it_takes_where_that_is_seldom_met():
    from exod.chaos.report import SELDOM, UNREACHABLE, not_reached

    (seldom,) = SELDOM
    ordinary = ("runner", "idle", "connect", "connecting")
    text = not_reached({seldom, ordinary})
    assert f"\n- instance: alive → deleted on `give_up`: {SELDOM[seldom]}" in text
    assert "\n- runner: idle → connecting on `connect`\n" in text  # no reason: just not met this time
    assert all(why in text for why in UNREACHABLE.values())
    assert not_reached(set()).startswith("\n- none\n")


def test_a_lowered_open_file_limit_is_given_back_and_its_undo_is_quiet_once_the_target_is_gone():
    from exod.chaos.faults import _lower_fd_limit

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        before = psutil.Process(child.pid).rlimit(resource.RLIMIT_NOFILE)
        restore = _lower_fd_limit(child.pid)
        lowered = psutil.Process(child.pid).rlimit(resource.RLIMIT_NOFILE)
        assert lowered[0] < before[0] and lowered[1] == before[1]
        restore()
        assert psutil.Process(child.pid).rlimit(resource.RLIMIT_NOFILE) == before
        # found by the 30-min campaign (seed 2074194091): the target lowered its own hard limit while the fault
        # held (mlx-lm's import did, in a daemon): the undo gives back the soft limit within it, refused by nobody
        restore = _lower_fd_limit(child.pid)
        own = min(before[1], 4096)
        psutil.Process(child.pid).rlimit(resource.RLIMIT_NOFILE, (lowered[0], own))
        restore()
        assert psutil.Process(child.pid).rlimit(resource.RLIMIT_NOFILE) == (min(before[0], own), own)
        restore = _lower_fd_limit(child.pid)
    finally:
        child.communicate(b"")
    restore()  # the target exited and was reaped while the fault held: nothing to give back, no error


def test_a_placement_pins_its_ranks_only_to_nodes_that_are_up_and_enough_of_them():
    """A 10-min campaign (seed 911) drew 3 pinned ranks while a daemon was down: the sampling error ended the
    workload's placements for the rest of the run. With fewer nodes up than ranks, the placer spreads them."""
    from exod.chaos.workload import placement_body

    rng = random.Random(0)
    bodies = [placement_body(rng, ["m"], ["node-1"]) for _ in range(200)]
    assert all(len(b.get("nodes", ())) in (0, b["ranks"]) for b in bodies)
    assert {b["ranks"] for b in bodies} == {1, 2, 3} and any(b.get("nodes") == ["node-1"] for b in bodies)
    assert all("nodes" not in b for b in bodies if b["ranks"] > 1)
    up = [placement_body(rng, ["m"], ["node-1", "node-2", "node-3"]) for _ in range(200)]
    assert any(len(b.get("nodes", ())) == 3 for b in up)


# -- issue #47: the long faults, always; two processes of one rank ------------------------------


def test_two_live_processes_of_one_rank_are_a_violation_whatever_their_generations():
    """A rank spawned twice (the controller starting its own node's rank beside an agent's, say) is a split brain
    even within one generation; a rank handed over between two samples is not."""
    handed_over = [life(1, 1, 0.0, 5.0), life(2, 1, 0.0, 5.0, rank=1), life(3, 2, 5.03, 9.0), life(4, 2, 5.03, 9.0, 1)]
    assert inv.one_generation_at_a_time(handed_over) == []
    same_generation = [life(1, 1, 0.0, 5.0), life(2, 1, 0.0, 5.0, rank=1), life(5, 1, 2.0, 3.0, rank=1)]
    [found] = inv.one_generation_at_a_time(same_generation)
    assert found.invariant == 1 and found.time == 2.0 and "two processes of rank 1" in found.text
    assert "pid 2" in found.text and "pid 5" in found.text
    both = [life(1, 1, 0.0, 5.0), life(3, 2, 4.0, 9.0)]  # rank 0 of generations 1 and 2: one violation says both
    [found] = inv.one_generation_at_a_time(both)
    assert "generation 1" in found.text and "generation 2" in found.text and "both rank 0" in found.text
    other_instance = [life(1, 1, 0.0, 5.0), life(2, 1, 1.0, 6.0, iid="i2")]
    assert inv.one_generation_at_a_time(other_instance) == []


def test_every_seed_draws_a_pause_and_a_cut_longer_than_the_lease_on_the_controller_and_on_a_rank_holding_agent():
    """Issue #47: the campaign never paused the controller past its lease. Whatever the seed and the duration
    (CI's 120 s among them), the schedule holds the four long faults, within the fault window, with no other
    fault on a node while they last; without namespaces, the two pauses."""
    from exod.chaos.schedule import Role, Step, fault_window, long_faults

    def alone(f: Step, on_nodes: list[Step]) -> bool:  # no other fault on a node while it lasts
        return not any(s != f and s.at <= f.at + f.hold and f.at <= s.at + s.hold for s in on_nodes)

    able, ttl, areas = Abilities(namespaces=True, tmpfs=True), 5.0, (Area.DAEMON, Area.NETWORK, Area.STORAGE)
    wanted = {(k, r) for k in (Kind.DAEMON_PAUSE, Kind.NETWORK_ALL) for r in (Role.CONTROLLER, Role.RANK_AGENT)}
    for seed, duration in itertools.product(range(60), (120.0, 600.0, 1800.0)):
        steps = draw(seed, duration, able, ttl=ttl)
        on_nodes = [s for s in steps if s.kind.area in areas and s.kind is not Kind.STORAGE_MODEL_GONE]
        held = {
            (s.kind, s.role)
            for s in long_faults(steps, ttl)
            if s.hold <= 2 * ttl and s.at + s.hold < fault_window(duration) and alone(s, on_nodes)
        }
        assert held >= wanted, (seed, duration, [s.text() for s in steps])
        assert steps == draw(seed, duration, able, ttl=ttl)  # still a pure function of the seed
    plain = draw(26, 120, Abilities(), ttl=ttl)
    assert {(Kind.DAEMON_PAUSE, Role.CONTROLLER), (Kind.DAEMON_PAUSE, Role.RANK_AGENT)} <= {
        (s.kind, s.role) for s in long_faults(plain, ttl)
    }


def test_a_fault_on_a_rank_holding_agent_hits_only_an_agent_with_a_runner_and_a_cut_only_the_namespaced_node():
    """The roles the long faults name are resolved when injected: an agent that holds a runner now (none: not
    injected, said so), and a network fault only on the namespaced node, if it plays the role now."""
    import types

    from exod.chaos.faults import Injector, NoTarget
    from exod.chaos.schedule import Role, Step

    nodes = [types.SimpleNamespace(name=f"node-{n}", alive=True, namespaced=n == 1) for n in (1, 2, 3)]
    rig = types.SimpleNamespace(nodes=nodes, controller=lambda: "node-2", node=lambda name: name)
    runners = {7: ProcessLife(7, "node-3", "i1", 0, 1, 0.0, 1.0), 8: ProcessLife(8, "node-2", "i1", 1, 1, 0.0, 1.0)}
    injector = Injector(rig, History(), lambda: 0.0, lambda: runners)
    assert injector._node(Step(0.0, Kind.DAEMON_PAUSE, Role.RANK_AGENT, 5, 10.0)) == "node-3"
    assert injector._node(Step(0.0, Kind.DAEMON_PAUSE, Role.CONTROLLER, 5, 10.0)) == "node-2"
    for role in (Role.RANK_AGENT, Role.CONTROLLER):  # node-1 is neither now
        with pytest.raises(NoTarget):
            injector._node(Step(0.0, Kind.NETWORK_ALL, role, 0, 10.0))
    runners[9] = ProcessLife(9, "node-1", "i1", 2, 1, 0.0, 1.0)
    assert injector._node(Step(0.0, Kind.NETWORK_ALL, Role.RANK_AGENT, 0, 10.0)) == "node-1"
    rig.controller = lambda: "node-1"
    injector._busy.clear()
    assert injector._node(Step(0.0, Kind.NETWORK_ALL, Role.CONTROLLER, 3, 10.0)) == "node-1"


# -- issue #47: the set-up survives any answer ---------------------------------------------------------------


class _Answers:
    """A node's answers to the set-up's placements, in turn (the last one again and again), and when each came."""

    def __init__(self, *answers) -> None:
        self.answers, self.asked = list(answers), []

    def __call__(self, request):
        self.asked.append(time.monotonic())
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        status, headers, body = answer
        return httpx.Response(status, headers=headers, json=body, request=request)


class _Rig:
    def urls(self) -> dict[str, str]:
        return {"node-1": "http://node-1", "node-2": "http://node-2"}


def _deposed(code: int = 503) -> tuple[int, dict[str, str], dict]:
    message = "node node-2 is no longer the controller: etcd refused its write: nothing was stored"
    return code, {"Retry-After": "1"}, {"error": {"message": message, "code": "controller_unavailable"}}


def _with_answers(monkeypatch, answers: _Answers) -> None:
    monkeypatch.setattr(campaign, "_client", lambda: httpx.Client(transport=httpx.MockTransport(answers)))


def test_a_placement_at_set_up_answered_not_now_or_not_at_all_is_asked_again_as_retry_after_says(monkeypatch):
    """A controller deposed mid-placement answers 503 (Retry-After: 1), an election under way no connection: the
    set-up asks again, after the Retry-After, and places its standing instance."""
    answers = _Answers(_deposed(), httpx.ConnectError("connection refused"), (201, {}, {"instance_id": "m-1"}))
    _with_answers(monkeypatch, answers)
    iid, asked, acknowledged = campaign._place(_Rig(), "exod/tiny-qwen2", {"ranks": 1})
    assert iid == "m-1" and len(answers.asked) == 3
    assert answers.asked[1] - answers.asked[0] >= 1.0  # the Retry-After, waited
    assert asked <= answers.asked[0] and acknowledged >= answers.asked[-1]


def test_a_placement_at_set_up_refused_for_good_or_not_now_for_too_long_is_the_rigs_failure(monkeypatch):
    """A 500 will not become a placement: not asked again. A 503 that lasts past the bound is given up."""
    broken = _Answers((500, {}, {"error": {"message": "internal error (Deposed)"}}))
    _with_answers(monkeypatch, broken)
    with pytest.raises(RigError, match=r"answered 500 internal error \(Deposed\)"):
        campaign._place(_Rig(), "exod/tiny-qwen2", {"ranks": 1})
    assert len(broken.asked) == 1  # not asked again: it will not become a placement
    _with_answers(monkeypatch, deposed := _Answers(_deposed()))
    with campaign._client() as client, pytest.raises(RigError, match=r"still answered 503 .*after 2 s"):
        campaign.setup_request(client, "POST", lambda: "http://node-2/instances", {}, within=2.0)
    assert len(deposed.asked) == 2  # asked again once a second later, not past the bound


def test_exod_chaos_whose_rig_fails_at_set_up_says_why_and_exits_with_its_own_status_not_a_traceback(monkeypatch):
    """Any answer at set-up: here every placement is a 500. `exod chaos` exits 3 (1 is a violation), saying
    the seed and what the node answered."""
    _with_answers(monkeypatch, _Answers((500, {}, {"error": {"message": "internal error (Deposed)"}})))
    monkeypatch.setattr(campaign, "run", lambda settings, announce: campaign._place_first(_Rig(), 3))
    done = CliRunner().invoke(chaos, ["--seed", "7", "--duration", "30"])
    assert done.exit_code == RIG_FAILED == 3, done.output
    assert isinstance(done.exception, SystemExit), done.exception
    assert "seed 7: the rig failed, nothing was checked" in done.output and "500 internal error" in done.output
    assert "Traceback" not in done.output
