"""Unit tests of the pure planner `fsm.plan`: one test (or parametrized group) per rule.

Views are built by hand. Multi-rank instances use two nodes: "a" hosts rank 0
(the leader), "b" hosts rank 1. Every test asserts the exact list of actions.
"""

from __future__ import annotations

import copy

import attrs
import pytest

import fsm
from fsm import instance
from fsm.actions import (
    CancelRequest,
    ConnectRunner,
    CreateRunner,
    DeleteInstance,
    ForwardRequest,
    LoadModel,
    StartDownload,
    StartGeneration,
    StopReason,
    StopRunner,
    WarmUp,
)
from fsm.download import DownloadState
from fsm.failure import Failure
from fsm.instance import DeleteReason, InstanceState
from fsm.plan import next_deadline, plan
from fsm.runner import RunnerPhase, RunnerState, phase_parent
from fsm.view import ClusterView, DownloadStatus, InstanceView, PendingRequest, RetryStatus, RunnerStatus, Slot

NOW = 100.0
MODEL = "m"
NODES = ("a", "b", "c")  # rank r lives on NODES[r]
BOOM = Failure.exception("RuntimeError", "boom")

# -- helpers ------------------------------------------------------------------------


def rid(iid: str, rank: int) -> str:
    return f"{iid}-r{rank}"


def inst(
    iid: str = "i",
    *,
    ranks: int = 2,
    state: InstanceState = InstanceState.STARTING,
    gen: int = 1,
    attempts: int = 0,
    max_retries: int = 5,
    deadline: float | None = None,
    reason: DeleteReason | None = None,
    model: str = MODEL,
    nodes: tuple[str, ...] = NODES,
) -> InstanceView:
    slots = tuple(Slot(r, nodes[r], rid(iid, r)) for r in range(ranks))
    return InstanceView(iid, model, slots, RetryStatus(state, gen, attempts, max_retries, deadline, reason))


def run(
    iid: str,
    rank: int,
    where: RunnerState | RunnerPhase,
    *,
    gen: int = 1,
    failure: Failure | None = None,
    stop_requested: bool = False,
    node: str | None = None,
    endpoint: str | None = "published",
) -> RunnerStatus:
    """A runner status; ``where`` is a top-level state (Idle, Failed) or a sub-phase."""
    if isinstance(where, RunnerPhase):
        state, phase = phase_parent(where), where
    else:
        state, phase = where, None
    if state is RunnerState.SHUTDOWN:
        stop_requested = True
    return RunnerStatus(
        runner_id=rid(iid, rank),
        instance_id=iid,
        node_id=node or NODES[rank],
        rank=rank,
        incarnation=gen,
        state=state,
        phase=phase,
        stop_requested=stop_requested,
        failure=failure,
        endpoint=endpoint,
    )


def done(*nodes: str, model: str = MODEL) -> list[DownloadStatus]:
    return [DownloadStatus(n, model, DownloadState.COMPLETED) for n in nodes]


def view(instances=(), runners=(), downloads=(), requests=()) -> ClusterView:
    return ClusterView.build(
        instances=list(instances), runners=list(runners), downloads=list(downloads), requests=list(requests)
    )


def create(iid: str, rank: int, *, ranks: int = 2, gen: int = 1, model: str = MODEL) -> CreateRunner:
    return CreateRunner(
        instance_id=iid,
        runner_id=rid(iid, rank),
        node_id=NODES[rank],
        rank=rank,
        world_size=ranks,
        incarnation=gen,
        model_id=model,
    )


IDLE, FAILED = RunnerState.IDLE, RunnerState.FAILED
JOINING, JOINED = RunnerPhase.JOINING, RunnerPhase.JOINED
WEIGHTS, LOADED, WARMING = RunnerPhase.WEIGHTS, RunnerPhase.LOADED, RunnerPhase.WARMING_UP
AVAILABLE, BUSY = RunnerPhase.AVAILABLE, RunnerPhase.BUSY
STOPPING, STOPPED = RunnerPhase.STOPPING, RunnerPhase.STOPPED


# -- cancel -------------------------------------------------------------------------


def test_cancel_request_for_missing_instance():
    v = view(requests=[PendingRequest("q1", "ghost")])
    assert plan(v, "a", NOW) == [CancelRequest("q1", "ghost", "instance does not exist")]


@pytest.mark.parametrize("reason", list(DeleteReason))
def test_cancel_request_for_deleted_instance(reason):
    v = view([inst(state=InstanceState.DELETED, reason=reason)], requests=[PendingRequest("q1", "i")])
    assert plan(v, "b", NOW) == [CancelRequest("q1", "i", f"instance was deleted ({reason.value})")]


def test_cancel_comes_first_and_live_requests_are_not_cancelled():
    v = view(
        [inst(state=InstanceState.DELETED, reason=DeleteReason.REQUESTED), inst("j", state=InstanceState.STARTING)],
        runners=[run("i", 0, AVAILABLE), run("j", 0, IDLE), run("j", 1, IDLE)],
        downloads=done("a", "b"),
        requests=[PendingRequest("q-live", "j"), PendingRequest("q-dead", "i")],
    )
    assert plan(v, "a", NOW) == [
        CancelRequest("q-dead", "i", "instance was deleted (requested)"),
        StopRunner("i-r0", 1, StopReason.INSTANCE_GONE),
        ConnectRunner("j-r0", 1),
    ]


