"""Snapshots: `from_dict`, `from_snapshot` and `reload` refuse what no machine could be, with the same checks.

A snapshot either describes a machine exactly (its `to_dict` gives the input back) or is refused with
`SnapshotError`, naming the field, and nothing changes. The targeted tests below pin each hole that used to
let an impossible snapshot through; the Hypothesis tests mutate real snapshots every which way.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fsm
from fsm import download as dl
from fsm import instance as it
from fsm import runner as rn
from fsm._machine import converter
from fsm.cluster import Cluster
from fsm.world import World

NAN, INF = math.nan, math.inf
POLICY = fsm.RetryPolicy(backoff=fsm.Backoff(1.0, 2.0, 8.0), max_failures=3, reset_after=40.0)
MODEL = "org/model"


# -- machines in known states -----------------------------------------------------------------


def runner_in(leaf: str) -> rn.RunnerLifecycle:
    """A rank-1 runner of a 2-rank instance, driven to ``leaf``."""
    m = rn.RunnerLifecycle("r", rank=1, world_size=2, incarnation=1)
    route = {
        "idle": [],
        "available": ["connect", "connected", "load", "progress", "weights_loaded", "warm_up", "warmed"],
        "busy": ["connect", "connected", "load", "progress", "weights_loaded", "warm_up", "warmed", "request"],
        "failed": ["connect", "fail"],
        "stopped": ["connect", "fail", "exited"],
    }[leaf]
    for name in route:
        m.apply(
            {
                "connect": rn.Connect("r", 1),
                "connected": rn.Connected("r", 1),
                "load": rn.Load("r", 1),
                "progress": rn.Progress("r", 1, layers_loaded=2, layers_total=4),
                "weights_loaded": rn.WeightsLoaded("r", 1),
                "warm_up": rn.WarmUp("r", 1),
                "warmed": rn.Warmed("r", 1),
                "request": rn.RequestStarted("r", 1),
                "fail": rn.Fail("r", 1, failure=fsm.Failure.signalled(9)),
                "exited": rn.Exited("r", 1, exit_code=0),
            }[name]
        )
    assert m.leaf == leaf
    return m


def instance_in(leaf: str) -> it.InstanceRetry:
    """A 2-rank instance driven to ``leaf``."""
    m = it.InstanceRetry("i", world_size=2, policy=POLICY)
    if leaf == "pending":
        return m
    if leaf == "deleted":
        m.apply(it.Delete("i", 1.0))
        return m
    m.apply(it.Start("i", 1.0, 1))
    for rank in (0, 1):
        m.apply(it.RankCreated("i", 1.0, 1, rank))
    if leaf in ("ready", "recovering", "backing_off"):
        for rank in (0, 1):
            m.apply(it.RankReady("i", 2.0, 1, rank))
    if leaf in ("recovering", "backing_off"):
        m.apply(it.RankFailed("i", 3.0, 1, 0, failure=fsm.Failure.signalled(9)))
    if leaf == "backing_off":
        for rank in (0, 1):
            m.apply(it.RankStopped("i", 4.0, 1, rank))
    assert m.leaf == leaf
    return m


def download_in(leaf: str) -> dl.DownloadLifecycle:
    m = dl.DownloadLifecycle(MODEL)
    if leaf != "pending":
        m.apply(dl.Begin(MODEL, 1.0))
        m.apply(dl.BytesProgress(MODEL, 2.0, 5, 10))
    if leaf == "failed":
        m.apply(dl.DownloadFailed(MODEL, 3.0, "offline"))
    if leaf == "completed":
        m.apply(dl.Complete(MODEL, 3.0))
    assert m.leaf == leaf
    return m


MACHINES: dict[str, Callable[[str], Any]] = {"runner": runner_in, "instance": instance_in, "download": download_in}
CLASSES: dict[str, Any] = {"runner": rn.RunnerLifecycle, "instance": it.InstanceRetry, "download": dl.DownloadLifecycle}
ELSEWHERE = {"runner": "available", "instance": "backing_off", "download": "completed"}
DROP = object()  # a change that removes the key

# (machine, leaf, changes, what the error names)
BAD = [
    # bug 1: the instance
    ("instance", "deleted", {"delete_reason": None}, "delete_reason"),
    ("instance", "ready", {"delete_reason": "requested"}, "delete_reason"),
    ("instance", "pending", {"world_size": 0}, "world_size"),
    ("instance", "pending", {"world_size": -2}, "world_size"),
    ("instance", "backing_off", {"deadline": NAN}, "deadline"),
    ("instance", "backing_off", {"deadline": INF}, "deadline"),
    ("instance", "backing_off", {"deadline": 10**400}, "deadline"),
    ("instance", "ready", {"ready_since": NAN}, "ready_since"),
    ("instance", "ready", {"clock": INF}, "clock"),
    ("instance", "ready", {"clock": -INF}, "clock"),
    ("instance", "recovering", {"attempts": -1}, "attempts"),
    ("instance", "recovering", {"attempts": 0}, "attempts"),  # its backoff timer could never be armed
    ("instance", "ready", {"generation": -1}, "generation"),
    ("instance", "starting", {"live_ranks": [2]}, "live_ranks"),
    ("instance", "starting", {"live_ranks": [-1, 0]}, "live_ranks"),
    ("instance", "starting", {"live_ranks": [1, 0]}, "live_ranks"),
    ("instance", "starting", {"live_ranks": [0, 0]}, "live_ranks"),
    ("instance", "starting", {"live_ranks": [True]}, "live_ranks"),
    ("instance", "starting", {"live_ranks": "01"}, "live_ranks"),
    ("instance", "ready", {"ready_ranks": [0, 5]}, "ready_ranks"),
    ("instance", "ready", {"seed": 1.5}, "seed"),
    ("instance", "ready", {"seed": "0"}, "seed"),
    ("instance", "ready", {"instance_id": ""}, "instance_id"),
    ("instance", "ready", {"deadline": "5"}, "deadline"),
    ("instance", "ready", {"attempts": 1.0}, "attempts"),
    ("instance", "ready", {"policy": {**converter.unstructure(POLICY), "max_failures": "3"}}, "max_failures"),
    ("instance", "ready", {"in_flight": 0}, "in_flight"),
    ("instance", "ready", {"last_failure": DROP}, "last_failure"),
    # from_snapshot would run what a real machine does on the way in; reload would not: such states never rest
    ("instance", "deleted", {"deadline": 5.0}, "deadline"),  # entering Deleted cancels the timer
    ("instance", "recovering", {"live_ranks": []}, "live_ranks"),  # goes on to backing_off at once
    ("instance", "starting", {"ready_ranks": [0, 1]}, "ready_ranks"),  # goes on to ready at once
    # bug 2: the runner
    ("runner", "busy", {"in_flight": 0}, "in_flight"),
    ("runner", "busy", {"in_flight": -1}, "in_flight"),
    ("runner", "available", {"in_flight": 2}, "in_flight"),
    ("runner", "failed", {"in_flight": 1}, "in_flight"),
    ("runner", "available", {"rank": 1.0}, "rank"),
    ("runner", "available", {"rank": 1.7}, "rank"),
    ("runner", "available", {"rank": "1"}, "rank"),
    ("runner", "available", {"rank": 2}, "rank"),
    ("runner", "available", {"incarnation": True}, "incarnation"),
    ("runner", "available", {"incarnation": -1}, "incarnation"),
    ("runner", "available", {"world_size": 2.0}, "world_size"),
    ("runner", "available", {"stop_requested": 1}, "stop_requested"),
    ("runner", "available", {"runner_id": 7}, "runner_id"),
    ("runner", "available", {"runner_id": ""}, "runner_id"),
    ("runner", "available", {"layers_loaded": -1}, "layers"),
    ("runner", "available", {"layers_total": -4}, "layers"),
    ("runner", "available", {"layers_loaded": 5}, "layers"),
    ("runner", "available", {"leaf": 3}, "leaf"),
    ("runner", "failed", {"failure": None}, "failure"),  # Failed always carries its cause
    ("runner", "failed", {"failure": {**attrs.asdict(fsm.Failure.signalled(9)), "retryable": 1}}, "retryable"),
    ("runner", "failed", {"failure": {**converter.unstructure(fsm.Failure.signalled(9)), "signal": "9"}}, "signal"),
    ("runner", "available", {"in_flight": DROP}, "in_flight"),
    ("runner", "stopped", {"stop_requested": False}, "stop_requested"),  # entering Shutdown records the stop
    # bug 3: the download
    ("download", "failed", {"attempts": -1}, "attempts"),
    ("download", "failed", {"retry_at": NAN}, "retry_at"),
    ("download", "failed", {"clock": INF}, "clock"),
    ("download", "ongoing", {"bytes_done": 11}, "bytes"),
    ("download", "ongoing", {"bytes_done": -1, "bytes_total": None}, "bytes"),
    ("download", "ongoing", {"bytes_total": -1}, "bytes"),
    ("download", "ongoing", {"bytes_total": "10"}, "bytes_total"),
    ("download", "ongoing", {"last_error": 5}, "last_error"),
    ("download", "ongoing", {"model_id": ""}, "model_id"),
    ("download", "failed", {"policy": {"initial": 0.5, "factor": 2.0, "cap": 10.0, "jitter": True}}, "jitter"),
    ("download", "failed", {"policy": {"initial": 0.5, "factor": 2.0, "cap": 10.0}}, "jitter"),
]


def _changed(data: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(data)
    for key, value in changes.items():
        if value is DROP:
            out.pop(key)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize(("kind", "leaf", "changes", "field"), BAD, ids=[f"{b[0]}-{b[1]}-{b[3]}" for b in BAD])
def test_from_dict_refuses_impossible_snapshots_naming_the_field(kind, leaf, changes, field):
    data = MACHINES[kind](leaf).to_dict()
    bad = _changed(data, changes)
    copied = copy.deepcopy(bad)
    with pytest.raises(fsm.SnapshotError, match=field):
        CLASSES[kind].from_dict(bad)
    assert repr(bad) == repr(copied)  # the input is left alone


# bug 4: reload (the checker's shortcut) and from_snapshot make the same checks as from_dict
OBJECT_BAD = [
    b
    for b in BAD
    if all(not isinstance(v, dict) and v is not DROP for v in b[2].values())
    and b[2].keys() <= attrs.fields_dict(CLASSES[b[0]].snapshot_type).keys()
]


@pytest.mark.parametrize(
    ("kind", "leaf", "changes", "field"), OBJECT_BAD, ids=[f"{b[0]}-{b[1]}-{b[3]}" for b in OBJECT_BAD]
)
def test_reload_and_from_snapshot_refuse_what_from_dict_refuses(kind, leaf, changes, field):
    cls = CLASSES[kind]
    snapshot = attrs.evolve(MACHINES[kind](leaf).snapshot(), **changes)
    with pytest.raises(fsm.SnapshotError, match=field):
        cls.from_snapshot(snapshot)
    machine = MACHINES[kind](ELSEWHERE[kind])
    before, path = machine.to_dict(), machine.path
    with pytest.raises(fsm.SnapshotError, match=field):
        machine.reload(snapshot)
    assert (machine.to_dict(), machine.path) == (before, path)  # changed nothing
    event = {
        "runner": rn.Stop("r", 1),
        "instance": it.Tick("i", 5.0),
        "download": dl.Invalidate(MODEL, 5.0),
    }[kind]
    machine.apply(event)  # and still works


def test_reload_refuses_a_foreign_snapshot_object_and_a_compound_leaf():
    machine = runner_in("available")
    before = machine.to_dict()
    for bad in (instance_in("ready").snapshot(), {"leaf": "idle"}, attrs.evolve(machine.snapshot(), leaf="ready")):
        with pytest.raises(fsm.SnapshotError):
            machine.reload(bad)
        assert machine.to_dict() == before


def test_from_snapshot_raises_snapshot_error_not_invalid_config():
    snapshot = attrs.evolve(runner_in("idle").snapshot(), rank=5)
    with pytest.raises(fsm.SnapshotError, match="rank"):
        rn.RunnerLifecycle.from_snapshot(snapshot)


@pytest.mark.parametrize(
    ("kind", "leaf", "changes"),
    [
        ("instance", "backing_off", {"deadline": 9, "clock": 4}),  # an int is a fine float
        ("instance", "ready", {"ready_since": 2, "policy": {**converter.unstructure(POLICY), "reset_after": 40}}),
        (
            "download",
            "failed",
            {"retry_at": 4, "clock": 3, "policy": {"initial": 1, "factor": 2, "cap": 10, "jitter": False}},
        ),
        ("runner", "available", {"incarnation": 10**30}),  # a huge int is still an int
    ],
)
def test_an_int_where_a_float_is_expected_round_trips_exactly(kind, leaf, changes):
    data = _changed(MACHINES[kind](leaf).to_dict(), changes)
    restored = CLASSES[kind].from_dict(data)
    assert _same(restored.to_dict(), data)


@pytest.mark.parametrize("version", [1.0, True, "1", None])
def test_the_version_is_the_int_1_and_nothing_equal_to_it(version):
    for kind, leaf in (("runner", "idle"), ("instance", "pending"), ("download", "pending")):
        with pytest.raises(fsm.SnapshotError, match="version"):
            CLASSES[kind].from_dict({**MACHINES[kind](leaf).to_dict(), "version": version})


def test_a_snapshot_missing_a_key_is_refused_even_with_a_default():
    data = runner_in("available").to_dict()
    del data["stop_requested"]
    with pytest.raises(fsm.SnapshotError, match="stop_requested"):
        rn.RunnerLifecycle.from_dict(data)
    data = download_in("failed").to_dict()
    del data["policy"]["jitter"]
    with pytest.raises(fsm.SnapshotError, match="jitter"):
        dl.DownloadLifecycle.from_dict(data)


# -- bug 5: Cluster.from_dict ------------------------------------------------------------------


def cluster_data() -> dict[str, Any]:
    cluster = Cluster()
    cluster.place("i", MODEL, [fsm.Slot(0, "a", "i/0"), fsm.Slot(1, "b", "i/1")], policy=POLICY)
    cluster.place("j", MODEL, [fsm.Slot(0, "a", "j/0")])
    world = World(cluster, ["a", "b"])
    for _ in range(4):
        world.step("a")
        world.step("b")
        world.deliver_all()
    data = cluster.to_dict()
    assert set(data["runners"]) == {"i/0", "i/1", "j/0"} and data["downloads"]
    return data


def _edit(edit: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    data = cluster_data()
    edit(data)
    return data


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    *parents, last = path.split(".")

    def edit(data: dict[str, Any]) -> None:
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is DROP:
            node.pop(int(last) if isinstance(node, list) else last)
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return edit


def _share_runner_id(data: dict[str, Any]) -> None:
    data["instances"]["j"]["slots"][0]["runner_id"] = "i/1"
    data["instances"]["j"]["machine"]["live_ranks"] = []
    data["instances"]["j"]["machine"]["ready_ranks"] = []
    del data["runners"]["j/0"]


CLUSTER_BAD = [
    pytest.param(lambda d: d.clear(), "instances", id="empty"),
    pytest.param(lambda d: d.pop("runners"), "runners", id="no-runners"),
    pytest.param(lambda d: d.update(bogus=1), "bogus", id="unknown-key"),
    pytest.param(_set("instances", []), "instances", id="instances-not-a-dict"),
    pytest.param(_set("instances.i.slots.1.rank", 0), r"instances\.i\.slots", id="duplicate-rank"),
    pytest.param(_set("instances.i.slots.1.rank", "1"), r"instances\.i\.slots", id="rank-str"),
    pytest.param(_set("instances.i.slots.1", DROP), r"instances\.i", id="slots-and-world-size-disagree"),
    pytest.param(_set("instances.i.slots.1.runner_id", "i/0"), r"instances\.i\.slots", id="runner-id-twice"),
    pytest.param(_share_runner_id, r"instances\.j\.slots.*i/1", id="runner-id-shared-between-instances"),
    pytest.param(_set("instances.i.model_id", DROP), r"instances\.i.*model_id", id="no-model-id"),
    pytest.param(_set("instances.i.extra", 1), r"instances\.i.*extra", id="unknown-placement-key"),
    pytest.param(_set("instances.i.machine.instance_id", "j"), r"instances\.i\.machine", id="instance-id-mismatch"),
    pytest.param(_set("instances.i.machine.clock", NAN), r"instances\.i\.machine.*clock", id="bad-instance-machine"),
    pytest.param(_set("runners.i/0.instance_id", "zzz"), r"runners\.i/0\.instance_id", id="runner-of-no-instance"),
    pytest.param(_set("runners.i/0.instance_id", "j"), r"runners\.i/0", id="runner-in-no-slot"),
    pytest.param(_set("runners.i/1.machine.rank", 0), r"runners\.i/1.*rank", id="rank-disagrees-with-slot"),
    pytest.param(_set("runners.i/1.node_id", "a"), r"runners\.i/1\.node_id", id="node-disagrees-with-slot"),
    pytest.param(_set("runners.i/1.machine.world_size", 3), r"runners\.i/1.*world_size", id="world-size-disagrees"),
    pytest.param(_set("runners.i/1.machine.incarnation", 7), r"runners\.i/1.*incarnation", id="future-incarnation"),
    pytest.param(_set("runners.i/1.machine.runner_id", "i/0"), r"runners\.i/1.*runner_id", id="runner-id-mismatch"),
    pytest.param(
        _set("runners.i/1.machine.in_flight", 3), r"runners\.i/1\.machine.*in_flight", id="bad-runner-machine"
    ),
    pytest.param(_set("runners.i/1.node_id", 5), r"runners\.i/1\.node_id", id="node-id-not-str"),
    pytest.param(lambda d: d["downloads"].append(d["downloads"][0]), r"downloads\[\d\]", id="duplicate-download"),
    pytest.param(_set("downloads.0.node_id", None), r"downloads\[0\]\.node_id", id="download-node-none"),
    pytest.param(_set("downloads.0.machine.attempts", -1), r"downloads\[0\]\.machine", id="bad-download-machine"),
    pytest.param(_set("downloads", {}), "downloads", id="downloads-not-a-list"),
]


@pytest.mark.parametrize(("edit", "field"), CLUSTER_BAD)
def test_cluster_from_dict_refuses_inconsistent_snapshots_naming_the_field(edit, field):
    bad = _edit(edit)
    with pytest.raises(fsm.SnapshotError, match=field):
        Cluster.from_dict(bad)


def test_cluster_from_dict_of_a_non_dict_is_a_snapshot_error():
    for bad in (None, [], "x"):
        with pytest.raises(fsm.SnapshotError):
            Cluster.from_dict(bad)  # type: ignore[arg-type]


def test_cluster_from_dict_ignores_the_requests_key_of_old_snapshots():
    data = cluster_data()
    restored = Cluster.from_dict({**data, "requests": [{"request_id": "q", "instance_id": "i"}]})
    assert restored.to_dict() == data


def test_cluster_round_trip_still_works():
    data = cluster_data()
    restored = Cluster.from_dict(data)
    assert _same(restored.to_dict(), data)
    assert restored.view() == Cluster.from_dict(data).view()


# -- bug 7: Hypothesis mutations of real snapshots -----------------------------------------------

ALL_LEAVES = sorted({s.id for cls in CLASSES.values() for s in cls.states_map.values()} | {"exploded", ""})
UNKNOWN_KEYS = ["extra", "requests", "leaf2", "Leaf", "0", "machine"]
ODD: list[Any] = [
    None, True, False, 0, 1, -1, 2, 7, 2**63, -(2**63), 10**30, 0.0, -0.0, 1.5, -2.5, 1e308,
    NAN, INF, -INF, "", "x", "3", "1.5", "true", [], [0], [1, 0], [0, 0], [-1], {}, {"x": 1},
    *ALL_LEAVES,
]  # fmt: skip


def _nodes(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _nodes(v, (*path, i))


def _neighbours(value: Any) -> list[Any]:
    """Values close to ``value`` but of another type or out of its range."""
    if isinstance(value, bool):
        return [not value, int(value), str(value).lower(), None]
    if isinstance(value, int):
        return [value + 1, value - 1, -value - 1, float(value), str(value), bool(value), value + 2**64, None]
    if isinstance(value, float):
        shifted = [int(value)] if math.isfinite(value) else []
        return [*shifted, -value, value + 1, str(value), NAN, INF, -INF, None, True]
    if isinstance(value, str):
        return ["", value + "x", value.upper(), 0, None, *ALL_LEAVES[:4]]
    if isinstance(value, list):
        return [[*value, 0], value[::-1], value[:-1], tuple(value), {}, None, "0"]
    if isinstance(value, dict):
        return [{}, [], None, list(value)]
    return [0, "", {}]


@st.composite
def mutated(draw: st.DrawFn, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with one to three mutations: drop, add, replace, nudge, or a leaf swapped."""
    value: Any = copy.deepcopy(data)
    for _ in range(draw(st.integers(1, 3))):
        nodes = list(_nodes(value))
        path, node = draw(st.sampled_from(nodes))
        kind = draw(st.sampled_from(["drop", "add", "replace", "nudge", "nudge", "leaf"]))
        if kind == "leaf":
            holders = [p for p, n in nodes if isinstance(n, dict) and "leaf" in n]
            if not holders:
                continue
            path = (*draw(st.sampled_from(holders)), "leaf")
            new: Any = draw(st.sampled_from(ALL_LEAVES))
        elif kind == "drop":
            if not path:
                continue
            value = _put(value, path, DROP)
            continue
        elif kind == "add":
            if isinstance(node, dict):
                path = (*path, draw(st.sampled_from(UNKNOWN_KEYS)))
            elif isinstance(node, list):
                path = (*path, len(node))
            else:
                continue
            new = draw(st.sampled_from(ODD))
        elif kind == "replace":
            new = draw(
                st.one_of(
                    st.sampled_from(ODD),
                    st.integers(),
                    st.floats(),
                    st.text(max_size=3),
                )
            )
        else:
            new = draw(st.sampled_from(_neighbours(node)))
        value = _put(value, path, new)
    return value


