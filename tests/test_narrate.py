"""exod.narrate: the transitions an operator hears of in the daemon's log, one line each."""

from __future__ import annotations

import logging

import pytest

from exod.narrate import narrate
from fsm.cluster import LogEntry


@pytest.mark.parametrize(
    ("entry", "level", "said"),
    [
        (LogEntry(1.0, "instance", "m-1", "warmed", "starting", "ready"), logging.INFO, "instance m-1 is Ready"),
        (
            LogEntry(1.0, "instance", "m-1", "rank_failed", "recovering", "backing_off", "InjectedFault: boom"),
            logging.WARNING,
            "instance m-1: retry scheduled after its generation failed: InjectedFault: boom",
        ),
        (
            LogEntry(1.0, "instance", "m-1", "delete", "ready", "deleted"),
            logging.WARNING,
            "instance m-1 deleted (delete)",
        ),
        (
            LogEntry(1.0, "runner", "m-1/0", "fail", "available", "failed", "runner killed by SIGKILL"),
            logging.WARNING,
            "runner m-1/0 failed: runner killed by SIGKILL",
        ),
        (
            LogEntry(1.0, "download", "local:org/m", "fail", "ongoing", "failed", "offline"),
            logging.WARNING,
            "download local:org/m failed: offline",
        ),
    ],
)
def test_what_matters_is_one_line(caplog, entry, level, said):
    with caplog.at_level(logging.DEBUG, logger="exod.lifecycle"):
        narrate(entry)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(level, said)]


def test_the_rest_is_at_debug_level(caplog):
    with caplog.at_level(logging.INFO, logger="exod.lifecycle"):
        narrate(LogEntry(1.0, "runner", "m-1/0", "connect", "idle", "joining"))
    assert caplog.records == []
