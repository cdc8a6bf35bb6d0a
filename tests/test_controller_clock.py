"""The controller's time-driven behaviour on trio's MockClock: backoff, budget reset, stall watchdogs, queue
timeout, give-up, download retries.

The controller is the real one (planner, machines, store, request book, the Supervisor's watchdog); the
runner processes and the model cache are in-process fakes (tests/fake_runners.py), so nothing but trio
sleeps and virtual time jumps straight to the next thing that happens. The policies are the realistic,
long ones (backoff 2 s → 30 s, reset after 600 s, a 30 s queue timeout) and every time is asserted
exactly. What only a real process shows (a real SIGKILL, real MLX, real model defects) is tested on the
real clock in test_daemon.py and test_fault_tolerance.py.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from fake_runners import TOKENS, FakeFleet, FakeModels, Timing

import fsm
from daemon_harness import config, instance, with_controller
from exod import generated as g
from exod.controller import Controller
from exod.host.supervisor import Timeouts
from exod.requests import QueueTimeout, RequestFailed
from exod.runner import protocol as p
from exod.runner.faults import Fault, FaultKind, FaultPhase, FaultSpec
from exod.state.journal import LAZY_WRITE_S
from exod.state.sqlite import Store
from fsm.cluster import LogEntry

WALL = 1_000_000.0  # the wall time the controller's clock starts at; trio's MockClock starts at 0
POLICY = fsm.RetryPolicy(backoff=fsm.Backoff(initial=2.0, factor=2.0, cap=30.0), max_failures=5, reset_after=600.0)
DOWNLOADS = fsm.Backoff(initial=5.0, factor=2.0, cap=60.0)
TIMEOUTS = Timeouts(connect=60, load_progress=120, warm_up=120, generate=300, stop_grace=5, term_grace=3)
QUEUE_TIMEOUT = 30.0
LIMIT = 86_400.0  # virtual seconds; with autojump a deadlock fails at once, never after a (real) day
REAL_SECONDS = 30.0  # each takes well under a second of real time (more under load); real waiting takes far longer
MODEL = "exod/tiny-qwen2"
MESSAGES = [{"role": "user", "content": "What is a state machine?"}]


@attrs.frozen
class Sim:
    controller: Controller
    fleet: FakeFleet
    models: FakeModels

    async def log(self, machine: str | None = None, key: str | None = None) -> list[LogEntry]:
        """The durable transition log, its times on trio's (virtual) clock."""
        return [
            attrs.evolve(e, time=e.time - WALL)
            for _, e in await self.controller.transitions()
            if (machine is None or e.machine == machine) and (key is None or e.key == key)
        ]

    def machine(self, iid: str) -> fsm.InstanceRetry:
        return self.controller.instance(iid)


def simulate(
    tmp_path: Path,
    body: Callable[[Sim], Awaitable[Any]],
    *,
    models: FakeModels | None = None,
    timing: Timing | None = None,
    fleet: FakeFleet | None = None,
    **overrides: Any,
) -> Any:
    """Run ``body`` against a controller with fake runners and models, on a MockClock that autojumps."""
    models = models or FakeModels()
    fleet = fleet or FakeFleet(models, timing or Timing())
    settings = {
        "timeouts": TIMEOUTS,
        "policy": POLICY,
        "download_policy": DOWNLOADS,
        "queue_timeout": QUEUE_TIMEOUT,
        **overrides,
    }
    threads = threading.active_count()
    started = time.perf_counter()
    result = with_controller(
        config(tmp_path, None, **settings),  # no hf_home: FakeModels looks nowhere
        lambda controller: body(Sim(controller, fleet, models)),
        limit=LIMIT,
        clock=trio.testing.MockClock(autojump_threshold=0),
        spawn=fleet,
        models=models,
        wall=lambda: WALL,
    )
    assert threading.active_count() == threads, "a thread was started: autojump would race it"
    assert time.perf_counter() - started < REAL_SECONDS
    return result


async def until(controller: Controller, predicate: Callable[[dict], bool]) -> dict:
    """Wait until ``predicate(status)`` holds; woken by every commit of the controller, no polling."""
    while not predicate(status := controller.status()):
        await controller.log_written.wait()
    return status


