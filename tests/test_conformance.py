"""fsm.conformance: a log that follows the machines conforms; the first step that does not is named."""

from __future__ import annotations

import json

import attrs
from click.testing import CliRunner

import fsm
from exod.cli import main
from fsm import runner as rn
from fsm.cluster import Cluster, LogEntry
from fsm.conformance import replay
from fsm.world import World


def recorded_log() -> list[LogEntry]:
    cluster = Cluster()
    cluster.place("i", "m/x", [fsm.Slot(0, "a", "i/0"), fsm.Slot(1, "b", "i/1")])
    cluster.log.append(LogEntry(0.0, "instance", "i", "place", "", "pending"))
    world = World(cluster, ["a", "b"])
    world.settle()
    cluster.runner_event(rn.Fail("i/1", 1, failure=fsm.Failure.stalled("busy", 9)), world.now)
    world.settle()
    cluster.delete("i", world.now)
    world.settle()
    return list(cluster.log)


def test_a_real_log_conforms_with_coverage():
    log = recorded_log()
    report = replay(log)
    assert report.ok, report.text()
    assert report.entries == len(log)
    runner = report.coverage["runner"]
    assert {"failed", "stopped", "stopping", "available", "warming_up"} <= runner.states_seen
    assert len(runner.transitions_seen) >= 10 and runner.transitions_all >= runner.transitions_seen
    assert "deleted" in report.coverage["instance"].states_seen
    assert "conform" in report.text()


def test_a_step_that_is_not_a_transition_is_the_first_divergence():
    log = recorded_log()
    index = next(i for i, e in enumerate(log) if e.machine == "runner" and e.target == "failed")
    forged = [*log[:index], attrs.evolve(log[index], target="joining", event="connect"), *log[index + 1 :]]
    report = replay(forged)
    assert not report.ok and report.divergence.index == index
    assert "not a transition" in report.divergence.text()


def test_a_step_from_the_wrong_state_is_named():
    log = recorded_log()
    index = next(i for i, e in enumerate(log) if e.machine == "instance" and e.target == "recovering")
    forged = [*log[:index], attrs.evolve(log[index], source="pending"), *log[index + 1 :]]
    report = replay(forged)
    assert report.divergence.index == index and "elsewhere" in report.divergence.reason


def test_unknown_machine_and_state():
    assert "unknown machine" in replay([LogEntry(0, "toaster", "t", "pop", "a", "b")]).divergence.reason
    assert "no such state" in replay([LogEntry(0, "runner", "r", "x", "idle", "nowhere")]).divergence.reason


def test_cli_replay_jsonl_and_check(tmp_path):
    path = tmp_path / "log.jsonl"
    rows = [
        {"time": e.time, "machine": e.machine, "id": e.key, "event": e.event, "from": e.source, "to": e.target}
        for e in recorded_log()
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ok = CliRunner().invoke(main, ["replay", "--jsonl", str(path)])
    assert ok.exit_code == 0 and "conform" in ok.output
    index = next(i for i, r in enumerate(rows) if r["machine"] == "runner" and r["event"] == "connect")
    rows[index]["to"] = "stopped"  # connect never stops a runner
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = CliRunner().invoke(main, ["replay", "--jsonl", str(path)])
    assert bad.exit_code == 1 and f"first divergence: entry {index}" in bad.output
    (tmp_path / "junk.jsonl").write_text("not json\n")
    junk = CliRunner().invoke(main, ["replay", "--jsonl", str(tmp_path / "junk.jsonl")])
    assert junk.exit_code == 1 and "not a transition log" in junk.output
    checked = CliRunner().invoke(main, ["check", "--max-retries", "1"])
    assert checked.exit_code == 0 and "all invariants hold" in checked.output and "exhaustive" in checked.output
    host = CliRunner().invoke(
        main, ["check", "--ranks", "1", "--max-retries", "2", "--faults", "crash,host", "--horizon", "30"]
    )
    assert host.exit_code == 0 and "all invariants hold" in host.output and "exhaustive up to t=30 s" in host.output
    parking = ["check", "--ranks", "1", "--max-retries", "1", "--requests", "1", "--parks", "1", "--keep-alive", "0"]
    parked = CliRunner().invoke(main, parking)
    assert parked.exit_code == 0 and "all invariants hold" in parked.output and "exhaustive" in parked.output
    replicas = ["check", "--max-retries", "1", "--strategy", "one_for_one", "--requests", "1"]
    alone = CliRunner().invoke(main, replicas)
    assert alone.exit_code == 0 and "all invariants hold" in alone.output and "exhaustive" in alone.output
    two = ["check", "--ranks", "1", "--max-retries", "1", "--instances", "2", "--node-memory", "1", "--keep-alive", "1"]
    evicting = CliRunner().invoke(main, [*two, "--requests", "1", "--no-deletes"])
    assert evicting.exit_code == 0 and "all invariants hold" in evicting.output and "exhaustive" in evicting.output
    forever = CliRunner().invoke(main, two[:-2])  # kept forever in the memory of one: the check refuses it
    assert forever.exit_code == 2 and "keep_alive" in forever.output
    wrong = CliRunner().invoke(main, ["check", "--faults", "crash,nope"])
    assert wrong.exit_code == 2 and "choose from crash, error, fatal, host" in wrong.output


def test_markers_are_checked_too():
    alive_again = [
        LogEntry(0, "runner", "r", "create", "", "idle"),
        LogEntry(1, "runner", "r", "create", "", "idle"),  # a second process while the first lives
    ]
    assert "while the previous one was alive" in replay(alive_again).divergence.reason
    assert "initial state" in replay([LogEntry(0, "runner", "r", "create", "", "available")]).divergence.reason
    after_forget = [
        LogEntry(0, "instance", "i", "place", "", "pending"),
        LogEntry(1, "instance", "i", "delete", "pending", "deleted"),
        LogEntry(2, "instance", "i", "forget", "deleted", ""),
        LogEntry(3, "instance", "i", "start", "pending", "starting"),
    ]
    report = replay(after_forget)
    assert report.divergence.index == 3 and "forgotten" in report.divergence.reason
    early_forget = [
        LogEntry(0, "instance", "i", "place", "", "pending"),
        LogEntry(1, "instance", "i", "forget", "", ""),
    ]
    assert "still in 'pending'" in replay(early_forget).divergence.reason