# -- stop ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "instances",
    [[], [inst(state=InstanceState.DELETED, reason=DeleteReason.REQUESTED)]],
    ids=["missing", "deleted"],
)
def test_stop_runner_of_gone_instance(instances):
    v = view(instances, [run("i", 0, AVAILABLE), run("i", 1, BUSY)])
    assert plan(v, "a", NOW) == [StopRunner("i-r0", 1, StopReason.INSTANCE_GONE)]
    assert plan(v, "b", NOW) == [StopRunner("i-r1", 1, StopReason.INSTANCE_GONE)]


def test_failed_runner_is_stopped_and_its_sibling_too():
    """Seed 000: a failing runner is dead (stopped, never revived); one_for_all stops its sibling."""
    v = view(
        [inst(state=InstanceState.READY)],
        [run("i", 0, FAILED, failure=BOOM), run("i", 1, AVAILABLE)],
        done("a", "b"),
    )
    assert plan(v, "a", NOW) == [StopRunner("i-r0", 1, StopReason.RUNNER_FAILED)]
    assert plan(v, "b", NOW) == [StopRunner("i-r1", 1, StopReason.SIBLING_FAILED)]


@pytest.mark.parametrize(
    ("sibling", "expected"),
    [
        (run("i", 0, FAILED, failure=BOOM), [StopRunner("i-r1", 1, StopReason.SIBLING_FAILED)]),
        (run("i", 0, STOPPING, failure=BOOM), [StopRunner("i-r1", 1, StopReason.SIBLING_FAILED)]),
        (run("i", 0, STOPPED, failure=Failure.exited(0)), [StopRunner("i-r1", 1, StopReason.SIBLING_FAILED)]),
        (run("i", 0, STOPPED), []),  # stopped on request: not a failure
        (run("i", 0, STOPPED, gen=0, failure=BOOM), []),  # failed in an older incarnation
    ],
    ids=["failed", "stopping-with-failure", "reaped-with-failure", "reaped-clean", "older-incarnation"],
)
def test_sibling_failed_rule(sibling, expected):
    v = view([inst(state=InstanceState.STARTING)], [sibling, run("i", 1, JOINED)], done("a", "b"))
    assert plan(v, "b", NOW) == expected


def test_sibling_failure_of_previous_generation_does_not_stop_the_new_one():
    v = view(
        [inst(state=InstanceState.STARTING, gen=2, attempts=1)],
        [run("i", 0, IDLE, gen=2), run("i", 1, STOPPED, gen=1, failure=BOOM)],
        done("a", "b"),
    )
    assert plan(v, "a", NOW) == []
    assert plan(v, "b", NOW) == [create("i", 1, gen=2)]


def test_runner_of_older_generation_is_stopped_as_stale():
    v = view([inst(state=InstanceState.STARTING, gen=2, attempts=1)], [run("i", 0, AVAILABLE, gen=1)], done("a", "b"))
    assert plan(v, "a", NOW) == [StopRunner("i-r0", 1, StopReason.STALE_GENERATION)]
    assert plan(v, "b", NOW) == []  # no creation while generation 1 is alive


@pytest.mark.parametrize("state", [InstanceState.RECOVERING, InstanceState.BACKING_OFF])
def test_runners_of_recovering_instance_are_stopped(state):
    v = view(
        [inst(state=state, attempts=1, deadline=NOW - 1 if state is InstanceState.BACKING_OFF else None)],
        [run("i", 0, AVAILABLE), run("i", 1, FAILED, failure=BOOM)],
        done("a", "b"),
    )
    # Backing off with a live runner: no StartGeneration even past the deadline.
    assert plan(v, "a", NOW) == [StopRunner("i-r0", 1, StopReason.RECOVERING)]
    assert plan(v, "b", NOW) == [StopRunner("i-r1", 1, StopReason.RUNNER_FAILED)]


@pytest.mark.parametrize(
    ("instances", "runner"),
    [
        ([inst(state=InstanceState.DELETED, reason=DeleteReason.REQUESTED)], run("i", 0, STOPPING)),
        ([inst(state=InstanceState.DELETED, reason=DeleteReason.REQUESTED)], run("i", 0, STOPPED)),
        ([inst(state=InstanceState.RECOVERING, attempts=1)], run("i", 0, FAILED, failure=BOOM, stop_requested=True)),
        ([inst(state=InstanceState.RECOVERING, attempts=1)], run("i", 0, STOPPED, failure=BOOM)),
        ([], run("i", 1, AVAILABLE)),  # on node b
    ],
    ids=["stop-requested", "reaped", "failed-stop-requested", "failed-reaped", "other-node"],
)
def test_no_stop(instances, runner):
    v = view(instances, [runner], done("a", "b"))
    assert plan(v, "a", NOW) == []


# -- create -------------------------------------------------------------------------


def test_create_runner_for_each_slot_of_current_generation():
    v = view([inst(state=InstanceState.STARTING)], downloads=done("a", "b"))
    assert plan(v, "a", NOW) == [
        CreateRunner(instance_id="i", runner_id="i-r0", node_id="a", rank=0, world_size=2, incarnation=1, model_id="m")
    ]
    assert plan(v, "b", NOW) == [
        CreateRunner(instance_id="i", runner_id="i-r1", node_id="b", rank=1, world_size=2, incarnation=1, model_id="m")
    ]


def test_no_second_create_when_runner_of_generation_exists():
    v = view([inst(state=InstanceState.STARTING)], [run("i", 0, IDLE)], done("a", "b"))
    assert plan(v, "a", NOW) == []
    assert plan(v, "b", NOW) == [create("i", 1)]