async def settled() -> None:
    """Let every task that can run at this virtual instant run (before the clock may jump again)."""
    await trio.testing.wait_all_tasks_blocked()


def ready_at(iid: str, generation: int) -> Callable[[dict], bool]:
    return lambda s: instance(s, iid)["state"] == "ready" and instance(s, iid)["generation"] == generation


def is_deleted(iid: str) -> Callable[[dict], bool]:
    return lambda s: instance(s, iid)["state"] == "deleted"


def all_stopped(iid: str) -> Callable[[dict], bool]:
    return lambda s: all(r["state"] == "shutdown" for r in instance(s, iid)["runners"])


def moves(entries: list[LogEntry], source: str, target: str) -> list[float]:
    """When the log shows ``source → target``."""
    return [e.time for e in entries if (e.source, e.target) == (source, target)]


async def chat(controller: Controller, iid: str, **params: Any) -> str:
    text = ""
    async for item in controller.requests.generate(iid, MESSAGES, **params):
        text += getattr(item, "text", "")
    return text


# -- starting -------------------------------------------------------------------------------------------


def test_a_two_rank_instance_reaches_ready_and_serves(tmp_path):
    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 2)
        status = await until(sim.controller, ready_at(iid, 1))
        return instance(status, iid), await chat(sim.controller, iid, max_tokens=4), await sim.log()

    inst, text, log = simulate(tmp_path, body)
    assert [r["state"] for r in inst["runners"]] == ["ready", "ready"]
    assert inst["attempts"] == 0 and inst["generation"] == 1
    assert text == "".join(TOKENS[:4])
    # The download (1 s) comes first (no process before its model), then the join (0.5 s), 4 layers of 0.25 s
    # and 0.5 s of warm-up.
    assert moves(log, "starting", "ready") == [3.0]
    assert [e.time for e in log if e.machine == "runner" and e.event == "create"] == [1.0, 1.0]


def test_a_requests_transitions_are_written_within_the_lazy_window_a_runners_death_at_once(tmp_path):
    """Writing the whole state twice per request cost the hot path (bench/request_cost.py): what only requests
    changed waits `LAZY_WRITE_S` for company; a change a restart needs is written the moment it is made."""

    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 1)
        await until(sim.controller, ready_at(iid, 1))
        await settled()
        served = trio.current_time()
        await chat(sim.controller, iid, max_tokens=2)
        await chat(sim.controller, iid, max_tokens=2)
        await settled()
        written_then = await sim.log("runner")
        await trio.sleep(LAZY_WRITE_S)
        written_later = await sim.log("runner")
        died = trio.current_time()
        sim.fleet.runner(0, 1).kill()
        while not [e for e in await sim.log("runner") if e.time >= died and e.target == "failed"]:
            await sim.controller.log_written.wait()
        return served, written_then, written_later, trio.current_time() - died

    served, then, later, death_written_after = simulate(tmp_path, body, timing=Timing(token=0.01))  # 2 chats: 0.04 s
    requests = [(e.source, e.target) for e in later if e.event in ("request_started", "request_finished")]
    assert requests == [("available", "busy"), ("busy", "available")] * 2  # every one written, in order …
    assert [e for e in then if e.event in ("request_started", "request_finished")] == []  # … in one write, later
    assert all(e.time >= served for e in later if e.event == "request_started")
    assert death_written_after == 0.0  # the same (virtual) instant


def test_a_request_reaches_its_runner_before_the_caller_yields(tmp_path):
    """Waiting for the controller's turn to forward a request was a fifth of a millisecond of each short one
    (bench/README.md, #30): it is planned and posted within `submit`, and the controller still plans what
    follows (its answer comes, the runner is available again)."""

    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 1)
        await until(sim.controller, ready_at(iid, 1))
        await settled()
        posted: list[p.Command] = []
        post = sim.controller.processes.post
        sim.controller.processes.post = lambda rid, inc, command: (posted.append(command), post(rid, inc, command))
        stream = sim.controller.requests.submit(iid, [{"role": "user", "content": "hi"}], max_tokens=2)
        forwarded_at_once = [type(c).__name__ for c in posted]  # no checkpoint since `submit`
        text = "".join([piece.text async for piece in stream if isinstance(piece, g.Token)])
        runner = await until(sim.controller, lambda s: instance(s, iid)["runners"][0]["state"] == "ready")
        return forwarded_at_once, text, instance(runner, iid)["runners"][0]

    forwarded_at_once, text, runner = simulate(tmp_path, body)
    assert forwarded_at_once == ["Generate"] and text == "".join(TOKENS[:2])
    assert runner["state"] == "ready" and runner["in_flight"] == 0


