"""The fault-injection matrix: every phase × every kind, on real 2-rank instances of the tiny model.

For each cell a fault is armed on rank 1 of generation 1 (`exod.runner.faults`), and the cell asserts what the
design promises: the right cause, one_for_all, the backoff waited out, one generation at a time, requests
ended with an error instead of a hang, service back afterwards, and a log that replays. The observations
become `specs/reliability.md` when `EXOD_WRITE_RELIABILITY=1` (`make reliability`).
"""

from __future__ import annotations

import os
import time

import attrs
import pytest
import trio
from reliability_report import SPEC, WRITE, write_section

import fsm
from daemon_harness import (
    FAST_TIMEOUTS,
    assert_log_conforms,
    config,
    instance,
    wait_for,
    with_controller,
)
from exod.chaos.report import rows_of, write_rows
from exod.host.supervisor import Timeouts
from exod.host.tiny_model import make_tiny_model
from exod.requests import RequestFailed
from exod.runner.faults import Fault, FaultKind, FaultPhase, FaultSpec
from exod.state.sqlite import Store
from fsm.conformance import replay

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")


MODEL = "exod/tiny-qwen2"
MESSAGES = [{"role": "user", "content": "hello"}]
POLICY = fsm.RetryPolicy(backoff=fsm.Backoff(0.2, 2.0, 1.0), max_failures=5)

# (phase, kind) -> the failure kind rank 1 of generation 1 must show (None: no failure, the fault is survived)
EXPECTED: dict[FaultKind, fsm.FailureKind | None] = {
    FaultKind.SIGKILL: fsm.FailureKind.SIGNAL,
    FaultKind.EXCEPTION: fsm.FailureKind.EXCEPTION,
    FaultKind.EXIT0: fsm.FailureKind.EXIT,
    FaultKind.HANG: fsm.FailureKind.STALL,
    FaultKind.SLOW: None,
}
OBSERVED: list[dict] = []
TAKEN: set = set()  # every transition the matrix's logs took: with the fault campaign's, the coverage figure


def expected(phase: FaultPhase, kind: FaultKind) -> fsm.FailureKind | None:
    if phase is FaultPhase.STOPPING and kind is not FaultKind.EXCEPTION:
        return None  # dying or stalling while being stopped is how a stop ends
    return EXPECTED[kind]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf")
    make_tiny_model(MODEL, layers=4, hf_home=home)
    return home


@pytest.fixture(scope="module")
def timeouts(hf_home, tmp_path_factory) -> Timeouts:
    """The stall timeouts the matrix arms, from what a fault-free cold start takes here and now: twice it, or
    4–5 s if that is more. A busy machine makes a phase slow, not stalled (two cells failed so beside other
    work, "no progress in phase loading for 4 s", issue #26); a hang is still told from it."""
    cfg = config(tmp_path_factory.mktemp("pace"), hf_home, timeouts=FAST_TIMEOUTS, policy=POLICY)

    async def cold_start(controller) -> float:
        started = trio.current_time()
        iid = await controller.place(MODEL, 2)
        await wait_for(controller, lambda s: instance(s, iid)["state"] == "ready", timeout=120)
        return trio.current_time() - started

    slack = 2 * with_controller(cfg, cold_start, limit=150)
    return attrs.evolve(
        FAST_TIMEOUTS,
        connect=max(5.0, slack),
        load_progress=max(4.0, slack),
        warm_up=max(5.0, slack),
        generate=max(4.0, slack),
        stop_grace=0.5,
        term_grace=0.5,
    )


def gen1_failure(log, key: str) -> str | None:
    """The cause recorded when rank 1's first incarnation failed, if it did."""
    creates = [i for i, e in enumerate(log) if e.key == key and e.event == "create"]
    end = creates[1] if len(creates) > 1 else len(log)
    causes = [e.cause for e in log[creates[0] : end] if e.key == key and e.target == "failed" and e.cause]
    return causes[0] if causes else None