def test_no_create_while_sibling_failed_and_we_did_not():
    """Seed 000: wait for the failed sibling to come back first; the failed one proceeds."""
    v = view(
        [inst(state=InstanceState.STARTING, gen=2, attempts=1)],
        [run("i", 0, STOPPED, gen=1), run("i", 1, STOPPED, gen=1, failure=BOOM)],
        done("a", "b"),
    )
    assert plan(v, "a", NOW) == []
    assert plan(v, "b", NOW) == [create("i", 1, gen=2)]
    # Once the sibling's new incarnation exists (not failed), we follow.
    v2 = view(
        [inst(state=InstanceState.STARTING, gen=2, attempts=1)],
        [run("i", 0, STOPPED, gen=1), run("i", 1, IDLE, gen=2)],
        done("a", "b"),
    )
    assert plan(v2, "a", NOW) == [create("i", 0, gen=2)]


def test_create_when_both_failed_before_no_deadlock():
    v = view(
        [inst(state=InstanceState.STARTING, gen=2, attempts=1)],
        [run("i", 0, STOPPED, gen=1, failure=BOOM), run("i", 1, STOPPED, gen=1, failure=Failure.exited(1))],
        done("a", "b"),
    )
    assert plan(v, "a", NOW) == [create("i", 0, gen=2)]
    assert plan(v, "b", NOW) == [create("i", 1, gen=2)]


def test_no_create_while_older_generation_alive():
    old_alive = run("i", 1, STOPPING, gen=1)
    v = view(
        [inst(state=InstanceState.STARTING, gen=2, attempts=1)],
        [run("i", 0, STOPPED, gen=1, failure=BOOM), old_alive],
        done("a", "b"),
    )
    assert plan(v, "a", NOW) == []
    assert plan(v, "b", NOW) == []
    reaped = view(
        [inst(state=InstanceState.STARTING, gen=2, attempts=1)],
        [run("i", 0, STOPPED, gen=1, failure=BOOM), run("i", 1, STOPPED, gen=1)],
        done("a", "b"),
    )
    assert plan(reaped, "a", NOW) == [create("i", 0, gen=2)]


@pytest.mark.parametrize(("now", "expected"), [(9.99, []), (10.0, [create("i", 0, gen=2)]), (11.0, None)])
def test_create_gated_by_backoff_deadline(now, expected):
    v = view([inst(state=InstanceState.STARTING, gen=2, attempts=1, deadline=10.0)], downloads=done("a", "b"))
    assert plan(v, "a", now) == (expected if expected is not None else [create("i", 0, gen=2)])


@pytest.mark.parametrize(
    ("attempts", "max_retries", "expected"),
    [
        (5, 5, [DeleteInstance("i", DeleteReason.RETRIES_EXHAUSTED)]),
        (6, 5, [DeleteInstance("i", DeleteReason.RETRIES_EXHAUSTED)]),
        (3, 3, [DeleteInstance("i", DeleteReason.RETRIES_EXHAUSTED)]),  # exo's constant in seed 003
        (4, 5, [create("i", 0, gen=5)]),
    ],
)
def test_at_retry_cap_delete_instead_of_create(attempts, max_retries, expected):
    v = view(
        [inst(state=InstanceState.STARTING, gen=5, attempts=attempts, max_retries=max_retries)],
        downloads=done("a", "b"),
    )
    assert plan(v, "a", NOW) == expected


def test_at_retry_cap_every_hosting_node_gives_up_and_nobody_starts():
    for state in (InstanceState.PENDING, InstanceState.STARTING, InstanceState.BACKING_OFF):
        v = view([inst(state=state, gen=3, attempts=3, max_retries=3, deadline=None)], downloads=done("a", "b"))
        assert plan(v, "a", NOW) == [DeleteInstance("i", DeleteReason.RETRIES_EXHAUSTED)], state
        assert plan(v, "b", NOW) == [DeleteInstance("i", DeleteReason.RETRIES_EXHAUSTED)], state
        assert plan(v, "c", NOW) == [], state


def test_no_give_up_while_ready_or_recovering():
    for state in (InstanceState.READY, InstanceState.RECOVERING):
        v = view([inst(state=state, attempts=5, max_retries=5)], downloads=done("a", "b"))
        assert plan(v, "a", NOW) == [], state


# -- start generations --------------------------------------------------------------


def test_pending_instance_started_by_leader_only():
    v = view([inst(state=InstanceState.PENDING, gen=0)], downloads=done("a", "b"))
    assert plan(v, "a", NOW) == [StartGeneration("i", 1)]
    assert plan(v, "b", NOW) == []


@pytest.mark.parametrize(("now", "expected"), [(9.5, []), (10.0, [StartGeneration("i", 3)]), (30.0, None)])
def test_backing_off_instance_started_once_deadline_passed(now, expected):
    v = view(
        [inst(state=InstanceState.BACKING_OFF, gen=2, attempts=2, deadline=10.0)],
        [run("i", 0, STOPPED, gen=2), run("i", 1, STOPPED, gen=2, failure=BOOM)],
        done("a", "b"),
    )
    assert plan(v, "a", now) == (expected if expected is not None else [StartGeneration("i", 3)])
    assert plan(v, "b", now) == []