def test_a_request_planned_inline_is_written_before_the_controllers_own_round(tmp_path):
    """The controller, woken by the same request, lets the command go out first (trio runs what woke together
    in any order: without that, half the requests waited for a round that had nothing to do for them)."""

    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 1)
        await until(sim.controller, ready_at(iid, 1))
        await settled()
        seen: list[str] = []
        act = sim.controller._act

        def traced_act() -> None:
            seen.append("inline round" if trio.lowlevel.current_task() is this else "controller round")
            act()

        runner = sim.fleet.runner(0, 1)
        take = runner._work_send.send_nowait
        runner._work_send.send_nowait = lambda command: (seen.append(type(command).__name__), take(command))
        sim.controller._act = traced_act
        this = trio.lowlevel.current_task()
        orders = []
        for _ in range(20):
            await settled()  # the daemon at rest when each comes (the last one's end planned)
            seen.clear()
            stream = sim.controller.requests.submit(iid, [{"role": "user", "content": "hi"}], max_tokens=1)
            async for _piece in stream:
                pass
            stream.close()
            orders.append(seen[:3])
        return orders

    orders = simulate(tmp_path, body)
    assert orders == [["inline round", "Generate", "controller round"]] * 20


def test_a_request_to_a_deposed_controller_is_not_planned_in_its_callers_task(tmp_path):
    """A controller whose term ended (its `run` cancelled, the daemon serving on until `fail_all`) plans
    nothing for a request that still reaches its book: no command to a runner it no longer runs, no runner
    started on a nursery that is closed, no error in the caller's task; the request waits, as it did before
    requests were planned inline, and the book's `fail_all` ends it."""
    fleet = FakeFleet(FakeModels())

    async def main() -> tuple[list[str], int, str]:
        cfg = config(tmp_path, None, timeouts=TIMEOUTS, policy=POLICY, queue_timeout=QUEUE_TIMEOUT)
        store = Store.open(cfg.db_path, retention=cfg.retention)
        try:
            controller = Controller(cfg, store, spawn=fleet, models=FakeModels(), wall=lambda: WALL)
            await controller.restore()
            with trio.fail_after(LIMIT):
                async with trio.open_nursery() as term:
                    await term.start(controller.run)
                    iid = await controller.place(MODEL, 1)
                    await until(controller, ready_at(iid, 1))
                    term.cancel_scope.cancel()  # deposed: `run` ends, its runners are reaped
                await settled()
                posted: list[str] = []
                post = controller.processes.post
                controller.processes.post = lambda rid, inc, c: (posted.append(type(c).__name__), post(rid, inc, c))
                spawned = len(fleet.generation(1)) + len(fleet.generation(2))
                stream = controller.requests.submit(iid, MESSAGES, max_tokens=2)  # must not raise
                await settled()
                controller.requests.fail_all("this node is no longer the cluster's controller")
                with pytest.raises(RequestFailed) as failed:
                    async for _piece in stream:
                        pass
                spawned_after = len(fleet.generation(1)) + len(fleet.generation(2)) - spawned
                return posted, spawned_after, str(failed.value)
        finally:
            store.close()

    posted, spawned, failure = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert posted == [] and spawned == 0
    assert "no longer the cluster's controller" in failure


# -- the backoff and the budget ---------------------------------------------------------------------------


