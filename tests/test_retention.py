"""exod.state.retention: the transition log, the runner logs and the hostfiles stay bounded, and readers of a pruned log
are told where it starts.

The store's pruning is unit-tested in test_store.py; here: the ``[retention]`` config, the file cleanup (alone,
then called by a controller of fake runners), a log that starts mid-way (`fsm.conformance`, `exod replay`,
``GET /events``), and a crash loop of real runner processes whose state directory stays within the bounds.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import attrs
import httpx
import pytest
import trio
from click.testing import CliRunner
from reliability_report import attack
from test_conformance import recorded_log
from test_controller_clock import Sim, settled, simulate, until

import fsm
from daemon_harness import FAST_TIMEOUTS, assert_log_conforms, config, instance, with_controller
from exod.api.app import create_app
from exod.api.http_server import serve_http
from exod.cli import main
from exod.config import ConfigError, DaemonConfig, ServeConfig, load
from exod.controller import Controller
from exod.host.tiny_model import make_tiny_model
from exod.runner.faults import Fault, FaultKind, FaultPhase, FaultSpec
from exod.state.retention import Retention, forget_generation, forget_instance, hostfile_path, runner_log_path
from exod.state.sqlite import Store
from fsm.conformance import replay

pytestmark = pytest.mark.usefixtures("no_runner_left_behind")

MODEL = "exod/tiny-qwen2"


# -- the bounds, from the config ---------------------------------------------------------------


def test_the_embedded_default_and_a_retention_section(tmp_path):
    assert load(None, state_dir=tmp_path).daemon.retention == Retention(100_000, 30.0, 3)
    path = tmp_path / "exod.toml"
    path.write_text("[retention]\nmax_log_rows = 500\nmax_log_age_days = 1.5\nkeep_runner_logs = 1\n")
    assert load(path).daemon.retention == Retention(max_log_rows=500, max_log_age_days=1.5, keep_runner_logs=1)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("max_log_rows = 0", "[retention] max_log_rows: input should be greater than or equal to 1, got 0"),
        ("max_log_rows = 10.5", "[retention] max_log_rows: input should be a valid integer, got 10.5"),
        ("keep_runner_logs = true", "[retention] keep_runner_logs: input should be a valid integer, got True"),
        ("max_log_age_days = -1", "[retention] max_log_age_days: input should be greater than 0, got -1"),
        ("max_log_days = 3", "unknown key(s) ['max_log_days'] in [retention]"),
    ],
)
def test_a_wrong_retention_setting_is_named(tmp_path, line, message):
    path = tmp_path / "exod.toml"
    path.write_text(f"[retention]\n{line}\n")
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert message in str(caught.value)


# -- the runner files ------------------------------------------------------------------------------


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()} if directory.exists() else set()


def test_forget_generation_deletes_its_hostfile_and_the_logs_older_than_the_last_kept(tmp_path):
    for gen in range(1, 7):
        touch(hostfile_path(tmp_path, "i", gen))
        for rank in (0, 1):
            touch(runner_log_path(tmp_path, "i", rank, gen))
    touch(runner_log_path(tmp_path, "other", 0, 1))
    touch(tmp_path / "logs" / "i" / "notes.txt")  # not a runner log: not ours to delete

    forget_generation(tmp_path, "i", 5, keep_logs=3)  # generation 6 lives on

    assert names(tmp_path / "run" / "i") == {"gen6.hostfile.json"}  # 5's, and any older one left behind
    logs = {f"rank{r}-gen{g}.log" for r in (0, 1) for g in (3, 4, 5, 6)}
    assert names(tmp_path / "logs" / "i") == logs | {"notes.txt"}
    assert names(tmp_path / "logs" / "other") == {"rank0-gen1.log"}

    forget_generation(tmp_path, "i", 6, keep_logs=1)
    assert names(tmp_path / "run" / "i") == set()
    assert names(tmp_path / "logs" / "i") == {"rank0-gen6.log", "rank1-gen6.log", "notes.txt"}
    forget_generation(tmp_path, "never-started", 1, keep_logs=1)  # no directory: nothing to do
    with pytest.raises(ValueError, match="keep_logs must be >= 1"):
        forget_generation(tmp_path, "i", 6, keep_logs=0)


def test_forget_instance_deletes_its_directories_and_only_them(tmp_path):
    touch(hostfile_path(tmp_path, "i", 3))
    touch(runner_log_path(tmp_path, "i", 0, 3))
    touch(runner_log_path(tmp_path, "j", 0, 1))
    forget_instance(tmp_path, "i")
    assert names(tmp_path / "run") == set() and names(tmp_path / "logs") == {"j"}
    forget_instance(tmp_path, "i")  # already gone
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError, match="not a single path component"):
            forget_instance(tmp_path, bad)
    assert names(tmp_path / "logs") == {"j"}


def test_the_controller_deletes_the_files_of_reaped_generations_and_forgotten_instances(tmp_path, monkeypatch):
    """Fake runners on trio's MockClock (tests/fake_runners.py); the hostfiles are the controller's own."""
    import exod.controller

    monkeypatch.setattr(exod.controller, "KEEP_DELETED", 2)

    async def body(sim: Sim) -> tuple[list[str], list[str]]:
        ids = [await sim.controller.place(MODEL, 2) for _ in range(4)]
        for iid in ids:
            await until(sim.controller, lambda s, iid=iid: instance(s, iid)["state"] == "ready")
            assert names(tmp_path / "state" / "run" / iid) == {"gen1.hostfile.json"}  # the live generation's
            touch(runner_log_path(tmp_path / "state", iid, 0, 1))  # what a real runner would have written
        for iid in ids:
            await sim.controller.delete(iid)
        await until(sim.controller, lambda s: len(s["instances"]) == 2)
        await settled()
        return ids, [i["instance_id"] for i in sim.controller.status()["instances"]]

    ids, kept = simulate(tmp_path, body)
    assert kept == ids[2:]
    state = tmp_path / "state"
    assert names(state / "run") <= set(kept) and names(state / "logs") == set(kept)  # the forgotten: gone
    assert all(names(state / "run" / iid) == set() for iid in kept)  # generation 1 was reaped: no hostfile


# -- a log that starts mid-way -----------------------------------------------------------------------


def test_every_suffix_of_a_conforming_log_conforms():
    log = recorded_log()
    for start in range(len(log)):
        report = replay(log[start:])
        assert report.ok, f"from entry {start}: {report.text()}"


def pruned_state(state: Path, max_log_rows: int) -> tuple[int, int]:
    """A state dir whose log of `recorded_log`, saved one entry at a time, was pruned: (log start, newest)."""
    store = Store.open(state / "state.db", retention=Retention(max_log_rows=max_log_rows))
    try:
        for e in recorded_log():
            newest = store.save({}, [e], now=e.time)
        return store.log_start(), newest
    finally:
        store.close()


def test_exod_replay_says_where_the_pruned_history_starts_and_replays_the_rest(tmp_path):
    start, newest = pruned_state(tmp_path / "pruned", max_log_rows=10)
    assert 1 < start < newest
    result = CliRunner().invoke(main, ["replay", "--state-dir", str(tmp_path / "pruned")])
    assert result.exit_code == 0, result.output
    said = result.output.splitlines()
    assert said[0].startswith(f"history before seq {start} (1970-01-01 ")  # the time of its oldest entry kept
    assert said[0].endswith("was pruned by the [retention] settings of the config; replaying from there")
    assert said[1] == f"{newest - start + 1} log entries: conform"

    pruned_state(tmp_path / "whole", max_log_rows=1000)
    whole = CliRunner().invoke(main, ["replay", "--state-dir", str(tmp_path / "whole")])
    assert whole.exit_code == 0 and "pruned" not in whole.output


def read_events(lines: list[str]) -> list[tuple[str, int, dict]]:
    """(event, id, data) of each server-sent event in ``lines``; comments (keepalives) skipped."""
    events, fields = [], {}
    for line in lines:
        if not line:
            if fields:
                events.append((fields["event"], int(fields["id"]), json.loads(fields["data"])))
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value
    return events


def test_events_resumed_before_the_log_start_say_truncated_then_stream_from_the_oldest_kept(tmp_path):
    cfg = DaemonConfig(state_dir=tmp_path / "state", retention=Retention(max_log_rows=10))
    log = recorded_log()

    async def main() -> None:
        store = Store.open(cfg.db_path, retention=cfg.retention)
        for e in log[:30]:
            store.save({}, [e], now=e.time)
        oldest = store.log_start()
        assert oldest > 20
        controller = Controller(cfg, store)
        app = create_app(controller)

        async def stream(url: str, headers: dict[str, str], until: int, meanwhile=None) -> list[tuple[str, int, dict]]:
            """The events up to the one with id ``until``; ``meanwhile`` runs once the stream waits for more."""
            lines: list[str] = []
            async with httpx.AsyncClient() as client, client.stream("GET", url, headers=headers) as response:
                if meanwhile is not None:
                    await trio.sleep(0.3)  # the stream has sent what there was and waits for newer entries
                    await meanwhile()
                async for line in response.aiter_lines():
                    lines.append(line)
                    if (events := read_events(lines)) and events[-1][1] == until:
                        return events
            raise AssertionError(f"the stream ended: {lines}")

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                urls = await nursery.start(partial(serve_http, app, ServeConfig(daemon=cfg, port=0)))
                url = f"{urls[0]}/events"

                resumed = await stream(url, {"Last-Event-ID": "2"}, until=30)
                assert resumed[0] == ("truncated", oldest - 1, {"oldest_seq": oldest, "after": 2})
                assert [(kind, seq) for kind, seq, _ in resumed[1:]] == [("transition", s) for s in range(oldest, 31)]
                assert resumed[1][2] == {"seq": oldest, **log[oldest - 1].as_record()}  # the usual format
                everything = await stream(url, {}, until=30)  # from the beginning: the beginning is gone
                assert everything[0] == ("truncated", oldest - 1, {"oldest_seq": oldest, "after": 0})
                kept = await stream(url, {"Last-Event-ID": str(oldest - 1)}, until=30)  # nothing missed: no notice
                assert [(kind, seq) for kind, seq, _ in kept] == [("transition", s) for s in range(oldest, 31)]

                async def outpace() -> None:  # 15 more entries while the reader waits: it misses some
                    for e in log[30:45]:
                        await controller.journal.state.save({}, [e], now=e.time)

                late = await stream(url, {"Last-Event-ID": "30"}, until=45, meanwhile=outpace)
                now_oldest = store.log_start()
                assert now_oldest > 31
                assert late[0] == ("truncated", now_oldest - 1, {"oldest_seq": now_oldest, "after": 30})
                assert [seq for _, seq, _ in late[1:]] == list(range(now_oldest, 46))
                nursery.cancel_scope.cancel()
        store.close()

    trio.run(main)


# -- a crash loop of real runners ---------------------------------------------------------------------

RETENTION = Retention(max_log_rows=60, keep_runner_logs=2)
# rank 1 of every generation (no `generation`) dies as it joins the ring that rank 0 joins with the hostfile:
# the shortest real crash with a ring, about a second a generation (later phases wait for mlx_lm's import)
CRASH = FaultSpec(Fault(FaultPhase.CONNECTING, FaultKind.SIGKILL), rank=1)
POLICY = fsm.RetryPolicy(backoff=fsm.Backoff(initial=0.01, factor=2.0, cap=0.05), max_failures=1000)
TIMEOUTS = attrs.evolve(FAST_TIMEOUTS, connect=10.0, load_progress=10.0, warm_up=10.0, stop_grace=0.5, term_grace=0.5)
GENERATIONS = 20
RANKS = 2


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf")
    make_tiny_model(MODEL, layers=2, hf_home=home)
    return home


def files(state: Path, instance_id: str) -> tuple[list[Path], list[Path]]:
    """(runner logs, hostfiles) of the instance."""
    return sorted((state / "logs" / instance_id).glob("*.log")), sorted((state / "run" / instance_id).glob("*.json"))


def generation_of(log: Path) -> int:
    return int(log.stem.rpartition("-gen")[2])


def test_a_crash_loop_of_real_runners_stays_within_the_retention_bounds(tmp_path, hf_home):
    cfg = config(tmp_path, hf_home, timeouts=TIMEOUTS, policy=POLICY, faults=(CRASH,), retention=RETENTION)
    samples: list[tuple[int, int, int, int]] = []  # generation, runner logs, hostfiles, log rows

    async def body(controller: Controller) -> str:
        iid = await controller.place(MODEL, RANKS)
        while (generation := instance(controller.status(), iid)["generation"]) <= GENERATIONS:
            logs, hostfiles = files(cfg.state_dir, iid)
            samples.append((generation, len(logs), len(hostfiles), len(list(await controller.transitions()))))
            await trio.sleep(0.05)
        return iid

    iid = with_controller(cfg, body, limit=150)

    assert {s[0] for s in samples} >= set(range(1, GENERATIONS + 1))  # a sample in every generation
    keep = RETENTION.keep_runner_logs
    # along the way: the kept generations, the live one, and the next one started before the last was reaped
    assert max(s[1] for s in samples) <= (keep + 2) * RANKS, samples
    assert max(s[2] for s in samples) <= 2, samples
    assert max(s[3] for s in samples) <= RETENTION.max_log_rows, samples
    logs, hostfiles = files(cfg.state_dir, iid)  # every runner reaped: the last `keep` generations' logs
    last = max(generation_of(p) for p in logs)
    assert last >= GENERATIONS and sorted({generation_of(p) for p in logs}) == list(range(last - keep + 1, last + 1))
    assert len(logs) == keep * RANKS and hostfiles == []
    store = Store.open(cfg.db_path)
    try:
        kept, start = len(list(store.transitions())), store.log_start()
    finally:
        store.close()
    assert kept <= RETENTION.max_log_rows and start > 1
    assert_log_conforms(cfg.db_path)  # what is kept still replays through the machines
    attack(
        "growth over a crash loop",
        f"{last} generations, a rank SIGKILLed in each (max_log_rows = {RETENTION.max_log_rows}, keep_runner_logs"
        f" = {keep}): at most {max(s[1] for s in samples)} runner logs, {max(s[2] for s in samples)} hostfile(s) "
        f"and {max(s[3] for s in samples)} log rows at any time; at the end {len(logs)} logs, no hostfile, "
        f"{kept} rows from seq {start}, and the log replays",
    )
