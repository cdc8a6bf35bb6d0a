"""exod.store: atomic snapshot + log, resume, and refusal of files it cannot trust."""

from __future__ import annotations

import os
import sqlite3

import pytest

import fsm
from exod.store import ProcessRecord, Store, StoreError
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
