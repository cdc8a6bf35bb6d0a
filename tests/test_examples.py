"""The examples/ programs run and print what they claim (or, without a daemon, one line saying so)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import fsm

ROOT = Path(__file__).resolve().parent.parent


def _run(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


SUPERVISORS = ["supervise_processes.py", "supervise_trio.py"]  # the same supervisor in asyncio and in trio


@pytest.mark.parametrize("example", SUPERVISORS)
def test_supervise_processes_as_replicas_restarts_the_killed_one_alone(example):
    """The same supervisor with `RestartStrategy.ONE_FOR_ONE`: rank 0 keeps its process while rank 1 restarts."""
    out = _run(example, "--one-for-one")
    first = re.search(r"^replicas of generations \[1, 1\] ready, attempts 0, pids \[(\d+), (\d+)\]$", out, re.M)
    second = re.search(r"^replicas of generations \[1, 2\] ready, attempts 1, pids \[(\d+), (\d+)\]$", out, re.M)
    assert first and second and f"killed rank 1 (pid {first.group(2)})" in out, out
    assert second.group(1) == first.group(1) and second.group(2) != first.group(2)  # rank 0 was never stopped
    assert "instance ready → degraded (rank_failed)" in out and "instance degraded → ready (auto)" in out
    assert "recovering" not in out and out.rstrip().endswith("log replays: ok")


def test_drive_runner_goes_through_the_lifecycle_and_fails_while_busy():
    out = _run("drive_runner.py")
    lines = out.splitlines()
    steps = [line.split()[0] for line in lines[1:] if line.strip() and not line.startswith(("final", "failure"))]
    assert steps[:3] == ["connect", "connected", "load"]
    assert steps.count("progress") == 4
    assert re.search(r"^connect\s+idle → joining\s+running\.connecting\.joining$", out, re.M)
    assert re.search(r"^load\s+joined → weights\s+running\.loading\.weights$", out, re.M)
    assert "layers 4/4" in out
    assert re.search(r"^warm_up\s+loaded → warming_up", out, re.M)
    assert re.search(r"^warmed\s+warming_up → available\s+running\.ready\.available$", out, re.M)
    assert re.search(r"^request_started\s+available → busy\s+running\.ready\.busy\s+in flight 1$", out, re.M)
    assert re.search(r"^exited\s+busy → failed, failed → stopped\s+shutdown\.stopped$", out, re.M)
    assert re.search(r"^warmed\s+ignored: stale incarnation 0 < 1", out, re.M)
    assert "final: shutdown.stopped, alive=False" in out
    assert "failure: runner killed by SIGKILL (retryable=True" in out


def test_custom_retry_policy_prints_a_seeded_schedule_and_its_diagram(tmp_path):
    out = _run("custom_retry_policy.py")
    assert out == _run("custom_retry_policy.py")  # seeded jitter: the same schedule every run
    assert "initial 0.5 s, factor 3.0, cap 10.0 s, jitter True, max_failures 3" in out
    schedule = re.findall(r"retry (\d): +([\d.]+) s → +([\d.]+) s", out)
    assert [float(c) for _, c, _ in schedule] == [0.5, 1.5, 4.5, 10.0, 10.0]
    assert all(0 <= float(d) <= float(c) for _, c, d in schedule)
    rows = re.findall(r"^ +(\d) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +backing_off until", out, re.M)
    assert [int(g) for g, *_ in rows] == [1, 2]
    for (_, _, _, ceiling, delay), (_, c, jittered) in zip(rows, schedule, strict=False):
        assert float(ceiling) == float(c) and float(delay) == float(jittered)
    assert re.search(r"^ +3 .* deleted$", out, re.M)
    assert "deleted (retries_exhausted) after 3 failed generations" in out
    assert "stateDiagram-v2" in out and "    class deleted current" in out

    target = tmp_path / "instance.mmd"
    out = _run("custom_retry_policy.py", str(target))
    assert f"diagram written to {target}" in out and "stateDiagram-v2" not in out
    assert target.read_text() == fsm.diagram.mermaid(fsm.InstanceRetry, highlight="deleted")


def test_model_check_example_proves_the_real_planner_and_breaks_the_variant():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(root / "examples" / "model_check.py")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    real, variant = out.stdout.split("== a planner without one_for_all ==")
    assert "all invariants hold" in real and "exhaustive" in real
    assert "invariant violated: 10 no deadlock" in variant and "shortest trace" in variant


def test_the_openai_client_example_without_a_daemon_says_so_in_one_line():
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "openai_client.py"), "--url", f"http://127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "no exod daemon answers there: start one with `make run` (or pass --url)"


@pytest.mark.parametrize("example", SUPERVISORS)
def test_supervise_processes_restarts_a_killed_rank_on_the_public_driver(example):
    """The newcomer's supervisor (#27): real processes on `fsm.Driver` in asyncio and in trio, no daemon code."""
    out = _run(example)
    first = re.search(r"^generation 1 ready, attempts 0, pids \[(\d+), (\d+)\]$", out, re.M)
    killed = re.search(r"^killed rank 1 \(pid (\d+)\)$", out, re.M)
    second = re.search(r"^generation 2 ready, attempts 1, pids \[(\d+), (\d+)\]$", out, re.M)
    assert first and killed and second, out
    assert killed.group(1) == first.group(2)
    assert not {first.group(1), first.group(2)} & {second.group(1), second.group(2)}  # a new generation
    assert "deleted; every process reaped: True" in out
    assert "instance ready → recovering (rank_failed)" in out and "instance backing_off → starting (start)" in out
    assert out.rstrip().endswith("log replays: ok")
    pids = [int(p) for m in (first, second) for p in m.groups()]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