def test_fresh_placement_after_deletion_starts_without_backoff():
    """Seed 003: the retry count resets when the instance is deleted; a fresh placement starts clean."""
    policy = fsm.RetryPolicy(max_failures=3)
    old = fsm.InstanceRetry("i", world_size=2, policy=policy)
    t = 0.0
    for gen in (1, 2, 3):
        if old.deadline is not None:
            t = old.deadline
        old.apply(instance.Start("i", t, generation=gen))
        old.apply(instance.RankFailed("i", t, generation=gen, rank=1, failure=BOOM))
    assert RetryStatus.of(old) == RetryStatus(
        InstanceState.DELETED, 3, 3, 3, None, DeleteReason.RETRIES_EXHAUSTED, rank_generations=(3, 3)
    )

    slots = (Slot(0, "a", "i-r0"), Slot(1, "b", "i-r1"))
    dead = view(
        [InstanceView("i", MODEL, slots, RetryStatus.of(old))],
        [run("i", 0, STOPPED, gen=3), run("i", 1, STOPPED, gen=3, failure=BOOM)],
        done("a", "b"),
    )
    assert plan(dead, "a", t) == []
    assert plan(dead, "b", t) == []

    fresh = fsm.InstanceRetry("i", world_size=2, policy=policy)  # placed again: its runners were forgotten
    assert RetryStatus.of(fresh) == RetryStatus(InstanceState.PENDING, 0, 0, 3, None, None, rank_generations=(0, 0))
    again = view([InstanceView("i", MODEL, slots, RetryStatus.of(fresh))], downloads=done("a", "b"))
    assert plan(again, "a", t) == [StartGeneration("i", 1)]

    fresh.apply(instance.Start("i", t, generation=1))  # accepted at once: no deadline
    started = view([InstanceView("i", MODEL, slots, RetryStatus.of(fresh))], downloads=done("a", "b"))
    assert plan(started, "a", t) == [create("i", 0)]
    assert plan(started, "b", t) == [create("i", 1)]


# -- downloads ----------------------------------------------------------------------


def pending_view(*downloads: DownloadStatus, instances=None) -> ClusterView:
    """A Pending instance led by "a": node "b" has nothing to do but download."""
    return view(instances or [inst(state=InstanceState.PENDING, gen=0)], downloads=downloads)


@pytest.mark.parametrize(
    ("download", "expected"),
    [
        (None, [StartDownload("b", MODEL)]),
        (DownloadStatus("b", MODEL, DownloadState.PENDING), [StartDownload("b", MODEL)]),
        (DownloadStatus("b", MODEL, DownloadState.ONGOING), []),
        (DownloadStatus("b", MODEL, DownloadState.COMPLETED), []),
        (DownloadStatus("a", MODEL, DownloadState.COMPLETED), [StartDownload("b", MODEL)]),  # another node's
        (DownloadStatus("b", "other", DownloadState.COMPLETED), [StartDownload("b", MODEL)]),  # another model
    ],
    ids=["missing", "pending", "ongoing", "completed", "other-node", "other-model"],
)
def test_download_by_state(download, expected):
    v = pending_view(*([download] if download else []))
    assert plan(v, "b", NOW) == expected


@pytest.mark.parametrize(
    ("download", "create_on_b"),
    [
        (None, False),
        (DownloadStatus("b", MODEL, DownloadState.PENDING), False),
        (DownloadStatus("b", MODEL, DownloadState.ONGOING), False),
        (DownloadStatus("b", MODEL, DownloadState.FAILED, attempts=1, retry_at=NOW + 60), False),
        (DownloadStatus("b", "other", DownloadState.COMPLETED), False),
        (DownloadStatus("b", MODEL, DownloadState.COMPLETED), True),
    ],
    ids=["missing", "pending", "ongoing", "failed", "other-model", "completed"],
)
def test_a_runner_is_created_only_once_its_model_is_on_its_node(download, create_on_b):
    """exo's order: download, then create; a model that never comes never costs a process."""
    downloads = [DownloadStatus("a", MODEL, DownloadState.COMPLETED), *([download] if download else [])]
    v = view([inst(state=InstanceState.STARTING)], downloads=downloads)
    assert plan(v, "a", NOW) == [create("i", 0)]  # node a has the model: its rank does not wait for b's
    assert (create("i", 1) in plan(v, "b", NOW)) is create_on_b


@pytest.mark.parametrize(
    ("retry_at", "now", "expected"),
    [
        (10.0, 9.0, []),
        (10.0, 10.0, [StartDownload("b", MODEL)]),
        (10.0, 11.0, [StartDownload("b", MODEL)]),
        (None, 0.0, [StartDownload("b", MODEL)]),
    ],
)
def test_failed_download_retried_after_backoff(retry_at, now, expected):
    v = pending_view(DownloadStatus("b", MODEL, DownloadState.FAILED, attempts=2, retry_at=retry_at))
    assert plan(v, "b", now) == expected


def test_one_download_per_model_sorted():
    v = pending_view(
        instances=[
            inst("i", state=InstanceState.PENDING, gen=0, model="z"),
            inst("j", state=InstanceState.PENDING, gen=0, model="m"),
            inst("k", state=InstanceState.PENDING, gen=0, model="z"),
        ]
    )
    assert plan(v, "b", NOW) == [StartDownload("b", "m"), StartDownload("b", "z")]


def test_no_download_for_deleted_instance():
    v = pending_view(instances=[inst(state=InstanceState.DELETED, reason=DeleteReason.REQUESTED)])
    assert plan(v, "b", NOW) == []
    assert plan(v, "a", NOW) == []


def test_no_download_on_node_outside_instance():
    assert plan(pending_view(), "c", NOW) == []


# -- connect ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("r0", "r1", "on_a", "on_b"),
    [
        (IDLE, IDLE, [ConnectRunner("i-r0", 1)], []),  # the last rank waits
        (JOINING, IDLE, [], [ConnectRunner("i-r1", 1)]),
        (JOINED, IDLE, [], [ConnectRunner("i-r1", 1)]),
        (IDLE, JOINING, [ConnectRunner("i-r0", 1)], []),
        (JOINED, JOINING, [], []),
    ],
)
def test_connect_order(r0, r1, on_a, on_b):
    v = view([inst()], [run("i", 0, r0), run("i", 1, r1)], done("a", "b"))
    assert plan(v, "a", NOW) == on_a
    assert plan(v, "b", NOW) == on_b


