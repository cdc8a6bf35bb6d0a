"""exod.state.sqlite: atomic snapshot + log, resume, and refusal of files it cannot trust."""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import stat

import pytest

import fsm
from daemon_harness import exod, start_daemon
from exod.state.retention import Retention
from exod.state.sqlite import ProcessRecord, Store, StoreError
from fsm.cluster import Cluster, LogEntry


def test_snapshot_and_log_survive_reopen(tmp_path):
    cluster = Cluster()
    cluster.place("i", "org/m", [fsm.Slot(0, "n", "i/0")])
    cluster.execute(fsm.StartGeneration("i", 1), 0.0)
    store = Store.open(tmp_path / "state.db")
    seq = store.save(cluster.to_dict(), cluster.log, now=1.0)
    assert seq == len(cluster.log) == 1
    store.close()

    reopened = Store.open(tmp_path / "state.db")
    restored = Cluster.from_dict(reopened.load())
    assert restored.to_dict() == cluster.to_dict()
    assert [entry for _, entry in reopened.transitions()] == cluster.log
    (mode,) = sqlite3.connect(tmp_path / "state.db").execute("PRAGMA journal_mode").fetchone()
    assert mode == "wal"


def test_transitions_resume_after_a_sequence_number(tmp_path):
    store = Store.open(tmp_path / "s.db")
    entries = [LogEntry(float(t), "runner", "r", "e", "a", "b") for t in range(5)]
    store.save({}, entries[:3], now=0.0)
    store.save({}, entries[3:], now=0.0)
    assert [seq for seq, _ in store.transitions()] == [1, 2, 3, 4, 5]
    assert [e.time for _, e in store.transitions(after=3)] == [3.0, 4.0]
    assert [e.time for _, e in store.transitions(after=1, limit=2)] == [1.0, 2.0]


def test_a_failed_save_writes_nothing(tmp_path):
    store = Store.open(tmp_path / "s.db")
    store.save({"v": 1}, [LogEntry(0.0, "m", "k", "e", "a", "b")], now=0.0)
    with pytest.raises(TypeError):
        store.save({"v": object()}, [LogEntry(1.0, "m", "k", "e", "b", "c")], now=1.0)
    assert store.load() == {"v": 1}
    assert len(list(store.transitions())) == 1


def test_corrupt_file_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "state.db"
    garbage = b"this is not sqlite" * 100
    path.write_bytes(garbage)
    with pytest.raises(StoreError, match="left untouched"):
        Store.open(path)
    assert path.read_bytes() == garbage


def test_unwritable_state_dir_is_a_clear_error(tmp_path):
    if os.geteuid() == 0:
        target = tmp_path / "file-not-dir" / "state.db"
        (tmp_path / "file-not-dir").write_text("x")  # root ignores permissions: a file where the dir should be
    else:  # pragma: no cover - CI runs as root
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "sub" / "state.db"
    with pytest.raises(StoreError, match="state directory"):
        Store.open(target)


def test_process_records(tmp_path):
    store = Store.open(tmp_path / "s.db")
    store.record_process(ProcessRecord("i/0", 1, 1234, 99))
    store.record_process(ProcessRecord("i/1", 1, 1235, 100))
    store.forget_process("i/0", 1)
    assert store.processes() == [ProcessRecord("i/1", 1, 1235, 100)]


def test_a_new_database_and_its_directories_are_private(tmp_path):
    old = os.umask(0)
    try:
        store = Store.open(tmp_path / "new" / "state" / "state.db")
        store.save({"v": 1}, [LogEntry(0.0, "m", "k", "e", "a", "b")], now=0.0)
    finally:
        os.umask(old)
    try:
        made = [tmp_path / "new", *(tmp_path / "new").rglob("*")]
        assert {p.name for p in made} >= {"state", "state.db", "state.db-wal", "state.db-shm"}
        assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in made if p.stat().st_mode & 0o077} == {}
    finally:
        store.close()


@pytest.mark.parametrize(
    ("body", "reason"),
    [("{not json", "not JSON"), ("null", "expected a JSON object, got NoneType"), ("[]", "got list")],
)
def test_a_snapshot_that_is_not_a_json_object_is_refused_and_kept(tmp_path, body, reason):
    store = Store.open(tmp_path / "state.db")
    store.save({"v": 1}, [LogEntry(0.0, "m", "k", "e", "a", "b")], now=0.0)
    store._db.execute("UPDATE snapshot SET body = ?", (body,))
    with pytest.raises(StoreError, match=f"state.db holds a state snapshot that cannot be restored .*{reason}"):
        store.load()
    assert len(list(store.transitions())) == 1  # the log is still there for `exod replay`
    store.close()


def test_a_zero_byte_database_is_used_as_a_new_one_with_a_warning(tmp_path, caplog):
    (tmp_path / "state.db").touch()
    with caplog.at_level(logging.WARNING, logger="exod.state.sqlite"):
        store = Store.open(tmp_path / "state.db")
    assert f"{tmp_path / 'state.db'} is empty (0 bytes): starting with no state" in caplog.text
    assert store.load() is None
    store.close()


# -- retention: the log stays bounded ---------------------------------------------------------

DAY = 86_400.0


def entry(time: float) -> LogEntry:
    return LogEntry(time, "runner", "i/0", "e", "a", "b")


def rows(store: Store) -> list[int]:
    return [seq for seq, _ in store.transitions()]


