"""Why a runner failed, and whether trying again can help.

The classification travels with the failure from the runner process through the
runner machine to the instance retry policy, which is the only place that acts
on `retryable`.
"""

from __future__ import annotations

import enum
import signal as _signal

import attrs


class FailureKind(enum.Enum):
    """What ended a runner: its own doing (charged), a peer's, or the host's (uncharged)."""

    EXIT = "exit"  #: the process ended on its own, any exit code, while not asked to stop
    SIGNAL = "signal"  #: the process was killed by a signal it was not sent by us
    EXCEPTION = "exception"  #: the runner reported an exception before dying
    STALL = "stall"  #: a watchdog saw no progress within the phase's timeout
    PEER = "peer_failed"  #: another rank of the same generation failed
    SPAWN = "spawn"  #: the process could not be started at all
    HOST = "host"  #: the host, not the model: no fds or disk to spawn, a ring port taken, a lost node (uncharged)
    POISON = "poison_request"  #: a request in the batch was at an earlier death too: the request's doing (uncharged)


@attrs.frozen
class Failure:
    """A cause with enough detail for an operator, and the retry classification."""

    kind: FailureKind = attrs.field(validator=attrs.validators.instance_of(FailureKind))
    message: str = attrs.field(validator=attrs.validators.instance_of(str))
    retryable: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    exit_code: int | None = None
    signal: int | None = None
    exception_type: str | None = None
    detail: str = ""  # last stderr lines or a traceback

    @classmethod
    def exited(cls, exit_code: int, detail: str = "") -> Failure:
        """A process that ended while not stopping: failed even with code 0."""
        if exit_code < 0:
            return cls.signalled(-exit_code, detail)
        return cls(
            FailureKind.EXIT,
            f"runner exited unexpectedly with code {exit_code}",
            exit_code=exit_code,
            detail=detail,
        )

    @classmethod
    def signalled(cls, signum: int, detail: str = "") -> Failure:
        """A process killed by a signal we did not send (an OOM killer, an operator): charged, retryable."""
        try:
            name = _signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return cls(FailureKind.SIGNAL, f"runner killed by {name}", signal=signum, detail=detail)

    @classmethod
    def exception(cls, exception_type: str, message: str, *, retryable: bool = True, detail: str = "") -> Failure:
        """The runner reported an exception; ``retryable=False`` for one no retry mends (a defect of the
        model), which deletes the instance at once instead of spending its budget."""
        return cls(
            FailureKind.EXCEPTION,
            f"{exception_type}: {message}",
            retryable=retryable,
            exception_type=exception_type,
            detail=detail,
        )

    @classmethod
    def stalled(cls, phase: str, seconds: float) -> Failure:
        """No progress in ``phase`` for ``seconds`` (`fsm.watchdog`): a hang counts as the runner's failure."""
        return cls(FailureKind.STALL, f"no progress in phase {phase} for {seconds:g} s")

    @classmethod
    def unresponsive(cls, seconds: float) -> Failure:
        """Its process answered no heartbeat for ``seconds`` (`fsm.watchdog`): stopped, wedged or frozen, a stall
        charged like any other, whatever it was doing."""
        return cls(FailureKind.STALL, f"missed its heartbeat: its process answered none for {seconds:.1f} s")

    @property
    def charged(self) -> bool:
        """Whether the failure costs its instance a retry: every failure but the host's does.

        A host failure still ends the generation and waits out the backoff (no tight loop), but a squatted
        port or a full fd table says nothing about the model, so it never uses up the budget.
        """
        return self.kind not in (FailureKind.HOST, FailureKind.POISON)

    @classmethod
    def host(cls, message: str, detail: str = "", exception_type: str | None = None) -> Failure:
        """The host failed, not the model (no fds or disk to spawn, a ring port taken, a lost node): retried
        after the backoff but never charged to the retry budget."""
        return cls(FailureKind.HOST, message, detail=detail, exception_type=exception_type)

    @classmethod
    def poisoned(cls, message: str, detail: str = "") -> Failure:
        """A death with a request in the batch that was in the batch at an earlier death of the same instance:
        the request kills runners, not the model. Retried after the backoff, never charged, and it gives back
        the retry the earlier death was charged (`InstanceRetry`, "Poison")."""
        return cls(FailureKind.POISON, message, detail=detail)

    @classmethod
    def peer_failed(cls, rank: int) -> Failure:
        """This rank ends because rank ``rank`` of its generation failed (one_for_all): a consequence, so the
        cause's report takes its place in ``last_failure``."""
        return cls(FailureKind.PEER, f"rank {rank} of the same generation failed")

    @classmethod
    def peer_lost(cls, message: str, detail: str = "") -> Failure:
        """A rank that lost its connection to a peer: the consequence of another rank's failure, not a cause."""
        return cls(FailureKind.PEER, message, detail=detail)
