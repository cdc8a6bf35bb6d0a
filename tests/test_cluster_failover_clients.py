"""Failover as a client sees it (issue #46): a forwarded answer whose controller goes silent ends within
``[cluster] forward_idle`` in the dialect's words, never a hang; a request carrying the cluster's token is
never a 401; a placement that races a step-down is a 503 that stored nothing; a node cut from etcd alone
forwards to the controller it last knew. Real `exod serve` nodes, hosts of their own in network namespaces
where a link is cut; what is checked is what the client got."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from etcd_harness import run_with_client
from reliability_report import cluster_fault
from test_cluster_nodes import hf_home as hf_home  # a fixture: a tiny model in an HF cache
from test_cluster_nodes import instance_at, nodes, start, stop_all, until

from exod.cluster import netns
from exod.cluster.devcluster import LocalEtcd, cluster_token_file
from exod.cluster.membership import DEFAULT_PREFIX
from exod.cluster.token import FORWARDED_BY, HEADER, NODE_KEEPALIVE_S

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")

KEY = "failover-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
IDLE = 6  # [cluster] forward_idle of the nodes that test it: seconds
LATE = NODE_KEEPALIVE_S + 1.0  # how late past the bound this busy machine may end an answer
# the runner hangs after its first token: every answer is surely mid-way, alive and silent, when the cut comes
HANG = '\n[[fault]]\nphase = "busy"\nkind = "hang"\n'
CHAT = {"model": "exod/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}]}


def _streamed(url: str, seen: dict) -> None:
    """A streamed chat, its events (and when each came) into ``seen``."""
    seen["events"] = []
    try:
        body = {**CHAT, "stream": True, "max_tokens": 4000}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=None) as response:
            seen["opened"] = time.monotonic()  # the controller's answer began (its keep-alives, if nothing else)
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    seen["events"].append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))
    except httpx.HTTPError as exc:
        seen["error"] = exc
    seen["ended"] = time.monotonic()


def _plain(url: str, seen: dict) -> None:
    try:
        seen["response"] = httpx.post(
            f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 4000}, headers=AUTH, timeout=None
        )
    except httpx.HTTPError as exc:
        seen["error"] = exc
    seen["ended"] = time.monotonic()


@pytest.mark.parametrize("fault", ["dropped", "paused"])
def test_forwarded_answers_whose_controller_goes_silent_end_within_forward_idle(tmp_path, namespace, hf_home, fault):
    """node-1, the controller, a host of its own; a streamed and a plain chat asked of node-2 are mid-answer
    there (its runner hangs after a token: alive, silent). Longer than the bound, neither ends: the stream's
    keep-alives and the controller's /health speak for it. Then its link drops every packet (``dropped``), or
    its daemon is SIGSTOPped (``paused``): within ``forward_idle`` the stream ends with the error event and
    ``[DONE]``, the plain one is a 504 to try again, as the clients see it."""
    env = {**os.environ, "HF_HOME": str(hf_home), "EXOD_API_KEY": KEY}
    extra = f"forward_idle = {IDLE}\n" + HANG
    etcd_address, outer = namespace.outside
    etcd = LocalEtcd(tmp_path / "etcd", host=etcd_address)
    etcd.start()
    daemons, threads = [], []
    stream: dict = {}
    plain: dict = {}
    try:
        node_1 = start(tmp_path, etcd.url, 1, env, address=namespace.inside, wrap=namespace.run, extra_cluster=extra)
        daemons.append(node_1)
        until(lambda: nodes(node_1[1], AUTH), lambda v: v["controller"] == "node-1", 30)
        daemons.append(start(tmp_path, etcd.url, 2, env, address=outer, extra_cluster=extra))
        url = daemons[1][1]
        until(lambda: nodes(url, AUTH), lambda v: len(v["nodes"]) == 2, 30)
        body = {"model": "exod/tiny-qwen2", "ranks": 1, "nodes": ["node-1"]}
        iid = httpx.post(f"{url}/instances", json=body, headers=AUTH, timeout=30).json()["instance_id"]
        until(lambda: instance_at(url, iid, AUTH), lambda i: i["state"] == "ready", 60)
        threads += [threading.Thread(target=_streamed, args=(url, stream))]
        threads[0].start()
        # the answer is under way: the runner's first token (a lone byte of a character may be held, unsent) and
        # then its hang, or the keep-alives that speak for it until then
        until(lambda: "opened" in stream, lambda opened: opened, 30)
        threads += [threading.Thread(target=_plain, args=(url, plain))]  # behind it, waiting
        threads[1].start()
        time.sleep(IDLE + 2 * NODE_KEEPALIVE_S)  # alive and silent past the bound
        open_past_the_bound = "ended" not in stream and "ended" not in plain
        cut_at = time.monotonic()
        if fault == "dropped":
            namespace.cut()
        else:
            node_1[0].send_signal(signal.SIGSTOP)
        for thread in threads:
            thread.join(timeout=IDLE + 30)
    finally:
        if fault == "paused" and daemons:
            daemons[0][0].send_signal(signal.SIGCONT)
        stop_all(daemons)
        etcd.stop()
        for thread in threads:
            thread.join(timeout=30)
    assert open_past_the_bound, (stream, plain)
    assert "error" not in stream, stream  # an answer, however it ends, never a broken connection
    (error_at, error), (_, done) = stream["events"][-2:]
    assert done == "[DONE]" and error["error"]["code"] == "controller_lost", stream["events"][-3:]
    assert "node-1" in error["error"]["message"]
    # the bound, or TCP keep-alive (a dropped host's connection times out: "went away", 502), whichever is first
    assert "went silent" in error["error"]["message"] or fault == "dropped", error
    response = plain["response"]
    assert response.status_code in (504, 502 if fault == "dropped" else 504), response.text
    assert response.headers["retry-after"] == "1" and response.json()["error"]["code"] == "controller_lost"
    stream_after, plain_after = error_at - cut_at, plain["ended"] - cut_at
    assert 0 < stream_after <= IDLE + LATE and 0 < plain_after <= IDLE + LATE  # and never before: open past it
    what = "its host dropping every packet" if fault == "dropped" else "its daemon SIGSTOPped"
    cluster_fault(
        f"controller silent mid-answer ({fault})",
        f"forwarded chats open {IDLE + 2 * NODE_KEEPALIVE_S:g} s past a token, then the controller silent ({what}): "
        f"the stream ended {stream_after:.1f} s later with controller_lost and [DONE], the plain one "
        f"{plain_after:.1f} s later with {response.status_code}, Retry-After 1 (forward_idle {IDLE} s)",
    )


def test_the_cluster_token_is_the_clusters_at_every_node_a_forward_it_cannot_serve_is_503_never_401(
    tmp_path, etcd, hf_home
):
    """A request another node forwards carries the cluster's token, not the client's key: landing on a node that
    is not the controller (it stepped down, or the sender's view was a term old), it is a 503 to try again in
    each dialect, never a 401 (OpenAI's clients do not retry one). Sent on by a node, the token is the cluster's
    there too; a wrong token is still a 401."""
    env = {**os.environ, "HF_HOME": str(hf_home), "EXOD_API_KEY": KEY}
    daemons = [start(tmp_path, etcd, n, env) for n in (1, 2)]
    token = cluster_token_file(tmp_path).read_text().strip()
    as_a_node = {HEADER: token, FORWARDED_BY: "node-3"}
    try:
        view = until(lambda: nodes(daemons[0][1], AUTH), lambda v: len(v["nodes"]) == 2 and v["controller"], 30)
        follower = next(n["api_url"] for n in view["nodes"] if not n["controller"])
        chat = httpx.post(f"{follower}/v1/chat/completions", json=CHAT, headers=as_a_node, timeout=30)
        messages = httpx.post(f"{follower}/v1/messages", json={**CHAT, "max_tokens": 4}, headers=as_a_node, timeout=30)
        sent_on = httpx.post(f"{follower}/v1/chat/completions", json=CHAT, headers={HEADER: token}, timeout=30)
        wrong = httpx.post(f"{follower}/v1/chat/completions", json=CHAT, headers={HEADER: "x" * 43}, timeout=30)
    finally:
        stop_all(daemons)
    assert chat.status_code == 503 and chat.headers["retry-after"] == "1", chat.text
    assert chat.json()["error"]["code"] == "controller_unavailable"
    assert messages.status_code == 503 and messages.json()["error"]["type"] == "overloaded_error", messages.text
    assert sent_on.status_code not in (401, 503), sent_on.text  # the controller answered it (no model placed: 404)
    assert wrong.status_code == 401
    cluster_fault(
        "forwarded request at a node that is not the controller",
        f"chat {chat.status_code} (Retry-After {chat.headers['retry-after']}), Anthropic's messages "
        f"{messages.status_code} {messages.json()['error']['type']}; the token alone sent on to the controller: "
        f"{sent_on.status_code}; a wrong token: {wrong.status_code}",
    )


def test_a_placement_racing_a_step_down_is_503_and_stores_nothing(tmp_path, etcd, hf_home):
    """The controller's turn ends under a placement (another turn wrote ``state/turn``, as a successor's take-over
    does): etcd refuses the placement's write (`Deposed`). The client gets a 503 to try again, not a 500; nothing
    of it is stored, and the next turn's controller places it when asked again."""
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemon, url = start(tmp_path, etcd, 1, env)
    turn = DEFAULT_PREFIX.encode() + b"state/turn"
    body = {"model": "exod/tiny-qwen2", "ranks": 1}
    try:
        until(lambda: nodes(url), lambda v: v["controller"] == "node-1", 30)
        run_with_client(etcd, lambda client: client.put(turn, b"a successor's turn"))
        raced = httpx.post(f"{url}/instances", json=body, timeout=30)
        after = until(lambda: httpx.get(f"{url}/instances", timeout=10), lambda r: r.status_code == 200, 30).json()
        again = until(lambda: httpx.post(f"{url}/instances", json=body, timeout=30), lambda r: r.status_code != 503, 30)
    finally:
        stop_all([(daemon, url)])
    assert raced.status_code == 503 and raced.headers["retry-after"] == "1", raced.text
    assert "nothing was stored" in raced.json()["error"]["message"]
    assert after["instances"] == []
    assert again.status_code == 201, again.text
    cluster_fault(
        "placement racing a step-down",
        f"POST /instances {raced.status_code} (Retry-After 1, {raced.json()['error']['code']}), "
        f"{len(after['instances'])} instances after; asked again, {again.status_code} from the next turn",
    )


def test_a_node_cut_from_etcd_alone_forwards_to_the_controller_it_last_knew(tmp_path, hf_home):
    """node-2, a host of its own, loses etcd (a blackhole route) but still reaches node-1, the controller: its
    chats are forwarded there for as long as the cut lasts (they were 503 from one lease TTL on). Cut from
    node-1 too, it says which of the two it cannot reach."""
    if (why := netns.unusable()) is not None:
        pytest.skip(f"{why} (CI runs as root)")
    env = {**os.environ, "HF_HOME": str(hf_home), "EXOD_API_KEY": KEY}
    ttl = 5
    with netns.namespace(outside=3) as namespace:
        etcd_address, address_1, client_address = namespace.outside
        etcd = LocalEtcd(tmp_path / "etcd", host=etcd_address)
        etcd.start()
        daemons = []
        try:
            daemons.append(start(tmp_path, etcd.url, 1, env, ttl, address=address_1))
            until(lambda: nodes(daemons[0][1], AUTH), lambda v: v["controller"] == "node-1", 30)
            daemons.append(start(tmp_path, etcd.url, 2, env, ttl, address=namespace.inside, wrap=namespace.run))
            url_1, url_2 = daemons[0][1], daemons[1][1]
            until(lambda: nodes(url_1, AUTH), lambda v: len(v["nodes"]) == 2, 30)
            body = {"model": "exod/tiny-qwen2", "ranks": 1, "nodes": ["node-1"]}
            iid = httpx.post(f"{url_1}/instances", json=body, headers=AUTH, timeout=30).json()["instance_id"]
            until(lambda: instance_at(url_1, iid, AUTH), lambda i: i["state"] == "ready", 60)
            chat = {**CHAT, "max_tokens": 3}
            # the client reaches node-2 from an address of its own (replies to etcd's are blackholed)
            with httpx.Client(transport=httpx.HTTPTransport(local_address=client_address), headers=AUTH) as client:
                assert client.post(f"{url_2}/v1/chat/completions", json=chat, timeout=30).status_code == 200
                namespace.cut_from(etcd_address)
                cut_at, statuses = time.monotonic(), []
                while time.monotonic() - cut_at < 3 * ttl:  # past a lease, and the window it was served from
                    statuses.append(client.post(f"{url_2}/v1/chat/completions", json=chat, timeout=30).status_code)
                    time.sleep(0.5)
                health = client.get(f"{url_2}/health", timeout=10).json()
                namespace.cut_from(address_1)
                neither = client.post(f"{url_2}/v1/chat/completions", json=chat, timeout=60)
                namespace.heal_from(address_1)
                namespace.heal_from(etcd_address)
        finally:
            stop_all(daemons)
            etcd.stop()
    assert health["status"] == "degraded" and "etcd" in health["reason"]  # the cut was real
    assert statuses and set(statuses) == {200}, statuses
    assert neither.status_code == 503 and neither.headers["retry-after"] == "1", neither.text
    message = neither.json()["error"]["message"]
    assert "etcd" in message and "node-1" in message and url_1 in message
    cluster_fault(
        "node cut from etcd alone",
        f"{len(statuses)} chats to it over {3 * ttl} s of the cut (lease TTL {ttl} s): all "
        f"{statuses[0]}, forwarded to node-1; cut from node-1 too: {neither.status_code} naming etcd and node-1",
    )


def test_forward_idle_is_a_few_lease_ttls_by_default_and_never_under_a_few_keep_alives(tmp_path):
    """`[cluster] forward_idle`: 3 lease TTLs unless given; one the forwarded streams' keep-alives could not
    meet is refused, naming the key and the least it may be."""
    from exod.config import ConfigError, load

    token = cluster_token_file(tmp_path)
    cluster = (
        f'[cluster]\nurl = "http://127.0.0.1:2379"\nnode_id = "n"\nadvertise = "127.0.0.1"\ntoken_file = "{token}"\n'
    )
    path = tmp_path / "exod.toml"
    path.write_text(cluster + "lease_ttl = 7\n")
    assert load(path).cluster.idle_bound == 21
    path.write_text(cluster + "forward_idle = 12.5\n")
    assert load(path).cluster.idle_bound == 12.5
    path.write_text(cluster + "forward_idle = 3\n")
    with pytest.raises(ConfigError, match=r"\[cluster\]: forward_idle must be at least 5 s"):
        load(path)
