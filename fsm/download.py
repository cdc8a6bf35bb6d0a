"""The download of one model to one node.

::

    Pending → Ongoing → Completed
                  ↘ Failed → (backoff) → Pending → Ongoing …

Unlike exo, a failed download is retried: ``retry`` is refused until the
per-model backoff deadline, which grows with consecutive failures. The backoff
resets when a runner starts loading the model (``load_started``): the files
proved good, so an old streak must not slow a later re-download.
``invalidate`` sends a completed download back to Pending when its files
are found missing or corrupt.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

import attrs
from statemachine import State

from fsm._machine import Lifecycle, Outcome
from fsm._validate import finite, integer, is_count, is_time, show
from fsm.backoff import Backoff
from fsm.errors import InvalidConfig, InvalidEvent


class DownloadState(enum.Enum):
    """Where one model's download on one node is (the states of `DownloadLifecycle`)."""

    PENDING = "pending"  #: not on the node (or invalidated): the plan starts the download when a runner needs it
    ONGOING = "ongoing"  #: being fetched; ``download.Complete`` or ``download.DownloadFailed`` is owed
    COMPLETED = "completed"  #: the files are on the node: runners may load them
    FAILED = "failed"  #: the last fetch failed; it is retried once its backoff ends


DEFAULT_DOWNLOAD_BACKOFF = Backoff(initial=0.5, factor=2.0, cap=10.0)


@attrs.frozen
class DownloadEvent:
    """Base of the download's events: every one names the model and carries the caller's ``now``."""

    name: ClassVar[str]
    model_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    now: float = attrs.field(validator=finite(InvalidEvent))

    def payload(self) -> dict[str, Any]:
        """The event's fields the machine's callbacks take (as keyword arguments of ``send``)."""
        return {}


@attrs.frozen
class Begin(DownloadEvent):
    """The fetch starts (`Cluster.execute` of a StartDownload sends it)."""

    name = "begin"


@attrs.frozen
class BytesProgress(DownloadEvent):
    """How far the fetch is, for progress views (optional, any number)."""

    name = "progress"
    bytes_done: int = attrs.field(validator=integer(InvalidEvent))
    bytes_total: int | None = attrs.field(default=None, validator=integer(InvalidEvent, optional=True))

    def __attrs_post_init__(self) -> None:
        if self.bytes_total is not None and self.bytes_done > self.bytes_total:
            raise InvalidEvent(f"bytes_done {self.bytes_done} exceeds bytes_total {self.bytes_total}")

    def payload(self) -> dict[str, Any]:
        """The byte counts, recorded by the machine for progress views."""
        return {"bytes_done": self.bytes_done, "bytes_total": self.bytes_total}


@attrs.frozen
class Complete(DownloadEvent):
    """The caller's report: the files are on the node, runners may load them."""

    name = "complete"


@attrs.frozen
class DownloadFailed(DownloadEvent):
    """The caller's report: the fetch failed for ``reason``; it is retried after the model's backoff."""

    name = "fail"
    reason: str = attrs.field(validator=attrs.validators.instance_of(str))

    def payload(self) -> dict[str, Any]:
        """The reason, kept as ``last_error`` for the operator."""
        return {"reason": self.reason}


@attrs.frozen
class Retry(DownloadEvent):
    """A failed download may be fetched again (refused before its backoff ends; the cluster sends it)."""

    name = "retry"


@attrs.frozen
class LoadStarted(DownloadEvent):
    """A runner started loading the files (the cluster sends it): they proved good, so the backoff resets."""

    name = "load_started"


@attrs.frozen
class Invalidate(DownloadEvent):
    """The caller found a completed download's files missing or corrupt: it is fetched again."""

    name = "invalidate"


@attrs.frozen
class DownloadSnapshot:
    """A download's whole state as a value (`DownloadLifecycle.snapshot`), its backoff included."""

    model_id: str
    policy: Backoff
    leaf: str
    attempts: int = 0
    retry_at: float | None = None
    clock: float | None = None
    bytes_done: int = 0
    bytes_total: int | None = None
    last_error: str = ""


