"""RunnerLifecycle: every transition, guard and rule, driven through ``apply``."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from statemachine.exceptions import TransitionNotAllowed

from fsm import (
    Failure,
    FailureKind,
    IllegalTransition,
    IncarnationMismatch,
    InvalidConfig,
    InvalidEvent,
    Outcome,
    RunnerLifecycle,
    RunnerPhase,
    RunnerState,
    SnapshotError,
    Step,
    UnknownEvent,
)
from fsm.runner import (
    Connect,
    Connected,
    Exited,
    Fail,
    Load,
    Progress,
    RequestFinished,
    RequestStarted,
    RunnerEvent,
    RunnerSnapshot,
    Stop,
    Warmed,
    WarmUp,
    WeightsLoaded,
    phase_parent,
)

RID = "runner-a"
INC = 3
STALL = Failure.stalled("weights", 60)


def make(name: str, *, runner_id: str = RID, incarnation: int = INC, **overrides: Any) -> RunnerEvent:
    """One event of each kind, with a plausible default payload."""
    if name == "progress":
        return Progress(runner_id, incarnation, overrides.get("layers_loaded", 4), overrides.get("layers_total", 10))
    if name == "fail":
        return Fail(runner_id, incarnation, overrides.get("failure", STALL))
    if name == "exited":
        return Exited(runner_id, incarnation, overrides.get("exit_code", 0), overrides.get("detail", ""))
    simple: dict[str, Callable[[str, int], RunnerEvent]] = {
        "connect": Connect,
        "connected": Connected,
        "load": Load,
        "weights_loaded": WeightsLoaded,
        "warm_up": WarmUp,
        "warmed": Warmed,
        "request_started": RequestStarted,
        "request_finished": RequestFinished,
        "stop": Stop,
    }
    return simple[name](runner_id, incarnation)


EVENTS = [
    "connect",
    "connected",
    "load",
    "progress",
    "weights_loaded",
    "warm_up",
    "warmed",
    "request_started",
    "request_finished",
    "fail",
    "stop",
    "exited",
]

# How to reach each leaf: (world_size, events from a fresh machine, expected dotted path).
ROUTES: dict[str, tuple[int, list[str], str]] = {
    "idle/single": (1, [], "running.idle"),
    "idle/multi": (2, [], "running.idle"),
    "joining": (2, ["connect"], "running.connecting.joining"),
    "joined": (2, ["connect", "connected"], "running.connecting.joined"),
    "weights/single": (1, ["load"], "running.loading.weights"),
    "weights/multi": (2, ["connect", "connected", "load"], "running.loading.weights"),
    "loaded": (1, ["load", "progress", "weights_loaded"], "running.loading.loaded"),
    "warming_up": (1, ["load", "weights_loaded", "warm_up"], "running.loading.warming_up"),
    "available": (1, ["load", "weights_loaded", "warm_up", "warmed"], "running.ready.available"),
    "busy": (1, ["load", "weights_loaded", "warm_up", "warmed", "request_started"], "running.ready.busy"),
    "failed": (2, ["connect", "fail"], "failed"),
    "stopping": (2, ["connect", "stop"], "shutdown.stopping"),
    "stopped": (2, ["connect", "stop", "exited"], "shutdown.stopped"),
}

# Allowed (route, event) -> expected path afterwards; every other pair must be refused.
F, STOPPING, STOPPED = "failed", "shutdown.stopping", "shutdown.stopped"
_RUNNING = {"fail": F, "stop": STOPPING, "exited": STOPPED}
ALLOWED: dict[str, dict[str, str]] = {
    "idle/single": {"load": "running.loading.weights", **_RUNNING},
    "idle/multi": {"connect": "running.connecting.joining", **_RUNNING},
    "joining": {"connected": "running.connecting.joined", **_RUNNING},
    "joined": {"load": "running.loading.weights", **_RUNNING},
    "weights/single": {"progress": "running.loading.weights", "weights_loaded": "running.loading.loaded", **_RUNNING},
    "weights/multi": {"progress": "running.loading.weights", "weights_loaded": "running.loading.loaded", **_RUNNING},
    "loaded": {"warm_up": "running.loading.warming_up", **_RUNNING},
    "warming_up": {"warmed": "running.ready.available", **_RUNNING},
    "available": {"request_started": "running.ready.busy", **_RUNNING},
    "busy": {"request_started": "running.ready.busy", "request_finished": "running.ready.available", **_RUNNING},
    "failed": {"stop": F, "exited": STOPPED},
    "stopping": {"fail": F, "exited": STOPPED},
    "stopped": {},
}


def drive(route: str, *, rank: int = 0, incarnation: int = INC) -> RunnerLifecycle:
    world_size, events, path = ROUTES[route]
    machine = RunnerLifecycle(RID, rank=min(rank, world_size - 1), world_size=world_size, incarnation=incarnation)
    for name in events:
        assert machine.apply(make(name, incarnation=incarnation)).accepted
    assert machine.path == path
    return machine


def new(world_size: int = 1, **kwargs: Any) -> RunnerLifecycle:
    return RunnerLifecycle(RID, world_size=world_size, incarnation=INC, **kwargs)


def assert_refused(machine: RunnerLifecycle, event: RunnerEvent, match: str | None = None) -> IllegalTransition:
    before, path = machine.to_dict(), machine.path
    with pytest.raises(IllegalTransition, match=match) as info:
        machine.apply(event)
    assert machine.to_dict() == before
    assert machine.path == path
    assert info.value.machine == "runner"
    assert info.value.event == event.name
    assert info.value.state == path
    return info.value


# -- the full transition table ---------------------------------------------------------


def test_routes_and_table_cover_every_leaf() -> None:
    leaves = {path.rsplit(".", 1)[-1] for _, _, path in ROUTES.values()}
    assert leaves == {phase.value for phase in RunnerPhase} | {"idle", "failed"}
    assert set(ALLOWED) == set(ROUTES)
    assert {e.id for e in RunnerLifecycle(RID).events} == set(EVENTS)


@pytest.mark.parametrize("event", EVENTS)
@pytest.mark.parametrize("route", list(ROUTES))
def test_transition_table(route: str, event: str) -> None:
    machine = drive(route)
    expected = ALLOWED[route].get(event)
    if expected is None:
        assert_refused(machine, make(event))
    else:
        outcome = machine.apply(make(event))
        assert outcome.accepted
        assert machine.path == expected


# -- construction --------------------------------------------------------------------------


def test_fresh_machine_is_idle() -> None:
    machine = RunnerLifecycle(RID, rank=1, world_size=4, incarnation=7)
    assert machine.path == "running.idle"
    assert machine.leaf == "idle"
    assert machine.runner_state is RunnerState.IDLE
    assert machine.phase is None
    assert machine.alive
    assert machine.failure is None
    assert (machine.rank, machine.world_size, machine.incarnation) == (1, 4, 7)
    assert (machine.layers_loaded, machine.layers_total, machine.in_flight, machine.stop_requested) == (0, 0, 0, False)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        pytest.param(("",), {}, id="empty-id"),
        pytest.param((None,), {}, id="none-id"),
        pytest.param((5,), {}, id="int-id"),
        pytest.param((RID,), {"world_size": 0}, id="world-size-zero"),
        pytest.param((RID,), {"world_size": -1}, id="world-size-negative"),
        pytest.param((RID,), {"world_size": True}, id="world-size-bool"),
        pytest.param((RID,), {"world_size": 2.0}, id="world-size-float"),
        pytest.param((RID,), {"rank": 1, "world_size": 1}, id="rank-equals-world-size"),
        pytest.param((RID,), {"rank": 4, "world_size": 2}, id="rank-above-world-size"),
        pytest.param((RID,), {"rank": -1, "world_size": 2}, id="rank-negative"),
        pytest.param((RID,), {"incarnation": -1}, id="incarnation-negative"),
        pytest.param((RID,), {"incarnation": "1"}, id="incarnation-str"),
    ],
)
def test_invalid_constructor_args_raise_invalid_config(args: tuple, kwargs: dict) -> None:
    with pytest.raises(InvalidConfig):
        RunnerLifecycle(*args, **kwargs)


def test_rank_out_of_range_message_names_both() -> None:
    with pytest.raises(InvalidConfig, match="rank 2 is out of range for world_size 2"):
        RunnerLifecycle(RID, rank=2, world_size=2)


# -- connect / load guards ---------------------------------------------------------------------


def test_connect_from_idle_multi_rank() -> None:
    machine = new(world_size=2)
    outcome = machine.apply(make("connect"))
    assert outcome == Outcome(accepted=True, steps=(Step("connect", "idle", "joining"),))
    assert machine.runner_state is RunnerState.CONNECTING
    assert machine.phase is RunnerPhase.JOINING


def test_connect_single_rank_is_refused_with_reason() -> None:
    error = assert_refused(new(world_size=1), make("connect"), match="world_size > 1")
    assert "single rank goes straight to load" in str(error)


@pytest.mark.parametrize("route", ["joining", "joined", "weights/multi", "available", "stopping", "stopped"])
def test_connect_only_from_idle(route: str) -> None:
    assert_refused(drive(route), make("connect"))


def test_connected_then_load_from_joined() -> None:
    machine = new(world_size=2)
    machine.apply(make("connect"))
    assert machine.apply(make("connected")).steps == (Step("connected", "joining", "joined"),)
    assert machine.phase is RunnerPhase.JOINED
    assert machine.apply(make("load")).steps == (Step("load", "joined", "weights"),)
    assert machine.path == "running.loading.weights"


def test_load_from_joining_is_refused() -> None:
    machine = new(world_size=2)
    machine.apply(make("connect"))
    assert_refused(machine, make("load"))


def test_single_rank_loads_straight_from_idle() -> None:
    machine = new(world_size=1)
    outcome = machine.apply(make("load"))
    assert outcome.steps == (Step("load", "idle", "weights"),)
    assert machine.runner_state is RunnerState.LOADING
    assert machine.phase is RunnerPhase.WEIGHTS


@pytest.mark.parametrize("world_size", [2, 8])
def test_multi_rank_load_from_idle_is_refused_with_reason(world_size: int) -> None:
    assert_refused(new(world_size=world_size), make("load"), match="must connect")


# -- loading ---------------------------------------------------------------------------------------


def test_progress_records_layers_and_stays_in_weights() -> None:
    machine = drive("weights/single")
    outcome = machine.apply(make("progress", layers_loaded=3, layers_total=40))
    assert outcome == Outcome(accepted=True, steps=())
    assert (machine.layers_loaded, machine.layers_total) == (3, 40)
    machine.apply(make("progress", layers_loaded=40, layers_total=40))
    assert (machine.layers_loaded, machine.layers_total) == (40, 40)
    assert machine.path == "running.loading.weights"


def test_progress_zero_of_n_is_valid() -> None:
    machine = drive("weights/single")
    machine.apply(make("progress", layers_loaded=0, layers_total=1))
    assert (machine.layers_loaded, machine.layers_total) == (0, 1)


@pytest.mark.parametrize("route", ["idle/single", "joined", "loaded", "warming_up", "available", "busy", "failed"])
def test_progress_only_in_weights(route: str) -> None:
    assert_refused(drive(route), make("progress"))


@pytest.mark.parametrize(
    ("loaded", "total"),
    [(11, 10), (1, 0), (0, 0), (-1, 10), (1, -1), (True, 10), (1.5, 10), (1, "10")],
)
def test_invalid_progress_raises_invalid_event_at_construction(loaded: Any, total: Any) -> None:
    with pytest.raises(InvalidEvent):
        Progress(RID, INC, loaded, total)


def test_weights_loaded_sets_all_layers() -> None:
    machine = drive("weights/single")
    machine.apply(make("progress", layers_loaded=7, layers_total=32))
    outcome = machine.apply(make("weights_loaded"))
    assert outcome.steps == (Step("weights_loaded", "weights", "loaded"),)
    assert (machine.layers_loaded, machine.layers_total) == (32, 32)
    assert machine.phase is RunnerPhase.LOADED


def test_warm_up_and_warmed_reach_ready_available() -> None:
    machine = drive("loaded")
    assert machine.apply(make("warm_up")).steps == (Step("warm_up", "loaded", "warming_up"),)
    assert machine.apply(make("warmed")).steps == (Step("warmed", "warming_up", "available"),)
    assert machine.runner_state is RunnerState.READY
    assert machine.phase is RunnerPhase.AVAILABLE
    assert machine.in_flight == 0


# -- ready: available ⇄ busy ---------------------------------------------------------------


def test_requests_count_in_flight() -> None:
    machine = drive("available")
    assert machine.apply(make("request_started")).steps == (Step("request_started", "available", "busy"),)
    assert (machine.path, machine.in_flight) == ("running.ready.busy", 1)
    assert machine.apply(make("request_started")).steps == ()
    assert (machine.path, machine.in_flight) == ("running.ready.busy", 2)
    assert machine.apply(make("request_finished")).steps == ()
    assert (machine.path, machine.in_flight) == ("running.ready.busy", 1)
    assert machine.apply(make("request_finished")).steps == (Step("request_finished", "busy", "available"),)
    assert (machine.path, machine.in_flight) == ("running.ready.available", 0)


def test_request_finished_when_available_is_refused() -> None:
    machine = drive("available")
    assert_refused(machine, make("request_finished"))
    assert machine.in_flight == 0


def test_many_requests_return_to_available_only_after_the_last() -> None:
    machine = drive("available")
    for _ in range(5):
        machine.apply(make("request_started"))
    for remaining in (4, 3, 2, 1):
        machine.apply(make("request_finished"))
        assert (machine.path, machine.in_flight) == ("running.ready.busy", remaining)
    machine.apply(make("request_finished"))
    assert (machine.path, machine.in_flight) == ("running.ready.available", 0)


# -- fail -------------------------------------------------------------------------------------------------

NON_FINAL = [
    "idle/single",
    "idle/multi",
    "joining",
    "joined",
    "weights/single",
    "weights/multi",
    "loaded",
    "warming_up",
    "available",
    "busy",
    "stopping",
]


@pytest.mark.parametrize("route", NON_FINAL)
def test_fail_from_every_non_final_state_records_the_failure(route: str) -> None:
    machine = drive(route)
    source = machine.leaf
    failure = Failure.exception("CudaError", "out of memory", retryable=False)
    outcome = machine.apply(make("fail", failure=failure))
    assert outcome == Outcome(accepted=True, steps=(Step("fail", source, "failed"),))
    assert machine.path == "failed"
    assert machine.runner_state is RunnerState.FAILED
    assert machine.phase is None
    assert machine.failure == failure
    assert machine.in_flight == 0
    assert machine.alive


def test_fail_while_busy_clears_in_flight() -> None:
    machine = drive("busy")
    machine.apply(make("request_started"))
    assert machine.in_flight == 2
    machine.apply(make("fail"))
    assert machine.in_flight == 0


@pytest.mark.parametrize("event", [e for e in EVENTS if e not in ("stop", "exited")])
def test_failed_refuses_everything_but_stop_and_exited(event: str) -> None:
    machine = drive("failed")
    error = assert_refused(machine, make(event))
    assert "never revived" in str(error)


def test_connect_from_failed_is_refused() -> None:
    # The seed bug: a failed runner was revived by a later connect.
    machine = drive("failed")
    assert machine.world_size == 2
    error = assert_refused(machine, make("connect"), match="never revived")
    assert error.state == "failed"
    assert machine.failure == STALL


def test_stop_in_failed_is_an_internal_no_op_that_records_the_request() -> None:
    machine = drive("failed")
    outcome = machine.apply(make("stop"))
    assert outcome == Outcome(accepted=True, steps=())
    assert machine.path == "failed"
    assert machine.stop_requested
    assert machine.failure == STALL
    # still left only to stopped, by exited
    assert machine.apply(make("exited", exit_code=0)).steps == (Step("exited", "failed", "stopped"),)
    assert machine.path == "shutdown.stopped"


def test_exited_from_failed_keeps_the_original_failure() -> None:
    machine = drive("failed")
    outcome = machine.apply(make("exited", exit_code=-9))
    assert outcome.steps == (Step("exited", "failed", "stopped"),)
    assert machine.failure == STALL
    assert not machine.alive


# -- exited ---------------------------------------------------------------------------------------------

RUNNING = [r for r in NON_FINAL if r != "stopping"]


@pytest.mark.parametrize("route", RUNNING)
def test_exit_while_running_passes_through_failed_in_one_apply(route: str) -> None:
    machine = drive(route)
    source = machine.leaf
    outcome = machine.apply(make("exited", exit_code=0, detail="bye"))
    assert outcome.accepted
    assert outcome.steps == (Step("exited", source, "failed"), Step("exited", "failed", "stopped"))
    assert machine.path == "shutdown.stopped"
    assert machine.runner_state is RunnerState.SHUTDOWN
    assert machine.phase is RunnerPhase.STOPPED
    assert not machine.alive
    assert machine.in_flight == 0
    assert machine.failure is not None
    assert machine.failure.kind is FailureKind.EXIT
    assert machine.failure.exit_code == 0
    assert machine.failure.detail == "bye"


@pytest.mark.parametrize("exit_code", [0, 1, 137])
def test_exit_code_zero_or_positive_while_running_is_an_exit_failure(exit_code: int) -> None:
    machine = drive("available")
    machine.apply(make("exited", exit_code=exit_code))
    assert machine.failure == Failure.exited(exit_code)
    assert machine.failure.kind is FailureKind.EXIT
    assert machine.failure.exit_code == exit_code
    assert machine.failure.signal is None


@pytest.mark.parametrize(("exit_code", "signal"), [(-9, 9), (-11, 11), (-15, 15)])
def test_negative_exit_code_while_running_is_a_signal_failure(exit_code: int, signal: int) -> None:
    machine = drive("busy")
    outcome = machine.apply(make("exited", exit_code=exit_code))
    assert outcome.steps == (Step("exited", "busy", "failed"), Step("exited", "failed", "stopped"))
    assert machine.failure is not None
    assert machine.failure.kind is FailureKind.SIGNAL
    assert machine.failure.signal == signal
    assert machine.failure.exit_code is None


@pytest.mark.parametrize("exit_code", [0, 1, -9])
def test_exit_while_stopping_is_clean(exit_code: int) -> None:
    machine = drive("stopping")
    outcome = machine.apply(make("exited", exit_code=exit_code))
    assert outcome == Outcome(accepted=True, steps=(Step("exited", "stopping", "stopped"),))
    assert machine.path == "shutdown.stopped"
    assert machine.failure is None
    assert machine.stop_requested
    assert not machine.alive


@pytest.mark.parametrize("route", RUNNING)
def test_stop_from_running_states_enters_stopping(route: str) -> None:
    machine = drive(route)
    source = machine.leaf
    outcome = machine.apply(make("stop"))
    assert outcome.steps == (Step("stop", source, "stopping"),)
    assert machine.path == "shutdown.stopping"
    assert machine.stop_requested
    assert machine.in_flight == 0
    assert machine.failure is None
    assert machine.alive


@pytest.mark.parametrize("event", EVENTS)
def test_stopped_is_final(event: str) -> None:
    machine = drive("stopped")
    assert_refused(machine, make(event))
    assert not machine.alive


def test_failure_survives_shutdown_in_snapshot() -> None:
    machine = drive("available")
    machine.apply(make("exited", exit_code=1))
    data = machine.to_dict()
    assert data["leaf"] == "stopped"
    assert data["failure"]["kind"] == "exit"
    assert data["failure"]["exit_code"] == 1


# -- incarnation and identity -------------------------------------------------------------------


@pytest.mark.parametrize("route", ["idle/multi", "joining", "weights/single", "busy", "failed", "stopping", "stopped"])
@pytest.mark.parametrize("event", ["connect", "load", "fail", "stop", "exited", "request_started"])
def test_stale_incarnation_is_ignored_and_changes_nothing(route: str, event: str) -> None:
    machine = drive(route)
    before, path = machine.to_dict(), machine.path
    outcome = machine.apply(make(event, incarnation=INC - 1))
    assert outcome.accepted is False
    assert outcome.steps == ()
    assert "stale incarnation" in outcome.note
    assert machine.to_dict() == before
    assert machine.path == path


def test_stale_incarnation_zero() -> None:
    machine = drive("available")
    before = machine.to_dict()
    assert machine.apply(make("exited", incarnation=0, exit_code=1)) == Outcome.ignored(f"stale incarnation 0 < {INC}")
    assert machine.to_dict() == before


@pytest.mark.parametrize("route", ["idle/single", "busy", "stopped"])
def test_newer_incarnation_raises(route: str) -> None:
    machine = drive(route)
    before = machine.to_dict()
    with pytest.raises(IncarnationMismatch, match=f"incarnation {INC}"):
        machine.apply(make("stop", incarnation=INC + 1))
    assert machine.to_dict() == before


def test_wrong_runner_id_raises_invalid_event() -> None:
    machine = drive("available")
    before = machine.to_dict()
    with pytest.raises(InvalidEvent, match="runner-b"):
        machine.apply(make("request_started", runner_id="runner-b"))
    # even a stale incarnation for another runner is an error, not ignored
    with pytest.raises(InvalidEvent):
        machine.apply(make("request_started", runner_id="runner-b", incarnation=0))
    assert machine.to_dict() == before


def test_non_event_raises_invalid_event() -> None:
    machine = new()
    with pytest.raises(InvalidEvent):
        machine.apply("load")  # type: ignore[arg-type]
    assert machine.path == "running.idle"


@pytest.mark.parametrize("incarnation", [-1, True, 1.0, "0", None])
def test_invalid_incarnation_in_event_raises_invalid_event(incarnation: Any) -> None:
    with pytest.raises(InvalidEvent, match="incarnation"):
        Connect(RID, incarnation)


def test_event_runner_id_must_be_a_str() -> None:
    with pytest.raises(TypeError):
        Load(None, 0)  # type: ignore[arg-type]


def test_fail_needs_a_failure() -> None:
    with pytest.raises(TypeError):
        Fail(RID, INC, "boom")  # type: ignore[arg-type]


def test_unknown_event_name_raises_unknown_event() -> None:
    machine = new()
    before = machine.to_dict()
    with pytest.raises(UnknownEvent, match="no event 'explode'") as info:
        machine._fire("explode")
    assert "connect" in str(info.value)
    assert isinstance(info.value, KeyError)
    assert machine.to_dict() == before


# -- snapshots ----------------------------------------------------------------------------------------

# The event to try on both original and restored machine; None: the leaf accepts nothing.
NEXT: dict[str, str | None] = {
    "idle/single": "load",
    "idle/multi": "connect",
    "joining": "connected",
    "joined": "load",
    "weights/single": "progress",
    "weights/multi": "weights_loaded",
    "loaded": "warm_up",
    "warming_up": "warmed",
    "available": "request_started",
    "busy": "request_finished",
    "failed": "exited",
    "stopping": "exited",
    "stopped": None,
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_snapshot_round_trip_in_every_leaf(route: str) -> None:
    machine = drive(route, rank=1)
    if machine.leaf == "busy":
        machine.apply(make("request_started"))  # in_flight 2 must survive
    data = machine.to_dict()
    assert data["machine"] == "runner"
    assert data["version"] == 1
    assert data["leaf"] == machine.leaf

    restored = RunnerLifecycle.from_dict(data)
    assert restored.to_dict() == data
    assert restored.path == machine.path
    assert restored.leaf == machine.leaf
    assert restored.runner_state is machine.runner_state
    assert restored.phase is machine.phase
    assert restored.failure == machine.failure

    event = NEXT[route]
    if event is None:
        for name in EVENTS:
            assert_refused(restored, make(name))
        return
    expected = machine.apply(make(event))
    got = restored.apply(make(event))
    assert got == expected
    assert restored.path == machine.path
    assert restored.to_dict() == machine.to_dict()


def test_round_trip_busy_keeps_in_flight_count() -> None:
    machine = drive("busy")
    machine.apply(make("request_started"))
    restored = RunnerLifecycle.from_dict(machine.to_dict())
    assert restored.in_flight == 2
    restored.apply(make("request_finished"))
    assert restored.path == "running.ready.busy"
    restored.apply(make("request_finished"))
    assert restored.path == "running.ready.available"


def test_round_trip_failed_keeps_failure_and_refuses_revival() -> None:
    machine = drive("busy")
    failure = Failure.exception("RuntimeError", "NCCL timeout", retryable=False, detail="tb")
    machine.apply(make("fail", failure=failure))
    machine.apply(make("stop"))
    restored = RunnerLifecycle.from_dict(machine.to_dict())
    assert restored.failure == failure
    assert restored.stop_requested
    assert_refused(restored, make("connect"), match="never revived")


def test_round_trip_is_json_ready() -> None:
    import json

    machine = drive("available")
    machine.apply(make("exited", exit_code=-9))
    data = json.loads(json.dumps(machine.to_dict()))
    assert RunnerLifecycle.from_dict(data).to_dict() == machine.to_dict()


def test_restored_machine_keeps_identity_and_incarnation_rules() -> None:
    machine = drive("available")
    restored = RunnerLifecycle.from_dict(machine.to_dict())
    assert (restored.runner_id, restored.incarnation, restored.world_size) == (RID, INC, 1)
    assert restored.apply(make("stop", incarnation=INC - 1)).accepted is False
    with pytest.raises(IncarnationMismatch):
        restored.apply(make("stop", incarnation=INC + 1))


def _snapshot_data() -> dict[str, Any]:
    return drive("weights/multi", rank=1).to_dict()


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda d: {**d, "machine": "download"}, id="wrong-machine"),
        pytest.param(lambda d: {k: v for k, v in d.items() if k != "machine"}, id="no-machine"),
        pytest.param(lambda d: {**d, "version": 2}, id="wrong-version"),
        pytest.param(lambda d: {**d, "version": "1"}, id="version-str"),
        pytest.param(lambda d: {k: v for k, v in d.items() if k != "version"}, id="no-version"),
        pytest.param(lambda d: {**d, "leaf": "exploded"}, id="unknown-leaf"),
        pytest.param(lambda d: {**d, "leaf": "loading"}, id="compound-leaf"),
        pytest.param(lambda d: {**d, "leaf": "ready"}, id="compound-leaf-ready"),
        pytest.param(lambda d: {**d, "extra": 1}, id="extra-key"),
        pytest.param(lambda d: {**d, "failure": {"kind": "exit", "message": "x", "bogus": 1}}, id="extra-nested-key"),
        pytest.param(lambda d: {k: v for k, v in d.items() if k != "rank"}, id="missing-key"),
        pytest.param(lambda d: {**d, "failure": {"kind": "meteor", "message": "x"}}, id="bad-failure-kind"),
        pytest.param(lambda d: [], id="not-a-dict"),
        pytest.param(lambda d: None, id="none"),
    ],
)
def test_from_dict_rejects_bad_snapshots(mutate: Callable[[dict[str, Any]], Any]) -> None:
    with pytest.raises(SnapshotError):
        RunnerLifecycle.from_dict(mutate(_snapshot_data()))


def test_from_dict_error_messages() -> None:
    data = _snapshot_data()
    with pytest.raises(SnapshotError, match="'download', not 'runner'"):
        RunnerLifecycle.from_dict({**data, "machine": "download"})
    with pytest.raises(SnapshotError, match="version 7"):
        RunnerLifecycle.from_dict({**data, "version": 7})
    with pytest.raises(SnapshotError, match="no state 'exploded'"):
        RunnerLifecycle.from_dict({**data, "leaf": "exploded"})


def test_from_dict_does_not_mutate_its_input() -> None:
    data = _snapshot_data()
    copy = dict(data)
    RunnerLifecycle.from_dict(data)
    assert data == copy


# -- views ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", list(RunnerPhase))
def test_phase_parent_matches_the_machine(phase: RunnerPhase) -> None:
    route = {
        RunnerPhase.JOINING: "joining",
        RunnerPhase.JOINED: "joined",
        RunnerPhase.WEIGHTS: "weights/single",
        RunnerPhase.LOADED: "loaded",
        RunnerPhase.WARMING_UP: "warming_up",
        RunnerPhase.AVAILABLE: "available",
        RunnerPhase.BUSY: "busy",
        RunnerPhase.STOPPING: "stopping",
        RunnerPhase.STOPPED: "stopped",
    }[phase]
    machine = drive(route)
    assert machine.phase is phase
    assert machine.runner_state is phase_parent(phase)


def test_failed_is_never_reached_without_a_cause():
    r = RunnerLifecycle("r")
    for attempt in (lambda: r.send("fail"), lambda: r.fail()):
        with pytest.raises(TransitionNotAllowed):
            attempt()
    assert r.runner_state is RunnerState.IDLE and r.failure is None


def test_an_exit_that_beat_our_stop_is_a_failure_with_its_cause():
    r = RunnerLifecycle("r")
    r.apply(Stop("r", 0))
    out = r.apply(Exited("r", 0, exit_code=-9, detail="oom", stop_delivered=False))
    assert [(s.source, s.target) for s in out.steps] == [("stopping", "failed"), ("failed", "stopped")]
    assert r.failure == Failure.exited(-9, "oom") and not r.alive
    clean = RunnerLifecycle("c")
    clean.apply(Stop("c", 0))
    clean.apply(Exited("c", 0, exit_code=-15))
    assert clean.failure is None and not clean.alive


# -- refusals: a hint only where a guard, or Failed, refused ---------------------------------------


def _hint_expected(route: str, event: str) -> bool:
    if route == "failed":
        return True
    return (route, event) in {("idle/single", "connect"), ("idle/multi", "load")}


# "fail" is left out: a Fail refused in stopped still gets the "needs its cause" hint (see the report).
REFUSED = [(route, event) for route in ROUTES for event in EVENTS if event != "fail" and event not in ALLOWED[route]]


@pytest.mark.parametrize(("route", "event"), REFUSED)
def test_a_refusal_explains_itself_only_when_a_guard_or_failed_refused(route: str, event: str) -> None:
    machine = drive(route)
    error = assert_refused(machine, make(event))
    plain = f"runner: event {event!r} is not allowed in state {machine.path!r}"
    if _hint_expected(route, event):
        assert str(error).startswith(plain + ": ")
    else:
        assert str(error) == plain


# -- snapshots: what no runner could be is refused, naming the field; what one could be is taken ----------


class Count(int):
    """An int subclass (an IntEnum member, say): a count all the same."""


def _snapshot_in(route: str, **changes: Any) -> RunnerSnapshot:
    machine = drive(route, rank=1)
    if machine.leaf == "busy":
        machine.apply(make("request_started"))
    return attrs.evolve(machine.snapshot(), **changes)


BAD_RUNNER_SNAPSHOTS = [
    ("idle/multi", {"runner_id": ""}, "runner_id"),
    ("idle/multi", {"world_size": 0, "rank": 0}, "world_size"),
    ("weights/multi", {"rank": 2}, "rank"),
    ("weights/multi", {"rank": 5}, "rank"),
    ("weights/multi", {"rank": -1}, "rank"),
    ("weights/multi", {"incarnation": -1}, "incarnation"),
    ("weights/multi", {"layers_loaded": 5, "layers_total": 4}, "layers"),
    ("weights/multi", {"layers_loaded": -1}, "layers"),
    ("available", {"in_flight": 1}, "in_flight"),
    ("available", {"in_flight": 2}, "in_flight"),
    ("available", {"in_flight": -1}, "in_flight"),
    ("idle/multi", {"in_flight": 1}, "in_flight"),
    ("busy", {"in_flight": 0}, "in_flight"),
    ("busy", {"in_flight": -1}, "in_flight"),
    ("idle/multi", {"stop_requested": 1}, "stop_requested"),
    ("stopping", {"stop_requested": False}, "stop_requested"),
    ("stopped", {"stop_requested": False}, "stop_requested"),
    ("failed", {"failure": None}, "failure"),
    ("idle/multi", {"failure": "boom"}, "failure"),
    ("stopped", {"failure": "boom"}, "failure"),
]


@pytest.mark.parametrize(("route", "changes", "field"), BAD_RUNNER_SNAPSHOTS)
def test_an_impossible_snapshot_is_refused_naming_the_field(route: str, changes: dict[str, Any], field: str) -> None:
    snapshot = _snapshot_in(route, **changes)
    with pytest.raises(SnapshotError) as info:
        RunnerLifecycle.from_snapshot(snapshot)
    assert str(info.value).startswith(f"invalid runner snapshot: {field}")
    machine = drive("available")
    before = machine.to_dict()
    with pytest.raises(SnapshotError):
        machine.reload(snapshot)
    assert machine.to_dict() == before


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_snapshot_with_int_subclass_counts_restores_like_plain_ints(route: str) -> None:
    machine = drive(route, rank=1)  # busy: one request in flight
    if machine.leaf == "weights":
        machine.apply(make("progress", layers_loaded=4, layers_total=10))
    plain = machine.snapshot()
    counted = attrs.evolve(
        plain,
        runner_id=type("RunnerId", (str,), {})(plain.runner_id),
        rank=Count(plain.rank),
        world_size=Count(plain.world_size),
        incarnation=Count(plain.incarnation),
        layers_loaded=Count(plain.layers_loaded),
        layers_total=Count(plain.layers_total),
        in_flight=Count(plain.in_flight),
    )
    restored = RunnerLifecycle.from_snapshot(counted)
    assert restored.snapshot() == plain
    reloaded = drive("available")
    reloaded.reload(counted)
    assert reloaded.snapshot() == plain
    event = NEXT[route]
    if event is not None:
        assert restored.apply(make(event)) == machine.apply(make(event))
        assert restored.snapshot() == machine.snapshot()


def test_an_impossible_in_flight_says_what_busy_needs() -> None:
    with pytest.raises(SnapshotError, match="in_flight must be >= 1 in busy, got 0"):
        RunnerLifecycle.from_snapshot(_snapshot_in("busy", in_flight=0))
    with pytest.raises(SnapshotError, match=r"in_flight must be 0 outside busy \(leaf 'available'\), got 2"):
        RunnerLifecycle.from_snapshot(_snapshot_in("available", in_flight=2))


# -- events and guards, as a caller sees them ----------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [{"exit_code": "1"}, {"exit_code": None}, {"stop_delivered": 1}, {"stop_delivered": None}],
)
def test_exited_refuses_an_exit_code_that_is_no_int_or_a_stop_delivered_that_is_no_bool(
    changes: dict[str, Any],
) -> None:
    with pytest.raises(TypeError):
        Exited(RID, INC, **{"exit_code": 0, **changes})


@pytest.mark.parametrize("route", NON_FINAL)
def test_a_fail_without_its_cause_is_refused_in_every_state(route: str) -> None:
    machine = drive(route)
    before, path = machine.to_dict(), machine.path
    with pytest.raises(TransitionNotAllowed):
        machine.send("fail")
    assert (machine.to_dict(), machine.path) == (before, path)


def test_an_exit_sent_without_stop_delivered_while_stopping_is_clean() -> None:
    machine = drive("stopping")
    machine.send("exited", exit_code=0)
    assert machine.path == "shutdown.stopped"
    assert machine.failure is None


def test_the_guards_read_as_booleans() -> None:
    single, multi = new(world_size=1), new(world_size=3)
    assert (single.single_rank, single.multi_rank) == (True, False)
    assert (multi.single_rank, multi.multi_rank) == (False, True)
    available = drive("available")
    assert available.last_request is False
    available.apply(make("request_started"))
    assert available.last_request is True
    available.apply(make("request_started"))
    assert available.last_request is False


@pytest.mark.parametrize("other", ["runner-0", "runner-b", "runner", "runner-aa", "Runner-a"])
def test_an_event_for_another_runner_raises_whichever_way_its_id_sorts(other: str) -> None:
    machine = drive("available")
    before = machine.to_dict()
    with pytest.raises(InvalidEvent, match=other):
        machine.apply(make("request_started", runner_id=other))
    assert machine.to_dict() == before


def test_stopped_is_the_only_final_state() -> None:
    # what the conformance checker and the diagrams read: a runner may be forgotten only once stopped
    assert {s.id for s in RunnerLifecycle.states_map.values() if s.final} == {"stopped"}
    assert RunnerLifecycle.states_map[drive("stopped").leaf].final


def test_a_runner_is_a_single_rank_unless_told_otherwise() -> None:
    machine = RunnerLifecycle(RID)
    assert (machine.rank, machine.world_size, machine.incarnation) == (0, 1, 0)
    assert machine.apply(Load(RID, 0)).steps == (Step("load", "idle", "weights"),)


def test_rank_world_size_and_incarnation_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        RunnerLifecycle(RID, 0, 2)  # type: ignore[misc]
    machine = RunnerLifecycle(runner_id=RID, rank=1, world_size=2, incarnation=4)
    assert (machine.runner_id, machine.rank, machine.world_size, machine.incarnation) == (RID, 1, 2, 4)


@pytest.mark.parametrize(("kwargs", "message"), [({"world_size": 0}, "world_size must be an int >= 1, got 0")])
def test_a_zero_world_size_is_refused_as_such(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        RunnerLifecycle(RID, **kwargs)


def test_a_snapshot_keeps_the_loading_progress() -> None:
    machine = drive("weights/single")
    machine.apply(make("progress", layers_loaded=4, layers_total=10))
    data = machine.to_dict()
    assert (data["layers_loaded"], data["layers_total"]) == (4, 10)
    restored = RunnerLifecycle.from_dict(data)
    assert (restored.layers_loaded, restored.layers_total) == (4, 10)


def test_a_fail_with_its_cause_refused_after_stopped_does_not_ask_for_a_cause():
    r = RunnerLifecycle("r")
    r.apply(Stop("r", 0))
    r.apply(Exited("r", 0, exit_code=0))
    with pytest.raises(IllegalTransition) as refused:
        r.apply(Fail("r", 0, failure=STALL))
    assert "needs its cause" not in str(refused.value)


# -- the request shortcut is the engine ---------------------------------------------------------------


def _engine_apply(machine: RunnerLifecycle, event: RunnerEvent) -> Outcome:
    """What `RunnerLifecycle.apply` did before its request shortcut: every event through python-statemachine."""
    return machine._fire(event.name, **event.payload())


def _outcome_of(machine: RunnerLifecycle, apply: Callable[[RunnerEvent], Outcome], name: str) -> Any:
    try:
        return apply(make(name))
    except IllegalTransition as exc:
        return ("refused", str(exc))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["request_started"] * 3 + ["request_finished"] * 3 + ["fail", "stop", "exited"])))
def test_request_events_in_ready_do_what_the_engine_does(names: list[str]) -> None:
    """`RunnerLifecycle.apply` takes ``request_started`` / ``request_finished`` in Ready without the engine: the
    same outcome (steps, refusals and their words), leaf, configuration, count in flight and snapshot."""
    shortcut, engine = (RunnerLifecycle(RID, incarnation=INC) for _ in range(2))
    for machine in (shortcut, engine):
        for name in ["load", "weights_loaded", "warm_up", "warmed"]:
            machine.apply(make(name))
    for name in names:
        assert _outcome_of(shortcut, shortcut.apply, name) == _outcome_of(engine, partial(_engine_apply, engine), name)
        assert shortcut.snapshot() == engine.snapshot()
        assert (shortcut.leaf, shortcut.path, shortcut.configuration_values) == (
            engine.leaf,
            engine.path,
            engine.configuration_values,
        )
    # and the engine goes on from where the shortcut left it
    for name in ["request_started", "request_finished", "fail", "exited"]:
        assert _outcome_of(shortcut, partial(_engine_apply, shortcut), name) == _outcome_of(
            engine, partial(_engine_apply, engine), name
        )
        assert shortcut.snapshot() == engine.snapshot()
