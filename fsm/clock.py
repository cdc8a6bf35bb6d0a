"""Which clock a cluster's times are read from: every ``now`` fed to it and every deadline it stores.

The clock story (docs/reattach.rst, "Clocks"):

* `fsm` never reads a clock; it compares the numbers it is given. Deadlines (backoffs, watchdogs, keep-alive,
  a budget's reset) are differences of those numbers, so feed a **monotonic** clock (``time.monotonic()``,
  or trio's/asyncio's loop time): it never steps. Keep wall time (``time.time()``) for what people read.
* A reading earlier than one already seen (a wall clock stepped back by NTP or an operator) is not an error:
  the cluster takes it as the latest reading seen, so time stands still until the clock catches up. No
  deadline fires early, none is lost; each waits as long as the clock stood still.
* Across a restart, a reboot or a move to another host, a monotonic clock starts from another origin (its
  *epoch*, e.g. the boot id). A snapshot (`fsm.cluster.Cluster.to_dict`) keeps the ``now`` it was written
  at; ``Cluster.from_dict(data, now=reading)`` rebases every stored time on the new clock, so what was left
  of a backoff is left of it (the supervisor's downtime does not count: never skipped, never refilled).
  Restored without ``now``, its times are taken as they are: this `Clock` then says which clock they were
  read from, and a monotonic clock of another epoch is refused rather than waiting out deadlines that may
  lie days in the future. Wall time (the default, for compatibility) means the same on every boot.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from fsm.errors import InvalidConfig, SnapshotError


class ClockKind(enum.Enum):
    """What the numbers count from."""

    WALL = "wall"  #: seconds since the Unix epoch: comparable across restarts and hosts (within their skew)
    MONOTONIC = "monotonic"  #: seconds since an arbitrary origin, fixed only within its epoch (a boot)


@attrs.frozen
class Clock:
    """The clock of a cluster's times; ``epoch`` names a monotonic clock's origin (a boot id), so that times of
    another origin are recognised."""

    kind: ClockKind = ClockKind.WALL
    epoch: str = attrs.field(default="", validator=attrs.validators.instance_of(str))

    def __attrs_post_init__(self) -> None:
        if self.kind is ClockKind.MONOTONIC and not self.epoch:
            raise InvalidConfig("a monotonic clock needs its epoch (e.g. the boot id): Clock.monotonic(epoch)")
        if self.kind is ClockKind.WALL and self.epoch:
            raise InvalidConfig("wall time has no epoch of its own: Clock.wall()")

    @classmethod
    def wall(cls) -> Clock:
        """Unix time (``time.time()``): the default, and the one whose deadlines survive a reboot."""
        return cls(ClockKind.WALL)

    @classmethod
    def monotonic(cls, epoch: str) -> Clock:
        """A monotonic clock (``time.monotonic()``) whose origin ``epoch`` names (the boot id), so that a snapshot
        restored after a reboot is refused rather than waiting out meaningless deadlines."""
        return cls(ClockKind.MONOTONIC, epoch)

    def __str__(self) -> str:
        return "wall time" if self.kind is ClockKind.WALL else f"the monotonic clock of epoch {self.epoch!r}"

    def to_dict(self) -> dict[str, str]:
        """What a snapshot keeps of the clock (`Cluster.to_dict`), so its times are read on the right one."""
        return {"kind": self.kind.value} | ({"epoch": self.epoch} if self.epoch else {})

    @classmethod
    def from_dict(cls, value: Any, where: str = "clock") -> Clock:
        """Read what `to_dict` wrote; `SnapshotError` naming ``where`` on anything else."""
        if not isinstance(value, dict) or set(value) - {"kind", "epoch"} or "kind" not in value:
            raise SnapshotError(f"{where}: expected {{'kind': 'wall' | 'monotonic', 'epoch': str}}, got {value!r}")
        try:
            return cls(ClockKind(value["kind"]), value.get("epoch", ""))
        except (ValueError, TypeError, InvalidConfig) as exc:
            raise SnapshotError(f"{where}: {exc}") from None
