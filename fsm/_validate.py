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