# -- the newcomer's scenario (#49): two workers that outlive their supervisor -------------------------------------

WORKERS = ROOT / "examples" / "supervise_workers.py"


def _workers(state: Path) -> dict[str, psutil.Process]:
    """The live worker processes of ``state``, by runner id, as the process table shows them (zombies are dead)."""
    found = {}
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = proc.info["cmdline"] or []
        if "-c" in cmd and str(state) in cmd and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found[cmd[cmd.index(str(state)) + 1]] = proc
    return found


def _until(what, bound_s: float, why: str):
    """Poll ``what`` until it is truthy; ``bound_s`` is a bound the caller derives, not a measurement."""
    end = time.monotonic() + bound_s
    while not (got := what()):
        assert time.monotonic() < end, f"not within {bound_s} s: {why}"
        time.sleep(0.05)
    return got


def _said(out: Path, *lines: str) -> bool:
    said = out.read_text().splitlines() if out.exists() else []
    return all(any(s.startswith(line) for s in said) for line in lines)


def _snapshot(state: Path) -> fsm.Cluster:
    """The supervisor's snapshot, read with the public API."""
    return fsm.Cluster.from_dict(json.loads((state / "cluster.json").read_text()))


def test_supervise_workers_reattaches_the_live_worker_and_restarts_the_missing_one_after_its_backoff(tmp_path):
    """Kill a worker, kill the supervisor while that replica backs off, restart it: the healthy worker keeps its
    pid (adopted, not restarted), the missing one is restarted only once its backoff is over, then a clean stop."""
    state, backoff = tmp_path / "state", 6.0  # long enough to kill and restart a supervisor inside it, under load too
    argv = [sys.executable, str(WORKERS), str(state), "--backoff", str(backoff)]
    supervisors: list[subprocess.Popen] = []

    def start(name: str) -> Path:
        out = tmp_path / f"{name}.out"
        with out.open("w") as sink:
            supervisors.append(subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT))
        return out

    try:
        first = start("first")
        bound = 20 * backoff  # spawning two interpreters on a loaded 2-core box: far below this
        _until(lambda: _said(first, "web/0 ready", "web/1 ready"), bound, "both workers ready")
        workers = _workers(state)
        healthy, victim = workers["web/0"], workers["web/1"]
        assert healthy.ppid() == victim.ppid() == supervisors[0].pid and healthy.pid != victim.pid
        victim.kill()
        spawned = time.monotonic()  # a process started now: the process table's time of the kill
        reference = psutil.Process(subprocess.Popen([sys.executable, "-c", ""]).pid)
        kill_ct, spawn_s = reference.create_time(), time.monotonic() - spawned
        reference.wait(timeout=bound)
        _until(lambda: not _snapshot(state).runners()["web/1"].alive, bound, "the supervisor saved web/1's exit")
        supervisors[0].kill()  # the supervisor dies while web/1 backs off; its workers are in sessions of their own
        supervisors[0].wait(timeout=bound)
        assert _workers(state).keys() == {"web/0"} and healthy.is_running()

        second = start("second")
        restarted_in = time.monotonic() - spawned
        assert restarted_in < backoff, f"the supervisor restarted {restarted_in:.2f} s after the kill: not inside it"
        _until(lambda: _said(second, "web/1 ready"), bound, "web/1 restarted by the second supervisor")
        assert _said(second, "re-attached: adopted ['web/0']") and not _said(second, "web/0 started")
        now = _workers(state)
        assert now["web/0"].pid == healthy.pid and now["web/0"].create_time() == healthy.create_time()
        replacement = now["web/1"]
        assert replacement.pid != victim.pid and replacement.ppid() == supervisors[1].pid
        waited = replacement.create_time() - kill_ct
        # create times are in clock ticks; the reference was spawned within spawn_s after the kill
        assert waited >= backoff - spawn_s - 0.02, f"web/1 restarted {waited:.2f} s after its death: backoff {backoff}"

        supervisors[1].send_signal(signal.SIGTERM)  # a clean stop: both workers stopped and reaped
        assert supervisors[1].wait(timeout=bound) == 0, (tmp_path / "second.out").read_text()
        assert (tmp_path / "second.out").read_text().rstrip().endswith("stopped: every worker reaped")
        _until(lambda: not _workers(state), bound, "no worker left")
        assert not (state / "cluster.json").exists()
    finally:
        for proc in [*_workers(state).values(), *supervisors]:
            proc.kill()


def test_supervise_workers_gives_up_with_the_reason_when_workers_keep_dying(tmp_path):
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, str(WORKERS), str(state), "--backoff", "0.05", "--crash"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        assert done.returncode == 3, done.stdout + done.stderr
        assert "gave up: retries_exhausted: runner exited unexpectedly with code 1" in done.stdout
        assert len(re.findall(r"^web/\d started", done.stdout, re.M)) >= 3  # restarted before giving up
        assert not _workers(state)
    finally:
        for proc in _workers(state).values():
            proc.kill()