def test_no_connect_until_every_rank_exists():
    v = view([inst()], [run("i", 0, IDLE)], done("a", "b"))
    assert plan(v, "a", NOW) == []


def test_no_connect_until_every_ranks_ring_endpoint_is_published():
    unpublished = [run("i", 0, IDLE), run("i", 1, IDLE, endpoint=None)]
    v = view([inst(state=InstanceState.STARTING)], runners=unpublished, downloads=done("a", "b"))
    assert plan(v, "a", NOW) == [] and plan(v, "b", NOW) == []  # not even rank 0: the hostfile is not whole


def test_never_connect_single_rank():
    v = view([inst(ranks=1)], [run("i", 0, IDLE)], [DownloadStatus("a", MODEL, DownloadState.ONGOING)])
    assert plan(v, "a", NOW) == []


def test_never_connect_failed_runner():
    """Seed 000: connect is only from Idle, never from Failed."""
    v = view([inst()], [run("i", 0, FAILED, failure=BOOM, stop_requested=True), run("i", 1, IDLE)], done("a", "b"))
    assert plan(v, "a", NOW) == []
    assert plan(v, "b", NOW) == [StopRunner("i-r1", 1, StopReason.SIBLING_FAILED)]


# -- load ---------------------------------------------------------------------------


def test_single_rank_loads_when_downloaded():
    v = view([inst(ranks=1)], [run("i", 0, IDLE)], done("a"))
    assert plan(v, "a", NOW) == [LoadModel("i-r0", 1, MODEL)]


@pytest.mark.parametrize(
    ("r0", "r1", "on_a", "on_b"),
    [
        (JOINED, JOINED, [LoadModel("i-r0", 1, MODEL)], [LoadModel("i-r1", 1, MODEL)]),
        (JOINED, WEIGHTS, [LoadModel("i-r0", 1, MODEL)], []),
        (JOINED, JOINING, [], []),
        (JOINED, IDLE, [], [ConnectRunner("i-r1", 1)]),
    ],
)
def test_multi_rank_loads_when_all_joined(r0, r1, on_a, on_b):
    v = view([inst()], [run("i", 0, r0), run("i", 1, r1)], done("a", "b"))
    assert plan(v, "a", NOW) == on_a
    assert plan(v, "b", NOW) == on_b


@pytest.mark.parametrize(
    ("b_download", "on_b"),
    [
        (DownloadStatus("b", MODEL, DownloadState.ONGOING), []),
        (DownloadStatus("b", MODEL, DownloadState.FAILED, retry_at=NOW + 5), []),
        (None, [StartDownload("b", MODEL)]),
    ],
    ids=["ongoing", "failed", "missing"],
)
def test_no_load_until_every_node_downloaded(b_download, on_b):
    downloads = [*done("a"), *([b_download] if b_download else [])]
    v = view([inst()], [run("i", 0, JOINED), run("i", 1, JOINED)], downloads)
    assert plan(v, "a", NOW) == []
    assert plan(v, "b", NOW) == on_b


# -- warm-up ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("r0", "r1", "on_a", "on_b"),
    [
        (LOADED, LOADED, [], [WarmUp("i-r1", 1)]),  # ranks > 0 first
        (WARMING, LOADED, [], [WarmUp("i-r1", 1)]),
        (LOADED, WARMING, [WarmUp("i-r0", 1)], []),  # rank 0 once the others warm up
        (LOADED, AVAILABLE, [WarmUp("i-r0", 1)], []),  # ... or are already Ready
        (WEIGHTS, LOADED, [], []),  # not all loaded yet
        (LOADED, WEIGHTS, [], []),
    ],
)
def test_warm_up_order(r0, r1, on_a, on_b):
    v = view([inst()], [run("i", 0, r0), run("i", 1, r1)], done("a", "b"))
    assert plan(v, "a", NOW) == on_a
    assert plan(v, "b", NOW) == on_b


def test_single_rank_warms_up_when_loaded():
    v = view([inst(ranks=1)], [run("i", 0, LOADED)], done("a"))
    assert plan(v, "a", NOW) == [WarmUp("i-r0", 1)]


# -- forward ------------------------------------------------------------------------


def test_forward_to_each_of_our_ready_runners():
    v = view(
        [inst(state=InstanceState.READY)],
        [run("i", 0, AVAILABLE), run("i", 1, BUSY)],
        done("a", "b"),
        [PendingRequest("q1", "i"), PendingRequest("q2", "i")],
    )
    assert plan(v, "a", NOW) == [ForwardRequest("q1", "i-r0", 1), ForwardRequest("q2", "i-r0", 1)]
    assert plan(v, "b", NOW) == [ForwardRequest("q1", "i-r1", 1), ForwardRequest("q2", "i-r1", 1)]


def test_forward_to_every_rank_a_node_hosts():
    both_on_a = inst(state=InstanceState.READY, nodes=("a", "a"))
    v = view(
        [both_on_a],
        [run("i", 0, AVAILABLE), run("i", 1, AVAILABLE, node="a")],
        done("a"),
        [PendingRequest("q1", "i")],
    )
    assert plan(v, "a", NOW) == [ForwardRequest("q1", "i-r0", 1), ForwardRequest("q1", "i-r1", 1)]


