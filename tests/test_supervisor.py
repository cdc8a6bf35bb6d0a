"""exod.host.supervisor with stand-in processes: stop escalation, exit reporting, stall watchdogs, garbled channels."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import attrs
import trio
import trio.testing

from exod.host.supervisor import RunnerSpec, Supervisor, Timeouts, Watchdog
from exod.runner import protocol as p

IGNORES_EVERYTHING = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ignoring", flush=True)
time.sleep(60)
"""
DIES_ON_TERM = "import time; time.sleep(60)"
GARBLES = """
import os, sys
fd = int(sys.argv[1])
os.write(fd, b'{"type": "status", "runner_id": "r", "incarnation": 1, "phase": "nonsense"}\\n')
import time; time.sleep(60)
"""
SAYS_NOTHING = "import time; time.sleep(60)"


class StandIn(Supervisor):
    def __init__(self, script: str, tmp_path: Path, timeouts: Timeouts) -> None:
        spec = RunnerSpec("r", 1, 0, 1, None, tmp_path / "r.log")
        self.events: list[tuple] = []
        super().__init__(spec, self, timeouts)
        self.script = script

    def _argv(self, control_fd: int, deadline_fd: int | None) -> list[str]:
        return [sys.executable, "-c", self.script, str(control_fd)]

    # the Listener, recording
    def on_spawned(self, spec, pid):
        self.events.append(("spawned", pid))

    def on_report(self, spec, report):
        self.events.append(("report", report))

    def on_stall(self, spec, phase, seconds):
        self.events.append(("stall", phase))

    def on_exit(self, spec, exit_code, stderr_tail, stopped):
        self.events.append(("exit", exit_code, stderr_tail, stopped))


FAST = Timeouts(connect=0.3, load_progress=0.3, warm_up=0.3, stop_grace=0.3, term_grace=0.3)


def run(supervisor: StandIn, after_start) -> float:
    async def main() -> float:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                await nursery.start(supervisor.run)
                await after_start(supervisor)
                start = trio.current_time()
                # run() returns once the process is reaped
            return trio.current_time() - start

    return trio.run(main)


async def ask_stop(s: StandIn) -> None:
    await trio.sleep(0.3)  # let the stand-in install its handlers
    s.stop()


def test_a_process_ignoring_shutdown_and_sigterm_is_killed(tmp_path):
    s = StandIn(IGNORES_EVERYTHING, tmp_path, FAST)
    run(s, ask_stop)
    assert s.events[0][0] == "spawned"
    assert s.events[-1][:2] == ("exit", -signal.SIGKILL)
    assert "ignoring" in s.events[-1][2]  # the log tail travels with the exit
    assert s.events[-1][3] is True  # we stopped it


def test_sigterm_is_enough_for_a_process_that_honours_it(tmp_path):
    s = StandIn(DIES_ON_TERM, tmp_path, FAST)
    run(s, ask_stop)
    assert s.events[-1][:2] == ("exit", -signal.SIGTERM)


def test_the_phases_of_a_start_are_not_the_supervisors_to_watch(tmp_path):
    """A silent Connect, Load or WarmUp is the plan's stall (`fsm.PhaseLimits`, kept by the controller, which
    sees the same reports); the supervisor reporting it too would fail the runner twice."""
    s = StandIn(SAYS_NOTHING, tmp_path, FAST)

    async def start_then_wait(sup):
        for command in (p.Connect(), p.Load(model_path="/nowhere"), p.WarmUp()):
            sup.post(command)
        await trio.sleep(4 * FAST.connect)
        sup.stop()

    run(s, start_then_wait)
    assert [e for e in s.events if e[0] == "stall"] == []


def test_a_garbled_channel_fails_the_runner_and_stops_it(tmp_path):
    s = StandIn(GARBLES, tmp_path, attrs.evolve(FAST, stop_grace=0.1))
    run(s, lambda sup: trio.sleep(0))
    reports = [e[1] for e in s.events if e[0] == "report"]
    assert len(reports) == 1 and isinstance(reports[0], p.Failed)
    assert reports[0].exception_type == "ProtocolError" and not reports[0].retryable
    assert s.events[-1][0] == "exit"


