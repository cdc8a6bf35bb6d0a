"""What every lifecycle machine of `fsm` shares, on top of python-statemachine.

* The step log: each leaf state entered during one event, with the leaf it
  came from, so that a chain (``ready → failed → stopped`` on one exit) is
  visible in order and an observer never has to guess.
* ``_fire``: the one door to ``send``. It refuses unknown events with
  `UnknownEvent` and turns refused transitions into `IllegalTransition`, so a
  caller never sees the library's generic error and the machine is unchanged.
* Snapshots: ``to_dict``/``from_dict`` through a strict cattrs converter, versioned and
  checked; ``check_snapshot`` is the one check ``from_snapshot`` and ``reload`` share.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any, ClassVar, Self

import attrs
import cattrs
from cattrs.errors import AttributeValidationNote, IterableValidationError, IterableValidationNote
from cattrs.gen import make_dict_structure_fn
from statemachine import State, StateMachine
from statemachine.exceptions import TransitionNotAllowed
from statemachine.orderedset import OrderedSet

from fsm._validate import as_finite_float, show
from fsm.errors import IllegalTransition, InvalidConfig, SnapshotError, UnknownEvent

# -- the snapshot converter: strict, so that a snapshot means exactly what it says -------------
#
# cattrs would coerce ("3" → 3, 1.7 → 1, 1 → True) and fill missing keys with defaults; a
# snapshot restored that way is not the one that was written. Here every key must be present,
# none may be unknown, and a value must already have its type: an int is an int (not a bool,
# float or str), a bool a bool, a str a str, a float a finite int or float (kept as given, so
# the round trip is exact), a tuple a list or tuple.

converter = cattrs.Converter(forbid_extra_keys=True)


def _strict_int(value: Any, _type: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an int, got {show(value)}")
    return value


def _strict_float(value: Any, _type: Any) -> float:
    if as_finite_float(value) is None:
        raise TypeError(f"expected a finite number, got {show(value)}")
    return value  # type: ignore[no-any-return]


def _strict_bool(value: Any, _type: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a bool, got {show(value)}")
    return value


def _strict_str(value: Any, _type: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a str, got {show(value)}")
    return value


converter.register_structure_hook(int, _strict_int)
converter.register_structure_hook(float, _strict_float)
converter.register_structure_hook(bool, _strict_bool)
converter.register_structure_hook(str, _strict_str)


def _is_homogeneous_tuple(type_: Any) -> bool:
    args = typing.get_args(type_)
    return typing.get_origin(type_) is tuple and len(args) == 2 and args[1] is Ellipsis


def _homogeneous_tuple_hook(type_: Any) -> Callable[[Any, Any], tuple[Any, ...]]:
    item_type = typing.get_args(type_)[0]
    item_hook = converter.get_structure_hook(item_type)

    def structure(value: Any, _type: Any) -> tuple[Any, ...]:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, got {show(value)}")
        items, errors = [], []
        for index, item in enumerate(value):
            try:
                items.append(item_hook(item, item_type))
            except Exception as exc:
                exc.__notes__ = [
                    *getattr(exc, "__notes__", []),
                    IterableValidationNote(f"Structuring {type_} @ index {index}", index, item_type),
                ]
                errors.append(exc)
        if errors:
            raise IterableValidationError(f"While structuring {type_!r}", errors, type_)
        return tuple(items)

    return structure


def _attrs_hook(cls: type) -> Callable[[Any, Any], Any]:
    structure_known_keys = make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=True)
    names = tuple(a.name for a in attrs.fields(cls))

    def structure(value: Any, _type: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError(f"expected a mapping, got {show(value)}")
        missing = [name for name in names if name not in value]
        if missing:
            errors = []
            for name in missing:
                exc = KeyError(name)
                exc.__notes__ = [AttributeValidationNote(f"Structuring {cls.__name__} @ {name}", name, None)]
                errors.append(exc)
            raise cattrs.ClassValidationError(f"While structuring {cls.__name__}", errors, cls)
        return structure_known_keys(value, _type)

    return structure


converter.register_structure_hook_factory(_is_homogeneous_tuple, _homogeneous_tuple_hook)
converter.register_structure_hook_factory(attrs.has, _attrs_hook)


def _describe(exc: BaseException, _type: Any) -> str:
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"unknown keys {sorted(exc.extra_fields)}"
    if isinstance(exc, KeyError):
        return "required key missing"
    return str(exc) or type(exc).__name__


def describe_structure_error(exc: BaseException) -> str:
    """What is wrong with a structured value, field by field: ``rank: expected an int, got '3'; …``."""
    messages = cattrs.transform_error(exc, "$", _describe)
    out = []
    for message in messages:
        text, _, path = message.rpartition(" @ ")
        path = path.removeprefix("$").removeprefix(".")
        out.append(f"{path}: {text}" if path else text)
    return "; ".join(out)


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
        """A stale or absorbed event: not an error (nothing to catch), it changes nothing and ``why`` says so."""
        return cls(accepted=False, note=why)


class Lifecycle(StateMachine):
    """Abstract base: python-statemachine in strict mode (errors raise) plus our conventions."""

    machine_name: ClassVar[str]
    snapshot_type: ClassVar[type]
    snapshot_version: ClassVar[int] = 1  # what `to_dict` writes; `_upgrade` reads every older one

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
        """python-statemachine's hook on every entry: it keeps the leaf and the step log, so that `Outcome.steps`
        shows a chain of moves (``ready → failed → stopped``) in order instead of leaving it to be guessed."""
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
        """The machine's whole state as a frozen value: what `to_dict` writes and `from_snapshot` reads back."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-ready dict: state plus extended state."""
        body = converter.unstructure(self.snapshot())
        return {"machine": self.machine_name, "version": self.snapshot_version, **body}

    @classmethod
    def from_dict(cls, data: dict[str, Any], **kwargs: Any) -> Self:
        """Restore what `to_dict` wrote; raises `SnapshotError` and builds nothing on bad input."""
        if not isinstance(data, dict):
            raise SnapshotError(f"expected a dict, got {type(data).__name__}")
        body = dict(data)
        machine, version = body.pop("machine", None), body.pop("version", None)
        if machine != cls.machine_name:
            raise SnapshotError(f"snapshot is of machine {show(machine)}, not {cls.machine_name!r}")
        if type(version) is not int or not 1 <= version <= cls.snapshot_version:  # 1.0 and True: not what we wrote
            raise SnapshotError(
                f"unsupported snapshot version {show(version)} (this library writes {cls.snapshot_version})"
            )
        body = cls._upgrade(body, version)
        try:
            snapshot = converter.structure(body, cls.snapshot_type)
        except (cattrs.BaseValidationError, ValueError, TypeError, KeyError) as exc:
            raise SnapshotError(f"invalid {cls.machine_name} snapshot: {describe_structure_error(exc)}") from exc
        try:
            return cls.from_snapshot(snapshot, **kwargs)
        except InvalidConfig as exc:
            raise SnapshotError(f"invalid {cls.machine_name} snapshot: {exc}") from exc

    @classmethod
    def _upgrade(cls, body: dict[str, Any], version: int) -> dict[str, Any]:
        """Bring the body of a snapshot an older version wrote up to `snapshot_version` (what it lacked)."""
        return body

    @classmethod
    def from_snapshot(cls, snapshot: Any, **kwargs: Any) -> Self:  # pragma: no cover
        """A new machine in the state ``snapshot`` describes; `SnapshotError` for one no machine could be in."""
        raise NotImplementedError

    @classmethod
    def check_snapshot(cls, snapshot: Any) -> None:
        """Raise `SnapshotError` unless ``snapshot`` describes a machine of this class that can go on.

        The one check that `from_snapshot` and `reload` share; cheap, for `reload` is a hot path.
        """
        if not isinstance(snapshot, cls.snapshot_type):
            raise SnapshotError(f"expected a {cls.snapshot_type.__name__}, got {type(snapshot).__name__}")
        cls._check_leaf(snapshot.leaf)
        if cls._snapshot_plainly_fine(snapshot):
            return
        problem = cls._snapshot_problem(snapshot)
        if problem:
            raise SnapshotError(f"invalid {cls.machine_name} snapshot: {problem}")

    @classmethod
    def _snapshot_plainly_fine(cls, snapshot: Any) -> bool:
        """A fast, conservative pass over the usual case (exact types, hardly a call): True only for a
        snapshot `_snapshot_problem` accepts; False sends it there, which decides and says why."""
        return False

    @classmethod
    def _snapshot_problem(cls, snapshot: Any) -> str | None:  # pragma: no cover - each machine defines it
        """What is wrong with the fields of ``snapshot`` (the leaf is known to exist), or None: the rule."""
        raise NotImplementedError

    def _adopt(self, snapshot: Any) -> None:  # pragma: no cover - each machine defines it
        raise NotImplementedError

    def reload(self, snapshot: Any) -> None:
        """Become the machine ``snapshot`` describes, without constructing a new one.

        Construction costs python-statemachine ~0.5 ms; the model checker visits states by the
        hundred thousand, so it re-points a few machine objects instead. Equivalent to
        ``from_snapshot`` (a property test holds the two to it): the same `check_snapshot`, so a
        bad snapshot raises `SnapshotError` and leaves the machine as it was.
        """
        type(self).check_snapshot(snapshot)  # the checks from_snapshot makes; nothing has changed yet
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
        if not isinstance(leaf, str) or leaf not in leaves:
            raise SnapshotError(f"leaf: {cls.machine_name} has no state {show(leaf)}; states: {sorted(leaves)}")