@pytest.mark.parametrize(
    ("state", "r1"),
    [(InstanceState.READY, WARMING), (InstanceState.STARTING, AVAILABLE), (InstanceState.RECOVERING, AVAILABLE)],
)
def test_no_forward_unless_instance_and_all_ranks_ready(state, r1):
    v = view(
        [inst(state=state, attempts=1 if state is InstanceState.RECOVERING else 0)],
        [run("i", 0, AVAILABLE), run("i", 1, r1)],
        done("a", "b"),
        [PendingRequest("q1", "i")],
    )
    actions = plan(v, "a", NOW) + plan(v, "b", NOW)
    assert not [x for x in actions if isinstance(x, (ForwardRequest, CancelRequest))]
    expected_a = [StopRunner("i-r0", 1, StopReason.RECOVERING)] if state is InstanceState.RECOVERING else []
    assert plan(v, "a", NOW) == expected_a


# -- priority order -----------------------------------------------------------------


def busy_view() -> ClusterView:
    """One view where every rule fires for node "a", plus instances whose create is blocked on "a". The runner to
    stop belongs to an instance no longer in the view: a deleted one's live runner would hold every creation on
    "a" back until it is reaped (its memory is not free yet: test_residency)."""
    return view(
        [
            inst("capped", ranks=1, state=InstanceState.STARTING, gen=5, attempts=5, max_retries=5),
            inst("fresh", ranks=1, state=InstanceState.PENDING, gen=0),
            inst("new", ranks=1, state=InstanceState.STARTING),
            inst("fetching", ranks=1, state=InstanceState.STARTING, model="m2"),
            inst("blocked", state=InstanceState.STARTING, gen=2, attempts=1),
            inst("conn", state=InstanceState.STARTING),
            inst("load", ranks=1, state=InstanceState.STARTING),
            inst("warm", ranks=1, state=InstanceState.STARTING),
            inst("serve", ranks=1, state=InstanceState.READY),
        ],
        [
            run("serve", 0, AVAILABLE),
            run("warm", 0, LOADED),
            run("load", 0, IDLE),
            run("conn", 0, IDLE),
            run("conn", 1, IDLE),
            run("blocked", 0, STOPPED, gen=1),
            run("blocked", 1, STOPPED, gen=1, failure=BOOM),
            run("gone", 0, AVAILABLE),
        ],
        done("a", "b"),
        [PendingRequest("q-serve", "serve"), PendingRequest("q-ghost", "ghost")],
    )


def test_priority_order_and_blocked_rule_does_not_starve_others():
    v = busy_view()
    assert plan(v, "a", NOW) == [
        CancelRequest("q-ghost", "ghost", "instance does not exist"),
        StopRunner("gone-r0", 1, StopReason.INSTANCE_GONE),
        DeleteInstance("capped", DeleteReason.RETRIES_EXHAUSTED),
        StartGeneration("fresh", 1),
        StartDownload("a", "m2"),
        create("new", 0, ranks=1),  # not "fetching": its model m2 is not on the node yet
        ConnectRunner("conn-r0", 1),
        LoadModel("load-r0", 1, MODEL),
        WarmUp("warm-r0", 1),
        ForwardRequest("q-serve", "serve-r0", 1),
    ]
    # The sibling that failed proceeds on its own node.
    assert plan(v, "b", NOW) == [
        CancelRequest("q-ghost", "ghost", "instance does not exist"),
        create("blocked", 1, gen=2),
    ]


# -- purity and next_deadline -------------------------------------------------------


def test_plan_is_pure():
    v = busy_view()
    before = copy.deepcopy(v)
    first = plan(v, "a", NOW)
    assert plan(v, "a", NOW) == first
    assert plan(before, "a", NOW) == first
    assert v == before


def deadline_view() -> ClusterView:
    return view(
        [
            inst("i", state=InstanceState.BACKING_OFF, gen=1, attempts=1, deadline=10.0),
            inst("j", ranks=1, state=InstanceState.BACKING_OFF, attempts=1, deadline=4.0, nodes=("c",)),
            inst("k", ranks=1, state=InstanceState.STARTING, nodes=("c",)),  # no deadline: no timer
            inst("d", ranks=1, state=InstanceState.DELETED, reason=DeleteReason.REQUESTED),
        ],
        downloads=[
            DownloadStatus("a", "m", DownloadState.FAILED, attempts=1, retry_at=7.0),
            DownloadStatus("b", "m", DownloadState.FAILED, attempts=1, retry_at=6.0),
            DownloadStatus("a", "x", DownloadState.COMPLETED, retry_at=1.0),
            DownloadStatus("a", "y", DownloadState.FAILED, attempts=1, retry_at=None),
        ],
    )


@pytest.mark.parametrize(
    ("node", "now", "expected"),
    [
        ("a", 0.0, 7.0),  # the download retry comes first
        ("a", 5.0, 7.0),
        ("a", 7.0, 10.0),  # strictly after now
        ("a", 9.0, 10.0),
        ("a", 10.0, None),
        ("b", 5.0, 6.0),
        ("b", 6.5, 10.0),
        ("c", 0.0, 4.0),
        ("c", 4.0, None),
        ("z", 0.0, None),
    ],
)
def test_next_deadline(node, now, expected):
    assert next_deadline(deadline_view(), node, now) == expected


def test_next_deadline_none_without_timers():
    assert next_deadline(view(), "a", NOW) is None
    assert next_deadline(busy_view(), "a", NOW) is None


