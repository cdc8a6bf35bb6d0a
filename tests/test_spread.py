"""When a node comes back, new generations spread again (issue #46, item 5): `fsm.place_again`, pure, and a
real cluster whose node returns and gets a rank of the instance's next generation."""

from __future__ import annotations

import os
import shutil
import signal
import time

import httpx
import pytest
from reliability_report import cluster_fault
from test_admit import GIB, LIMITS, QWEN, placed
from test_cluster_nodes import TTL, instance_at, nodes, start, stop_all, until
from test_cluster_nodes import hf_home as hf_home  # a fixture: the tiny model, 2 layers

import fsm
from daemon_harness import runner_pid
from exod.cluster.devcluster import cluster_token_file
from fsm.view import ClusterView, InstanceView, RetryStatus, RunnerStatus, Slot

PENDING = fsm.InstanceState.PENDING

THREE = {"n1": 4 * GIB, "n2": 4 * GIB, "n3": 4 * GIB}


def again(view: ClusterView, nodes: dict[str, int], **kwargs) -> tuple[str, ...] | None:
    return fsm.place_again("a", model=QWEN, view=view, nodes=nodes, limits=LIMITS, **kwargs)


def test_ranks_packed_on_the_survivors_spread_again_once_a_node_is_back():
    packed = placed(("a", "org/qwen", ["n1", "n1"]))  # n2 died, its rank moved to n1
    assert again(packed, {"n1": 4 * GIB}) is None  # n2 still gone: nowhere to spread
    assert sorted(again(packed, {"n1": 4 * GIB, "n2": 4 * GIB})) == ["n1", "n2"]  # n2 is back: one rank each
    three = placed(("a", "org/qwen", ["n1", "n1", "n2"]))
    assert sorted(again(three, THREE)) == ["n1", "n2", "n3"]


def test_a_spread_instance_stays_where_it_is():
    assert again(placed(("a", "org/qwen", ["n1", "n2"])), THREE) is None  # not reshuffled onto n3
    assert again(placed(("a", "org/qwen", ["n1", "n2", "n3", "n1"])), THREE) is None  # 4 ranks, 3 nodes: spread


def test_ranks_spread_only_where_there_is_room_and_never_while_a_runner_lives():
    packed = placed(("a", "org/qwen", ["n1", "n1"]), ("b", "org/qwen", ["n2", "n2"]))
    full = {"n1": 4 * GIB, "n2": 2 * GIB}  # b's two ranks take all of n2's memory
    assert again(packed, full, facts={"org/qwen": QWEN}) is None
    assert sorted(again(packed, {"n1": 4 * GIB, "n2": 3 * GIB}, facts={"org/qwen": QWEN})) == ["n1", "n2"]
    alive = RunnerStatus("a/0", "a", "n1", 0, 1, fsm.RunnerState.READY, fsm.RunnerPhase.AVAILABLE)
    instances = list(placed(("a", "org/qwen", ["n1", "n1"])).instances.values())
    running = ClusterView.build(instances=instances, runners=[alive])
    assert again(running, {"n1": 4 * GIB, "n2": 4 * GIB}) is None  # only between generations


def test_a_placement_packed_by_choice_starts_where_it_was_placed():
    """Three ranks pinned to one node (`--nodes`) start there: only a later generation may spread."""
    pinned = InstanceView("a", "org/qwen", [Slot(r, "n1", f"a/{r}") for r in range(3)], RetryStatus(PENDING))
    assert again(ClusterView.build(instances=[pinned]), THREE) is None


def test_a_node_gone_still_moves_its_ranks_to_the_live_ones():
    assert again(placed(("a", "org/qwen", ["n1", "n2"])), {"n1": 4 * GIB, "n3": 4 * GIB}) == ("n1", "n3")


@pytest.mark.usefixtures("no_runner_left_behind")
def test_a_node_that_comes_back_gets_a_rank_of_the_next_generation(tmp_path, etcd, hf_home):
    """Two nodes, an instance of two ranks. node-2 is SIGKILLed: the next generation runs both ranks on node-1.
    node-2 starts again (same id, same address); then a rank on node-1 dies: the generation after that puts
    a rank on node-2 again, rather than staying packed on the survivor."""
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = [start(tmp_path, etcd, n, env) for n in (1, 2)]
    try:
        view = until(lambda: nodes(daemons[0][1]), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        controller = int(view["controller"].removeprefix("node-"))
        url, victim = daemons[controller - 1][1], 3 - controller
        answer = httpx.post(f"{url}/instances", json={"model": "exod/tiny-qwen2", "ranks": 2}, timeout=30)
        assert answer.status_code == 201, answer.text
        iid = answer.json()["instance_id"]
        first = until(lambda: instance_at(url, iid), lambda i: i["state"] == "ready", 60)
        daemons[victim - 1][0].send_signal(signal.SIGKILL)
        daemons[victim - 1][0].wait()
        packed = until(
            lambda: instance_at(url, iid),
            lambda i: i["state"] == "ready" and i["generation"] > first["generation"],
            12 * TTL,
        )
        back = tmp_path / "back"  # the node's daemon started again: same id, same address, same cluster token
        back.mkdir()
        shutil.copy(cluster_token_file(tmp_path), cluster_token_file(back))
        daemons.append(start(back, etcd, victim, env))
        until(lambda: nodes(url), lambda v: len(v["nodes"]) == 2, 6 * TTL)
        returned_at = time.monotonic()
        os.kill(runner_pid(1), signal.SIGKILL)  # a failure of the instance's own: its next generation is placed again
        spread = until(
            lambda: instance_at(url, iid),
            lambda i: i["state"] == "ready" and i["generation"] > packed["generation"],
            12 * TTL,
        )
        took = time.monotonic() - returned_at
    finally:
        stop_all(daemons)
    assert sorted(r["node"] for r in first["runners"]) == ["node-1", "node-2"]
    assert [r["node"] for r in packed["runners"]] == [f"node-{controller}"] * 2  # packed on the survivor
    assert sorted(r["node"] for r in spread["runners"]) == ["node-1", "node-2"]  # spread again
    cluster_fault(
        "node back",
        f"generation {packed['generation']} packed on node-{controller} while node-{victim} was gone; node-{victim} "
        f"back, the next failure's generation {spread['generation']} Ready on node-1 and node-2 "
        f"({took:.1f} s after its return)",
    )