class DownloadLifecycle(Lifecycle):
    """One model on one node. See the module docstring."""

    machine_name = "download"
    snapshot_type = DownloadSnapshot

    pending = State(initial=True)
    ongoing = State()
    completed = State()
    failed = State()

    begin = pending.to(ongoing, on="_begin")
    progress = ongoing.to.itself(internal=True, on="_progress")
    complete = ongoing.to(completed)
    fail = ongoing.to(failed, on="_failed")
    retry = failed.to(pending, cond="backoff_elapsed")
    load_started = completed.to.itself(internal=True, on="_reset_backoff")
    invalidate = completed.to(pending)

    def __init__(
        self, model_id: str, *, policy: Backoff = DEFAULT_DOWNLOAD_BACKOFF, _snapshot: DownloadSnapshot | None = None
    ) -> None:
        if not isinstance(model_id, str) or not model_id:
            raise InvalidConfig(f"model_id must be a non-empty str, got {model_id!r}")
        if not isinstance(policy, Backoff):
            raise InvalidConfig(f"policy must be a Backoff, got {type(policy).__name__}")
        if policy.jitter:
            raise InvalidConfig("download backoff takes no jitter: one node retries one model")
        snap = _snapshot or DownloadSnapshot(model_id, policy, leaf="pending")
        self._adopt(snap)
        super().__init__(start_leaf=snap.leaf if _snapshot else None)

    def _adopt(self, snap: DownloadSnapshot) -> None:
        """Take the extended state from a snapshot (construction and `reload` share it)."""
        # straight into __dict__: python-statemachine checks every setattr, and `reload` is a hot path
        self.__dict__.update(
            model_id=snap.model_id,
            policy=snap.policy,
            attempts=snap.attempts,
            retry_at=snap.retry_at,
            clock=snap.clock,
            bytes_done=snap.bytes_done,
            bytes_total=snap.bytes_total,
            last_error=snap.last_error,
        )

    @property
    def backoff_elapsed(self) -> bool:
        """Guard of ``retry``: a failed download is not fetched again before its backoff ends."""
        return self.retry_at is None or (self.clock is not None and self.clock >= self.retry_at)

    def _begin(self) -> None:
        self.bytes_done, self.bytes_total = 0, None

    def _progress(self, bytes_done: int, bytes_total: int | None) -> None:
        self.bytes_done, self.bytes_total = bytes_done, bytes_total

    def _failed(self, reason: str) -> None:
        self.attempts += 1
        self.last_error = reason
        assert self.clock is not None
        self.retry_at = self.clock + self.policy.delay(self.attempts)

    def _reset_backoff(self) -> None:
        self.attempts, self.retry_at = 0, None

    def _why_refused(self, event: str) -> str:
        if event == "retry" and self.leaf == "failed":
            return f"backoff until {self.retry_at} (now {self.clock})"
        return ""

    def apply(self, event: DownloadEvent) -> Outcome:
        """Handle an event about this model's download; its ``now`` moves the machine's clock, which the backoff
        is measured on (a refused event moves nothing, not even time)."""
        if not isinstance(event, DownloadEvent):
            raise InvalidEvent(f"expected a DownloadEvent, got {type(event).__name__}")
        if event.model_id != self.model_id:
            raise InvalidEvent(f"event for model {event.model_id!r} sent to download of {self.model_id!r}")
        clock = self.clock
        self.clock = event.now if clock is None else max(clock, event.now)
        try:
            return self._fire(event.name, **event.payload())
        except Exception:
            self.clock = clock
            raise

    @property
    def download_state(self) -> DownloadState:
        """The state as an enum, to compare with rather than the leaf's string."""
        return DownloadState(self.leaf)

    def snapshot(self) -> DownloadSnapshot:
        """The whole state, attempts and retry deadline included, so a restart keeps the backoff it was in."""
        return DownloadSnapshot(
            model_id=self.model_id,
            policy=self.policy,
            leaf=self.leaf,
            attempts=self.attempts,
            retry_at=self.retry_at,
            clock=self.clock,
            bytes_done=self.bytes_done,
            bytes_total=self.bytes_total,
            last_error=self.last_error,
        )

    @classmethod
    def from_snapshot(cls, snapshot: DownloadSnapshot) -> DownloadLifecycle:
        """Restore what `snapshot` returned; `SnapshotError` for a state no download could be in."""
        cls.check_snapshot(snapshot)
        return cls(snapshot.model_id, policy=snapshot.policy, _snapshot=snapshot)

    @classmethod
    def _snapshot_plainly_fine(cls, s: DownloadSnapshot) -> bool:
        done, total = s.bytes_done, s.bytes_total
        return (
            type(s.model_id) is str
            and s.model_id != ""
            and type(s.policy) is Backoff
            and s.policy.jitter is False
            and type(s.attempts) is int
            and s.attempts >= 0
            # a float is finite iff x - x == 0 (inf - inf and nan - nan are nan)
            and (s.retry_at is None or (type(s.retry_at) is float and s.retry_at - s.retry_at == 0.0))
            and (s.clock is None or (type(s.clock) is float and s.clock - s.clock == 0.0))
            and type(done) is int
            and done >= 0
            and (total is None or (type(total) is int and done <= total))
            and type(s.last_error) is str
        )

    @classmethod
    def _snapshot_problem(cls, s: DownloadSnapshot) -> str | None:
        """What no download could be: bad types or ranges, more bytes done than there are, a jittered policy."""
        if not isinstance(s.model_id, str) or not s.model_id:
            return f"model_id must be a non-empty str, got {show(s.model_id)}"
        if not isinstance(s.policy, Backoff):
            return f"policy must be a Backoff, got {type(s.policy).__name__}"
        if s.policy.jitter:
            return "policy.jitter: download backoff takes no jitter: one node retries one model"
        if not is_count(s.attempts):
            return f"attempts must be an int >= 0, got {show(s.attempts)}"
        for name, value in (("retry_at", s.retry_at), ("clock", s.clock)):
            if not is_time(value):
                return f"{name} must be a finite number or None, got {show(value)}"
        done, total = s.bytes_done, s.bytes_total
        if not is_count(done) or not (total is None or (is_count(total) and done <= total)):
            return (
                "bytes must satisfy 0 <= bytes_done <= bytes_total (or bytes_total None), "
                f"got bytes_done={show(s.bytes_done)}, bytes_total={show(s.bytes_total)}"
            )
        if not isinstance(s.last_error, str):
            return f"last_error must be a str, got {show(s.last_error)}"
        return None
