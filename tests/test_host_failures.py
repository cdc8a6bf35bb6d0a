"""Failures of the host, not the model — no fds or disk to start a runner, a ring port another process took —
end the generation and wait out the backoff, but spend no retry: the instance is never deleted by them.
And a model whose files vanish from the cache is fetched again: that is no defect of the model either."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import pytest
import trio
from fake_runners import FakeFleet, FakeModels, FakeRunner
from reliability_report import attack
from test_controller_clock import MODEL, POLICY, Sim, instance, ready_at, simulate, until

import fsm
from daemon_harness import FAST_RETRY, config, runner_pids, wait_for, with_controller
from exod.host import ring
from exod.host.tiny_model import make_tiny_model
from exod.reports import Reports
from exod.runner import protocol as p
from exod.runner.process import _failure_fields, is_host_failure

STRICT = fsm.RetryPolicy(backoff=POLICY.backoff, max_failures=1)  # one charged failure would delete it


@pytest.mark.parametrize(
    ("exc", "host"),
    [
        (RuntimeError("[ring] Couldn't bind socket (error: 98)"), True),  # what MLX raises for a taken port
        (OSError(errno.EMFILE, "Too many open files"), True),
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (RuntimeError("[ring] Couldn't bind socket (error: 13)"), False),  # EACCES: not a busy host
        (RuntimeError("boom"), False),
        (FileNotFoundError(errno.ENOENT, "model.safetensors"), False),
    ],
)
def test_what_the_runner_calls_the_hosts_failure(exc, host):
    assert is_host_failure(exc) is host
    fields = _failure_fields(exc)
    assert fields["host"] is host and (fields["retryable"] or not host)


def test_a_host_failure_report_becomes_an_uncharged_failure():
    events = []

    class Sink:
        requests = None

        def runner_event(self, event):
            events.append(event)

    report = p.Failed("r", 1, **_failure_fields(RuntimeError("[ring] Couldn't bind socket (error: 98)")))
    assert p.from_json(report.to_json()) == report  # the field crosses the wire
    Reports(Sink()).on_report(_spec(), report)
    (event,) = events
    assert event.failure.kind is fsm.FailureKind.HOST and not event.failure.charged
    assert "Couldn't bind socket" in event.failure.message


def _spec():
    from exod.host.supervisor import RunnerSpec

    return RunnerSpec(runner_id="r", incarnation=1, rank=0, world_size=1, hostfile=None, log_path=Path("/dev/null"))


class NoFds(FakeFleet):
    """A fleet whose first ``failing`` processes cannot be started: the host is out of file descriptors."""

    def __init__(self, models: FakeModels, failing: int) -> None:
        super().__init__(models)
        self.failing = failing

    def __call__(self, spec, listener, timeouts) -> FakeRunner:
        runner = super().__call__(spec, listener, timeouts)
        if self.failing > 0:
            self.failing -= 1

            async def cannot_start(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
                raise OSError(errno.EMFILE, "Too many open files")

            runner.run = cannot_start  # type: ignore[method-assign]
        return runner


def test_runners_that_cannot_be_spawned_for_lack_of_fds_cost_no_retry(tmp_path):
    models = FakeModels()
    fleet = NoFds(models, failing=3)

    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 1, policy=STRICT)
        return await until(sim.controller, ready_at(iid, 4)), await sim.log("instance", iid)

    status, log = simulate(tmp_path, body, models=models, fleet=fleet)
    inst = status["instances"][0]
    assert (inst["attempts"], inst["uncharged"], inst["state"]) == (0, 3, "ready")
    armed = [e.time for e in log if e.target == "backing_off"]
    restarted = [e.time for e in log if e.source == "backing_off" and e.target == "starting"]
    assert [round(b - a, 6) for a, b in zip(armed, restarted, strict=True)] == [2.0, 4.0, 8.0]  # waited, growing


def test_no_fds_for_the_ring_ports_is_a_host_failure_not_a_daemon_crash(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = ring.free_ports

    def exhausted(count):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(count)

    monkeypatch.setattr(ring, "free_ports", exhausted)

    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 2, policy=STRICT)
        return await until(sim.controller, ready_at(iid, 3))

    inst = simulate(tmp_path, body)["instances"][0]
    assert (inst["attempts"], inst["uncharged"]) == (0, 2)
    assert "Too many open files" in inst["last_failure"]


# -- a squatted ring port, with real runner processes -------------------------------------------------


@pytest.mark.usefixtures("no_runner_left_behind")
def test_a_squatted_ring_port_costs_nothing_and_the_next_generation_picks_new_ports(tmp_path, monkeypatch):
    hf = tmp_path / "hf"
    make_tiny_model(MODEL, layers=2, hf_home=hf)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real, calls = ring.free_ports, {"n": 0}

    def first_two_taken(count):  # the race free_ports cannot rule out, made certain for two generations
        calls["n"] += 1
        ports = real(count)
        return [taken, *ports[1:]] if calls["n"] <= 2 else ports

    monkeypatch.setattr(ring, "free_ports", first_two_taken)
    policy = fsm.RetryPolicy(backoff=FAST_RETRY.backoff, max_failures=1)
    cfg = config(tmp_path, hf)

    async def body(controller):
        iid = await controller.place(MODEL, 2, policy=policy)
        status = await wait_for(
            controller,
            lambda s: instance(s, iid)["state"] in ("ready", "deleted") and instance(s, iid)["generation"] >= 3,
        )
        return instance(status, iid)

    try:
        inst = with_controller(cfg, body, limit=120)
    finally:
        squatter.close()
    assert (inst["state"], inst["generation"], inst["attempts"], inst["uncharged"]) == ("ready", 3, 0, 2)
    assert "Couldn't bind socket" in inst["last_failure"]
    assert runner_pids() == []
    attack(
        "port squatting",
        f"rank 0's ring port taken for 2 generations (max_failures = 1): '{inst['last_failure']}' twice, "
        f"{inst['attempts']} retries spent, {inst['uncharged']} uncharged, Ready at generation 3 on new ports",
    )


# -- a model whose files vanish as a runner loads it ---------------------------------------------------------


class VanishingOnce(FakeModels):
    """The first load finds the model's files gone from the cache (removed between the check and the read)."""

    def __init__(self) -> None:
        super().__init__()
        self.gone_once = False

    def defect(self, model_path: str) -> str | None:
        if self.gone_once:
            return None
        self.gone_once = True
        self._paths.clear()  # what `huggingface-cli delete-cache` did meanwhile
        return "FileNotFoundError: No such file or directory: 'model.safetensors'"


