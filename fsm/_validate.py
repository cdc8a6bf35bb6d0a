"""attrs validators shared by the machines' events and policies.

Each takes the error type to raise, so a bad policy is an `InvalidConfig` and
a bad event an `InvalidEvent`, with one implementation of each check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

Validator = Callable[[Any, attrs.Attribute, Any], None]


def as_finite_float(value: object) -> float | None:
    """``value`` as a finite float, or None if it is not a finite real number (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def finite(error: type[Exception], *, above: float | None = None, at_least: float | None = None) -> Validator:
    def check(_inst: object, attribute: attrs.Attribute, value: object) -> None:
        number = as_finite_float(value)
        bound = "" if above is None else f" > {above:g}"
        bound += "" if at_least is None else f" >= {at_least:g}"
        if number is None or (above is not None and number <= above) or (at_least is not None and number < at_least):
            raise error(f"{attribute.name} must be a finite number{bound}, got {value!r}")

    return check


def integer(error: type[Exception], *, at_least: int = 0, optional: bool = False) -> Validator:
    def check(_inst: object, attribute: attrs.Attribute, value: object) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
            none = " or None" if optional else ""
            raise error(f"{attribute.name} must be an int >= {at_least}{none}, got {value!r}")

    return check


# -- plain predicates, for the snapshot checks (a hot path of the model checker: no attrs machinery) ----


def show(value: object) -> str:
    """``repr(value)`` for an error message, kept short (and safe for ints too long to print)."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"an int of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_count(value: object, at_least: int = 0) -> bool:
    """``value`` is an int (not a bool) >= ``at_least``."""
    return (type(value) is int or (isinstance(value, int) and not isinstance(value, bool))) and value >= at_least


def is_time(value: object) -> bool:
    """``value`` is None (not yet) or a finite number."""
    return value is None or as_finite_float(value) is not None


def ranks_problem(name: str, ranks: object, world_size: int) -> str | None:
    """Why ``ranks`` is not an ascending list of distinct ranks below ``world_size``, or None."""
    if isinstance(ranks, (tuple, list)):
        previous = -1
        for rank in ranks:
            if not is_count(rank) or rank <= previous or rank >= world_size:  # type: ignore[operator]
                break
            previous = rank  # type: ignore[assignment]
        else:
            return None
    return f"{name} must be ascending distinct ints >= 0 and < world_size {show(world_size)}, got {show(ranks)}"