def _put(root: Any, path: tuple, new: Any) -> Any:
    """A copy of ``root`` with the value at ``path`` replaced (or removed, for DROP; appended past a list's end)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(root, dict):
        out = dict(root)
        if rest:
            out[head] = _put(root[head], rest, new)
        elif new is DROP:
            out.pop(head, None)
        else:
            out[head] = new
        return out
    out_list = list(root)
    if rest:
        out_list[head] = _put(root[head], rest, new)
    elif new is DROP:
        del out_list[head]
    elif head == len(out_list):
        out_list.append(new)
    else:
        out_list[head] = new
    return out_list if isinstance(root, list) else tuple(out_list)


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (True is not 1, 1.0 is not 1; a tuple is a list)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _raw_snapshot(cls: Any, data: Any) -> Any:
    """A snapshot object of ``data``'s values, each structured on its own where it can be, else left as it is."""
    if not isinstance(data, dict):
        return None
    snap_type = cls.snapshot_type
    attrs.resolve_types(snap_type)
    fields = {f.name: f for f in attrs.fields(snap_type)}
    body = {k: v for k, v in data.items() if k not in ("machine", "version")}
    if not body.keys() <= fields.keys():
        return None
    for key, value in body.items():
        with contextlib.suppress(Exception):  # left raw if it cannot be structured: reload must refuse it
            body[key] = converter.structure(value, fields[key].type)
    try:
        return snap_type(**body)
    except TypeError:  # a required field is missing
        return None


