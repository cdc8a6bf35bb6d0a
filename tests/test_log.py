"""fsm.log: the transition log in and out as JSON lines, and what a bad line is told."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fsm
from fsm.conformance import replay
from fsm.world import World

text = st.text(max_size=12)
entries = st.builds(
    fsm.LogEntry,
    time=st.floats(allow_nan=False, allow_infinity=False),
    machine=st.sampled_from(sorted(fsm.MACHINES)),
    key=text,
    event=text,
    source=text,
    target=text,
    cause=text,
)


@given(st.lists(entries, max_size=8))
def test_jsonl_round_trip(log):
    dumped = fsm.log.dumps(log)
    assert dumped.count("\n") == len(log)
    assert fsm.log.loads(dumped) == log


def test_a_real_log_exported_replays():
    cluster = fsm.Cluster()
    cluster.place("i", "org/m", [fsm.Slot(0, "a", "i/0"), fsm.Slot(1, "b", "i/1")])
    World(cluster, ["a", "b"]).settle()
    restored = fsm.log.loads(fsm.log.dumps(cluster.log))
    assert restored == cluster.log
    assert replay(restored).ok


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("not json", "line 3: "),
        ("[1, 2]", "line 3: a log entry is a JSON object, not list"),
        ('{"time": 1}', "line 3: a log entry lacks ['machine', 'id', 'event', 'from', 'to']"),
        ('{"time": "x", "machine": "runner", "id": "r", "event": "e", "from": "a", "to": "b"}', "time: expected a"),
        ('{"time": 1, "machine": "runner", "id": 3, "event": "e", "from": "a", "to": "b"}', "id: expected a string"),
    ],
)
def test_a_bad_line_is_named(line, says):
    good = fsm.log.dumps([fsm.LogEntry(0.0, "runner", "r", "connect", "idle", "joining")])
    with pytest.raises(fsm.SnapshotError) as caught:
        fsm.log.loads(good + "\n" + line + "\n")  # a blank line between: skipped, still counted
    assert says in str(caught.value)