def test_each_crash_costs_one_generation_the_backoff_is_waited_exactly_and_grows_then_retries_exhausted(tmp_path):
    crash = FaultSpec(Fault(FaultPhase.READY, FaultKind.SIGKILL), rank=1, generation=None)  # every generation
    policy = attrs.evolve(POLICY, max_failures=6)  # backoffs 2, 4, 8, 16, then the cap: 30

    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 2)
        status = await until(sim.controller, is_deleted(iid))
        await until(sim.controller, all_stopped(iid))
        await trio.sleep(3600)  # an hour later, nothing more was created
        return instance(status, iid), await sim.log("instance", iid), sim.fleet

    inst, log, fleet = simulate(tmp_path, body, policy=policy, faults=(crash,))
    assert inst["delete_reason"] == "retries_exhausted"
    assert inst["attempts"] == 6 and inst["generation"] == 6
    assert inst["last_failure"] == "runner killed by SIGKILL"
    assert len(fleet.runners) == 6 * 2  # max_retries generations of 2 ranks, not one more
    assert all(r.exit_code == -signal.SIGKILL for r in fleet.runners if r.spec.rank == 1)

    delays = [policy.backoff.delay(n) for n in range(1, 6)]
    assert delays == [2.0, 4.0, 8.0, 16.0, 30.0]
    for generation, delay in enumerate(delays, start=1):
        reaped = fleet.reaped_at(generation)
        assert fleet.created_at(generation + 1) == [reaped + delay] * 2  # at the deadline, not a tick later
    # The log says the same: BackingOff when the last rank of a generation was reaped, Starting `delay` later.
    backing_off, restarting = moves(log, "recovering", "backing_off"), moves(log, "backing_off", "starting")
    assert backing_off == [fleet.reaped_at(g) for g in range(1, 6)]
    assert [b - a for a, b in zip(backing_off, restarting, strict=True)] == delays
    assert moves(log, "ready", "deleted") == [fleet.runner(1, 6).exited_at]


def test_the_budget_refills_exactly_reset_after_of_continuous_ready_and_a_failure_before_keeps_the_count(tmp_path):
    async def body(sim: Sim):
        c, fleet = sim.controller, sim.fleet
        iid = await c.place(MODEL, 1)
        await until(c, ready_at(iid, 1))
        fleet.runner(0, 1).kill()
        await until(c, ready_at(iid, 2))
        assert sim.machine(iid).attempts == 1

        # Ready for 599 s only: the failure counts on top of the first.
        await trio.sleep_until(sim.machine(iid).ready_since - WALL + POLICY.reset_after - 1)
        assert sim.machine(iid).attempts == 1
        fleet.runner(0, 2).kill()
        await until(c, ready_at(iid, 3))
        assert sim.machine(iid).attempts == 2
        assert fleet.created_at(3) == [fleet.reaped_at(2) + POLICY.backoff.delay(2)]

        # Ready and idle: no report, no request, nothing. The controller wakes for the reset by itself.
        ready_since = sim.machine(iid).ready_since - WALL
        due = ready_since + POLICY.reset_after
        await trio.sleep_until(due - 0.001)
        await settled()
        assert sim.machine(iid).attempts == 2
        await trio.sleep_until(due)
        await settled()
        assert sim.machine(iid).attempts == 0
        assert sim.machine(iid).clock - WALL == due  # observed at exactly the due time
        assert [e.time for e in await sim.log() if e.time > ready_since] == []  # and no event brought it about

        # The next failure is charged to a fresh budget: one attempt, the first backoff again.
        fleet.runner(0, 3).kill()
        await until(c, ready_at(iid, 4))
        assert sim.machine(iid).attempts == 1
        assert fleet.created_at(4) == [fleet.reaped_at(3) + POLICY.backoff.delay(1)]

    simulate(tmp_path, body)


