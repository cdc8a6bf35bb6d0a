"""How long a runner may sit in a phase: the watchdogs, as deadlines the planner acts on.

A runner that hangs while joining its ring, reading weights or warming up
reports nothing, so no event ever says so; a runner asked to stop may linger.
Each limit here turns that silence into a deadline: ``since`` (when the runner
entered its phase, or last reported progress while loading) plus the phase's
limit. `fsm.next_deadline` includes it, and when it passes `fsm.plan` emits the
failure (`FailStalled`: a charged stall, as a runner's own fault) or the
escalation (`KillRunner`: the stop's grace is over). A caller gets watchdogs
without writing them; a limit of None leaves that phase unwatched (the default:
a caller with watchdogs of its own, such as exod's supervisors, keeps them).
"""

from __future__ import annotations

import attrs

from fsm._validate import finite
from fsm.errors import InvalidConfig
from fsm.runner import RunnerPhase

_positive = finite(InvalidConfig, above=0.0)


def _limit(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None:
        _positive(instance, attribute, value)


@attrs.frozen
class PhaseLimits:
    """Seconds a runner may spend in a phase without news (None: unwatched)."""

    connect: float | None = attrs.field(default=None, validator=_limit)  # joining its ring
    load_progress: float | None = attrs.field(default=None, validator=_limit)  # between layers read
    warm_up: float | None = attrs.field(default=None, validator=_limit)
    stop_grace: float | None = attrs.field(default=None, validator=_limit)  # asked to stop → killed

    def for_phase(self, phase: RunnerPhase | None) -> float | None:
        """The limit of a phase the runner works through alone (the waits for other ranks have none; a stop's is
        ``stop_grace``, from when it was asked, whatever the phase)."""
        return {
            RunnerPhase.JOINING: self.connect,
            RunnerPhase.WEIGHTS: self.load_progress,
            RunnerPhase.WARMING_UP: self.warm_up,
        }.get(phase)  # type: ignore[arg-type]