def test_the_log_keeps_at_most_max_log_rows_pruning_to_nine_tenths(tmp_path):
    store = Store.open(tmp_path / "s.db", retention=Retention(max_log_rows=20))
    counts = []
    for seq in range(1, 61):
        assert store.save({"v": seq}, [entry(float(seq))], now=float(seq)) == seq
        kept = rows(store)
        assert kept == list(range(kept[0], seq + 1))  # the newest, without gaps
        assert store.log_start() == kept[0]
        counts.append(len(kept))
    assert max(counts) == 20 and min(counts[20:]) == 18  # past 20, pruned to 18: not at every save
    assert counts[19:23] == [20, 18, 19, 20]
    assert store.load() == {"v": 60}  # the state is the snapshot's, whatever the log keeps
    store.close()
    reopened = Store.open(tmp_path / "s.db")
    assert reopened.log_start() == rows(reopened)[0] > 1  # readers learn where the log starts after a restart
    reopened.close()


def test_one_save_of_more_than_max_log_rows_keeps_the_newest(tmp_path):
    store = Store.open(tmp_path / "s.db", retention=Retention(max_log_rows=10))
    store.save({}, [entry(float(t)) for t in range(25)], now=25.0)
    assert rows(store) == list(range(17, 26)) and store.log_start() == 17


def test_the_log_keeps_nothing_older_than_max_log_age_days(tmp_path):
    store = Store.open(tmp_path / "s.db", retention=Retention(max_log_age_days=10))
    times = [0.0, 0.5 * DAY, 1.5 * DAY, 5 * DAY, 9.5 * DAY]
    store.save({}, [entry(t) for t in times], now=9.5 * DAY)
    assert rows(store) == [1, 2, 3, 4, 5] and store.log_start() == 1  # none is 10 days old yet
    store.save({}, [entry(10.2 * DAY)], now=10.2 * DAY)  # entry 1 is past 10 days: prune to 9 days
    assert [e.time for _, e in store.transitions()] == [1.5 * DAY, 5 * DAY, 9.5 * DAY, 10.2 * DAY]
    assert store.log_start() == 3
    store.save({}, [], now=30 * DAY)  # a save with nothing new, long after: the whole log is past the age
    assert rows(store) == [] and store.log_start() == 7


def test_a_log_within_its_bounds_is_not_touched(tmp_path):
    store = Store.open(tmp_path / "s.db")  # the defaults: 100,000 rows, 30 days
    store.save({}, [entry(float(t)) for t in range(1000)], now=1000.0)
    assert rows(store) == list(range(1, 1001)) and store.log_start() == 1
    assert store._db.execute("SELECT value FROM meta WHERE key = 'log_start'").fetchone() is None


def test_pruning_reads_and_deletes_only_the_head_of_the_log(tmp_path):
    store = Store.open(tmp_path / "s.db", retention=Retention(max_log_rows=10, max_log_age_days=1))
    store.save({}, [entry(float(t)) for t in range(10)], now=10.0)
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    store.save({}, [entry(DAY + 20)], now=DAY + 20)  # past both bounds
    store._db.set_trace_callback(None)
    assert rows(store) == [11]
    plans = {
        sql: " ".join(row[-1] for row in store._db.execute("EXPLAIN QUERY PLAN " + sql))
        for sql in statements
        if "FROM transitions" in sql
    }
    deletes = [plan for sql, plan in plans.items() if sql.startswith("DELETE")]
    assert deletes and all("USING INTEGER PRIMARY KEY (rowid<?)" in plan for plan in deletes), plans
    assert not any("TEMP B-TREE" in plan for plan in plans.values()), plans  # nothing sorted: rowid order


# -- `exod serve` on such files ---------------------------------------------------------------

NO_PLACEMENT = """
[daemon]
host = "127.0.0.1"
port = 0
offline = true
"""


@pytest.fixture
def env(tmp_path):
    (tmp_path / "exod.toml").write_text(NO_PLACEMENT)
    return {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}


def test_serve_on_a_snapshot_of_the_wrong_shape_says_what_to_do_without_a_traceback(tmp_path, env):
    state = tmp_path / "state"
    store = Store.open(state / "state.db")
    wrong = {"instances": 5, "runners": {}, "downloads": {}}  # valid JSON, not a cluster
    store.save(wrong, [LogEntry(0.0, "runner", "i/0", "e", "a", "b")], now=0.0)
    store.close()

    result = exod("serve", "--config", str(tmp_path / "exod.toml"), "--state-dir", str(state), env=env, check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    message = " ".join(result.stderr.split())  # click does not wrap, but a terminal might
    assert f"{state / 'state.db'} holds a state snapshot that cannot be restored" in message
    assert "instances: expected a dict keyed by id, got int" in message  # what is wrong, from the machines
    assert "move it into another directory" in message and "exod replay" in message  # what to do

    offline = exod("status", "--state-dir", str(state), env=env, check=False)  # the CLI reads it the same way
    assert offline.returncode != 0 and "Traceback" not in offline.stderr
    assert "instances: expected a dict keyed by id, got int" in offline.stderr

    kept = Store.open(state / "state.db")  # left untouched: snapshot and log
    try:
        assert kept.load() == wrong
        assert len(list(kept.transitions())) == 1
    finally:
        kept.close()


def test_serve_on_a_zero_byte_database_starts_empty_and_says_so(tmp_path, env):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "state.db").touch()
    daemon, url = start_daemon(tmp_path, env, "--no-place")
    try:
        assert "no instances" in exod("status", "--url", url, env=env).stdout
        said = (tmp_path / "serve.log").read_text()
        assert f"{state / 'state.db'} is empty (0 bytes): starting with no state" in said
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
