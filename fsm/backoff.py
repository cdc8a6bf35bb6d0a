"""Exponential backoff as values: a policy, and per-key attempt bookkeeping.

Both are pure. Nothing here reads a clock: every time is a parameter, so a
schedule is a function of its inputs and replays identically.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

import attrs

from fsm._validate import as_finite_float, finite
from fsm.errors import InvalidConfig

K = TypeVar("K")
V = TypeVar("V")


class _FrozenMap(Mapping[K, V]):
    """A read-only, hashable mapping (a copy of what it is given): what a frozen value can hold."""

    __slots__ = ("_data", "_hash")

    def __init__(self, items: Mapping[K, V] | None = None) -> None:
        self._data: dict[K, V] = dict(items or {})
        self._hash: int | None = None

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def get(self, key: K, default: Any = None) -> Any:
        return self._data.get(key, default)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _FrozenMap):
            return self._data == other._data
        return self._data == other if isinstance(other, Mapping) else NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __repr__(self) -> str:
        return repr(self._data)


@attrs.frozen
class Backoff:
    """Delay before retry n (n ≥ 1): ``min(cap, initial · factor^(n−1))``.

    With ``jitter`` the delay is drawn from ``uniform(0, that)`` ("full jitter")
    using the RNG the caller passes in, so a seeded caller gets a reproducible
    schedule.
    """

    initial: float = attrs.field(default=2.0, validator=finite(InvalidConfig, above=0))
    factor: float = attrs.field(default=2.0, validator=finite(InvalidConfig, at_least=1))
    cap: float = attrs.field(default=30.0, validator=finite(InvalidConfig, above=0))
    jitter: bool = attrs.field(default=False)

    def __attrs_post_init__(self) -> None:
        if self.cap < self.initial:
            raise InvalidConfig(f"cap ({self.cap}) must be >= initial ({self.initial})")
        if not isinstance(self.jitter, bool):
            raise InvalidConfig(f"jitter must be a bool, got {self.jitter!r}")

    def ceiling(self, attempt: int) -> float:
        """The un-jittered delay before retry ``attempt``; exact, and safe for huge attempts."""
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
            raise InvalidConfig(f"attempt must be an int >= 1, got {attempt!r}")
        exponent = attempt - 1
        if exponent == 0:
            return self.initial  # exactly `initial`, never a rounding of cap
        # Compare exponents (int vs float compares exactly, whatever the int's size) so that
        # factor**exponent is only computed when it stays below cap / initial.
        if self.factor > 1 and exponent >= (math.log(self.cap) - math.log(self.initial)) / math.log(self.factor):
            return self.cap
        return min(self.cap, self.initial * self.factor**exponent)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The delay to wait before retry ``attempt``; ``rng`` is required when jitter is on."""
        ceiling = self.ceiling(attempt)
        if not self.jitter:
            return ceiling
        if rng is None:
            raise InvalidConfig("this Backoff has jitter=True: pass a seeded random.Random")
        return rng.uniform(0.0, ceiling)


@attrs.frozen
class KeyedBackoff(Generic[K]):
    """Attempts and next-allowed times per key, as an immutable value.

    Every change returns a new ``KeyedBackoff``: callers keep the old one if the
    action it gated did not happen, and a planner can take it as plain input.
    """

    policy: Backoff = attrs.field(factory=Backoff, validator=attrs.validators.instance_of(Backoff))
    _attempts: Mapping[K, int] = attrs.field(factory=_FrozenMap, converter=_FrozenMap, alias="attempts_by_key")
    _not_before: Mapping[K, float] = attrs.field(factory=_FrozenMap, converter=_FrozenMap, alias="not_before_by_key")

    def attempts(self, key: K) -> int:
        """How many attempts for ``key`` were recorded since it was last reset (what the next delay grows with)."""
        return self._attempts.get(key, 0)

    def deadline(self, key: K) -> float | None:
        """The earliest time the next attempt for ``key`` may start, or None if free now."""
        return self._not_before.get(key)

    def should_proceed(self, key: K, now: float) -> bool:
        """Whether an attempt for ``key`` may start at ``now``: check it before acting, then `record_attempt`."""
        deadline = self._not_before.get(key)
        return deadline is None or now >= deadline

    def record_attempt(self, key: K, now: float, rng: random.Random | None = None) -> KeyedBackoff[K]:
        """Count an attempt at ``now``; the next one waits ``policy.delay(attempts)``.

        ``now`` must be a finite number: a NaN deadline would block ``key`` forever.
        """
        if as_finite_float(now) is None:
            raise InvalidConfig(f"now must be a finite number, got {now!r}")
        attempts = self.attempts(key) + 1
        return attrs.evolve(
            self,
            attempts_by_key={**self._attempts, key: attempts},
            not_before_by_key={**self._not_before, key: now + self.policy.delay(attempts, rng)},
        )

    def reset(self, key: K) -> KeyedBackoff[K]:
        """Forget ``key`` (e.g. on success or deletion): its next attempt is free."""
        if key not in self._attempts and key not in self._not_before:
            return self
        return attrs.evolve(
            self,
            attempts_by_key={k: v for k, v in self._attempts.items() if k != key},
            not_before_by_key={k: v for k, v in self._not_before.items() if k != key},
        )
