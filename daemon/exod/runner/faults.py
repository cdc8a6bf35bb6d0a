"""Fault injection: make a runner fail on purpose, at a named phase, in a chosen way.

For tests, and for operators reproducing a bug. Never active by default: a fault
exists only when the configuration names it (``[[fault]]`` in the TOML, or
`DaemonConfig.faults`), and only for the rank and generation it names. The
runner receives it as ``--fault PHASE:KIND``.
"""

from __future__ import annotations

import enum
import os
import signal
import threading
import time
from collections.abc import Callable

import attrs


class FaultPhase(enum.Enum):
    CONNECTING = "connecting"  # just after joining starts
    LOADING = "loading"  # after the first layer is in
    WARMING_UP = "warming_up"
    READY = "ready"  # idle, shortly after Ready
    BUSY = "busy"  # mid-generation, after the first token
    STOPPING = "stopping"  # when asked to shut down


class FaultKind(enum.Enum):
    SIGKILL = "sigkill"  # the process kills itself
    EXCEPTION = "exception"  # raises: reported as Failed, exit 1
    EXIT0 = "exit0"  # exits cleanly, unannounced
    HANG = "hang"  # stops answering (the watchdogs must notice)
    SLOW = "slow"  # goes on, slowly (progress continues: no watchdog may fire)


class InjectedFault(RuntimeError):
    """The exception an ``exception`` fault raises."""


@attrs.frozen
class Fault:
    phase: FaultPhase
    kind: FaultKind

    @classmethod
    def parse(cls, text: str) -> Fault:
        phase, _, kind = text.partition(":")
        try:
            return cls(FaultPhase(phase), FaultKind(kind))
        except ValueError:
            raise ValueError(
                f"fault {text!r} must be PHASE:KIND with PHASE in {[p.value for p in FaultPhase]} "
                f"and KIND in {[k.value for k in FaultKind]}"
            ) from None

    def __str__(self) -> str:
        return f"{self.phase.value}:{self.kind.value}"


@attrs.frozen
class FaultSpec:
    """Which runner gets which fault: rank ``rank`` of generation ``generation`` (None: every one)."""

    fault: Fault
    rank: int | None = None
    generation: int | None = None

    def applies(self, rank: int, generation: int) -> bool:
        return (self.rank is None or self.rank == rank) and (self.generation is None or self.generation == generation)


def armed(specs: tuple[FaultSpec, ...], rank: int, generation: int) -> str | None:
    """The fault (``PHASE:KIND``) a configuration arms for this rank of this generation, if any: each node arms
    its own runners from its own ``[[fault]]``, whoever asked it to start them."""
    return next((str(spec.fault) for spec in specs if spec.applies(rank, generation)), None)


SLOW_S = 0.4  # how long a "slow" fault pauses, per layer while loading


class Injector:
    """The runner's side: ``at(phase)`` does what the fault says when the runner reaches ``phase``."""

    def __init__(self, fault: Fault | None, *, fail: Callable[[BaseException], None], exit_now: Callable[[int], None]):
        self.fault = fault
        self._fail = fail  # report Failed and exit (for faults on threads other than the main one)
        self._exit_now = exit_now
        self.hung = threading.Event()

    def armed(self, phase: FaultPhase) -> FaultKind | None:
        return self.fault.kind if self.fault is not None and self.fault.phase is phase else None

    def at(self, phase: FaultPhase, *, main_thread: bool = True) -> None:
        kind = self.armed(phase)
        if kind is None:
            return
        if kind is FaultKind.SIGKILL:
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind is FaultKind.EXIT0:
            self._exit_now(0)
        elif kind is FaultKind.EXCEPTION:
            exc = InjectedFault(f"injected fault: exception while {phase.value}")
            if main_thread:
                raise exc
            self._fail(exc)
        elif kind is FaultKind.HANG:
            self.hung.set()
            if main_thread:
                threading.Event().wait()  # forever: only a watchdog, a signal or the hang-up watchdog ends this
        elif kind is FaultKind.SLOW:
            time.sleep(SLOW_S)

    def at_ready_soon(self, delay: float = 0.2) -> None:
        """Idle faults fire from a timer: the main thread is waiting for commands."""
        if self.armed(FaultPhase.READY) is not None:
            threading.Timer(delay, self.at, (FaultPhase.READY,), {"main_thread": False}).start()
