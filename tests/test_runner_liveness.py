"""A stopped runner is noticed in seconds (issue #46, item 3): the heartbeat.

A runner process SIGSTOPped, from outside, while it serves nothing (Ready, idle) and while it answers a streamed
chat (busy): within ``[timeouts] heartbeat`` (and one ping's interval) `/instances` says its runner failed,
naming the missed heartbeat, charged to the instance; the chat in flight ends with an error event and
``[DONE]``, never a hang; the stopped process is killed and reaped, and a new generation, new processes,
serves. The same on a cluster's node that is not the controller, whose agent pings its runner and relays the
answers. Watched from outside: the runner processes from /proc every 20 ms (never two at once, the stopped one
gone), the client's stream, and `/instances`. The stopped process is let go (SIGCONT, SIGKILL) whatever
happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from reliability_report import attack, cluster_fault
from test_cluster_nodes import hf_home as hf_home  # a fixture: a tiny model in an HF cache
from test_cluster_nodes import instance_at, nodes, start, stop_all
from test_runner_process import model_dir as model_dir  # a fixture: a tiny model's directory
from test_runner_process import spawn as spawn  # a fixture: runner processes with their channel

from daemon_harness import Background, runner_pids, start_daemon, wait_instance
from exod.cluster.remote import SILENCE_S
from exod.host.heartbeats import PINGS_PER_LIMIT
from exod.host.tiny_model import SPECIAL_TOKENS, make_tiny_model
from exod.runner import protocol as p

MODEL = "exod/tiny-qwen2"
MESSAGES = [{"role": "user", "content": "Tell me about state machines."}]  # the tiny model talks on (test_drain)
HEARTBEAT = 2.0  # [timeouts] heartbeat: the limit under test
STOP_GRACE = TERM_GRACE = 1.0  # a stopped process ignores Shutdown and SIGTERM: SIGKILL ends it after both
PING = HEARTBEAT / PINGS_PER_LIMIT  # the last answer came at most this long before the stop
SLACK = 3.0  # the daemon's event loop and this test's polling on a busy machine (2 cores, 4 workers)
CONFIG = f"""
[daemon]
host = "127.0.0.1"
port = 0
offline = true

[retry]
initial = 0.2
cap = 1.0
max_failures = 3

[timeouts]
heartbeat = {HEARTBEAT}
stop_grace = {STOP_GRACE}
term_grace = {TERM_GRACE}