@pytest.mark.parametrize("kind", list(FaultKind), ids=lambda k: k.value)
@pytest.mark.parametrize("phase", list(FaultPhase), ids=lambda p: p.value)
def test_fault(tmp_path, hf_home, timeouts, phase: FaultPhase, kind: FaultKind):
    fault = FaultSpec(Fault(phase, kind), rank=1, generation=1)
    cfg = config(tmp_path, hf_home, timeouts=timeouts, policy=POLICY, faults=(fault,))
    patience = timeouts.load_progress / 4.0  # the waits below, stretched as the machine is slow
    want = expected(phase, kind)
    recovers = want is not None or phase is FaultPhase.STOPPING
    observed: dict = {"phase": phase.value, "kind": kind.value}

    async def body(controller):
        iid = await controller.place(MODEL, 2)
        if phase in (FaultPhase.READY, FaultPhase.BUSY, FaultPhase.STOPPING) or want is None:
            await wait_for(controller, lambda s: instance(s, iid)["state"] == "ready", timeout=30 * patience)
        if phase is FaultPhase.READY:
            await trio.sleep(0.5)  # the idle fault fires shortly after Ready
        if (phase is FaultPhase.BUSY and want is not None) or (phase is FaultPhase.READY and kind is FaultKind.HANG):
            started = trio.current_time()
            ended: list[float] = []

            async def one(seed: int) -> None:
                with pytest.raises(RequestFailed):  # each request of the batch in flight ends with an error
                    stream = controller.requests.generate(iid, MESSAGES, max_tokens=4000, temperature=1.0, seed=seed)
                    async for _ in stream:
                        pass
                ended.append(trio.current_time() - started)

            async with trio.open_nursery() as nursery:  # a batch in flight: 4 requests decoded together
                for seed in range(1, 5):
                    nursery.start_soon(one, seed)
            observed["request_error_s"] = round(max(ended), 2)
            bound = 2 * timeouts.generate + 2  # a stall is told after `generate` s; then the stop
            assert len(ended) == 4 and observed["request_error_s"] < bound  # every one of them, none hangs
        if phase is FaultPhase.STOPPING:  # make rank 1 stop: its sibling dies
            import signal

            os.kill(controller.processes.pid(f"{iid}/0", 1), signal.SIGKILL)
        if recovers:
            await wait_for(
                controller,
                lambda s: instance(s, iid)["state"] == "ready" and instance(s, iid)["generation"] >= 2,
                40 * patience,
            )
        else:
            await trio.sleep(1.0)  # a slow phase is survived: still generation 1, nothing failed
        text = ""
        async for item in controller.requests.generate(iid, MESSAGES, max_tokens=8, temperature=1.0, seed=2):
            text += getattr(item, "text", "")
        observed["served_after"] = True
        return iid, instance(controller.status(), iid)

    start = time.monotonic()
    iid, inst = with_controller(cfg, body, limit=80 * patience)
    observed["seconds"] = round(time.monotonic() - start, 1)
    store = Store.open(cfg.db_path)
    log = [e for _, e in store.transitions()]
    store.close()
    assert_log_conforms(cfg.db_path)
    moves = [(e.machine, e.key, e.source, e.target, e.event) for e in log]
    TAKEN.update(rows_of(replay(log).coverage)[1])

    cause = gen1_failure(log, f"{iid}/1")
    if phase is FaultPhase.CONNECTING and kind is FaultKind.HANG:
        # rank 0 waits in the ring for the hung rank 1: both stall in joining, their limits passing within a
        # millisecond of each other, and the planner fails the first it finds past (found by the suite on 2 busy
        # cores: rank 0, connected first). Either is the fault's effect; the generation must fail with it.
        cause = cause or gen1_failure(log, f"{iid}/0")
    observed["cause"] = cause or "-"
    if want is None:
        if phase is not FaultPhase.STOPPING:
            assert cause is None and inst["generation"] == 1 and inst["attempts"] == 0
    else:
        kind_word = {
            fsm.FailureKind.SIGNAL: "SIGKILL",
            fsm.FailureKind.EXCEPTION: "InjectedFault",
            fsm.FailureKind.EXIT: "exited unexpectedly with code 0",
            fsm.FailureKind.STALL: "no progress",
        }[want]
        assert cause is not None and kind_word in cause, (cause, kind_word)
    if recovers:
        assert inst["attempts"] == 1  # several ranks failing in one generation cost one retry
        # one_for_all, one generation at a time: every generation-1 runner stopped before generation 2 began
        restart = moves.index(("instance", iid, "backing_off", "starting", "start"))
        backing_off = moves.index(("instance", iid, "recovering", "backing_off", "auto"))
        stops = [i for i, m in enumerate(moves) if m[0] == "runner" and m[3] == "stopped" and i < restart]
        assert len(stops) == 2
        creates = [i for i, m in enumerate(moves) if m[4] == "create"]
        assert len(creates) == 4 and all(i > restart for i in creates[2:])
        waited = log[restart].time - log[backing_off].time
        assert waited >= POLICY.backoff.initial - 1e-3  # no start before its deadline
        observed["backoff_waited_s"] = round(waited, 2)
    observed["generation"] = inst["generation"]
    observed["attempts"] = inst["attempts"]
    OBSERVED.append(observed)


@pytest.fixture(scope="module", autouse=True)
def reliability_report():
    """`make reliability`: once the whole matrix ran, what it observed becomes specs/reliability.md."""
    yield
    if WRITE and len(OBSERVED) == len(FaultPhase) * len(FaultKind):
        write_report()
        write_rows(SPEC.parent / "transitions-fault-matrix.json", TAKEN)  # read by `exod chaos --report`


def write_report() -> None:
    rows = [
        "| phase | kind | cause recorded for rank 1 | generation | retries | backoff waited | request error after | "
        "served after | seconds |",
        "|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for o in OBSERVED:
        rows.append(
            f"| {o['phase']} | {o['kind']} | {o['cause']} | {o['generation']} | {o['attempts']} | "
            f"{o.get('backoff_waited_s', '-')} | {o.get('request_error_s', '-')} | "
            f"{'yes' if o.get('served_after') else 'no'} | {o['seconds']} |"
        )
    text = (
        "## The fault-injection matrix\n\n"
        "Written by `make reliability` (tests/test_fault_matrix.py) from what the run observed, not by hand. "
        "Each row: a real 2-rank instance of the tiny model, a fault armed on rank 1 of generation 1 at that "
        "phase, of that kind. Every row also asserted: one_for_all (every generation-1 runner stopped before "
        "generation 2 started), no start before the backoff deadline, never more live processes than ranks, "
        "no process left at the end, and a transition log that replays through the machines.\n\n"
        "Dying or stalling while being stopped is how a stop ends, so those rows record no failure; a slow phase "
        "is survived without one.\n\n" + "\n".join(rows) + "\n"
    )
    write_section("matrix", text)
