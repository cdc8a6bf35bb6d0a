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
from statemachine.orderedset import OrderedSet

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

    def _adopt(self, snapshot: Any) -> None:  # pragma: no cover - each machine defines it
        raise NotImplementedError

    def reload(self, snapshot: Any) -> None:
        """Become the machine ``snapshot`` describes, without constructing a new one.

        Construction costs python-statemachine ~0.5 ms; the model checker visits states by the
        hundred thousand, so it re-points a few machine objects instead. Equivalent to
        ``from_snapshot`` (a property test holds the two to it).
        """
        if not isinstance(snapshot, self.snapshot_type):
            raise SnapshotError(f"expected a {self.snapshot_type.__name__}, got {type(snapshot).__name__}")
        type(self)._check_leaf(snapshot.leaf)
        self._adopt(snapshot)
        self.model.state = self._configuration_value(snapshot.leaf)
        # python-statemachine stops its engine on reaching a top-level final state; a machine
        # re-pointed away from one must run again (and one pointed at one must not).
        self._engine.running = (
            not self.states_map[snapshot.leaf].final or self.states_map[snapshot.leaf].parent is not None
        )
        self._leaf = snapshot.leaf
        self._steps = []

    @classmethod
    def _configuration_value(cls, leaf: str) -> Any:
        """What python-statemachine keeps in the model for the configuration whose innermost state is ``leaf``."""
        state = cls.states_map[leaf]
        chain = [state]
        while state.parent is not None:
            state = state.parent
            chain.append(state)
        if len(chain) == 1:
            return chain[0].value
        return OrderedSet(s.value for s in reversed(chain))

    @classmethod
    def _check_leaf(cls, leaf: str) -> None:
        leaves = cls.__dict__.get("_leaves_cache")
        if leaves is None:
            leaves = frozenset(s.id for s in cls.states_map.values() if not s.states)
            type.__setattr__(cls, "_leaves_cache", leaves)
        if leaf not in leaves:
            raise SnapshotError(f"{cls.machine_name} has no state {leaf!r}; states: {sorted(leaves)}")