[[place]]
model = "{MODEL}"
ranks = 1
"""

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")


@pytest.fixture
def no_runner_left_behind() -> Iterator[None]:
    yield
    assert runner_pids() == [], "a runner process outlived its test"


class Watch(Background):
    """The runner processes of this session, from /proc every 20 ms: each pid's first and last sighting, and
    the most seen alive at once."""

    EVERY = 0.02

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, tuple[float, float]] = {}
        self.most_at_once = 0

    def step(self) -> None:
        now, pids = time.monotonic(), runner_pids()
        self.most_at_once = max(self.most_at_once, len(pids))
        for pid in pids:
            self.seen[pid] = (self.seen.get(pid, (now, now))[0], now)


@contextlib.contextmanager
def serving(tmp: Path) -> Iterator[str]:
    """`exod serve` with the tiny model, once its instance is Ready; SIGTERM ends it."""
    hf = tmp / "hf"
    make_tiny_model(MODEL, layers=2, hf_home=hf)
    (tmp / "exod.toml").write_text(CONFIG)
    process, url = start_daemon(tmp, {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"})
    try:
        wait_instance(url, lambda i: i["state"] == "ready")
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[float]:
    """SIGSTOP ``pid``; yields when. Let go however the test ends: continued, then killed if still there (the
    daemon must have killed it already)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        until(lambda: state(pid), lambda s: s == "T", 5)  # a signal is delivered when the process is scheduled
        yield time.monotonic()
    finally:
        for signum in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def state(pid: int) -> str:
    """The process's state letter (T: stopped, Z: a zombie), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def alive(pid: int) -> bool:
    return state(pid) not in ("", "Z")


def until(what, done, within: float, step: float = 0.02):
    deadline = time.monotonic() + within
    while True:
        value = what()
        if done(value):
            return value, time.monotonic()
        assert time.monotonic() < deadline, f"not within {within:g} s; last: {value}"
        time.sleep(step)


def instance(url: str) -> dict:
    return httpx.get(f"{url}/instances", timeout=10).json()["instances"][0]


# the tiny model's special tokens (its end of turn among them) never sampled: a chat that lasts its max_tokens,
# surely mid-answer when its runner is stopped (otherwise a random model may end it within a few tokens)
# (the BPE trainer numbers the special tokens first, in order: 0, 1, 2)
ENDLESS = {str(i): -100 for i in range(len(SPECIAL_TOKENS))}


def streamed(url: str, seen: dict) -> None:
    """A streamed chat, its events (and when each came) into ``seen``."""
    seen["events"] = []
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 4000, "logit_bias": ENDLESS}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=None) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    seen["events"].append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))
    except httpx.HTTPError as exc:
        seen["error"] = exc
    seen["ended"] = time.monotonic()


def test_the_runner_answers_a_ping_whatever_its_main_thread_does_and_a_stopped_one_does_not(spawn, model_dir):
    """The reader thread answers: with the main thread stuck for good (a fault hangs it while warming up) a
    ping is answered at once; SIGSTOPped, nothing comes; continued, the ping waiting is answered."""
    runner = spawn(extra=("--fault", "warming_up:hang"))
    runner.send(p.Load(str(model_dir)))
    runner.recv_until(p.Status)  # weights
    runner.recv_until(p.Status)  # loaded
    runner.send(p.WarmUp())
    assert [m.phase for m in runner.recv_until(p.Status) if isinstance(m, p.Status)] == [p.Phase.WARMING_UP]
    for _ in range(3):
        asked = time.monotonic()
        runner.send(p.Ping())
        assert isinstance(runner.recv(timeout=HEARTBEAT), p.Pong)  # the main thread hangs: the reader answers
        assert time.monotonic() - asked < HEARTBEAT / PINGS_PER_LIMIT
    with stopped(runner.proc.pid):
        runner.send(p.Ping())
        runner.sock.settimeout(HEARTBEAT)
        with pytest.raises(TimeoutError):
            runner.sock.recv(1)  # stopped: no answer
        os.kill(runner.proc.pid, signal.SIGCONT)
        assert isinstance(runner.recv(timeout=HEARTBEAT), p.Pong)


@pytest.mark.parametrize("doing", ["idle", "busy"])
def test_a_stopped_runner_misses_its_heartbeat_and_a_new_generation_serves(tmp_path, doing):
    chat: dict = {}
    with serving(tmp_path) as url, Watch() as watch:
        (old,) = runner_pids()
        before = instance(url)
        assert (before["generation"], before["attempts"]) == (1, 0), before
        reader = threading.Thread(target=streamed, args=(url, chat), daemon=True)
        if doing == "busy":
            reader.start()
            until(lambda: len(chat.get("events", [])), lambda n: n >= 2, 30)  # tokens flow
        with stopped(old) as stopped_at:
            assert "ended" not in chat, "the chat ended before its runner was stopped: make it longer"
            failed, failed_at = until(
                lambda: instance(url), lambda i: i["last_failure"] is not None, HEARTBEAT + PING + SLACK
            )
            noticed = failed_at - stopped_at
            old_gone_at = until(lambda: alive(old), lambda a: not a, STOP_GRACE + TERM_GRACE + SLACK)[1]
            if doing == "busy":
                reader.join(timeout=SLACK)
                assert not reader.is_alive(), "the chat in flight hangs on its stopped runner"
        ready, ready_at = until(
            lambda: instance(url), lambda i: i["state"] == "ready" and i["generation"] == 2, 60, step=0.05
        )
        (new,) = runner_pids()
    assert HEARTBEAT - PING - 0.5 <= noticed <= HEARTBEAT + PING + SLACK, noticed  # the heartbeat, nothing else
    assert "missed its heartbeat" in failed["last_failure"], failed
    (runner,) = failed["runners"]
    assert "missed its heartbeat" in (runner["failure"] or ""), runner
    assert failed["state"] in ("recovering", "backing_off", "starting"), failed
    assert failed["attempts"] == 1 and failed["uncharged"] == 0, failed  # charged: its own failure
    assert ready["attempts"] == 1, ready
    assert new != old and not alive(old)
    assert watch.most_at_once == 1, f"two runner processes alive at once: {watch.seen}"
    assert watch.seen[old][1] < watch.seen[new][0], watch.seen  # the stopped one reaped before the next spawned
    ended = ""
    if doing == "busy":
        (_, error), (_, done) = chat["events"][-2:]
        assert done == "[DONE]" and "error" in error, chat["events"][-3:]
        assert "error" not in chat, chat  # an answer that ends, not a broken connection
        ended = (
            f"; the chat in flight ended {chat['ended'] - stopped_at:.1f} s after the stop with an error event "
            f"({error['error']['message'][:80]!r}) and [DONE]"
        )
    attack(
        f"runner stopped while {doing}",
        f"SIGSTOP of the runner ({'mid-answer' if doing == 'busy' else 'Ready, no request'}), heartbeat "
        f"{HEARTBEAT:g} s: /instances said it failed {noticed:.1f} s later ({failed['last_failure']!r}, charged: "
        f"attempts 1){ended}; the stopped process was gone {old_gone_at - stopped_at:.1f} s after the stop, "
        f"a new generation Ready with a new pid {ready_at - stopped_at:.1f} s after it; never two runner "
        f"processes alive at once (/proc every 20 ms)",
    )


def test_the_daemon_paused_past_the_heartbeat_fails_no_runner(tmp_path):
    """The silence is the daemon's own (SIGSTOPped, as a starved event loop would be): the answers wait unread,
    and on resuming it listens a whole limit again before it judges. Nothing fails, nothing is charged, the
    same process serves on."""
    with serving(tmp_path) as url:
        (pid,) = runner_pids()
        daemon = int(json.loads((tmp_path / "state" / "daemon.json").read_text())["pid"])
        os.kill(daemon, signal.SIGSTOP)
        try:
            time.sleep(4 * HEARTBEAT)
        finally:
            os.kill(daemon, signal.SIGCONT)
        time.sleep(2 * HEARTBEAT)  # longer than the limit, listening again
        after = instance(url)
        answered = httpx.post(
            f"{url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4}, timeout=30
        )
        assert runner_pids() == [pid]
    assert (after["state"], after["generation"], after["attempts"], after["last_failure"]) == ("ready", 1, 0, None)
    assert answered.status_code == 200, answered.text


def test_a_stopped_runner_on_another_node_is_noticed_by_the_controller(tmp_path, etcd, hf_home):
    """Two `exod serve` nodes on one etcd; the rank runs on node-2, the controller is node-1: node-2's agent
    pings its runner, and the answers reach the controller on the agent's report stream. Stopped, the runner
    misses them: the controller fails it within the heartbeat, node-2's agent kills it, and a new generation
    serves there."""
    extra = f"\n[timeouts]\nheartbeat = {HEARTBEAT}\nstop_grace = {STOP_GRACE}\nterm_grace = {TERM_GRACE}\n"
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = []
    try:
        with Watch() as watch:
            daemons.append(start(tmp_path, etcd, 1, env, extra_cluster=extra))
            until(lambda: nodes(daemons[0][1]).get("controller"), lambda c: c == "node-1", 30, step=0.1)
            daemons.append(start(tmp_path, etcd, 2, env, extra_cluster=extra))
            url = daemons[0][1]
            until(lambda: len(nodes(url)["nodes"]), lambda n: n == 2, 30, step=0.1)
            body = {"model": MODEL, "ranks": 1, "nodes": ["node-2"]}
            iid = httpx.post(f"{url}/instances", json=body, timeout=30).json()["instance_id"]
            until(lambda: instance_at(url, iid)["state"], lambda s: s == "ready", 60, step=0.1)
            (old,) = runner_pids()
            with stopped(old) as stopped_at:
                failed, failed_at = until(
                    lambda: instance_at(url, iid), lambda i: i["last_failure"] is not None, HEARTBEAT + PING + SLACK
                )
                noticed = failed_at - stopped_at
                old_gone_at = until(lambda: alive(old), lambda a: not a, STOP_GRACE + TERM_GRACE + SLACK)[1]
            ready, ready_at = until(
                lambda: instance_at(url, iid), lambda i: i["state"] == "ready" and i["generation"] == 2, 60, step=0.1
            )
            (new,) = runner_pids()
    finally:
        stop_all(daemons)
    assert HEARTBEAT - PING - 0.5 <= noticed <= HEARTBEAT + PING + SLACK, noticed
    assert "missed its heartbeat" in failed["last_failure"] and failed["attempts"] == 1, failed
    assert [r["node"] for r in ready["runners"]] == ["node-2"] and ready["attempts"] == 1, ready
    assert new != old and not alive(old)
    assert watch.most_at_once == 1, f"two runner processes alive at once: {watch.seen}"
    cluster_fault(
        "runner stopped on another node",
        f"SIGSTOP of the runner on node-2 (Ready, no request; node-1 the controller), heartbeat {HEARTBEAT:g} s: "
        f"the controller's /instances said it failed {noticed:.1f} s later ({failed['last_failure']!r}, "
        f"charged); node-2's agent had it gone {old_gone_at - stopped_at:.1f} s after the stop, a new "
        f"generation Ready on node-2 {ready_at - stopped_at:.1f} s after it; never two runner processes alive",
    )


def test_a_paused_agent_is_its_nodes_failure_never_its_runners_missed_heartbeat(tmp_path, etcd, hf_home):
    """node-2's daemon (its agent) SIGSTOPped, its runner not, the heartbeat shorter than a lost node takes to
    say: the runner's answers stop reaching the controller with its node's stream, and that is its node's
    failure (uncharged), never the runner's missed heartbeat."""
    extra = f"\n[timeouts]\nheartbeat = {HEARTBEAT}\n"
    env = {**os.environ, "HF_HOME": str(hf_home)}
    daemons = []
    try:
        daemons.append(start(tmp_path, etcd, 1, env, extra_cluster=extra))
        until(lambda: nodes(daemons[0][1]).get("controller"), lambda c: c == "node-1", 30, step=0.1)
        daemons.append(start(tmp_path, etcd, 2, env, extra_cluster=extra))
        url = daemons[0][1]
        until(lambda: len(nodes(url)["nodes"]), lambda n: n == 2, 30, step=0.1)
        body = {"model": MODEL, "ranks": 1, "nodes": ["node-2"]}
        iid = httpx.post(f"{url}/instances", json=body, timeout=30).json()["instance_id"]
        until(lambda: instance_at(url, iid)["state"], lambda s: s == "ready", 60, step=0.1)
        agent = daemons[1][0]
        agent.send_signal(signal.SIGSTOP)
        try:
            failed, _ = until(
                lambda: instance_at(url, iid), lambda i: i["last_failure"] is not None, SILENCE_S + SLACK, step=0.1
            )
        finally:
            agent.send_signal(signal.SIGCONT)
    finally:
        stop_all(daemons)
    assert "missed its heartbeat" not in failed["last_failure"], failed
    assert "node-2 lost" in failed["last_failure"], failed
    assert (failed["attempts"], failed["uncharged"]) == (0, 1), failed
    cluster_fault(
        "agent paused, heartbeat shorter than a lost node",
        f"node-2's daemon SIGSTOPped, its runner not, heartbeat {HEARTBEAT:g} s (a silent stream is a lost node "
        f"after {SILENCE_S:g} s): the controller said {failed['last_failure']!r}, attempts "
        f"{failed['attempts']}, uncharged {failed['uncharged']}: the node's failure, not the runner's",
    )