# -- stall watchdogs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault_phase", "phase", "timeout"),
    [
        (FaultPhase.CONNECTING, "joining", TIMEOUTS.connect),
        (FaultPhase.LOADING, "weights", TIMEOUTS.load_progress),
        (FaultPhase.WARMING_UP, "warming_up", TIMEOUTS.warm_up),
        (FaultPhase.BUSY, "generating", TIMEOUTS.generate),
    ],
)
def test_a_silent_runner_is_failed_as_stalled_exactly_the_phase_timeout_after_its_last_word(
    tmp_path, fault_phase, phase, timeout
):
    hang = FaultSpec(Fault(fault_phase, FaultKind.HANG), rank=0, generation=1)

    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 2)
        if fault_phase is FaultPhase.BUSY:
            await until(sim.controller, ready_at(iid, 1))
            with pytest.raises(RequestFailed, match=f"no progress in phase {phase}"):
                await chat(sim.controller, iid)  # ends with the runner's failure, never a hang
        status = await until(sim.controller, ready_at(iid, 2))
        return instance(status, iid), await sim.log("runner", f"{iid}/0"), sim.fleet

    inst, rank0_log, fleet = simulate(tmp_path, body, faults=(hang,))
    silent = fleet.runner(0, 1)
    last_word, _ = silent.reports[-1]
    (failed,) = [e for e in rank0_log if e.event == "fail"]
    assert failed.time == last_word + timeout
    assert failed.cause == f"no progress in phase {phase} for {timeout:g} s"
    # It ignores Shutdown: SIGTERM after stop_grace ends it, and that exit was our stop, not a second failure.
    assert silent.exit_code == -signal.SIGTERM and silent.stop_delivered
    assert silent.exited_at == failed.time + TIMEOUTS.stop_grace
    assert inst["attempts"] == 1 and inst["last_failure"] == failed.cause
    assert fleet.created_at(2) == [fleet.reaped_at(1) + POLICY.backoff.delay(1)] * 2


def test_slow_loading_that_keeps_reporting_progress_is_never_a_stall(tmp_path):
    slow = Timing(layers=4, layer=100.0)  # 400 s of loading, a progress report every 100 s < load_progress

    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 1)
        status = await until(sim.controller, ready_at(iid, 1))
        return instance(status, iid), trio.current_time()

    inst, ready = simulate(tmp_path, body, timing=slow)
    assert inst["attempts"] == 0 and inst["last_failure"] is None
    assert ready > slow.layers * slow.layer > TIMEOUTS.load_progress  # longer than the watchdog's limit in all


# -- requests -------------------------------------------------------------------------------------------


def test_a_request_no_ready_runner_takes_fails_with_queue_timeout_after_exactly_queue_timeout(tmp_path):
    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 1)
        await trio.sleep(7)
        submitted = trio.current_time()
        with pytest.raises(QueueTimeout):
            await chat(sim.controller, iid)
        return trio.current_time() - submitted, list(sim.controller.requests.pending()), sim.machine(iid)

    waited, pending, machine = simulate(tmp_path, body, models=FakeModels(delay=10_000))  # never Ready here
    assert waited == QUEUE_TIMEOUT
    assert pending == []  # forgotten, not left for a runner to pick up later
    assert machine.instance_state is fsm.InstanceState.STARTING and machine.attempts == 0


def test_a_request_queued_while_the_instance_starts_is_served_once_it_is_ready(tmp_path):
    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 1)
        text = await chat(sim.controller, iid)
        return text, trio.current_time(), moves(await sim.log("instance", iid), "starting", "ready")

    text, done, (ready,) = simulate(tmp_path, body, models=FakeModels(delay=20))
    assert ready < QUEUE_TIMEOUT
    assert text == "".join(TOKENS)
    assert done == ready + len(TOKENS) * Timing().token  # forwarded the moment the instance was Ready


def test_delete_ends_queued_requests_with_an_error_at_once(tmp_path):
    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 1)
        outcomes: list[tuple[float, str]] = []

        async def one():
            try:
                await chat(sim.controller, iid)
            except RequestFailed as exc:
                outcomes.append((trio.current_time(), f"{type(exc).__name__}: {exc}"))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
            await trio.sleep(10)
            await sim.controller.delete(iid)
        return outcomes

    outcomes = simulate(tmp_path, body, models=FakeModels(delay=10_000))  # still downloading at the delete
    assert outcomes == [(10.0, "RequestFailed: instance was deleted (requested)")] * 3


def test_delete_ends_an_in_flight_request_with_an_error_at_once(tmp_path):
    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 2)
        await until(sim.controller, ready_at(iid, 1))
        tokens = []
        with pytest.raises(RequestFailed) as failure:  # the runner's end, not a QueueTimeout
            async for item in sim.controller.requests.generate(iid, MESSAGES):
                tokens.append(item)
                deleted_at = trio.current_time()
                await sim.controller.delete(iid)
        assert not isinstance(failure.value, QueueTimeout)
        assert "instance was deleted (requested)" in str(failure.value)
        return tokens, deleted_at, trio.current_time(), instance(sim.controller.status(), iid)

    slow_tokens = Timing(token=10.0)  # 70 s for the whole answer
    tokens, deleted_at, failed_at, inst = simulate(tmp_path, body, timing=slow_tokens)
    assert [type(t) for t in tokens] == [g.Token]
    assert failed_at == deleted_at  # not after the generation, nor after a watchdog
    assert inst["delete_reason"] == "requested"