def test_next_deadline_wakes_exactly_when_plan_changes():
    v = deadline_view()
    t1 = next_deadline(v, "a", 5.0)
    assert t1 == 7.0
    assert plan(v, "a", 5.0) == plan(v, "a", t1 - 0.001) == []
    assert plan(v, "a", t1) == [StartDownload("a", "m")]
    t2 = next_deadline(v, "a", t1)
    assert t2 == 10.0
    assert plan(v, "a", t2 - 0.001) == [StartDownload("a", "m")]
    assert plan(v, "a", t2) == [StartGeneration("i", 2), StartDownload("a", "m")]
    assert next_deadline(v, "a", t2) is None


# -- gaps found by review, now rules ---------------------------------------------------


def test_sibling_in_state_failed_without_failure_record_counts_as_failed():
    v = view([inst(state=InstanceState.READY)], [run("i", 0, FAILED), run("i", 1, AVAILABLE)], done("a", "b"))
    assert plan(v, "a", NOW) == [StopRunner("i-r0", 1, StopReason.RUNNER_FAILED)]  # passes: reads the state
    assert plan(v, "b", NOW) == [StopRunner("i-r1", 1, StopReason.SIBLING_FAILED)]


def test_next_deadline_reports_a_starting_instance_deadline():
    v = view([inst(state=InstanceState.STARTING, gen=2, attempts=1, deadline=10.0)], downloads=done("a", "b"))
    assert plan(v, "a", 5.0) == []
    assert plan(v, "a", 10.0) == [create("i", 0, gen=2)]
    assert next_deadline(v, "a", 5.0) == 10.0


def test_warm_up_not_blocked_by_a_rank_already_ready():
    v = view(
        [inst(ranks=3)],
        [run("i", 0, LOADED), run("i", 1, AVAILABLE), run("i", 2, LOADED)],
        done("a", "b", "c"),
    )
    assert plan(v, "a", NOW) == []  # rank 0 waits for rank 2: right
    assert plan(v, "c", NOW) == [WarmUp("i-r2", 1)]


# -- rules that once leaked or were missing ---------------------------------------------------


def test_cancel_is_planned_only_on_nodes_hosting_the_deleted_instance():
    v = view([inst(state=InstanceState.DELETED, reason=DeleteReason.REQUESTED)], requests=[PendingRequest("q1", "i")])
    assert [a for a in plan(v, "c", NOW) if isinstance(a, CancelRequest)] == []  # rank r lives on NODES[r]: not c
    assert plan(v, "a", NOW) == plan(v, "b", NOW) == [CancelRequest("q1", "i", "instance was deleted (requested)")]


def test_a_runner_in_no_slot_of_its_instance_is_stopped():
    stray = attrs.evolve(run("i", 0, AVAILABLE), runner_id="i-stray")
    runners = [run("i", 0, AVAILABLE), run("i", 1, AVAILABLE), stray]
    v = view([inst(state=InstanceState.READY)], runners=runners, downloads=done("a", "b"))
    assert plan(v, "a", NOW) == [StopRunner("i-stray", 1, StopReason.INSTANCE_GONE)]


def test_next_deadline_includes_a_budget_reset_coming_due():
    ready = attrs.evolve(
        inst(state=InstanceState.READY, attempts=2),
        retry=RetryStatus(InstanceState.READY, 3, 2, 5, None, None, ready_since=40.0, reset_after=600.0),
    )
    assert next_deadline(view([ready]), "a", NOW) == 640.0
    assert next_deadline(view([ready]), "a", 640.0) is None  # due now: observed by the event at that time
    fresh = attrs.evolve(ready, retry=attrs.evolve(ready.retry, attempts=0))
    assert next_deadline(view([fresh]), "a", NOW) is None  # nothing to reset
    assert next_deadline(view([ready]), "c", NOW) is None  # not a node of the instance


def test_the_daemon_and_the_checker_wake_for_the_reset_from_next_deadline_alone():
    """The machines' own reset and `next_deadline` agree: at the deadline, a Tick resets the budget."""
    from fsm.cluster import Cluster

    cluster = Cluster()
    policy = fsm.RetryPolicy(backoff=fsm.Backoff(1.0, 2.0, 4.0), max_failures=3, reset_after=50.0)
    cluster.place("i", MODEL, [Slot(0, "a", "i/0")], policy=policy)
    from fsm.world import World

    world = World(cluster, ["a"])
    world.settle()
    cluster.runner_event(fsm.runner.Exited("i/0", 1, exit_code=-9, stop_delivered=False), world.now)
    world.settle()  # backs off, starts generation 2, Ready again; then waits for the reset
    machine = cluster.instance("i")
    assert (machine.instance_state, machine.generation, machine.attempts) == (InstanceState.READY, 2, 0)
    assert world.now == machine.ready_since + 50.0


# -- the desired state: configured placements -----------------------------------------------------


def test_configured_placements_are_idempotent_per_model():
    config, cli = [("exod/tiny-qwen2", 2)], [("exod/tiny-qwen2", 2)]
    assert fsm.to_place(config + cli, placed=[]) == [("exod/tiny-qwen2", 2)]  # one instance, not two
    assert fsm.to_place(config + cli, placed=["exod/tiny-qwen2"]) == []  # a restart places nothing again
    assert fsm.to_place([("a/m", 1), ("b/m", 2), ("a/m", 3)], placed=["b/m"]) == [("a/m", 3)]  # the last wins
    with pytest.raises(fsm.InvalidConfig, match="ranks"):
        fsm.to_place([("a/m", 0)], placed=[])


