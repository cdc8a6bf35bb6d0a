"""The exceptions of `fsm`: one type per way a caller can be wrong.

Every error is raised *before* anything changes, so a caller that catches one
still holds a machine in the state it had.
"""

from __future__ import annotations


class FsmError(Exception):
    """Base of every error this library raises on purpose."""


class InvalidConfig(FsmError, ValueError):
    """A policy or machine parameter is out of range; the message names the bound."""


class InvalidEvent(FsmError, ValueError):
    """An event carries values no machine could accept (e.g. negative progress)."""


class UnknownEvent(FsmError, KeyError):
    """The machine has no event of that name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class IllegalTransition(FsmError):
    """The event exists but is not allowed from the current state (or its guard is false)."""

    def __init__(self, machine: str, event: str, state: str, why: str = "") -> None:
        self.machine = machine
        self.event = event
        self.state = state
        self.why = why  # which guard refused it, in words ("" when the state itself does not take the event)
        detail = f": {why}" if why else ""
        super().__init__(f"{machine}: event {event!r} is not allowed in state {state!r}{detail}")


class IncarnationMismatch(FsmError):
    """An event names a newer incarnation (or generation) than the machine: the caller routed it wrong."""


class SnapshotError(FsmError, ValueError):
    """A serialized machine cannot be restored: wrong machine, wrong version or bad fields."""
