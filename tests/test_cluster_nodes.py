"""Three real `exod serve --cluster` daemons on one etcd, advertising 127.0.0.1, .2 and .3: they list each
other from every node, exactly one is the controller, and when its daemon is SIGKILLed another one is
elected once its lease has expired."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from etcd_harness import run_with_client
from reliability_report import cluster_fault
from test_degraded import fill
from test_degraded import small_disk as small_disk  # a fixture: a 4 MiB tmpfs

from daemon_harness import Background, exod, runner_pid, runner_pids
from exod.cluster.devcluster import LocalEtcd, cluster_token_file
from exod.cluster.etcd_state import EtcdState
from exod.cluster.membership import DEFAULT_PREFIX
from exod.cluster.nodes import FENCE_MARGIN, NodeRecord, node_key
from exod.host.tiny_model import make_tiny_model
from exod.status import status_of
from fsm.cluster import Cluster, LogEntry

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")

TTL = 5
PARTITION_TTL = 10  # the default; the partitions' tests watch a whole lease lifetime go by
CONFIG = """
[daemon]
port = 0
offline = true

[cluster]
url = "{etcd}"
node_id = "{node}"
advertise = "{address}"
lease_ttl = {ttl}
token_file = "{token}"
"""


def start(
    tmp_path: Path,
    etcd: str,
    n: int,
    env: dict[str, str] | None = None,
    ttl: int = TTL,
    *,
    address: str | None = None,
    wrap: Callable[[list[str]], list[str]] = list,
    state: Path | None = None,
    extra_cluster: str = "",
) -> tuple[subprocess.Popen[bytes], str]:
    """Node ``node-n``'s daemon, advertising 127.0.0.n (or ``address``), its command line run by ``wrap``
    (inside a network namespace, say), its state in ``state`` (default: under its home); its process and API
    URL once it serves."""
    home = tmp_path / f"node-{n}"
    home.mkdir()
    address = address or f"127.0.0.{n}"
    token = cluster_token_file(tmp_path)  # every node of the test's cluster holds it
    config = CONFIG.format(etcd=etcd, node=f"node-{n}", address=address, ttl=ttl, token=token) + extra_cluster
    (home / "exod.toml").write_text(config)
    state = state or home / "state"
    args = ["serve", "--config", str(home / "exod.toml"), "--state-dir", str(state), "--host", address]
    log = (home / "serve.log").open("wb")
    argv = wrap([sys.executable, "-m", "exod", *args])
    daemon = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while not (state / "daemon.json").exists():
        assert daemon.poll() is None, (home / "serve.log").read_text()
        assert time.monotonic() < deadline, (home / "serve.log").read_text()
        time.sleep(0.05)
    return daemon, json.loads((state / "daemon.json").read_text())["url"]


def stop_all(daemons: list[tuple[subprocess.Popen[bytes], str]]) -> list[int]:
    """SIGTERM every daemon still running and wait for it (killed after 30 s); their exit codes."""
    for daemon, _ in daemons:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
    codes = []
    for daemon, _ in daemons:
        try:
            codes.append(daemon.wait(timeout=30))
        except subprocess.TimeoutExpired:
            daemon.kill()
            codes.append(daemon.wait())
    return codes


def nodes(url: str, headers: dict[str, str] | None = None) -> dict:
    answer = httpx.get(f"{url}/nodes", headers=headers, timeout=10)
    assert answer.headers.get("content-type", "").startswith("application/json"), (answer.status_code, answer.text)
    return answer.json()


def until(read, done, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value):
            return value
        assert time.monotonic() < deadline, f"timed out; last: {value}"
        time.sleep(0.1)


def test_three_nodes_list_each_other_elect_one_controller_and_another_when_it_dies(tmp_path, etcd):
    daemons = [start(tmp_path, etcd, n) for n in (1, 2, 3)]
    try:
        views = [
            until(lambda u=url: nodes(u), lambda v: len(v["nodes"]) == 3 and v["controller"], 30) for _, url in daemons
        ]
        controller = views[0]["controller"]
        for view in views:
            assert [n["node_id"] for n in view["nodes"]] == ["node-1", "node-2", "node-3"]
            assert [n["address"] for n in view["nodes"]] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
            assert view["controller"] == controller  # one controller, as every node sees it
            assert [n["node_id"] for n in view["nodes"] if n["controller"]] == [controller]
            assert 0 < view["fence_in"] <= TTL * (1 - FENCE_MARGIN)  # its runners' deadline: its lease, less the margin
        assert {n["api_url"] for n in views[0]["nodes"]} == {url for _, url in daemons}

        status = exod("status", "--url", daemons[1][1], env=dict(os.environ)).stdout
        assert "3 node(s), this one node-2" in status and f"node {controller}" in status
        assert "this node's runners end in " in status

        victim = int(controller.removeprefix("node-")) - 1
        daemons[victim][0].send_signal(signal.SIGKILL)  # no goodbye: its lease must run out
        daemons[victim][0].wait()
        killed_at = time.monotonic()
        survivor = daemons[(victim + 1) % 3][1]
        after = until(lambda: nodes(survivor), lambda v: v["controller"] not in (None, controller), 6 * TTL)
        took = time.monotonic() - killed_at
        assert len(after["nodes"]) == 2 and controller not in [n["node_id"] for n in after["nodes"]]
        assert took >= TTL - 2  # not before the dead controller's lease expired
    finally:
        codes = stop_all(daemons)
    assert set(codes) <= {0, -signal.SIGKILL}
    assert runner_pids() == []


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf")
    make_tiny_model("exod/tiny-qwen2", layers=2, hf_home=home)
    return home


def instance_at(url: str, iid: str, headers: dict[str, str] | None = None) -> dict:
    return httpx.get(f"{url}/instances/{iid}", headers=headers, timeout=10).json()


def stored(etcd: str) -> tuple[dict, list]:
    """The cluster's state and transition log as etcd holds them."""

    async def read(client):
        state = EtcdState(client, DEFAULT_PREFIX.encode(), None)
        return await state.load(), await state.transitions()

    return run_with_client(etcd, read)


def follow(url: str, count: int) -> list[dict]:
    """The first ``count`` transitions of ``url``'s ``/events``."""
    found: list[dict] = []
    with httpx.stream("GET", f"{url}/events", timeout=30) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                found.append(json.loads(line.removeprefix("data: ")))
                if len(found) == count:
                    return found
    raise AssertionError(f"the stream ended after {found}")


def sse(url: str, body: dict) -> list:
    """The data of each server-sent event of a streamed chat: parsed JSON, or the final ``[DONE]``."""
    events: list = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def chunk_text(chunk: dict) -> str:
    return "".join(choice["delta"].get("content") or "" for choice in chunk.get("choices", []))


KEPT = ("instance_id", "model_id", "ranks", "attempts", "uncharged", "max_retries", "delete_reason")


