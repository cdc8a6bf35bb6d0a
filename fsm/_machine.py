"""What every lifecycle machine of `fsm` shares, on top of python-statemachine.

* The step log: each leaf state entered during one event, with the leaf it
  came from, so that a chain (``ready → failed → stopped`` on one exit) is
  visible in order and an observer never has to guess.
* ``_fire``: the one door to ``send``. It refuses unknown events with
  `UnknownEvent` and turns refused transitions into `IllegalTransition`, so a
  caller never sees the library's generic error and the machine is unchanged.
* Snapshots: ``to_dict``/``from_dict`` through cattrs, versioned and checked.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

import attrs
import cattrs
from statemachine import State, StateMachine
from statemachine.exceptions import TransitionNotAllowed

from fsm.errors import IllegalTransition, InvalidConfig, SnapshotError, UnknownEvent

converter = cattrs.Converter(forbid_extra_keys=True)


@attrs.frozen
class Step:
    """One leaf-to-leaf move made while handling an event."""

    event: str
    source: str
    target: str


@attrs.frozen
class Outcome:
    """What an event did: ``accepted`` is False for stale or absorbed events, which change nothing."""

    accepted: bool
    steps: tuple[Step, ...] = ()
    note: str = ""

    @classmethod
    def ignored(cls, why: str) -> Outcome:
        return cls(accepted=False, note=why)


class Lifecycle(StateMachine):
    """Abstract base: python-statemachine in strict mode (errors raise) plus our conventions."""

    machine_name: ClassVar[str]
    snapshot_type: ClassVar[type]

    def __init__(self, *, start_leaf: str | None = None) -> None:
        self._steps: list[Step] = []
        self._leaf = start_leaf or ""
        super().__init__(start_value=start_leaf)

    # -- introspection -------------------------------------------------------

    @property
    def leaf(self) -> str:
        """The id of the innermost active state, e.g. ``"weights"``."""
        return self._leaf

    @property
    def path(self) -> str:
        """Dotted path of the active states, e.g. ``"loading.weights"``."""
        return ".".join(s.id for s in self.configuration)

    @property
    def top(self) -> State:
        """The active top-level state."""
        return next(iter(self.configuration))

    # -- the one door to send --------------------------------------------------

    def on_enter_state(self, event: Any, state: State) -> None:
        if state.states:  # a compound's entry is followed by its initial child's
            return
        if self._leaf:  # eventless transitions (joint conditions) are logged as "auto"
            self._steps.append(Step("auto" if event is None else str(event), self._leaf, state.id))
        self._leaf = state.id

    def _fire(self, event: str, **kwargs: Any) -> Outcome:
        if event not in {e.id for e in self.events}:
            raise UnknownEvent(
                f"{self.machine_name} has no event {event!r}; known events: {sorted(e.id for e in self.events)}"
            )
        self._steps = []
        try:
            self.send(event, **kwargs)
        except TransitionNotAllowed:
            raise IllegalTransition(self.machine_name, event, self.path, self._why_refused(event)) from None
        return Outcome(accepted=True, steps=tuple(self._steps))

    def _why_refused(self, event: str) -> str:
        """A hint for a refused event, when a guard (not the state) refused it."""
        return ""

    # -- persistence ----------------------------------------------------------------

    def snapshot(self) -> Any:  # pragma: no cover - each machine defines it
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-ready dict: state plus extended state."""
        return {"machine": self.machine_name, "version": 1, **converter.unstructure(self.snapshot())}

    @classmethod
    def from_dict(cls, data: dict[str, Any], **kwargs: Any) -> Self:
        """Restore what `to_dict` wrote; raises `SnapshotError` and builds nothing on bad input."""
        if not isinstance(data, dict):
            raise SnapshotError(f"expected a dict, got {type(data).__name__}")
        body = dict(data)
        machine, version = body.pop("machine", None), body.pop("version", None)
        if machine != cls.machine_name:
            raise SnapshotError(f"snapshot is of machine {machine!r}, not {cls.machine_name!r}")
        if version != 1:
            raise SnapshotError(f"unsupported snapshot version {version!r} (this library writes 1)")
        try:
            snapshot = converter.structure(body, cls.snapshot_type)
        except (cattrs.BaseValidationError, ValueError, TypeError, KeyError) as exc:
            raise SnapshotError(f"invalid {cls.machine_name} snapshot: {exc}") from exc
        try:
            return cls.from_snapshot(snapshot, **kwargs)
        except InvalidConfig as exc:
            raise SnapshotError(f"invalid {cls.machine_name} snapshot: {exc}") from exc

    @classmethod
    def from_snapshot(cls, snapshot: Any, **kwargs: Any) -> Self:  # pragma: no cover
        raise NotImplementedError

    @classmethod
    def _check_leaf(cls, leaf: str) -> None:
        leaves = {s.id for s in cls.states_map.values() if not s.states}
        if leaf not in leaves:
            raise SnapshotError(f"{cls.machine_name} has no state {leaf!r}; states: {sorted(leaves)}")