# -- rules for every rank, node and order ---------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "still_idle"),
    [(IDLE, True), (JOINED, False), (LOADED, False)],
    ids=["idle", "joined", "loaded"],
)
def test_runners_of_an_older_generation_are_only_stopped_never_driven(phase, still_idle):
    """Generation 2 has started while generation 1 is still alive: its ranks are stopped, never connected,
    loaded or warmed up (they belong to a generation the instance has left)."""
    v = view([inst(gen=2, attempts=1)], [run("i", 0, phase, gen=1), run("i", 1, phase, gen=1)], done("a", "b"))
    assert plan(v, "a", NOW) == [StopRunner("i-r0", 1, StopReason.STALE_GENERATION)]
    assert plan(v, "b", NOW) == [StopRunner("i-r1", 1, StopReason.STALE_GENERATION)]


@pytest.mark.parametrize("stray_id", ["i-a", "i-old", "i-stray", "zz"])
def test_a_runner_in_no_slot_is_stopped_whatever_its_id(stray_id):
    stray = attrs.evolve(run("i", 0, AVAILABLE), runner_id=stray_id)
    v = view([inst(state=InstanceState.READY)], [run("i", 0, AVAILABLE), run("i", 1, AVAILABLE), stray], done("a", "b"))
    assert plan(v, "a", NOW) == [StopRunner(stray_id, 1, StopReason.INSTANCE_GONE)]
    assert plan(v, "b", NOW) == []


def test_a_failed_rank_stops_every_other_rank_below_and_above_it():
    """one_for_all whichever rank fails: here the middle one of three."""
    v = view(
        [inst(ranks=3, state=InstanceState.READY)],
        [run("i", 0, AVAILABLE), run("i", 1, FAILED, failure=BOOM), run("i", 2, BUSY)],
        done("a", "b", "c"),
    )
    assert plan(v, "a", NOW) == [StopRunner("i-r0", 1, StopReason.SIBLING_FAILED)]
    assert plan(v, "b", NOW) == [StopRunner("i-r1", 1, StopReason.RUNNER_FAILED)]
    assert plan(v, "c", NOW) == [StopRunner("i-r2", 1, StopReason.SIBLING_FAILED)]


@pytest.mark.parametrize("failed_rank", [0, 1])
def test_whichever_rank_failed_is_recreated_first_and_the_other_waits(failed_rank):
    runners = [run("i", r, STOPPED, gen=1, failure=BOOM if r == failed_rank else None) for r in (0, 1)]
    v = view([inst(gen=2, attempts=1)], runners, done("a", "b"))
    node_of = {0: "a", 1: "b"}
    assert plan(v, node_of[failed_rank], NOW) == [create("i", failed_rank, gen=2)]
    assert plan(v, node_of[1 - failed_rank], NOW) == []


def test_on_a_node_hosting_two_ranks_the_failed_one_is_recreated_while_the_other_waits():
    """The waiting rank comes first in slot order: it must not keep the failed one from coming back."""
    v = view(
        [inst(gen=2, attempts=1, nodes=("a", "a"))],
        [run("i", 0, STOPPED, gen=1), run("i", 1, STOPPED, gen=1, failure=BOOM, node="a")],
        done("a"),
    )
    assert plan(v, "a", NOW) == [attrs.evolve(create("i", 1, gen=2), node_id="a")]


def test_an_instance_that_cannot_create_yet_does_not_hold_back_the_next_one():
    v = view(
        [
            inst("gated", ranks=1, gen=2, attempts=1, deadline=NOW + 10),  # backoff not over
            inst("old", gen=2, attempts=1),  # its generation-1 rank 1 is still stopping
            inst("ok", ranks=1),
        ],
        [run("old", 0, STOPPED, gen=1, failure=BOOM), run("old", 1, STOPPING, gen=1)],
        done("a", "b"),
    )
    assert plan(v, "a", NOW) == [create("ok", 0, ranks=1)]


def test_connect_order_with_three_ranks():
    """Every rank below the last connects at once; the last only once all the others are connecting."""
    idle = view([inst(ranks=3)], [run("i", r, IDLE) for r in range(3)], done(*NODES))
    assert [plan(idle, n, NOW) for n in NODES] == [[ConnectRunner("i-r0", 1)], [ConnectRunner("i-r1", 1)], []]
    half = view([inst(ranks=3)], [run("i", 0, JOINING), run("i", 1, IDLE), run("i", 2, IDLE)], done(*NODES))
    assert [plan(half, n, NOW) for n in NODES] == [[], [ConnectRunner("i-r1", 1)], []]
    rest = view([inst(ranks=3)], [run("i", 0, JOINING), run("i", 1, JOINED), run("i", 2, IDLE)], done(*NODES))
    assert [plan(rest, n, NOW) for n in NODES] == [[], [], [ConnectRunner("i-r2", 1)]]


def test_a_rank_already_warming_does_not_hold_back_another_rank_on_the_same_node():
    v = view(
        [inst(ranks=3, nodes=("b", "a", "a"))],
        [run("i", 0, LOADED, node="b"), run("i", 1, WARMING, node="a"), run("i", 2, LOADED, node="a")],
        done("a", "b"),
    )
    assert plan(v, "a", NOW) == [WarmUp("i-r2", 1)]
    assert plan(v, "b", NOW) == []  # rank 0 waits for rank 2


def test_a_request_that_cannot_be_forwarded_does_not_hold_back_the_next_one():
    v = view(
        [inst("j", ranks=1), inst("i", ranks=1, state=InstanceState.READY)],
        [run("j", 0, WARMING), run("i", 0, AVAILABLE)],
        done("a"),
        [PendingRequest("q-ghost", "ghost"), PendingRequest("q-early", "j"), PendingRequest("q1", "i")],
    )
    assert plan(v, "a", NOW) == [
        CancelRequest("q-ghost", "ghost", "instance does not exist"),
        ForwardRequest("q1", "i-r0", 1),
    ]
