"""The daemon's log, in words: one line for each transition an operator wants to hear of as it happens (an
instance Ready, a runner failed and why, a retry scheduled, an instance deleted, a download failed). The
rest stays in the transition log (`GET /events`, `exod replay`), where every transition is."""

from __future__ import annotations

import logging

import fsm
from fsm.cluster import LogEntry

log = logging.getLogger("exod.lifecycle")

_INSTANCE, _RUNNER, _DOWNLOAD = "instance", "runner", "download"


def narrate(entry: LogEntry) -> None:
    """Log ``entry`` if it is one of the transitions that matter (see the module docstring)."""
    said = _line(entry)
    if said is not None:
        level, message = said
        log.log(level, message)
    else:
        log.debug("%s %s: %s → %s (%s)", entry.machine, entry.key, entry.source, entry.target, entry.event)


def _line(e: LogEntry) -> tuple[int, str] | None:
    why = f": {e.cause}" if e.cause else ""
    if e.machine == _INSTANCE and e.source != e.target:
        match e.target:
            case fsm.InstanceState.READY.value:
                return logging.INFO, f"instance {e.key} is Ready"
            case fsm.InstanceState.BACKING_OFF.value:
                return logging.WARNING, f"instance {e.key}: retry scheduled after its generation failed{why}"
            case fsm.InstanceState.DELETED.value:
                return logging.WARNING, f"instance {e.key} deleted ({e.event}){why}"
    if e.machine == _RUNNER and e.target == fsm.RunnerState.FAILED.value and e.source != e.target:
        return logging.WARNING, f"runner {e.key} failed{why}"
    if e.machine == _DOWNLOAD and e.source != e.target:
        match e.target:
            case fsm.DownloadState.FAILED.value:
                return logging.WARNING, f"download {e.key} failed{why}"
            case fsm.DownloadState.COMPLETED.value:
                return logging.INFO, f"download {e.key} completed"
    return None