def check_restore(cls: Any, data: Any, elsewhere: Any) -> Any:
    """from_dict and reload of ``data``: the machine it describes exactly, or SnapshotError and nothing changed."""
    try:
        restored = cls.from_dict(data)
    except fsm.SnapshotError:
        restored = None
    if restored is not None:
        assert _same(restored.to_dict(), data), (restored.to_dict(), data)
    snapshot = _raw_snapshot(cls, data)
    if snapshot is None:
        assert restored is None
        return None
    fresh = check_object(cls, snapshot, elsewhere)
    if restored is not None:
        assert fresh is not None, "reload refused what from_dict took"
        assert (elsewhere.to_dict(), elsewhere.path) == (restored.to_dict(), restored.path)
    return restored or fresh


def check_object(cls: Any, snapshot: Any, elsewhere: Any) -> Any:
    """from_snapshot and reload agree on a snapshot object: both take it alike, or both refuse it, changing nothing."""
    if isinstance(snapshot.leaf, str) and snapshot.leaf in cls.states_map and cls._snapshot_plainly_fine(snapshot):
        assert cls._snapshot_problem(snapshot) is None, "the fast path took what the rule refuses"
    try:
        fresh = cls.from_snapshot(snapshot)
    except fsm.SnapshotError:
        fresh = None
    before, path = elsewhere.to_dict(), elsewhere.path
    try:
        elsewhere.reload(snapshot)
    except fsm.SnapshotError:
        assert fresh is None, "reload refused what from_snapshot took"
        assert (elsewhere.to_dict(), elsewhere.path) == (before, path), "a refused reload changed the machine"
        return None
    assert fresh is not None, "reload took what from_snapshot refused"
    assert (elsewhere.to_dict(), elsewhere.path) == (fresh.to_dict(), fresh.path)
    return fresh