# -- giving up, downloads -------------------------------------------------------------------------------


def test_a_non_retryable_failure_deletes_at_once_and_nothing_is_started_again(tmp_path):
    corrupt = FakeModels(defective={MODEL: "SafetensorError: Error while deserializing header: incomplete metadata"})

    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 2)
        status = await until(sim.controller, is_deleted(iid))
        await until(sim.controller, all_stopped(iid))
        await trio.sleep(3600)
        return instance(status, iid), await sim.log("instance", iid), sim.fleet

    inst, log, fleet = simulate(tmp_path, body, models=corrupt)
    assert inst["delete_reason"] == "non_retryable"
    assert inst["attempts"] == 0 and inst["generation"] == 1
    assert inst["last_failure"].startswith("SafetensorError")
    first_failed = min(t for r in fleet.runners for t, report in r.reports if isinstance(report, p.Failed))
    assert moves(log, "starting", "deleted") == [first_failed]  # at once: no backoff, no second generation
    assert len(fleet.runners) == 2


def test_a_failed_download_is_retried_after_the_download_backoff_and_costs_the_instance_nothing(tmp_path):
    flaky = FakeModels(delay=1.0, failures={MODEL: 3})

    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 1)
        await until(sim.controller, lambda s: (instance(s, iid)["download"] or {}).get("attempts") == 1)
        waiting = instance(sim.controller.status(), iid)
        status = await until(sim.controller, ready_at(iid, 1))
        return waiting, instance(status, iid), sim.fleet

    waiting, inst, fleet = simulate(tmp_path, body, models=flaky)
    assert waiting["state"] == "starting" and waiting["waiting_for"] == "download"
    assert waiting["runners"][0]["state"] is None  # no process before its model is on the node
    assert "fake hub" in waiting["download"]["last_error"]
    starts = [started for started, _, _ in flaky.fetches]
    assert [outcome == "ok" for _, _, outcome in flaky.fetches] == [False, False, False, True]
    gaps = [b - (a + flaky.delay) for a, b in itertools.pairwise(starts)]
    assert gaps == [DOWNLOADS.delay(n) for n in (1, 2, 3)] == [5.0, 10.0, 20.0]
    assert inst["attempts"] == 0 and inst["generation"] == 1 and len(fleet.runners) == 1


def test_the_controller_spawns_only_what_the_machines_accepted(tmp_path, monkeypatch):
    """A late CreateRunner for a deleted instance leaves no process and no phantom runner."""
    late: list[fsm.CreateRunner] = []
    real_plan = fsm.plan

    def plan_with_a_late_create(view, node_id, now):
        return [*real_plan(view, node_id, now), *late]

    monkeypatch.setattr(fsm, "plan", plan_with_a_late_create)

    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 2)
        await until(sim.controller, lambda s: all(r["state"] for r in instance(s, iid)["runners"]))
        await sim.controller.delete(iid)  # generation 1 started and its runners exist
        await until(sim.controller, all_stopped(iid))
        other = await sim.controller.place(MODEL, 1)  # something to plan for: the late action rides along
        late.append(fsm.CreateRunner(iid, f"{iid}/9", "local", 0, 2, 1, MODEL))
        await settled()
        return iid, other, [r.spec.runner_id for r in sim.fleet.runners], sim.controller.status()

    iid, other, spawned, status = simulate(tmp_path, body, models=FakeModels(delay=1.0))
    assert f"{iid}/9" not in spawned  # the machines refused it: no process
    assert [r["runner_id"] for r in instance(status, iid)["runners"]] == [f"{iid}/0", f"{iid}/1"]  # no phantom
    assert instance(status, iid)["state"] == "deleted" and instance(status, other)["state"] != "deleted"
