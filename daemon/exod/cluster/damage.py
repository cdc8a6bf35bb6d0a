"""A value in etcd that exod cannot restore: which key, what is wrong with it, and what the operator does.

Every value read from etcd is untrusted input (#25): whoever can write to etcd can write anything at any key.
One that a controller needs to take over — the snapshot, or the meta that says where the log ends — and that
does not restore stops no node (#45): the node elected holds its term with nothing restored and nothing written
over the value (`exod.serve`), every node says why (``/health``, ``exod status``), and ``exod repair`` moves the
value aside (`exod.cluster.repair`), after which the controller resumes on its own. A batch of the transition log
that is not exod's is skipped by every reader, and moved aside the same way.

A value moved aside is never destroyed: it is kept at `aside_key`, under ``damaged/`` (which nothing of exod's
reads), for the operator to look at.
"""

from __future__ import annotations

import enum
import time

import attrs

from exod.cluster.membership import DEFAULT_PREFIX
from exod.state.sqlite import StoreError

DAMAGED = b"damaged/"  # under the cluster's prefix: every value moved aside, kept


class Kind(enum.Enum):
    """What the damaged value was to exod."""

    #: ``state/snapshot``: every machine; no controller can take over without it
    SNAPSHOT = "snapshot"
    #: ``state/meta``: where the log ends and starts; no controller can take over without it either
    META = "meta"
    #: ``log/<seq>``: one batch of the transition log; readers skip it, so the log has a gap there
    LOG = "log"


@attrs.frozen
class Damage:
    """The value at ``key`` (its ``revision``: what a repair moves, and only that) cannot be restored."""

    kind: Kind
    key: bytes
    reason: str  # what is wrong with it, in words
    revision: int  # the key's mod revision when it was read
    url: str  # the etcd, for the repair command
    prefix: bytes  # the cluster's, for the repair command

    @property
    def command(self) -> str:
        """The command that moves it aside, as the operator types it."""
        prefix = "" if self.prefix == DEFAULT_PREFIX.encode() else f" --prefix {self.prefix.decode()}"
        return f"exod repair --cluster {self.url}{prefix}"

    def __str__(self) -> str:
        where = f"{self.key.decode(errors='replace')} in etcd at {self.url}"
        aside = f"(a copy is kept under {(self.prefix + DAMAGED).decode()})"
        if self.kind is Kind.LOG:
            return (
                f"{where} is not a batch of exod's transition log ({self.reason}): every reader skips it, so the "
                f"log has a gap there. `{self.command}` moves it aside {aside}"
            )
        what = "holds a state snapshot" if self.kind is Kind.SNAPSHOT else "holds the log's meta"
        return (
            f"{where} {what} that cannot be restored ({self.reason}). Nothing is restored from it nor written over "
            f"it, and the cluster's controller serves nothing until it is moved aside: `{self.command}` does "
            f"{aside}, or delete it (`etcdctl del {self.key.decode(errors='replace')}`, losing it); the controller "
            "then resumes on its own, from what is left"
        )


class Unrestorable(StoreError):
    """The cluster's state in etcd cannot be restored: `damage` says which key and why."""

    def __init__(self, damage: Damage) -> None:
        super().__init__(str(damage))
        self.damage = damage


def aside_key(damage: Damage, now: float | None = None) -> bytes:
    """Where `exod repair` keeps the value it moves: under ``damaged/``, named by its key, the time and its
    revision (two repairs of the same key never meet)."""
    relative = damage.key.removeprefix(damage.prefix)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return damage.prefix + DAMAGED + relative + f".{stamp}.r{damage.revision}".encode()