def poke(machine: Any, events: list[Any]) -> None:
    """Events on a restored machine raise nothing but FsmError, and every state it reaches is a valid snapshot."""
    for event in events:
        with contextlib.suppress(fsm.FsmError):
            machine.apply(event)
        data = machine.to_dict()
        assert _same(type(machine).from_dict(data).to_dict(), data)


# Event specs are drawn as data and turned into events for whichever machine they land on.

RUNNER_SPECS = st.tuples(
    st.sampled_from(
        [
            *("connect", "connected", "load", "progress", "weights_loaded", "warm_up", "warmed"),
            *("request_started", "request_finished", "fail", "stop", "exited"),
        ]
    ),
    st.sampled_from([0, 0, 0, -1, 1]),  # incarnation offset
    st.integers(0, 8),
    st.booleans(),
)


def runner_event(m: rn.RunnerLifecycle, spec: tuple) -> rn.RunnerEvent:
    name, offset, n, flag = spec
    rid, inc = m.runner_id, m.incarnation + offset
    match name:
        case "progress":
            return rn.Progress(rid, inc, layers_loaded=n // 2, layers_total=max(n, 1))
        case "fail":
            return rn.Fail(rid, inc, failure=fsm.Failure.exception("E", "x", retryable=flag))
        case "exited":
            return rn.Exited(rid, inc, exit_code=n - 4, stop_delivered=flag)
    cls = {
        "connect": rn.Connect,
        "connected": rn.Connected,
        "load": rn.Load,
        "weights_loaded": rn.WeightsLoaded,
        "warm_up": rn.WarmUp,
        "warmed": rn.Warmed,
        "request_started": rn.RequestStarted,
        "request_finished": rn.RequestFinished,
        "stop": rn.Stop,
    }[name]
    return cls(rid, inc)


INSTANCE_SPECS = st.tuples(
    st.sampled_from(
        ["start", "rank_created", "rank_ready", "rank_failed", "rank_stopped", "resume", "tick", "delete", "give_up"]
    ),
    st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.0, 50.0, -1.0]),  # dt
    st.sampled_from([0, 0, 1, -1]),  # generation offset
    st.integers(0, 3),  # rank
    st.booleans(),  # retryable
)