def test_a_load_that_finds_the_model_gone_fetches_it_again_instead_of_deleting_the_instance(tmp_path):
    models = VanishingOnce()

    async def body(sim: Sim):
        iid = await sim.controller.place(MODEL, 2)
        return await until(sim.controller, ready_at(iid, 2)), await sim.log("download")

    status, downloads = simulate(tmp_path, body, models=models)
    inst = status["instances"][0]
    assert inst["delete_reason"] is None  # retried, not deleted as non-retryable
    assert (inst["attempts"], inst["uncharged"]) == (0, 1)  # the host lost the files: no retry spent (#26)
    assert "went missing from this node's cache: fetching it again" in inst["last_failure"]
    assert len([f for f in models.fetches if f[2] == "ok"]) == 2  # fetched again
    assert ("completed", "pending") in [(e.source, e.target) for e in downloads]


def test_exod_status_shows_the_hosts_failures_apart_and_what_an_instance_waits_for(tmp_path):
    from click.testing import CliRunner

    from exod.cli import main
    from exod.state.sqlite import Store
    from fsm import instance as inst
    from fsm.cluster import Cluster

    cluster = Cluster()
    cluster.place("i", MODEL, [fsm.Slot(0, "local", "i/0")])
    cluster.execute(fsm.StartGeneration("i", 1), 1.0)
    port_taken = fsm.Failure.host("RuntimeError: [ring] Couldn't bind socket (error: 98)")
    cluster.instance_event(inst.RankFailed("i", 2.0, 1, 0, failure=port_taken))
    cluster.instance_event(inst.RankStopped("i", 2.0, 1, 0))
    cluster.execute(fsm.StartGeneration("i", 2), 10.0)
    store = Store.open(tmp_path / "state" / "state.db")
    store.save(cluster.to_dict(), cluster.log, 10.0)
    store.close()
    out = CliRunner().invoke(main, ["status", "--state-dir", str(tmp_path / "state")])
    assert out.exit_code == 0, out.output
    assert "attempts=0/5 (+1 the host's, uncharged)" in out.output
    assert "waiting for: download" in out.output and "Couldn't bind socket" in out.output