def test_a_new_controller_resumes_from_the_state_the_dead_one_wrote(tmp_path, etcd, hf_home):
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = [start(tmp_path, etcd, n, env) for n in (1, 2)]
    try:
        first = until(lambda: nodes(daemons[0][1]), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        for node in first["nodes"]:  # what placement over nodes will read: memory and cached models
            assert node["models"] == ["exod/tiny-qwen2"] and 0 < node["memory_free"] <= node["memory_total"]
        a = int(first["controller"].removeprefix("node-")) - 1
        (killed, url_a), (_, url_b) = daemons[a], daemons[1 - a]

        # placed through the node that is not the controller: forwarded to the one that is
        placed = httpx.post(f"{url_b}/instances", json={"model": "exod/tiny-qwen2", "ranks": 1}, timeout=30)
        assert placed.status_code == 201, placed.text
        iid = placed.json()["instance_id"]
        until(lambda: instance_at(url_a, iid), lambda i: i["state"] == "ready", 60)
        seen_by_b = until(lambda: instance_at(url_b, iid), lambda i: i["state"] == "ready", 10)  # etcd's copy
        snapshot, log = stored(etcd)
        followed = follow(url_b, len(log))  # the other node streams the controller's log from etcd

        killed.send_signal(signal.SIGKILL)  # its runner follows it (the runner's hang-up watchdog)
        killed.wait()
        orphaned_doc = httpx.get(f"{url_b}/instances", timeout=10).json()  # its key outlives it by up to a lease
        until(lambda: nodes(url_b), lambda v: v["controller"] == f"node-{2 - a}", 6 * TTL)
        resumed = until(lambda: instance_at(url_b, iid), lambda i: i["state"] == "ready", 60)
        snapshot_after, log_after = stored(etcd)
    finally:
        stop_all(daemons)

    written = next(i for i in status_of(Cluster.from_dict(snapshot))["instances"] if i["instance_id"] == iid)
    orphaned = next(i for i in orphaned_doc["instances"] if i["instance_id"] == iid)
    assert (orphaned["state"], orphaned["last_known_state"]) == ("unknown", "ready")  # not Ready: nobody vouches
    assert {r["state"] for r in orphaned["runners"]} == {"unknown"} and "does not answer" in orphaned_doc["as_of"]
    assert {k: seen_by_b[k] for k in KEPT} == {k: written[k] for k in KEPT}  # a follower shows what etcd holds
    assert {k: resumed[k] for k in KEPT} == {k: written[k] for k in KEPT}  # and the new controller read it
    assert resumed["generation"] == written["generation"] + 1  # resumed in a new generation, no retry charged
    assert [(doc["seq"], LogEntry.from_record(doc)) for doc in followed] == log
    assert log_after[: len(log)] == log  # the log goes on after what was written …
    assert [seq for seq, _ in log_after] == list(range(1, len(log_after) + 1))  # … in one order, no gap
    resumes = [e for _, e in log_after[len(log) :] if e.key == iid and e.machine == "instance"]
    assert resumes and resumes[0].event == "resume"
    cluster_fault(
        "controller death",
        f"another node elected; {iid} resumed in generation {resumed['generation']} with {resumed['attempts']} "
        f"retries charged; the log went on from seq {len(log) + 1} without a gap, and replays",
    )
    assert snapshot_after != snapshot
    assert runner_pids() == []
    replayed = exod("replay", "--cluster", etcd, env=dict(os.environ), check=False)
    assert replayed.returncode == 0 and "log entries: conform" in replayed.stdout, replayed.stdout


def test_serve_without_its_etcd_says_so_and_exits(tmp_path):
    home = tmp_path / "node-1"
    home.mkdir()
    (home / "exod.toml").write_text(
        CONFIG.format(
            etcd="http://127.0.0.1:9", node="node-1", address="127.0.0.1", ttl=TTL, token=cluster_token_file(tmp_path)
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "exod", "serve", "--config", str(home / "exod.toml"), "--state-dir", str(home / "s")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "cannot join the cluster" in done.stderr and "Traceback" not in done.stderr


def test_replay_of_a_cluster_whose_etcd_is_not_there_says_so():
    done = exod("replay", "--cluster", "http://127.0.0.1:9", env=dict(os.environ), check=False)
    assert done.returncode == 1 and "Is etcd running at http://127.0.0.1:9?" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_node_that_loses_etcd_is_degraded_and_joins_again_when_it_returns(tmp_path, etcd_server):
    daemon, url = start(tmp_path, etcd_server.url, 1)
    try:
        until(lambda: nodes(url), lambda v: v["controller"] == "node-1", 30)
        etcd_server.stop()
        health = until(lambda: httpx.get(f"{url}/health", timeout=10).json(), lambda h: h["status"] != "ok", 3 * TTL)
        assert health["status"] == "degraded" and "etcd cannot be reached" in health["reason"]
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 503
        refused = httpx.post(f"{url}/instances", json={"model": "exod/tiny-qwen2", "ranks": 1}, timeout=10)
        assert refused.status_code == 503 and "degraded" in refused.json()["error"]["message"]
        assert httpx.get(f"{url}/nodes", timeout=10).status_code == 503
        etcd_server.start()  # the same member, its data kept: the node's lease may have expired meanwhile
        until(lambda: httpx.get(f"{url}/health", timeout=10).json(), lambda h: h["status"] == "ok", 6 * TTL)
        back = until(lambda: nodes(url), lambda v: v["controller"] == "node-1" and len(v["nodes"]) == 1, 6 * TTL)
        assert back["nodes"][0]["node_id"] == "node-1"
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0


def test_through_a_short_etcd_outage_the_controller_keeps_serving_its_instances(tmp_path, etcd_server, hf_home):
    """Shorter than the lease: the term holds (no other node can be elected), the runners serve, the
    state written meanwhile waits in memory, and no generation is lost to it."""
    ttl = 10  # the window: an outage shorter than the lease, with room for two busy cores
    daemon, url = start(tmp_path, etcd_server.url, 1, {**os.environ, "HF_HOME": str(hf_home)}, ttl=ttl)
    try:
        until(lambda: nodes(url), lambda v: v["controller"] == "node-1", 30)
        placed = httpx.post(f"{url}/instances", json={"model": "exod/tiny-qwen2", "ranks": 1}, timeout=30).json()
        iid = placed["instance_id"]
        before = until(lambda: instance_at(url, iid), lambda i: i["state"] == "ready", 60)
        etcd_server.stop()
        health = until(lambda: httpx.get(f"{url}/health", timeout=10).json(), lambda h: h["status"] != "ok", ttl)
        chat = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        served = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30)
        during = instance_at(url, iid)
        etcd_server.start()
        until(lambda: httpx.get(f"{url}/health", timeout=10).json(), lambda h: h["status"] == "ok", 3 * ttl)
        after = instance_at(url, iid)
        view = nodes(url)
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
    # it noticed the outage (whichever noticed first: the lease's keep-alive or a write of the state) …
    assert "etcd" in health["reason"] and etcd_server.url.rstrip("/") in health["reason"]
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] >= 1  # … and served
    assert during["state"] == after["state"] == "ready"
    assert during["generation"] == after["generation"] == before["generation"]
    assert view["controller"] == "node-1"
    cluster_fault(
        "etcd outage shorter than the lease",
        f"/health degraded, chat 200 during it, generation {after['generation']} throughout (lease TTL {ttl} s)",
    )


def test_through_a_short_etcd_outage_a_follower_forwards_to_the_controller_it_last_saw(tmp_path, etcd_server, hf_home):
    """Issue #25: every chat sent to a follower was 503 while etcd was away for 3 s (it looks the controller up
    in etcd for each request). It forwards to the controller it last saw, for as long as that one's term can
    be alive (its lease's TTL since), as the controller itself keeps serving meanwhile."""
    ttl = 10
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = [start(tmp_path, etcd_server.url, n, env, ttl=ttl) for n in (1, 2)]
    try:
        view = until(lambda: nodes(daemons[0][1]), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        follower = next(n["api_url"] for n in view["nodes"] if not n["controller"])
        placed = httpx.post(f"{follower}/instances", json={"model": "exod/tiny-qwen2", "ranks": 1}, timeout=30)
        until(lambda: instance_at(follower, placed.json()["instance_id"]), lambda i: i["state"] == "ready", 60)
        chat = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        httpx.post(f"{follower}/v1/chat/completions", json=chat, timeout=30)  # the follower has seen its controller
        etcd_server.stop()
        stopped_at = time.monotonic()
        during = httpx.post(f"{follower}/v1/chat/completions", json=chat, timeout=30)
        answered_within = time.monotonic() - stopped_at
        etcd_server.start()
    finally:
        stop_all(daemons)
    assert during.status_code == 200, during.text
    assert answered_within < ttl  # within the window the controller's term can be alive


def test_a_controller_cut_off_from_etcd_past_its_lease_stops_its_runners_then_resumes(tmp_path, etcd_server, hf_home):
    """Fencing: past its lease (less a margin) another node may be elected, so its runners must be gone;
    back in touch, it is elected again and resumes the instance from etcd in a new generation."""
    daemon, url = start(tmp_path, etcd_server.url, 1, {**os.environ, "HF_HOME": str(hf_home)})
    try:
        until(lambda: nodes(url), lambda v: v["controller"] == "node-1", 30)
        placed = httpx.post(f"{url}/instances", json={"model": "exod/tiny-qwen2", "ranks": 1}, timeout=30).json()
        iid = placed["instance_id"]
        before = until(lambda: instance_at(url, iid), lambda i: i["state"] == "ready", 60)
        assert len(runner_pids()) == 1
        etcd_server.stop()
        stopped_at = time.monotonic()
        until(runner_pids, lambda pids: pids == [], 3 * TTL)
        fenced_after = time.monotonic() - stopped_at
        etcd_server.start()
        until(lambda: nodes(url), lambda v: v["controller"] == "node-1", 6 * TTL)
        after = until(lambda: instance_at(url, iid), lambda i: i["state"] == "ready", 60)
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
    # the step-down comes TTL less the margin after the last renewal at the latest; the runner's stop then
    # takes a moment (a partition, unlike a stopped etcd, would let the lease expire at TTL)
    assert fenced_after < TTL + 2.0
    assert after["generation"] == before["generation"] + 1 and after["attempts"] == before["attempts"]


def test_a_controller_whose_election_key_is_taken_stops_and_writes_nothing_more(tmp_path, etcd, hf_home):
    """Another term began (here forced by hand): the old controller's runners stop, it refuses what only the
    controller does, naming the new one, and etcd holds no write of its after the new term began."""
    daemon, url = start(tmp_path, etcd, 1, {**os.environ, "HF_HOME": str(hf_home)})
    key = DEFAULT_PREFIX.encode() + b"controller"

    async def take_the_key(client):
        lease = await client.grant(60)
        return lease, await client.put(key, b"intruder", lease=lease)  # what node-1's writes compare changes

    async def snapshot_revision(client):
        return (await client.get(DEFAULT_PREFIX.encode() + b"state/snapshot")).mod_revision

    try:
        until(lambda: nodes(url), lambda v: v["controller"] == "node-1", 30)
        placed = httpx.post(f"{url}/instances", json={"model": "exod/tiny-qwen2", "ranks": 1}, timeout=30).json()
        until(lambda: instance_at(url, placed["instance_id"]), lambda i: i["state"] == "ready", 60)
        lease, taken_at = run_with_client(etcd, take_the_key)
        until(runner_pids, lambda pids: pids == [], 3 * TTL)
        refused = httpx.post(f"{url}/instances", json={"model": "exod/tiny-qwen2", "ranks": 1}, timeout=10)
        written_at = run_with_client(etcd, snapshot_revision)
        run_with_client(etcd, lambda client: client.revoke(lease))  # the intruder goes: node-1 is elected again
        until(lambda: nodes(url), lambda v: v["controller"] == "node-1", 6 * TTL)
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
    error = refused.json()["error"]  # forwarded to a controller that publishes no API: a clear refusal
    assert (
        refused.status_code == 503 and error["code"] == "controller_unavailable" and "node intruder" in error["message"]
    )
    assert written_at < taken_at
    cluster_fault(
        "election key taken",
        "its runner stopped, placements answered 503 naming the new holder, no write of its after the new term",
    )


@pytest.fixture(scope="module")
def hf_home_8_layers(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf8")
    make_tiny_model("exod/tiny-qwen2", layers=8, hf_home=home)
    return home


def test_three_ranks_on_three_nodes_answer_as_the_model_does_on_one(tmp_path, etcd, hf_home_8_layers):
    """One MLX ring across 127.0.0.1, .2 and .3, pipeline-parallel: greedy answers are mlx-lm's own."""
    from test_daemon import MAX_TOKENS, MESSAGES, reference_text

    from exod.host.models import resolve_model

    env = {**os.environ, "HF_HOME": str(hf_home_8_layers)}
    daemons = [start(tmp_path, etcd, n, env) for n in (1, 2, 3)]
    try:
        view = until(lambda: nodes(daemons[0][1]), lambda v: len(v["nodes"]) == 3 and v["controller"], 30)
        url = next(n["api_url"] for n in view["nodes"] if n["controller"])
        placed = httpx.post(f"{url}/instances", json={"model": "exod/tiny-qwen2", "ranks": 3}, timeout=30)
        assert placed.status_code == 201, placed.text
        iid = placed.json()["instance_id"]
        ready = until(lambda: instance_at(url, iid), lambda i: i["state"] in ("ready", "deleted"), 120)
        body = {"model": "exod/tiny-qwen2", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        follower = next(n["api_url"] for n in view["nodes"] if not n["controller"])
        forwarded = httpx.post(f"{follower}/v1/chat/completions", json=body, timeout=60)
        streamed = sse(follower, {**body, "stream": True})
        models = httpx.get(f"{follower}/v1/models", timeout=10).json()
        status = exod("status", "--url", daemons[2][1], env=dict(os.environ)).stdout
    finally:
        stop_all(daemons)
    assert ready["state"] == "ready", ready
    assert sorted(r["node"] for r in ready["runners"]) == ["node-1", "node-2", "node-3"]  # one rank each
    assert answer.status_code == 200, answer.text
    snapshot = resolve_model("exod/tiny-qwen2", hf_home=hf_home_8_layers, offline=True)
    text = reference_text(snapshot)
    assert answer.json()["choices"][0]["message"]["content"] == text
    assert forwarded.status_code == 200 and forwarded.json()["choices"][0]["message"]["content"] == text
    assert streamed[-1] == "[DONE]" and "".join(chunk_text(c) for c in streamed[:-1]) == text
    assert [m["id"] for m in models["data"]] == ["exod/tiny-qwen2"]
    assert all(f"on node-{n}" in status for n in (1, 2, 3))  # from a node that is not the controller


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_a_forward_whose_controller_dies_mid_stream_ends_with_an_error_event(tmp_path, etcd, hf_home, dialect):
    """OpenAI's clients get an error event then ``data: [DONE]``; Anthropic's an ``error`` event of its shape."""
    env = {**os.environ, "HF_HOME": str(hf_home)}
    # the runner hangs after its first token: the answer is surely mid-stream when its controller dies, however
    # late this busy machine gets to the kill (a tiny model's whole answer can be sent before it otherwise)
    hang = '\n[[fault]]\nphase = "busy"\nkind = "hang"\n'
    daemons = [start(tmp_path, etcd, n, env, extra_cluster=hang) for n in (1, 2)]
    try:
        view = until(lambda: nodes(daemons[0][1]), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        controller = int(view["controller"].removeprefix("node-")) - 1
        (victim, url), (_, follower) = daemons[controller], daemons[1 - controller]
        placed = httpx.post(f"{follower}/instances", json={"model": "exod/tiny-qwen2", "ranks": 1}, timeout=30)
        iid = placed.json()["instance_id"]
        until(lambda: instance_at(url, iid), lambda i: i["state"] == "ready", 60)
        assert nodes(follower)["controller"] == view["controller"]  # still the one to kill (a busy machine's lease)
        body = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        path = "/v1/chat/completions" if dialect == "openai" else "/v1/messages"
        events: list = []
        killed = False
        with httpx.stream("POST", f"{follower}{path}", json={**body, "max_tokens": 4096}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
                # its first event, or a keep-alive (a first token that is a lone byte of a character is held)
                if not killed and (line.startswith("data: ") or line.startswith(":")):
                    victim.send_signal(signal.SIGKILL)  # the controller, mid-stream
                    killed = True
    finally:
        stop_all(daemons)
    if dialect == "openai":
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2].get("error") or {}
        assert error.get("code") == "controller_lost" and "node-" in error.get("message", ""), events[-3:]
    else:
        assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error", events[-3:]
        assert "went away mid-stream" in events[-1]["error"]["message"], events[-3:]


def test_make_cluster_starts_everything_and_ctrl_c_leaves_nothing_behind(tmp_path):
    """`make cluster` runs `exod cluster-demo`: ready with a rank on each node; Ctrl-C stops every node,
    their runners and etcd, even where it was started with SIGINT ignored (a background job, a CI runner)."""
    log = (tmp_path / "demo.log").open("w+")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job starts it: SIGINT ignored (POSIX)
    try:
        demo = subprocess.Popen(
            [sys.executable, "-m", "exod", "cluster-demo"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        until(
            lambda: (tmp_path / "demo.log").read_text(), lambda text: "ready:" in text or demo.poll() is not None, 240
        )
        out = (tmp_path / "demo.log").read_text()
        assert "ready: Ctrl-C" in out, out
        assert "rank 0 on node-" in out and {f"on node-{n}" in out for n in (1, 2, 3)} == {True}
        url = out.split("node-2: ", 1)[1].split()[0]
        body = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        children = _children(demo.pid)
        assert len(children) >= 4  # etcd and three nodes
        demo.send_signal(signal.SIGINT)  # what Ctrl-C sends (to the demo alone: it stops the rest)
        assert demo.wait(timeout=120) == 0, (tmp_path / "demo.log").read_text()
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert [pid for pid in children if Path(f"/proc/{pid}").exists()] == []
    assert runner_pids() == []


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def test_with_an_api_key_every_hop_is_authenticated_and_errors_keep_their_shape(tmp_path, etcd, hf_home):
    """The caller's key opens every node, its forward to the controller, and the controller's calls to the
    agents; without it, any node answers 401; a refusal comes back through the hop as the controller said it."""
    env = {**os.environ, "HF_HOME": str(hf_home), "EXOD_API_KEY": "s3cret"}
    key = {"Authorization": "Bearer s3cret"}
    daemons = [start(tmp_path, etcd, n, env) for n in (1, 2)]
    try:
        view = until(
            lambda: httpx.get(f"{daemons[0][1]}/nodes", headers=key, timeout=10).json(),
            lambda v: len(v.get("nodes", ())) == 2 and v["controller"],
            30,
        )
        follower = next(n["api_url"] for n in view["nodes"] if not n["controller"])
        body = {"model": "exod/tiny-qwen2", "ranks": 2}
        denied = httpx.post(f"{follower}/instances", json=body, timeout=30)
        placed = httpx.post(f"{follower}/instances", json=body, headers=key, timeout=30)
        iid = placed.json()["instance_id"]
        ready = until(
            lambda: httpx.get(f"{follower}/instances/{iid}", headers=key, timeout=10).json(),
            lambda i: i["state"] == "ready",
            60,
        )
        chat = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        answered = httpx.post(f"{follower}/v1/chat/completions", json=chat, headers=key, timeout=60)
        unknown = httpx.post(f"{follower}/v1/chat/completions", json={**chat, "model": "org/none"}, headers=key)
        hop = {**key, "x-exod-forwarded-by": "node-9"}  # as if another node forwarded it here: no second hop
        looped = httpx.post(f"{follower}/v1/chat/completions", json=chat, headers=hop, timeout=10)
    finally:
        stop_all(daemons)
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert placed.status_code == 201
    assert sorted(r["node"] for r in ready["runners"]) == ["node-1", "node-2"]  # the agents took the key too
    assert answered.status_code == 200 and answered.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert unknown.status_code == 404 and set(unknown.json()["error"]) == {"message", "type", "param", "code"}
    assert looped.status_code == 503 and looped.json()["error"]["code"] == "controller_unavailable"


def test_the_agents_obey_only_the_cluster_token_neither_a_stranger_nor_a_client_with_the_api_key(
    tmp_path, etcd, hf_home
):
    """Issue #25's first rows, tried on both nodes, without any credential and with the client's API key: stop
    a runner, open the report stream (which would take the agent over from its controller), spawn a runner.
    Each is 401; the instance stays Ready in its generation, no retry charged, its runner processes the same;
    and the agents' endpoints are not in the client API's document."""
    env = {**os.environ, "HF_HOME": str(hf_home), "EXOD_API_KEY": "s3cret"}
    key = {"Authorization": "Bearer s3cret"}
    daemons = [start(tmp_path, etcd, n, env) for n in (1, 2)]
    try:
        until(lambda: nodes(daemons[0][1], key), lambda v: len(v.get("nodes", ())) == 2 and v["controller"], 30)
        url = daemons[1][1]
        body = {"model": "exod/tiny-qwen2", "ranks": 2}
        iid = httpx.post(f"{url}/instances", json=body, headers=key, timeout=30).json()["instance_id"]
        before = until(lambda: instance_at(url, iid, key), lambda i: i["state"] == "ready", 60)
        processes = runners_of(iid)
        runner = before["runners"][1]
        spawn = {"instance_id": iid, "runner_id": runner["runner_id"], "incarnation": 99, "rank": 1}
        spawn |= {"world_size": 2, "ring": [], "stream": 1}
        answers = []
        for headers in ({}, key):
            for _, node in daemons:
                stop = f"{node}/agent/runners/{runner['runner_id']}/{runner['incarnation']}"
                answers.append(httpx.delete(stop, headers=headers, timeout=10))
                answers.append(httpx.post(f"{node}/agent/runners", json=spawn, headers=headers, timeout=10))
                with httpx.stream("GET", f"{node}/agent/reports", headers=headers, timeout=10) as stream:
                    stream.read()
                    answers.append(stream)
        time.sleep(4)  # what a stream held open by a stranger would have done by now: it took the agent over
        after = instance_at(url, iid, key)
        still = runners_of(iid)
        document = httpx.get(f"{url}/openapi.json", headers=key, timeout=10).json()
    finally:
        stop_all(daemons)
    assert [a.status_code for a in answers] == [401] * 12
    assert all(a.json()["error"]["code"] == "invalid_cluster_token" for a in answers)
    assert (after["state"], after["generation"], after["attempts"]) == ("ready", before["generation"], 0)
    assert still == processes and len(processes) == 2
    assert not [path for path in document["paths"] if path.startswith("/agent")]


def test_forged_and_malformed_node_records_in_etcd_break_nothing_and_win_no_placement(tmp_path, etcd, hf_home):
    """Issue #25's rows on etcd's records, on real daemons: records written by hand (not JSON, extra keys, a
    list, nonsense or unbounded numbers, a claim of 10 PB) made /nodes, placement and follower chat answer 500,
    or drew rank 0 — and with it the client's key — to a forged node. Now each is skipped and counted."""
    from test_election import FORGED

    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = [start(tmp_path, etcd, n, env) for n in (1, 2)]

    async def forge(client):
        lease = await client.grant(60)
        for n, raw in enumerate(FORGED.values()):
            await client.put(node_key(DEFAULT_PREFIX.encode(), f"forged-{n}"), raw, lease=lease)
        return lease

    try:
        view = until(lambda: nodes(daemons[0][1]), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        lease = run_with_client(etcd, forge)
        follower = next(n["api_url"] for n in view["nodes"] if not n["controller"])
        listed = [httpx.get(f"{url}/nodes", timeout=10) for _, url in daemons]
        placed = httpx.post(f"{follower}/instances", json={"model": "exod/tiny-qwen2", "ranks": 1}, timeout=30)
        iid = placed.json()["instance_id"]
        ready = until(lambda: instance_at(follower, iid), lambda i: i["state"] == "ready", 60)
        chat = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        answered = httpx.post(f"{follower}/v1/chat/completions", json=chat, timeout=60)
        metrics = httpx.get(f"{follower}/metrics", timeout=10).text
        run_with_client(etcd, lambda client: client.revoke(lease))
    finally:
        stop_all(daemons)
    assert [r.status_code for r in listed] == [200, 200]
    assert all(sorted(n["node_id"] for n in r.json()["nodes"]) == ["node-1", "node-2"] for r in listed)
    assert placed.status_code == 201 and ready["runners"][0]["node"] in ("node-1", "node-2")
    assert answered.status_code == 200
    skipped = next(
        line for line in metrics.splitlines() if line.startswith('exod_etcd_values_skipped_total{kind="node"}')
    )
    assert float(skipped.split()[-1]) >= len(FORGED)


def test_a_node_whose_disk_is_full_degrades_and_supervises_on_never_ends(tmp_path, etcd, hf_home, small_disk):
    """Issue #25: a node's state dir full, one of its runners killed: its daemon exited (the disk's error out of
    the agent's supervisor). It says it is degraded (its /health, its record in /nodes) and goes on; the kill
    is charged once, as the runner's own failure, while the node's refusals to start a runner on a full disk
    are the host's (uncharged). With space back, the node is whole and the instance Ready again."""
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = [start(tmp_path, etcd, 1, env)]
    until(lambda: nodes(daemons[0][1]), lambda v: v["controller"] == "node-1", 30)
    daemons.append(start(tmp_path, etcd, 2, env, state=small_disk / "state"))
    url, full = daemons[0][1], daemons[1][1]
    filler = small_disk / "filler"
    try:
        until(lambda: nodes(url), lambda v: len(v["nodes"]) == 2, 30)
        body = {"model": "exod/tiny-qwen2", "ranks": 2, "nodes": ["node-1", "node-2"]}
        iid = httpx.post(f"{url}/instances", json=body, timeout=30).json()["instance_id"]
        before = until(lambda: instance_at(url, iid), lambda i: i["state"] == "ready", 60)
        fill(filler)
        os.kill(runner_pid(1), signal.SIGKILL)  # node-2's rank: its agent must write that it is gone
        health = until(lambda: httpx.get(f"{full}/health", timeout=10).json(), lambda h: h["status"] != "ok", 30)
        listed = until(
            lambda: nodes(url), lambda v: any(n["degraded"] for n in v["nodes"] if n["node_id"] == "node-2"), 30
        )
        alive = daemons[1][0].poll() is None
        filler.unlink()
        whole = until(lambda: httpx.get(f"{full}/health", timeout=10).json(), lambda h: h["status"] == "ok", 30)
        after = until(
            lambda: instance_at(url, iid),
            lambda i: i["state"] == "ready" and i["generation"] > before["generation"],
            120,
        )
    finally:
        stop_all(daemons)
    assert alive and "disk is full" in health["reason"]
    assert "disk is full" in next(n["degraded"] for n in listed["nodes"] if n["node_id"] == "node-2")
    assert whole["status"] == "ok" and after["attempts"] == before["attempts"] + 1


def test_a_snapshot_or_a_log_batch_in_etcd_that_is_not_exods_is_said_on_a_follower_never_a_500(tmp_path, etcd):
    """Issue #25: every value read from etcd is untrusted input. A snapshot that is not exod's makes a follower's
    /instances a 503 that says where and what to do (and counts it); a log batch that is not is skipped by
    /events; nothing answers 500."""
    daemons = [start(tmp_path, etcd, n, dict(os.environ)) for n in (1, 2)]
    prefix = DEFAULT_PREFIX.encode()
    try:
        view = until(lambda: nodes(daemons[0][1]), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        follower = next(n["api_url"] for n in view["nodes"] if not n["controller"])

        async def forge(client):
            await client.put(prefix + b"log/" + b"9" * 12, b'{"first": "x"}')
            await client.put(prefix + b"state/snapshot", b'{"instances": 7}')

        run_with_client(etcd, forge)
        instances = httpx.get(f"{follower}/instances", timeout=10)
        with httpx.stream("GET", f"{follower}/events", timeout=10) as stream:  # a stream: its start is enough
            events = stream.status_code
        metrics = httpx.get(f"{follower}/metrics", timeout=10).text
    finally:
        stop_all(daemons)
    assert instances.status_code == 503 and "cannot be restored" in instances.json()["error"]["message"]
    assert events == 200
    assert 'exod_etcd_values_skipped_total{kind="snapshot"} 1.0' in metrics


def test_a_forged_controller_key_gets_no_clients_key_and_its_threat_is_etcds_to_guard(tmp_path, etcd, hf_home):
    """Issue #25's row: a forged election key (and a node record for it) deposed the real controller, and the
    followers forwarded chats to the forger with the client's key. Whoever can write to etcd owns the cluster
    (README, Securing etcd: TLS and etcd's own users keep them out); what exod itself promises is that a
    client's key never leaves the node it was sent to: the forger gets the request without it."""
    import http.server

    from exod.cluster.election import election_key

    heard: list[dict[str, str]] = []

    class Forger(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            heard.append({k.lower(): v for k, v in self.headers.items()})
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args) -> None: ...

    forger = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forger)
    threading.Thread(target=forger.serve_forever, daemon=True).start()
    env = {**os.environ, "HF_HOME": str(hf_home), "EXOD_API_KEY": "s3cret"}
    key = {"Authorization": "Bearer s3cret"}
    daemons = [start(tmp_path, etcd, n, env) for n in (1, 2)]
    prefix = DEFAULT_PREFIX.encode()
    record = NodeRecord("forger", "127.0.0.1", f"http://127.0.0.1:{forger.server_port}", 1 << 30, 1 << 30)

    async def forge(client):
        lease = await client.grant(60)
        await client.put(node_key(prefix, "forger"), record.to_json(), lease=lease)
        await client.put(election_key(prefix), b"forger", lease=lease)

    try:
        view = until(lambda: nodes(daemons[0][1], key), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        follower = next(n["api_url"] for n in view["nodes"] if not n["controller"])
        run_with_client(etcd, forge)
        chat = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        until(
            lambda: httpx.post(f"{follower}/v1/chat/completions", json=chat, headers=key, timeout=10).status_code,
            lambda status: heard,
            30,
        )
    finally:
        stop_all(daemons)
        forger.shutdown()
    assert "authorization" not in heard[0] and "x-api-key" not in heard[0]
    assert heard[0]["x-exod-forwarded-by"] in ("node-1", "node-2")


def test_a_node_that_dies_takes_its_rank_with_it_and_the_next_generation_runs_on_the_live_ones(tmp_path, etcd, hf_home):
    """Its report stream breaks: the rank is lost as the host's failure (no retry charged); once its lease
    expired the instance is placed again on the nodes that are left, and serves."""
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = [start(tmp_path, etcd, n, env) for n in (1, 2)]
    try:
        view = until(lambda: nodes(daemons[0][1]), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        controller = int(view["controller"].removeprefix("node-")) - 1
        url, (victim, _) = daemons[controller][1], daemons[1 - controller]
        placed = httpx.post(f"{url}/instances", json={"model": "exod/tiny-qwen2", "ranks": 2}, timeout=30).json()
        iid = placed["instance_id"]
        before = until(lambda: instance_at(url, iid), lambda i: i["state"] == "ready", 60)
        victim.send_signal(signal.SIGKILL)  # the other node: its runner follows it (hang-up watchdog)
        victim.wait()
        after = until(
            lambda: instance_at(url, iid),
            lambda i: i["state"] == "ready" and i["generation"] > before["generation"],
            12 * TTL,
        )
        chat = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        served = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    finally:
        stop_all(daemons)
    assert sorted(r["node"] for r in before["runners"]) == ["node-1", "node-2"]
    assert {r["node"] for r in after["runners"]} == {view["controller"]}  # moved to the node that is left
    assert after["attempts"] == before["attempts"] and after["uncharged"] >= 1  # the host's, not the model's
    victim_id = next(r["node"] for r in before["runners"] if r["node"] != view["controller"])
    assert f"node {victim_id} lost" in after["last_failure"]  # the log says why
    assert served.status_code == 200
    cluster_fault(
        "host death",
        f"generation {after['generation']} Ready on {view['controller']} alone; attempts {after['attempts']}, "
        f"uncharged {after['uncharged']}; chat 200",
    )


def test_a_three_member_etcd_that_loses_a_member_disrupts_nothing(tmp_path, etcd_cluster, hf_home):
    """Each node is given every member; the one they talk to first dies: no degraded state, no new
    controller, no new generation; placements and chat go on through the other two."""
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = [start(tmp_path, etcd_cluster.url, n, env) for n in (1, 2)]
    try:
        view = until(lambda: nodes(daemons[0][1]), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        url = daemons[0][1]
        placed = httpx.post(f"{url}/instances", json={"model": "exod/tiny-qwen2", "ranks": 2}, timeout=30).json()
        before = until(lambda: instance_at(url, placed["instance_id"]), lambda i: i["state"] == "ready", 60)
        etcd_cluster.members[0].stop()  # the first endpoint of every node
        time.sleep(2 * TTL)  # two lease lifetimes: renewals, the election's watch and the journal all moved on
        health = [httpx.get(f"{u}/health", timeout=10).json() for _, u in daemons]
        after = instance_at(url, placed["instance_id"])
        again = httpx.post(f"{daemons[1][1]}/instances", json={"model": "exod/tiny-qwen2", "ranks": 1}, timeout=30)
        chat = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        served = httpx.post(f"{daemons[1][1]}/v1/chat/completions", json=chat, timeout=60)
        still = nodes(daemons[1][1])
    finally:
        stop_all(daemons)
    assert [h["status"] for h in health] == ["ok", "ok"], health
    assert (after["state"], after["generation"]) == ("ready", before["generation"])
    assert again.status_code == 201 and served.status_code == 200
    assert still["controller"] == view["controller"] and len(still["nodes"]) == 2
    cluster_fault(
        "etcd member loss",
        f"after {2 * TTL} s without member 0: /health ok on both nodes, generation {after['generation']} still "
        "Ready, the same controller, a placement 201 and chat 200",
    )


def test_etcd_down_past_the_lease_fences_every_node_and_all_converges_when_it_returns(tmp_path, etcd_server, hf_home):
    """Safety over availability: no node can prove its lease, so every runner stops — the controller's and
    the agents' — before a lease could expire; etcd back, one controller resumes the instance."""
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = [start(tmp_path, etcd_server.url, n, env) for n in (1, 2)]
    try:
        view = until(lambda: nodes(daemons[0][1]), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        url = daemons[0][1]
        placed = httpx.post(f"{url}/instances", json={"model": "exod/tiny-qwen2", "ranks": 2}, timeout=30).json()
        iid = placed["instance_id"]
        before = until(lambda: instance_at(url, iid), lambda i: i["state"] == "ready", 60)
        assert len(runner_pids()) == 2
        etcd_server.stop()
        stopped_at = time.monotonic()
        until(runner_pids, lambda pids: pids == [], 3 * TTL)  # every node fenced itself
        fenced_after = time.monotonic() - stopped_at
        etcd_server.start()
        after = until(
            lambda: httpx.get(f"{url}/instances/{iid}", timeout=10).json(),
            lambda i: i.get("state") == "ready" and i["generation"] > before["generation"],
            12 * TTL,
        )
        view_after = until(lambda: nodes(url), lambda v: len(v["nodes"]) == 2 and v["controller"], 6 * TTL)
    finally:
        stop_all(daemons)
    assert fenced_after < TTL + 2.0  # TTL less the margin after the last renewal, then a stop
    assert sorted(r["node"] for r in after["runners"]) == ["node-1", "node-2"]
    assert after["attempts"] == before["attempts"]  # the cluster's outage, not the model's failure
    assert view_after["controller"] in ("node-1", "node-2") and view["controller"]
    cluster_fault(
        "etcd outage longer than the lease",
        f"every runner stopped {fenced_after:.1f} s after etcd did; once it was back, generation "
        f"{after['generation']} Ready on both nodes, attempts {after['attempts']}",
    )


def runners_of(iid: str) -> dict[int, int]:
    """The live runner processes of instance ``iid`` on this machine, whatever their node: pid → generation."""
    found = {}
    for pid in runner_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "--runner-id" in argv and argv[argv.index("--runner-id") + 1].startswith(f"{iid}/"):
            found[pid] = int(argv[argv.index("--incarnation") + 1])
    return found


@pytest.mark.parametrize("cut", ["node", "controller", "controller alone"])
def test_a_partitioned_node_fences_itself_and_the_instance_recovers_without_two_generations(
    tmp_path, namespace, hf_home_8_layers, cut
):
    """One node is a host of its own (a network namespace behind a veth pair) holding a rank, and its link
    is cut. It kills its runner before its lease can expire (its own clock). The instance recovers on the
    nodes left; healed, the node joins again and the instance is left alone. Never two generations alive,
    watched throughout.

    ``node``: node-3, an agent, holds rank 1 of 2. ``controller``: node-1, the controller, holds rank 0 of 3;
    the agents on node-2 and node-3 still run the others (their streams from the old controller just went
    silent). One of them is elected; the next generation starts only once the other's runner is gone
    (`exod.cluster.remote.Fleet`): the new controller asks that agent to stop it, and waits for its key to go.
    ``controller alone``: node-1, the controller, holds the instance's only rank, so no peer's loss ends it:
    the controller must step down by its own clock, though no watch ever tells it (a term ends by the clock)."""
    env = {**os.environ, "HF_HOME": str(hf_home_8_layers), "EXOD_API_KEY": "partition-test"}  # a key: not loopback
    auth = {"Authorization": "Bearer partition-test"}
    inner = 3 if cut == "node" else 1
    outer = iter(namespace.outside)
    addresses = {n: namespace.inside if n == inner else next(outer) for n in (1, 2, 3)}
    etcd = LocalEtcd(tmp_path / "etcd", host=namespace.outside[0])
    etcd.start()
    daemons = []

    def node(n: int) -> tuple[subprocess.Popen[bytes], str]:
        wrap = namespace.run if n == inner else list
        return start(tmp_path, etcd.url, n, env, PARTITION_TTL, address=addresses[n], wrap=wrap)

    try:
        daemons.append(node(1))
        until(lambda: nodes(daemons[0][1], auth), lambda v: v["controller"] == "node-1", 30)
        daemons += [node(2), node(3)]
        url = daemons[1][1]  # node-2: outside, whichever is cut
        until(lambda: nodes(url, auth), lambda v: len(v["nodes"]) == 3, 30)
        pinned = {"node": ["node-1", "node-3"], "controller": ["node-1", "node-2", "node-3"]}.get(cut, ["node-1"])
        body = {"model": "exod/tiny-qwen2", "ranks": len(pinned), "nodes": pinned}
        iid = httpx.post(f"{url}/instances", json=body, headers=auth, timeout=30).json()["instance_id"]
        before = until(lambda: instance_at(url, iid, auth), lambda i: i["state"] == "ready", 60)
        inside = set(namespace.pids()) & set(runners_of(iid))
        assert len(inside) == 1  # the cut node's rank

        namespace.cut()
        cut_at, generations_seen = time.monotonic(), []
        while inside & set(alive := runners_of(iid)):  # the cut node fences itself: its runner is killed
            generations_seen.append(sorted(set(alive.values())))
            assert time.monotonic() - cut_at < PARTITION_TTL, "the cut node never fenced itself"
            time.sleep(0.02)
        fenced_after = time.monotonic() - cut_at
        key = node_key(DEFAULT_PREFIX.encode(), f"node-{inner}")
        lease_then = run_with_client(etcd.url, lambda client: client.get(key))  # still there: not expired
        expired_after = None
        while True:
            generations_seen.append(sorted(set(runners_of(iid).values())))
            now = time.monotonic() - cut_at
            listed = [n["node_id"] for n in nodes(url, auth)["nodes"]]
            if expired_after is None and f"node-{inner}" not in listed:
                expired_after = now
            after = instance_at(url, iid, auth)
            if after.get("state") == "ready" and after["generation"] > before["generation"]:
                break
            assert now < 6 * PARTITION_TTL, f"not recovered: {after}"
            time.sleep(0.05)
        controller = nodes(url, auth)["controller"]

        namespace.heal()
        until(lambda: nodes(url, auth), lambda v: f"node-{inner}" in [n["node_id"] for n in v["nodes"]], 30)
        time.sleep(TTL)  # back a while: nothing of the instance moves
        settled = instance_at(url, iid, auth)
        chat = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        served = httpx.post(f"{url}/v1/chat/completions", json=chat, headers=auth, timeout=60)
        still = nodes(url, auth)["controller"]
    finally:
        stop_all(daemons)
        etcd.stop()
    assert lease_then is not None and expired_after is not None  # it killed its runner before its lease expired
    assert all(len(generations) <= 1 for generations in generations_seen)  # never two generations at once
    left = sorted(f"node-{n}" for n in (1, 2, 3) if n != inner)
    moved_to = sorted({r["node"] for r in after["runners"]})  # off the cut node
    assert moved_to == left if len(pinned) > 1 else len(moved_to) == 1 and moved_to[0] in left
    assert after["attempts"] == before["attempts"]  # the network's failure, not the model's
    if cut == "node":  # a new controller resumes without a failure (`Cluster.recover`)
        assert after["uncharged"] > before["uncharged"] and "node node-3 lost" in after["last_failure"]
    assert (settled["state"], settled["generation"]) == ("ready", after["generation"])
    assert controller in left and still == controller and served.status_code == 200
    cluster_fault(
        f"partition of {'a node' if cut == 'node' else 'the controller'}{' holding every rank' * (len(pinned) == 1)}",
        f"node-{inner}'s runner killed {fenced_after:.1f} s after the cut, its lease gone at "
        f"{expired_after:.1f} s; generation {after['generation']} Ready on {' and '.join(moved_to)}, attempts "
        f"{after['attempts']}, never two generations alive; node-{inner} back, generation "
        f"{settled['generation']} still Ready, {still} still the controller (lease TTL {PARTITION_TTL} s)",
    )


def test_every_dialect_answers_from_a_node_that_is_not_the_controller(tmp_path, etcd, hf_home):
    """Chat, text completions, Responses and Anthropic's Messages, asked of the follower with the official
    clients, streamed or not, on an instance whose ranks are on both nodes."""
    import anthropic
    import openai

    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = [start(tmp_path, etcd, n, env) for n in (1, 2)]
    try:
        view = until(lambda: nodes(daemons[0][1]), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        follower = daemons[1][1] if view["controller"] == "node-1" else daemons[0][1]
        placed = httpx.post(f"{follower}/instances", json={"model": "exod/tiny-qwen2", "ranks": 2}, timeout=30)
        iid = placed.json()["instance_id"]
        until(lambda: instance_at(follower, iid), lambda i: i["state"] == "ready", 60)
        client = openai.OpenAI(base_url=f"{follower}/v1", api_key="unused", max_retries=0, timeout=60)
        claude = anthropic.Anthropic(base_url=follower, api_key="unused", max_retries=0, timeout=60)
        ask = [{"role": "user", "content": "hi"}]
        model = "exod/tiny-qwen2"
        chat = client.chat.completions.create(model=model, messages=ask, max_tokens=3, logprobs=True)
        text = client.completions.create(model=model, prompt="The quick", max_tokens=3)
        response = client.responses.create(model=model, input="hi", max_output_tokens=3)
        with client.responses.stream(model=model, input="hi", max_output_tokens=3) as stream:
            streamed = [event.type for event in stream]
        message = claude.messages.create(model=model, max_tokens=3, messages=ask)
        with claude.messages.stream(model=model, max_tokens=3, messages=ask) as stream:
            said = "".join(stream.text_stream)
            final = stream.get_final_message()
        found = client.models.retrieve(model)
    finally:
        stop_all(daemons)
    # sampled: up to 3 tokens each (the end of the sequence may come first), every one accounted for
    assert (
        1 <= chat.usage.completion_tokens <= 3 and len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    )
    assert 1 <= text.usage.completion_tokens <= 3 and 1 <= response.usage.output_tokens <= 3
    assert streamed[0] == "response.created" and streamed[-1] == "response.completed"
    assert 1 <= message.usage.output_tokens <= 3 and message.stop_reason in ("max_tokens", "end_turn")
    assert final.stop_reason in ("max_tokens", "end_turn") and said == "".join(b.text for b in final.content)
    assert found.id == model


class Chats(Background):
    """Chats sent to ``url`` one after another from a thread, while the block runs: an instance in use."""

    BODY = {"model": "exod/tiny-qwen2", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url, self.sent = url, 0

    def step(self) -> None:
        self.sent += 1
        with contextlib.suppress(httpx.HTTPError):  # an error is the instance failing: what it is for
            httpx.post(f"{self.url}/v1/chat/completions", json=self.BODY, timeout=60)


@pytest.mark.parametrize("serving", [False, True], ids=["idle", "serving"])
def test_an_agents_daemon_paused_past_its_lease_has_its_runner_end_itself_so_no_two_generations_overlap(
    tmp_path, etcd, hf_home, serving
):
    """The dead man's switch (DESIGN §5): node-3's daemon is SIGSTOPped, not its runner. The runner's deadline
    is no longer moved on, so its watchdog process ends it before node-3's lease may expire, and so before
    the controller, which waits for its key to go, starts the next generation elsewhere. Polled from outside
    every 50 ms: never two generations alive. Continued, node-3 rejoins and nothing is charged.

    Serving, rank 0 loses its ring when rank 1 ends, and says so before node-3 is lost: the fault campaign
    (#26, seed 1) found that consequence charged to the model; the node's loss now gives the retry back."""
    env = {**os.environ, "HF_HOME": str(hf_home)}
    ttl = TTL if serving else PARTITION_TTL  # the short lease: its runner's deadline comes before the link's timeout
    daemons = []
    try:
        daemons.append(start(tmp_path, etcd, 1, env, ttl))
        until(lambda: nodes(daemons[0][1]), lambda v: v["controller"] == "node-1", 30)
        daemons += [start(tmp_path, etcd, n, env, ttl) for n in (2, 3)]
        url = daemons[0][1]
        until(lambda: nodes(url), lambda v: len(v["nodes"]) == 3, 30)
        body = {"model": "exod/tiny-qwen2", "ranks": 2, "nodes": ["node-1", "node-3"]}
        iid = httpx.post(f"{url}/instances", json=body, timeout=30).json()["instance_id"]
        before = until(lambda: instance_at(url, iid), lambda i: i["state"] == "ready", 60)
        rank_1 = [r for r in before["runners"] if r["rank"] == 1]
        assert [r["node"] for r in rank_1] == ["node-3"]
        on_node_3 = {pid for pid in runners_of(iid) if "--rank\x001\x00" in Path(f"/proc/{pid}/cmdline").read_text()}
        assert len(on_node_3) == 1

        paused = daemons[2][0]
        chats = Chats(url) if serving else contextlib.nullcontext()
        with chats:
            paused.send_signal(signal.SIGSTOP)
            paused_at, generations_seen, runner_gone_after = time.monotonic(), [], None
            try:
                while time.monotonic() - paused_at < 2 * ttl:  # well past its lease
                    alive = runners_of(iid)
                    generations_seen.append(sorted(set(alive.values())))
                    if runner_gone_after is None and not on_node_3 & set(alive):
                        runner_gone_after = time.monotonic() - paused_at
                    time.sleep(0.05)
            finally:
                paused.send_signal(signal.SIGCONT)
        after = until(
            lambda: instance_at(url, iid),
            lambda i: i.get("state") == "ready" and i["generation"] > before["generation"],
            6 * ttl,
        )
        until(lambda: nodes(url), lambda v: "node-3" in [n["node_id"] for n in v["nodes"]], 30)
    finally:
        stop_all(daemons)
    assert runner_gone_after is not None and runner_gone_after < ttl  # before its lease could expire
    assert all(len(generations) <= 1 for generations in generations_seen)  # never two generations at once
    assert after["attempts"] == before["attempts"]  # a paused host is not the model's failure
    assert after["uncharged"] > before["uncharged"]
    if serving:
        lost = "connection to a peer was lost" in (tmp_path / "node-1" / "serve.log").read_text()
        assert chats.sent > 0 and lost  # rank 0, serving, lost its ring: the consequence came first
        return
    cluster_fault(
        "paused agent daemon",
        f"node-3's daemon SIGSTOPped {2 * ttl} s: its runner ended itself {runner_gone_after:.1f} s in "
        f"(its deadline), before its lease could expire; generation {after['generation']} Ready, attempts "
        f"{after['attempts']}, never two generations alive (lease TTL {ttl} s)",
    )


def test_a_controller_cut_from_etcd_alone_steps_down_and_commands_nothing_more(tmp_path, namespace, hf_home):
    """node-1, the controller, in a network namespace, loses etcd (a blackhole route) but still reaches node-2.
    By its own clock it steps down before its lease may expire: its runner is killed, and it answers no chat
    as the controller; node-2 is elected, resumes the instance alone, and the old controller's term cannot
    touch it. Polled from outside: never two generations alive, nothing charged. Healed, nothing moves."""
    env = {**os.environ, "HF_HOME": str(hf_home), "EXOD_API_KEY": "partition-test"}  # a key: not loopback
    auth = {"Authorization": "Bearer partition-test"}
    etcd_address, outer = namespace.outside
    etcd = LocalEtcd(tmp_path / "etcd", host=etcd_address)
    etcd.start()
    daemons = []
    try:
        daemons.append(start(tmp_path, etcd.url, 1, env, PARTITION_TTL, address=namespace.inside, wrap=namespace.run))
        until(lambda: nodes(daemons[0][1], auth), lambda v: v["controller"] == "node-1", 30)
        daemons.append(start(tmp_path, etcd.url, 2, env, PARTITION_TTL, address=outer))
        url_1, url_2 = daemons[0][1], daemons[1][1]
        until(lambda: nodes(url_2, auth), lambda v: len(v["nodes"]) == 2, 30)
        body = {"model": "exod/tiny-qwen2", "ranks": 2, "nodes": ["node-1", "node-2"]}
        iid = httpx.post(f"{url_2}/instances", json=body, headers=auth, timeout=30).json()["instance_id"]
        before = until(lambda: instance_at(url_2, iid, auth), lambda i: i["state"] == "ready", 60)
        inside = set(namespace.pids()) & set(runners_of(iid))
        assert len(inside) == 1

        namespace.cut_from(etcd_address)
        cut_at, generations_seen, fenced_after = time.monotonic(), [], None
        chat = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        while True:
            alive = runners_of(iid)
            generations_seen.append(sorted(set(alive.values())))
            now = time.monotonic() - cut_at
            if fenced_after is None and not inside & set(alive):
                fenced_after = now
                with httpx.Client(transport=httpx.HTTPTransport(local_address=outer)) as client:  # not from etcd's
                    as_controller = client.post(f"{url_1}/v1/chat/completions", json=chat, headers=auth, timeout=30)
            after = instance_at(url_2, iid, auth)
            if after.get("state") == "ready" and after["generation"] > before["generation"]:
                break
            assert now < 6 * PARTITION_TTL, f"not recovered: {after}"
            time.sleep(0.05)
        controller = nodes(url_2, auth)["controller"]
        with httpx.Client(transport=httpx.HTTPTransport(local_address=outer)) as client:  # still cut from etcd
            via_old = client.post(f"{url_1}/v1/chat/completions", json=chat, headers=auth, timeout=30)
        time.sleep(PARTITION_TTL)  # the old controller, cut from etcd, has had a whole lease to act: nothing moves
        for _ in range(int(1 / 0.05)):
            generations_seen.append(sorted(set(runners_of(iid).values())))
            time.sleep(0.05)
        unmoved = instance_at(url_2, iid, auth)

        namespace.heal_from(etcd_address)
        until(lambda: nodes(url_2, auth), lambda v: "node-1" in [n["node_id"] for n in v["nodes"]], 30)
        time.sleep(TTL)
        settled = instance_at(url_2, iid, auth)
    finally:
        stop_all(daemons)
        etcd.stop()
    assert fenced_after is not None and fenced_after < PARTITION_TTL  # before its lease could expire
    assert as_controller.status_code == 503  # no answer as a controller it no longer is
    assert via_old.status_code == 200, via_old.text  # then, still cut: forwarded to the one the others elected
    assert all(len(generations) <= 1 for generations in generations_seen)  # never two generations at once
    assert controller == "node-2" and {r["node"] for r in after["runners"]} == {"node-2"}
    assert after["attempts"] == before["attempts"]  # the network's failure, not the model's
    assert (unmoved["state"], unmoved["generation"]) == ("ready", after["generation"])
    assert (settled["state"], settled["generation"]) == ("ready", after["generation"])
    cluster_fault(
        "controller cut from etcd alone",
        f"node-1's runner killed {fenced_after:.1f} s after the cut, chat to it 503; node-2 elected, node-1 (still "
        f"cut) forwards the next chat to it: {via_old.status_code}; generation "
        f"{after['generation']} Ready on node-2, still so a lease later and after the heal; attempts "
        f"{after['attempts']}, never two generations alive (lease TTL {PARTITION_TTL} s)",
    )


def test_a_node_on_a_secured_etcd_joins_serves_and_its_log_replays(tmp_path, secure_etcd, hf_home):
    """The README's secured set-up, end to end: `[cluster]` names the CA, the certificate, the user and the
    password file; the node is elected, places, answers; `exod replay --cluster` reads the log with the same
    options. Without them the node says why it cannot join and exits."""

    s = secure_etcd.security
    secured = (
        f'etcd_ca = "{s.ca}"\netcd_cert = "{s.cert}"\netcd_key = "{s.key}"\n'
        f'etcd_user = "root"\netcd_password_file = "{secure_etcd.password_file}"\n'
    )
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemon, url = start(tmp_path, secure_etcd.url, 1, env, extra_cluster=secured)
    try:
        until(lambda: nodes(url), lambda v: v["controller"] == "node-1", 30)
        iid = httpx.post(f"{url}/instances", json={"model": "exod/tiny-qwen2", "ranks": 1}, timeout=30).json()[
            "instance_id"
        ]
        until(lambda: instance_at(url, iid), lambda i: i["state"] == "ready", 60)
        chat = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        answered = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    finally:
        stop_all([(daemon, url)])
    options = ["--etcd-ca", str(s.ca), "--etcd-cert", str(s.cert), "--etcd-key", str(s.key), "--etcd-user", "root"]
    options += ["--etcd-password-file", str(secure_etcd.password_file)]
    replay = [sys.executable, "-m", "exod", "replay", "--cluster", secure_etcd.url]
    replayed = subprocess.run([*replay, *options], capture_output=True, text=True, timeout=60)
    token = ["--cluster-token-file", str(cluster_token_file(tmp_path))]
    bare = [sys.executable, "-m", "exod", "serve", "--cluster", secure_etcd.url, "--node-id", "x", *token]
    refused = subprocess.run([*bare, "--state-dir", str(tmp_path / "x")], capture_output=True, text=True, timeout=60)
    assert answered.status_code == 200
    assert replayed.returncode == 0, replayed.stderr
    assert refused.returncode == 1 and "etcd" in refused.stderr and "Traceback" not in refused.stderr


def ranks_of(iid: str) -> dict[int, tuple[int, int, int]]:
    """The live runner processes of ``iid`` on this machine: pid → (generation, rank, parent pid)."""
    found = {}
    for pid in runner_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if argv[argv.index("--runner-id") + 1].startswith(f"{iid}/"):
                found[pid] = (int(argv[argv.index("--incarnation") + 1]), int(argv[argv.index("--rank") + 1]), parent)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not a runner's command line
    return found


class ProcSampler(Background):
    """``ranks_of(iid)`` every 20 ms from a thread, while the block runs: (time, sample) pairs."""

    EVERY = 0.02

    def __init__(self, iid: str) -> None:
        super().__init__()
        self.iid, self.samples = iid, []

    def step(self) -> None:
        self.samples.append((time.monotonic(), ranks_of(self.iid)))

    def most_generations(self) -> int:
        return max((len({g for g, _, _ in alive.values()}) for _, alive in self.samples), default=0)

    def most_per_rank(self) -> int:
        counts = [[r for _, r, _ in alive.values()] for _, alive in self.samples]
        return max((ranks.count(r) for ranks in counts for r in ranks), default=0)


@pytest.mark.parametrize("ranks_on", ["controller", "spread"])
def test_a_controller_paused_two_leases_has_its_runners_end_by_their_deadline_and_steps_down_doing_nothing(
    tmp_path, etcd, hf_home, ranks_on
):
    """Issue #47: node-1, the controller, its daemon SIGSTOPped for 2 × the lease TTL (its runners not). Watched
    from outside, /proc every 20 ms and etcd: its runners are ended by their deadline before its node key (its
    lease) goes; another node is elected and the instance is Ready in a newer generation on the others; never
    two generations, nor two processes of one rank, alive at once. Continued, node-1 knows its term is over:
    it spawns nothing and the instance stays as the new controller left it.

    ``controller``: the instance's only rank on node-1 (no peer's loss tells anyone; two ranks packed on one
    node of three are spread before they start, `fsm.place_again`). ``spread``: ranks on node-1 and node-2, whose
    runner the new controller must see gone before the next generation starts."""
    env = {**os.environ, "HF_HOME": str(hf_home)}
    pinned = ["node-1"] if ranks_on == "controller" else ["node-1", "node-2"]
    controller_key, node_1_key = DEFAULT_PREFIX.encode() + b"controller", node_key(DEFAULT_PREFIX.encode(), "node-1")

    def holder(key: bytes) -> str | None:
        found = run_with_client(etcd, lambda client: client.get(key))
        return found.value.decode() if found is not None else None

    daemons = []
    try:
        daemons.append(start(tmp_path, etcd, 1, env))
        until(lambda: nodes(daemons[0][1]), lambda v: v["controller"] == "node-1", 30)
        daemons += [start(tmp_path, etcd, n, env) for n in (2, 3)]
        url = daemons[1][1]  # node-2: never paused
        until(lambda: nodes(url), lambda v: len(v["nodes"]) == 3, 30)
        body = {"model": "exod/tiny-qwen2", "ranks": len(pinned), "nodes": pinned}
        iid = httpx.post(f"{url}/instances", json=body, timeout=30).json()["instance_id"]
        before = until(lambda: instance_at(url, iid), lambda i: i["state"] == "ready", 60)
        paused = daemons[0][0]
        on_node_1 = {pid for pid, (_, _, parent) in ranks_of(iid).items() if parent == paused.pid}
        assert len(on_node_1) == 1, (before["runners"], ranks_of(iid))  # rank 0

        with ProcSampler(iid) as watch:
            paused.send_signal(signal.SIGSTOP)
            paused_at, expired_after, elected, held_before = time.monotonic(), None, None, set()
            try:
                while (now := time.monotonic() - paused_at) < 2 * TTL:
                    # the controller key first, node-1's key after: a key that has expired never comes back (its
                    # daemon is stopped), so node-1's key still there means it was there at the first read too
                    # (read the other way round, an election between the two reads looked like an overlap)
                    held, alive = holder(controller_key), holder(node_1_key) is not None
                    if expired_after is None and not alive:
                        expired_after = now
                    if alive:  # its lease alive at the controller key's read: no one else may be the controller
                        held_before.add(held)
                    elif elected is None and held not in (None, "node-1"):
                        elected = held
                    time.sleep(0.1)
            finally:
                paused.send_signal(signal.SIGCONT)
            continued_at = time.monotonic()
            if elected is None:  # the election came after the pause ended
                elected = until(lambda: holder(controller_key), lambda h: h not in (None, "node-1"), TTL)
            after = until(
                lambda: instance_at(url, iid),
                lambda i: i.get("state") == "ready" and i["generation"] > before["generation"],
                6 * TTL,
            )
            stepped_down = until(lambda: nodes(daemons[0][1]), lambda v: v["controller"] not in (None, "node-1"), TTL)
            time.sleep(TTL)  # the old controller, continued, has had a whole lease to act: nothing moves
            settled = instance_at(url, iid)
            still = holder(controller_key)
    finally:
        stop_all(daemons)
    gone = [t for t, alive in watch.samples if t > paused_at and not on_node_1 & set(alive)]
    ended_after = gone[0] - paused_at if gone else None
    spawned_by_node_1 = {
        pid for t, alive in watch.samples if t > continued_at for pid, (*_, p) in alive.items() if p == paused.pid
    }
    assert ended_after is not None and expired_after is not None, (ended_after, expired_after)
    assert ended_after < expired_after < 2 * TTL  # the runners by their deadline, before its lease could expire
    assert watch.most_generations() == 1 and watch.most_per_rank() == 1  # never two at once, in any sample
    assert held_before == {"node-1"}  # no other controller while node-1's lease lived
    assert elected in ("node-2", "node-3") and still == elected == stepped_down["controller"]
    assert after["state"] == "ready" and {r["node"] for r in after["runners"]} <= {"node-2", "node-3"}
    assert after["attempts"] == before["attempts"]  # a paused host is not the model's failure
    assert not spawned_by_node_1  # continued, node-1 started nothing
    assert (settled["state"], settled["generation"]) == ("ready", after["generation"])
    samples = len(watch.samples)
    every_ms = 1000 * (watch.samples[-1][0] - watch.samples[0][0]) / (samples - 1)  # the sweep's own time included
    where = "every rank on the controller" if ranks_on == "controller" else "ranks on the controller and an agent"
    cluster_fault(
        f"controller paused 2× TTL, {where}",
        f"node-1's daemon SIGSTOPped {2 * TTL} s: its runner ended {ended_after:.1f} s in (its deadline), its "
        f"lease gone at {expired_after:.1f} s; {elected} elected, generation {after['generation']} Ready on "
        f"{' and '.join(sorted({r['node'] for r in after['runners']}))}, attempts {after['attempts']}; continued, "
        f"node-1 named {stepped_down['controller']} the controller and spawned nothing, generation "
        f"{settled['generation']} still Ready a lease later; in {samples} samples of /proc (one per "
        f"{every_ms:.0f} ms), at most "
        f"{watch.most_generations()} generation and {watch.most_per_rank()} process per rank alive (lease TTL {TTL} s)",
    )
