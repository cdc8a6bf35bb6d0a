"""DownloadLifecycle: pending → ongoing → completed, and failed → (backoff) → pending."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import pytest

from fsm import (
    DEFAULT_DOWNLOAD_BACKOFF,
    Backoff,
    DownloadLifecycle,
    DownloadState,
    IllegalTransition,
    InvalidConfig,
    InvalidEvent,
    Outcome,
    SnapshotError,
    Step,
    UnknownEvent,
)
from fsm.download import (
    Begin,
    BytesProgress,
    Complete,
    DownloadEvent,
    DownloadFailed,
    DownloadSnapshot,
    Invalidate,
    LoadStarted,
    Retry,
)

MODEL = "llama-3-8b"


def new(**kwargs: Any) -> DownloadLifecycle:
    return DownloadLifecycle(MODEL, **kwargs)


def failed_at(now: float, **kwargs: Any) -> DownloadLifecycle:
    machine = new(**kwargs)
    machine.apply(Begin(MODEL, now))
    machine.apply(DownloadFailed(MODEL, now, "connection reset"))
    return machine


def assert_refused(machine: DownloadLifecycle, event: DownloadEvent, match: str | None = None) -> IllegalTransition:
    before, path = machine.to_dict(), machine.path
    with pytest.raises(IllegalTransition, match=match) as info:
        machine.apply(event)
    assert machine.to_dict() == before
    assert machine.path == path
    assert info.value.machine == "download"
    assert info.value.event == event.name
    return info.value


# -- the default policy ----------------------------------------------------------------------


def test_default_policy_is_half_a_second_doubling_capped_at_ten() -> None:
    assert Backoff(initial=0.5, factor=2.0, cap=10.0) == DEFAULT_DOWNLOAD_BACKOFF
    assert new().policy == DEFAULT_DOWNLOAD_BACKOFF
    assert [DEFAULT_DOWNLOAD_BACKOFF.delay(n) for n in range(1, 8)] == [0.5, 1, 2, 4, 8, 10, 10]


# -- happy path --------------------------------------------------------------------------------


def test_fresh_download_is_pending() -> None:
    machine = new()
    assert machine.path == "pending"
    assert machine.download_state is DownloadState.PENDING
    assert (machine.attempts, machine.retry_at, machine.clock) == (0, None, None)
    assert (machine.bytes_done, machine.bytes_total, machine.last_error) == (0, None, "")


def test_pending_ongoing_completed() -> None:
    machine = new()
    assert machine.apply(Begin(MODEL, 1.0)) == Outcome(accepted=True, steps=(Step("begin", "pending", "ongoing"),))
    assert machine.download_state is DownloadState.ONGOING
    assert machine.apply(BytesProgress(MODEL, 2.0, 500, 1000)) == Outcome(accepted=True, steps=())
    assert (machine.bytes_done, machine.bytes_total) == (500, 1000)
    assert machine.apply(Complete(MODEL, 3.0)).steps == (Step("complete", "ongoing", "completed"),)
    assert machine.download_state is DownloadState.COMPLETED
    assert machine.clock == 3.0
    assert machine.attempts == 0


def test_progress_may_have_unknown_total_and_is_replaced_each_time() -> None:
    machine = new()
    machine.apply(Begin(MODEL, 0.0))
    machine.apply(BytesProgress(MODEL, 1.0, 10))
    assert (machine.bytes_done, machine.bytes_total) == (10, None)
    machine.apply(BytesProgress(MODEL, 2.0, 20, 20))
    assert (machine.bytes_done, machine.bytes_total) == (20, 20)


def test_begin_resets_byte_counters() -> None:
    machine = new()
    machine.apply(Begin(MODEL, 0.0))
    machine.apply(BytesProgress(MODEL, 0.1, 300, 900))
    machine.apply(DownloadFailed(MODEL, 0.2, "oops"))
    machine.apply(Retry(MODEL, 5.0))
    machine.apply(Begin(MODEL, 5.0))
    assert (machine.bytes_done, machine.bytes_total) == (0, None)


# -- the transition table -------------------------------------------------------------------

ROUTES = {
    "pending": [],
    "ongoing": ["begin"],
    "completed": ["begin", "complete"],
    "failed": ["begin", "fail"],
}
ALLOWED = {
    "pending": {"begin": "ongoing"},
    "ongoing": {"progress": "ongoing", "complete": "completed", "fail": "failed"},
    "completed": {"load_started": "completed", "invalidate": "pending"},
    "failed": {"retry": "pending"},
}
EVENTS = ["begin", "progress", "complete", "fail", "retry", "load_started", "invalidate"]


def make(name: str, now: float) -> DownloadEvent:
    if name == "progress":
        return BytesProgress(MODEL, now, 1, 2)
    if name == "fail":
        return DownloadFailed(MODEL, now, "boom")
    return {
        "begin": Begin,
        "complete": Complete,
        "retry": Retry,
        "load_started": LoadStarted,
        "invalidate": Invalidate,
    }[name](MODEL, now)


def test_table_covers_every_event() -> None:
    assert {e.id for e in new().events} == set(EVENTS)
    assert set(ROUTES) == {s.value for s in DownloadState}


@pytest.mark.parametrize("event", EVENTS)
@pytest.mark.parametrize("route", list(ROUTES))
def test_transition_table(route: str, event: str) -> None:
    machine = new()
    for name in ROUTES[route]:
        machine.apply(make(name, 0.0))
    assert machine.path == route
    clock = machine.clock
    assert clock == (0.0 if ROUTES[route] else None)
    expected = ALLOWED[route].get(event)
    if expected is None:
        assert_refused(machine, make(event, 100.0))
        assert machine.clock == clock
    else:
        assert machine.apply(make(event, 100.0)).accepted  # 100 s is past any first backoff
        assert machine.path == expected
        assert machine.clock == 100.0


# -- failure and backoff ----------------------------------------------------------------------


def test_fail_counts_attempt_and_sets_retry_at() -> None:
    machine = new()
    machine.apply(Begin(MODEL, 100.0))
    outcome = machine.apply(DownloadFailed(MODEL, 101.0, "HTTP 503"))
    assert outcome.steps == (Step("fail", "ongoing", "failed"),)
    assert machine.download_state is DownloadState.FAILED
    assert machine.attempts == 1
    assert machine.retry_at == 101.5
    assert machine.last_error == "HTTP 503"


def test_retry_refused_before_retry_at_and_machine_unchanged() -> None:
    machine = failed_at(100.0)
    assert machine.retry_at == 100.5
    error = assert_refused(machine, Retry(MODEL, 100.25), match="backoff until 100.5")
    assert error.state == "failed"
    assert machine.clock == 100.0  # the refused event's time was not kept
    assert_refused(machine, Retry(MODEL, 100.4999))
    assert machine.clock == 100.0


def test_retry_allowed_exactly_at_retry_at() -> None:
    machine = failed_at(100.0)
    outcome = machine.apply(Retry(MODEL, 100.5))
    assert outcome.steps == (Step("retry", "failed", "pending"),)
    assert machine.path == "pending"
    assert machine.clock == 100.5
    assert machine.attempts == 1  # a retry is not a success: the streak goes on


def test_retry_allowed_after_retry_at() -> None:
    machine = failed_at(100.0)
    machine.apply(Retry(MODEL, 1000.0))
    assert machine.path == "pending"


def test_clock_never_goes_back_and_backoff_counts_from_it() -> None:
    machine = new()
    machine.apply(Begin(MODEL, 100.0))
    machine.apply(BytesProgress(MODEL, 200.0, 1, 2))
    machine.apply(DownloadFailed(MODEL, 150.0, "late report"))  # stamped before the clock
    assert machine.clock == 200.0
    assert machine.retry_at == 200.5
    assert_refused(machine, Retry(MODEL, 200.4))
    machine.apply(Retry(MODEL, 200.5))
    assert machine.path == "pending"


def test_consecutive_failures_grow_the_delay() -> None:
    machine = new()
    now = 0.0
    delays = []
    for _ in range(7):
        machine.apply(Begin(MODEL, now))
        machine.apply(DownloadFailed(MODEL, now, "timeout"))
        assert machine.retry_at is not None
        delays.append(machine.retry_at - now)
        assert_refused(machine, Retry(MODEL, machine.retry_at - 0.01))
        now = machine.retry_at
        machine.apply(Retry(MODEL, now))
    assert machine.attempts == 7
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_custom_policy_is_used() -> None:
    machine = failed_at(10.0, policy=Backoff(initial=3.0, factor=3.0, cap=100.0))
    assert machine.retry_at == 13.0
    machine.apply(Retry(MODEL, 13.0))
    machine.apply(Begin(MODEL, 13.0))
    machine.apply(DownloadFailed(MODEL, 14.0, "again"))
    assert machine.retry_at == 23.0


def test_load_started_resets_backoff() -> None:
    # The seed's "download backoff resets on load": proven files end the failure streak.
    machine = new()
    for now in (0.0, 10.0, 20.0):
        machine.apply(Begin(MODEL, now))
        machine.apply(DownloadFailed(MODEL, now, "flaky"))
        machine.apply(Retry(MODEL, now + 5))
    assert machine.attempts == 3
    machine.apply(Begin(MODEL, 30.0))
    machine.apply(Complete(MODEL, 31.0))
    assert machine.attempts == 3  # completing alone does not reset it
    assert machine.retry_at == 22.0
    outcome = machine.apply(LoadStarted(MODEL, 32.0))
    assert outcome == Outcome(accepted=True, steps=())
    assert machine.path == "completed"
    assert (machine.attempts, machine.retry_at) == (0, None)
    # the next failure starts the schedule over
    machine.apply(Invalidate(MODEL, 40.0))
    machine.apply(Begin(MODEL, 40.0))
    machine.apply(DownloadFailed(MODEL, 41.0, "disk full"))
    assert (machine.attempts, machine.retry_at) == (1, 41.5)


@pytest.mark.parametrize("route", ["pending", "ongoing", "failed"])
def test_load_started_only_when_completed(route: str) -> None:
    machine = new()
    for name in ROUTES[route]:
        machine.apply(make(name, 0.0))
    attempts = machine.attempts
    assert_refused(machine, LoadStarted(MODEL, 50.0))
    assert machine.attempts == attempts


def test_invalidate_sends_completed_back_to_pending() -> None:
    machine = new()
    machine.apply(Begin(MODEL, 0.0))
    machine.apply(BytesProgress(MODEL, 1.0, 10, 10))
    machine.apply(Complete(MODEL, 2.0))
    outcome = machine.apply(Invalidate(MODEL, 3.0))
    assert outcome.steps == (Step("invalidate", "completed", "pending"),)
    assert machine.download_state is DownloadState.PENDING
    machine.apply(Begin(MODEL, 4.0))
    assert machine.path == "ongoing"


# -- event validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("done", "total"),
    [(-1, None), (-1, 10), (5, -1), (11, 10), (True, 10), (1, False), (1.5, None), ("1", None), (1, 2.0)],
)
def test_invalid_bytes_progress_raises_invalid_event(done: Any, total: Any) -> None:
    with pytest.raises(InvalidEvent):
        BytesProgress(MODEL, 0.0, done, total)


@pytest.mark.parametrize(("done", "total"), [(0, None), (0, 0), (10, 10), (10**12, None)])
def test_valid_bytes_progress(done: int, total: int | None) -> None:
    event = BytesProgress(MODEL, 0.0, done, total)
    assert event.payload() == {"bytes_done": done, "bytes_total": total}


@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf, "1", None, True])
def test_event_time_must_be_finite(now: Any) -> None:
    with pytest.raises(InvalidEvent, match="now"):
        Begin(MODEL, now)


def test_wrong_model_raises_invalid_event_and_keeps_the_clock() -> None:
    machine = new()
    machine.apply(Begin(MODEL, 1.0))
    before = machine.to_dict()
    with pytest.raises(InvalidEvent, match="other-model"):
        machine.apply(Complete("other-model", 50.0))
    assert machine.to_dict() == before


def test_non_event_raises_invalid_event() -> None:
    with pytest.raises(InvalidEvent):
        new().apply("begin")  # type: ignore[arg-type]


def test_unknown_event_raises_unknown_event() -> None:
    machine = new()
    with pytest.raises(UnknownEvent, match="no event 'pause'"):
        machine._fire("pause")
    assert machine.path == "pending"


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"policy": Backoff(jitter=True)}, id="jitter"),
        pytest.param({"policy": Backoff(initial=1.0, cap=5.0, jitter=True)}, id="jitter-custom"),
        pytest.param({"policy": "fast"}, id="not-a-backoff"),
    ],
)
def test_invalid_policy_raises_invalid_config(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidConfig):
        new(**kwargs)


@pytest.mark.parametrize("model_id", ["", None, 3])
def test_invalid_model_id_raises_invalid_config(model_id: Any) -> None:
    with pytest.raises(InvalidConfig):
        DownloadLifecycle(model_id)


# -- snapshots ----------------------------------------------------------------------------------


def test_snapshot_round_trip_mid_backoff() -> None:
    machine = new()
    for now in (0.0, 10.0):
        machine.apply(Begin(MODEL, now))
        machine.apply(BytesProgress(MODEL, now, 7, 70))
        machine.apply(DownloadFailed(MODEL, now + 1, "reset by peer"))
        if now == 0.0:
            machine.apply(Retry(MODEL, 5.0))
    assert (machine.attempts, machine.retry_at, machine.clock) == (2, 12.0, 11.0)

    data = json.loads(json.dumps(machine.to_dict()))
    assert data["machine"] == "download"
    assert data["version"] == 1
    restored = DownloadLifecycle.from_dict(data)
    assert restored.to_dict() == machine.to_dict()
    assert restored.path == "failed"
    assert (restored.attempts, restored.retry_at, restored.clock) == (2, 12.0, 11.0)
    assert restored.last_error == "reset by peer"
    assert (restored.bytes_done, restored.bytes_total) == (7, 70)
    assert restored.policy == DEFAULT_DOWNLOAD_BACKOFF

    assert_refused(restored, Retry(MODEL, 11.9))
    restored.apply(Retry(MODEL, 12.0))
    assert restored.path == "pending"
    restored.apply(Begin(MODEL, 12.0))
    restored.apply(DownloadFailed(MODEL, 13.0, "again"))
    assert (restored.attempts, restored.retry_at) == (3, 15.0)


@pytest.mark.parametrize("route", list(ROUTES))
def test_snapshot_round_trip_in_every_state(route: str) -> None:
    policy = Backoff(initial=1.0, factor=3.0, cap=20.0)
    machine = new(policy=policy)
    for name in ROUTES[route]:
        machine.apply(make(name, 1.0))
    restored = DownloadLifecycle.from_dict(machine.to_dict())
    assert restored.to_dict() == machine.to_dict()
    assert restored.path == machine.path
    assert restored.policy == policy
    nxt = next(iter(ALLOWED[route]))
    assert restored.apply(make(nxt, 50.0)) == machine.apply(make(nxt, 50.0))
    assert restored.to_dict() == machine.to_dict()


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda d: {**d, "machine": "runner"}, id="wrong-machine"),
        pytest.param(lambda d: {**d, "version": 0}, id="wrong-version"),
        pytest.param(lambda d: {**d, "leaf": "paused"}, id="unknown-leaf"),
        pytest.param(lambda d: {**d, "surprise": True}, id="extra-key"),
        pytest.param(lambda d: {**d, "policy": {**d["policy"], "extra": 1}}, id="extra-policy-key"),
        pytest.param(lambda d: {**d, "policy": {**d["policy"], "cap": 0.1}}, id="invalid-policy"),
        pytest.param(lambda d: {k: v for k, v in d.items() if k != "policy"}, id="missing-policy"),
        pytest.param(lambda d: "not a dict", id="not-a-dict"),
    ],
)
def test_from_dict_rejects_bad_snapshots(mutate: Any) -> None:
    data = failed_at(3.0).to_dict()
    with pytest.raises(SnapshotError):
        DownloadLifecycle.from_dict(mutate(data))


def _snapshot(**changes: Any) -> DownloadSnapshot:
    """A failed download mid-backoff (bytes counted, an error kept), as a snapshot, with ``changes``."""
    machine = new()
    machine.apply(Begin(MODEL, 10.0))
    machine.apply(BytesProgress(MODEL, 10.0, 7, 70))
    machine.apply(DownloadFailed(MODEL, 11.0, "reset by peer"))
    return attrs.evolve(machine.snapshot(), **changes)


def test_a_snapshot_with_int_times_and_every_byte_done_restores_exactly() -> None:
    data = failed_at(3.0).to_dict()
    data.update(retry_at=12, clock=11, attempts=2, bytes_done=70, bytes_total=70)
    restored = DownloadLifecycle.from_dict(data)
    assert restored.to_dict() == data
    assert (restored.retry_at, restored.clock, restored.bytes_done, restored.bytes_total) == (12, 11, 70, 70)
    assert_refused(restored, Retry(MODEL, 11.5))
    assert restored.apply(Retry(MODEL, 12.0)).accepted
    reloaded = new()
    reloaded.reload(_snapshot(retry_at=12, clock=11, bytes_done=70, bytes_total=70))
    assert (reloaded.path, reloaded.retry_at, reloaded.clock, reloaded.bytes_done) == ("failed", 12, 11, 70)


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"retry_at": 0.0, "clock": 0.0}, id="zero"),
        pytest.param({"retry_at": 1e308, "clock": 1e308}, id="huge"),
        pytest.param({"retry_at": -1e308, "clock": -0.0}, id="negative"),
        pytest.param({"retry_at": None, "clock": None, "bytes_done": 0, "bytes_total": None}, id="none"),
        pytest.param({"bytes_done": 0, "bytes_total": 0, "attempts": 0}, id="zero-bytes"),
    ],
)
def test_a_snapshot_with_any_finite_times_restores_exactly(changes: dict[str, Any]) -> None:
    snapshot = _snapshot(**changes)
    assert DownloadLifecycle.from_snapshot(snapshot).snapshot() == snapshot
    data = {**failed_at(3.0).to_dict(), **changes}
    assert DownloadLifecycle.from_dict(data).to_dict() == data
    reloaded = new()
    reloaded.reload(snapshot)
    assert reloaded.snapshot() == snapshot


IMPOSSIBLE_SNAPSHOTS = [
    pytest.param({"model_id": ""}, "model_id", id="empty-model-id"),
    pytest.param({"model_id": 5}, "model_id", id="model-id-not-str"),
    pytest.param({"policy": Backoff(jitter=True)}, "jitter", id="jittered-policy"),
    pytest.param({"policy": "fast"}, "policy", id="policy-not-a-backoff"),
    pytest.param({"attempts": -1}, "attempts", id="negative-attempts"),
    pytest.param({"attempts": 1.0}, "attempts", id="float-attempts"),
    pytest.param({"retry_at": math.nan}, "retry_at", id="nan-retry-at"),
    pytest.param({"retry_at": math.inf}, "retry_at", id="inf-retry-at"),
    pytest.param({"retry_at": True}, "retry_at", id="bool-retry-at"),
    pytest.param({"retry_at": "12"}, "retry_at", id="str-retry-at"),
    pytest.param({"clock": math.nan}, "clock", id="nan-clock"),
    pytest.param({"clock": -math.inf}, "clock", id="inf-clock"),
    pytest.param({"clock": True}, "clock", id="bool-clock"),
    pytest.param({"clock": "11"}, "clock", id="str-clock"),
    pytest.param({"clock": 10**400}, "clock", id="int-clock-beyond-float"),
    pytest.param({"bytes_done": -1, "bytes_total": None}, "bytes", id="negative-bytes-done"),
    pytest.param({"bytes_done": 1.5, "bytes_total": None}, "bytes", id="float-bytes-done"),
    pytest.param({"bytes_done": 1, "bytes_total": 2.5}, "bytes", id="float-bytes-total"),
    pytest.param({"bytes_done": 1, "bytes_total": True}, "bytes", id="bool-bytes-total"),
    pytest.param({"bytes_done": 5, "bytes_total": 3}, "bytes", id="more-done-than-total"),
    pytest.param({"last_error": 5}, "last_error", id="last-error-not-str"),
    pytest.param({"last_error": None}, "last_error", id="last-error-none"),
]


@pytest.mark.parametrize(("changes", "field"), IMPOSSIBLE_SNAPSHOTS)
def test_a_snapshot_no_download_could_be_is_refused_by_from_snapshot_and_reload(
    changes: dict[str, Any], field: str
) -> None:
    snapshot = _snapshot(**changes)
    with pytest.raises(SnapshotError, match=field):
        DownloadLifecycle.from_snapshot(snapshot)
    machine = failed_at(3.0)
    before = machine.to_dict()
    with pytest.raises(SnapshotError, match=field):
        machine.reload(snapshot)
    assert machine.to_dict() == before


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"model_id": ""}, id="empty-model-id"),
        pytest.param({"attempts": -1}, id="negative-attempts"),
        pytest.param({"bytes_done": -1, "bytes_total": None}, id="negative-bytes-done"),
        pytest.param({"bytes_done": 5, "bytes_total": 3}, id="more-done-than-total"),
        pytest.param({"bytes_done": 5, "bytes_total": 3, "retry_at": 12}, id="more-done-than-total-int-time"),
        pytest.param({"policy": {**attrs.asdict(DEFAULT_DOWNLOAD_BACKOFF), "jitter": True}}, id="jittered-policy"),
    ],
)
def test_from_dict_refuses_a_well_typed_snapshot_no_download_could_be(changes: dict[str, Any]) -> None:
    data = {**failed_at(3.0).to_dict(), **changes}
    with pytest.raises(SnapshotError):
        DownloadLifecycle.from_dict(data)


def test_backoff_elapsed_says_whether_a_retry_would_be_allowed() -> None:
    assert new().backoff_elapsed is True
    machine = failed_at(100.0)
    assert machine.backoff_elapsed is False
    machine.apply(Retry(MODEL, 100.5))
    assert machine.backoff_elapsed is True


@pytest.mark.parametrize("route", ["pending", "ongoing", "completed"])
def test_a_retry_refused_by_the_state_does_not_blame_a_backoff(route: str) -> None:
    machine = new()
    for name in ROUTES[route]:
        machine.apply(make(name, 0.0))
    error = assert_refused(machine, Retry(MODEL, 100.0))
    assert "backoff" not in str(error)


@pytest.mark.parametrize("event", ["begin", "complete", "load_started", "invalidate"])
def test_only_a_refused_retry_of_a_failed_download_names_the_backoff(event: str) -> None:
    machine = failed_at(100.0)
    assert "backoff until 100.5 (now 100.1)" in str(assert_refused(machine, Retry(MODEL, 100.1)))
    assert "backoff" not in str(assert_refused(machine, make(event, 100.1)))


@pytest.mark.parametrize("model_id", [3, None, b"llama"])
def test_an_event_for_a_model_id_that_is_not_a_str_cannot_be_made(model_id: Any) -> None:
    with pytest.raises(TypeError):
        Begin(model_id, 0.0)
    with pytest.raises(TypeError):
        DownloadFailed(model_id, 0.0, "boom")


@pytest.mark.parametrize("reason", [None, 5, b"timeout"])
def test_a_failure_whose_reason_is_not_a_str_cannot_be_made(reason: Any) -> None:
    with pytest.raises(TypeError):
        DownloadFailed(MODEL, 0.0, reason)


def test_the_policy_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        DownloadLifecycle(MODEL, Backoff(initial=3.0, cap=3.0))  # type: ignore[misc]


@pytest.mark.parametrize("other", ["a-model", "zz-model", MODEL + "-instruct", MODEL[:-1]])
def test_an_event_for_any_other_model_is_refused_and_changes_nothing(other: str) -> None:
    machine = new()
    machine.apply(Begin(MODEL, 1.0))
    before = machine.to_dict()
    with pytest.raises(InvalidEvent, match="sent to download of"):
        machine.apply(Complete(other, 50.0))
    assert machine.to_dict() == before