def instance_event(m: it.InstanceRetry, spec: tuple) -> it.InstanceEvent:
    name, dt, offset, rank, flag = spec
    iid, now, gen = m.instance_id, (m.clock or 0.0) + dt, m.generation + offset
    match name:
        case "start":
            return it.Start(iid, now, m.generation + 1 + offset)
        case "rank_created":
            return it.RankCreated(iid, now, gen, rank)
        case "rank_ready":
            return it.RankReady(iid, now, gen, rank)
        case "rank_failed":
            return it.RankFailed(iid, now, gen, rank, failure=fsm.Failure.exception("E", "x", retryable=flag))
        case "rank_stopped":
            return it.RankStopped(iid, now, gen, rank)
    return {"resume": it.Resume, "tick": it.Tick, "delete": it.Delete, "give_up": it.GiveUp}[name](iid, now)


DOWNLOAD_SPECS = st.tuples(
    st.sampled_from(["begin", "progress", "complete", "fail", "retry", "load_started", "invalidate"]),
    st.sampled_from([0.0, 0.5, 1.0, 2.0, 20.0, -1.0]),
    st.integers(0, 20),
)


def download_event(m: dl.DownloadLifecycle, spec: tuple) -> dl.DownloadEvent:
    name, dt, n = spec
    mid, now = m.model_id, (m.clock or 0.0) + dt
    match name:
        case "progress":
            return dl.BytesProgress(mid, now, n // 2, n if n % 3 else None)
        case "fail":
            return dl.DownloadFailed(mid, now, "offline")
    cls = {
        "begin": dl.Begin,
        "complete": dl.Complete,
        "retry": dl.Retry,
        "load_started": dl.LoadStarted,
        "invalidate": dl.Invalidate,
    }[name]
    return cls(mid, now)


def drive(machine: Any, make: Callable[[Any, tuple], Any], specs: list[tuple]) -> list[dict[str, Any]]:
    """Apply the events; return the snapshot of every state passed through."""
    seen = [machine.to_dict()]
    for spec in specs:
        try:
            machine.apply(make(machine, spec))
        except fsm.FsmError:
            continue
        seen.append(machine.to_dict())
    return seen


def events_for(machine: Any, make: Callable[[Any, tuple], Any], specs: list[tuple]) -> list[Any]:
    out = []
    for spec in specs:
        with contextlib.suppress(fsm.FsmError):  # an event no one could send (e.g. a negative incarnation)
            out.append(make(machine, spec))
    return out


MUTATION_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@MUTATION_SETTINGS
@given(
    world_size=st.integers(1, 3),
    specs=st.lists(RUNNER_SPECS, max_size=14),
    after=st.lists(RUNNER_SPECS, max_size=6),
    data=st.data(),
)
def test_mutated_runner_snapshots_restore_exactly_or_are_refused(world_size, specs, after, data):
    machine = rn.RunnerLifecycle("r", rank=world_size - 1, world_size=world_size, incarnation=1)
    seen = drive(machine, runner_event, specs)
    mutant = data.draw(mutated(data.draw(st.sampled_from(seen))))
    restored = check_restore(rn.RunnerLifecycle, mutant, runner_in("stopped"))
    if restored is not None:
        poke(restored, events_for(restored, runner_event, after))


@MUTATION_SETTINGS
@given(
    world_size=st.integers(1, 3),
    seed=st.integers(0, 3),
    specs=st.lists(INSTANCE_SPECS, max_size=20),
    after=st.lists(INSTANCE_SPECS, max_size=8),
    data=st.data(),
)
def test_mutated_instance_snapshots_restore_exactly_or_are_refused(world_size, seed, specs, after, data):
    policy = fsm.RetryPolicy(backoff=fsm.Backoff(1.0, 2.0, 8.0, jitter=bool(seed % 2)), max_failures=3, reset_after=5)
    machine = it.InstanceRetry("i", world_size=world_size, policy=policy, seed=seed)
    seen = drive(machine, instance_event, specs)
    mutant = data.draw(mutated(data.draw(st.sampled_from(seen))))
    restored = check_restore(it.InstanceRetry, mutant, instance_in("backing_off"))
    if restored is not None:
        poke(restored, events_for(restored, instance_event, after))


@MUTATION_SETTINGS
@given(specs=st.lists(DOWNLOAD_SPECS, max_size=14), after=st.lists(DOWNLOAD_SPECS, max_size=6), data=st.data())
def test_mutated_download_snapshots_restore_exactly_or_are_refused(specs, after, data):
    machine = dl.DownloadLifecycle(MODEL)
    seen = drive(machine, download_event, specs)
    mutant = data.draw(mutated(data.draw(st.sampled_from(seen))))
    restored = check_restore(dl.DownloadLifecycle, mutant, download_in("completed"))
    if restored is not None:
        poke(restored, events_for(restored, download_event, after))


LEAVES = {
    "runner": ["idle", "available", "busy", "failed", "stopped"],
    "instance": ["pending", "starting", "ready", "recovering", "backing_off", "deleted"],
    "download": ["pending", "ongoing", "failed", "completed"],
}
SPECS = {"runner": RUNNER_SPECS, "instance": INSTANCE_SPECS, "download": DOWNLOAD_SPECS}
MAKE = {"runner": runner_event, "instance": instance_event, "download": download_event}
ODD_OBJECTS: list[Any] = [
    *ODD,
    (),
    (0,),
    (1,),
    (0, 1),
    (1, 0),
    (0, 0),
    (-1,),
    (True,),
    (0.0,),
    fsm.Failure.signalled(9),
    fsm.Failure.exception("E", "x", retryable=False),
    POLICY,
    fsm.Backoff(),
    fsm.Backoff(jitter=True),
    fsm.DeleteReason.REQUESTED,
    fsm.DeleteReason.NON_RETRYABLE,
    2.0,
    1e300,
]


@MUTATION_SETTINGS
@given(kind=st.sampled_from(sorted(LEAVES)), data=st.data())
def test_snapshot_objects_with_odd_fields_are_taken_or_refused_alike_by_from_snapshot_and_reload(kind, data):
    cls = CLASSES[kind]
    base = MACHINES[kind](data.draw(st.sampled_from(LEAVES[kind]))).snapshot()
    changes = {
        field.name: data.draw(st.sampled_from(ODD_OBJECTS))
        for field in attrs.fields(cls.snapshot_type)
        if data.draw(st.integers(0, 3)) == 0
    }
    snapshot = attrs.evolve(base, **changes)
    restored = check_object(cls, snapshot, MACHINES[kind](ELSEWHERE[kind]))
    if restored is not None:
        poke(restored, events_for(restored, MAKE[kind], data.draw(st.lists(SPECS[kind], max_size=6))))


# The cluster: a World driven at random, then mutated.

WORLD_OPS = st.one_of(
    st.tuples(st.just("plan"), st.integers(0, 2)),
    st.tuples(st.just("deliver"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("fail"), st.integers(0, 2), st.sampled_from(["kill", "exception", "fatal"])),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 2.0, 9.0, 50.0])),
    st.tuples(st.just("delete"), st.sampled_from(["i", "j"])),
)