def test_cancelling_the_supervisor_kills_and_reaps(tmp_path):
    s = StandIn(IGNORES_EVERYTHING, tmp_path, FAST)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(s.run)
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()

    trio.run(main)
    pid = s.events[0][1]
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped (not even a zombie) before run() returned


def test_a_busy_runner_that_goes_silent_is_reported_stalled(tmp_path):
    s = StandIn(SAYS_NOTHING, tmp_path, attrs.evolve(FAST, generate=0.3))

    async def request_then_wait(sup):
        sup.post(p.Generate(request_id="r1", prompt_tokens=[1]))
        await trio.sleep(0.8)
        sup.stop()

    run(s, request_then_wait)
    assert [e for e in s.events if e[0] == "stall"] == [("stall", "generating")]


def test_an_exit_by_a_signal_we_never_sent_did_not_answer_our_stop(tmp_path):
    """Killed by another just before our Shutdown: the write may still succeed, but the exit is not ours."""
    s = StandIn(SAYS_NOTHING, tmp_path, FAST)

    async def killed_then_stopped(sup):
        os.kill(sup.pid, signal.SIGKILL)
        sup.stop()

    run(s, killed_then_stopped)
    assert s.events[-1][:2] == ("exit", -signal.SIGKILL)
    assert s.events[-1][3] is False


def test_a_runner_log_is_its_own_processs_never_appended_to_an_earlier_ones(tmp_path):
    """Issue #25: a reused instance id's log grew across unrelated spawns, and the exit's tail showed another
    process's last words."""
    (tmp_path / "r.log").write_text("an earlier process's last words\n")
    says_bye = "import sys; print('bye', file=sys.stderr, flush=True); sys.exit(3)"
    supervisor = StandIn(says_bye, tmp_path, FAST)
    run(supervisor, lambda s: trio.sleep(0))
    exit_code, tail = supervisor.events[-1][1], supervisor.events[-1][2]
    assert exit_code == 3 and "bye" in tail and "earlier" not in tail
    assert (tmp_path / "r.log").read_text() == "bye\n"


def test_commands_posted_together_are_written_at_once_and_in_order(tmp_path):
    """One planner pass's commands (one call's inputs to embed) go to the runner in one write, which the
    runner takes in one step (`exod.runner.batch.Lockstep`); a command posted later goes in a write of its own."""
    import trio.testing

    class Recording:
        def __init__(self) -> None:
            self.writes: list[bytes] = []

        async def send_all(self, data: bytes) -> None:
            self.writes.append(data)

    supervisor = StandIn(SAYS_NOTHING, tmp_path, FAST)
    stream = Recording()
    supervisor._stream = stream  # type: ignore[assignment]
    together = [p.Generate(f"e{i}", prompt_text=f"input {i}", max_tokens=0, embed=True) for i in range(5)]

    async def main() -> None:
        for command in together:
            supervisor.post(command)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor._write_commands)
            await trio.testing.wait_all_tasks_blocked()
            supervisor.post(p.Cancel("e0"))
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert stream.writes == [b"".join(c.to_line() for c in together), p.Cancel("e0").to_line()]


def test_the_generation_watchdog_fires_one_timeout_after_the_last_token_and_never_while_tokens_flow():
    """Tokens move the deadline without waking the watchdog (it looks again when the old one passes); a
    runner silent for the timeout with a request outstanding is reported once; one with none is not."""
    stalls: list[tuple[str, float]] = []

    async def main() -> None:
        watchdog = Watchdog(Timeouts(generate=10.0), lambda phase, _: stalls.append((phase, trio.current_time())))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watchdog.run)
            for round_ in range(2):  # the second after a Done disarmed it: a new request arms it again
                watchdog.arm_for(p.Generate(f"r{round_}", prompt_tokens=[1], max_tokens=99))
                for _ in range(20):  # 120 s of tokens, 6 s apart
                    await trio.sleep(6)
                    watchdog.feed(p.Token("w", 0, f"r{round_}", "x", 1))
                assert stalls == []
                if round_ == 0:
                    watchdog.feed(p.Done("w", 0, "r0", p.FinishReason.LENGTH, 1, 20))
                    await trio.sleep(60)  # nothing outstanding: silence is no stall
                    assert stalls == []
            last_token = trio.current_time()
            await trio.sleep(60)
            nursery.cancel_scope.cancel()
        assert stalls == [("generating", last_token + 10.0)]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
