"""The desired state an operator configures, against what is already placed.

A daemon keeps the models its configuration (``[[place]]``) and command line
(``--place``) name placed. Whether one must be placed on start is decided here,
once, for every front end: idempotent per model, so naming a model twice (the
default config and ``--place``), or restarting with it already placed, never
gives it a second instance.
"""

from __future__ import annotations

from collections.abc import Iterable

from fsm.errors import InvalidConfig


def to_place(wanted: Iterable[tuple[str, int]], placed: Iterable[str]) -> list[tuple[str, int]]:
    """The ``(model_id, ranks)`` to place now: one per model not yet placed, in the order first named.

    When a model is named more than once, the last entry's ranks win (the command line comes after the
    configuration file, and is the more specific).
    """
    ranks_by_model: dict[str, int] = {}
    for model_id, ranks in wanted:
        if not isinstance(model_id, str) or not model_id:
            raise InvalidConfig(f"a placement needs a model id, got {model_id!r}")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise InvalidConfig(f"ranks of {model_id} must be an int >= 1, got {ranks!r}")
        ranks_by_model[model_id] = ranks
    already = set(placed)
    return [(model_id, ranks) for model_id, ranks in ranks_by_model.items() if model_id not in already]