def world_op(world: World, op: tuple) -> None:
    cluster, kind = world.cluster, op[0]
    if kind == "plan":
        world.step(world.nodes[op[1] % len(world.nodes)])
    elif kind == "deliver" and world.pending:
        world.deliver(op[1] % len(world.pending), ok=op[2])
    elif kind == "fail":
        entry = sorted(cluster.runners.items())[op[1] % len(cluster.runners)][1] if cluster.runners else None
        if entry is None or not entry.machine.alive:
            return
        m = entry.machine
        if op[2] == "kill":
            cluster.runner_event(rn.Exited(m.runner_id, m.incarnation, exit_code=-9), world.now)
        elif m.runner_state is not fsm.RunnerState.FAILED:
            failure = fsm.Failure.exception("E", "boom", retryable=op[2] == "exception")
            cluster.runner_event(rn.Fail(m.runner_id, m.incarnation, failure=failure), world.now)
    elif kind == "advance":
        world.advance(world.now + op[1])
    elif kind == "delete" and op[1] in cluster.instances:
        cluster.delete(op[1], world.now)


def random_world(ranks: int, two: bool, ops: list[tuple]) -> tuple[World, list[dict[str, Any]]]:
    nodes = ["n0", "n1", "n2"][:ranks]
    cluster = Cluster()
    cluster.place("i", MODEL, [fsm.Slot(r, nodes[r], f"i/{r}") for r in range(ranks)], policy=POLICY)
    if two:
        cluster.place("j", "org/other", [fsm.Slot(0, nodes[-1], "j/0")])
    world = World(cluster, nodes)
    seen = [cluster.to_dict()]
    for op in ops:
        world_op(world, op)
        seen.append(cluster.to_dict())
    return world, seen


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ranks=st.integers(1, 3),
    two=st.booleans(),
    ops=st.lists(WORLD_OPS, max_size=25),
    after=st.lists(WORLD_OPS, max_size=10),
    data=st.data(),
)
def test_mutated_cluster_snapshots_restore_exactly_or_are_refused(ranks, two, ops, after, data):
    world, seen = random_world(ranks, two, ops)
    mutant = data.draw(mutated(data.draw(st.sampled_from(seen))))
    try:
        restored = Cluster.from_dict(mutant)
    except fsm.SnapshotError:
        return
    expected = {k: v for k, v in mutant.items() if k != "requests"}  # old snapshots' requests are ignored
    expected.setdefault("clock", {"kind": "wall"})  # a snapshot that names no clock was written on wall time
    assert _same(restored.to_dict(), expected)
    probe = World(restored, world.nodes, world.now)
    for op in after:
        with contextlib.suppress(fsm.FsmError):
            world_op(probe, op)
        data_now = restored.to_dict()
        assert _same(Cluster.from_dict(data_now).to_dict(), data_now)
