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

Liveness is the other watch, whatever the phase: a process that is stopped
(SIGSTOP), wedged or frozen by its host says nothing either, even while Ready
with nothing to do. The caller asks it for a heartbeat every so often and tells
the cluster when one is answered (`Cluster.heard`), and that it listens
(`Cluster.listened`, every so often too; ``resumed`` after a break in which it
could not read, such as its own pause). The runner misses its heartbeat once
``heartbeat`` seconds passed since its last answer (or its last change of phase,
or the start of the caller's unbroken listening, whichever is latest) while the
caller listened: `fsm.plan` then fails it (`FailUnresponsive`: a charged stall).
So a caller that was itself paused, whose answers wait unread, fails nothing: it
listens a whole limit again first. A runner that has answered none yet is not
watched this way (its process may not have started: the start's phases are
watched above) unless it is Ready (a caller that took it over from another
has heard nothing from it yet, and from a stopped one never will), nor one joining its ring (a ring's init may hold the
interpreter while it waits for its peers, so no answer comes: the ``connect``
limit watches it, and the watch starts again once it joined), nor one failed or
asked to stop.
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
    """Seconds a runner may spend in a phase without news, or without answering a heartbeat (None: unwatched)."""

    connect: float | None = attrs.field(default=None, validator=_limit)  # joining its ring
    load_progress: float | None = attrs.field(default=None, validator=_limit)  # between layers read
    warm_up: float | None = attrs.field(default=None, validator=_limit)
    stop_grace: float | None = attrs.field(default=None, validator=_limit)  # asked to stop → killed
    heartbeat: float | None = attrs.field(default=None, validator=_limit)  # last heartbeat answered → failed

    def for_phase(self, phase: RunnerPhase | None) -> float | None:
        """The limit of a phase the runner works through alone (the waits for other ranks have none; a stop's is
        ``stop_grace``, from when it was asked, whatever the phase)."""
        return {
            RunnerPhase.JOINING: self.connect,
            RunnerPhase.WEIGHTS: self.load_progress,
            RunnerPhase.WARMING_UP: self.warm_up,
        }.get(phase)  # type: ignore[arg-type]

    def heartbeat_deadline(self, phase: RunnerPhase | None, liveness: Liveness, since: float | None) -> float | None:
        """When a runner with ``liveness``, in ``phase`` since ``since``, misses its heartbeat if its caller listens
        until then; None: not watched (no limit, no answer yet, or joining its ring)."""
        if self.heartbeat is None or phase is RunnerPhase.JOINING:
            return None
        if liveness.heard is None and phase not in _SERVING:  # its process may be starting still
            return None
        times = [t for t in (liveness.heard, since, liveness.listening) if t is not None]
        return max(times) + self.heartbeat if times else None

    def missed(self, phase: RunnerPhase | None, liveness: Liveness, since: float | None) -> float | None:
        """Seconds the runner has been silent, if it missed its heartbeat: the deadline passed while its caller
        listened; None if it did not (or is not watched)."""
        deadline = self.heartbeat_deadline(phase, liveness, since)
        if deadline is None or liveness.listened is None or liveness.listened < deadline:
            return None
        assert self.heartbeat is not None
        return self.heartbeat + liveness.listened - deadline


@attrs.frozen
class Liveness:
    """What the caller knows of a runner process's heartbeat: when it last answered (``heard``), and since when
    it has listened without a break (``listening``), up to when (``listened``). Never persisted: a restarted
    caller listens anew."""

    heard: float | None = None
    listening: float | None = None
    listened: float | None = None

    def answered(self, now: float) -> Liveness:
        """The process answered a heartbeat at ``now``."""
        return attrs.evolve(self, heard=now)

    def listening_until(self, now: float, *, resumed: bool = False) -> Liveness:
        """The caller listened until ``now``: without a break since it began, unless ``resumed``."""
        start = now if resumed or self.listening is None else self.listening
        return attrs.evolve(self, listening=start, listened=now)


UNHEARD = Liveness()  # no answer yet, no listening: not watched
# phases a runner reaches only once its process answered its caller: watched even with no heartbeat heard yet
# (a caller that took over a Ready runner from another hears from a stopped one never)
_SERVING = frozenset({RunnerPhase.AVAILABLE, RunnerPhase.BUSY})
