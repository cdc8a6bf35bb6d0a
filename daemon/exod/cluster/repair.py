"""What in etcd no controller can restore: every node's check, the state a node sees meanwhile, ``exod repair``.

`StateCheck` runs on every node of a cluster (in `exod.serve`'s nursery): every `CHECK_S` seconds it reads the
snapshot and the meta — the two values a controller reads to take over — and says what is wrong with them, if
anything. Then:

* a node that is not the controller says so (``/health``): its state is `Guarded`, whose `Guarded.refused` is
  the check's finding, and its controller's journal is degraded by it;
* the node elected holds its term with nothing restored and nothing written (`Guarded` over its term's state),
  answering as the controller — placements 503, naming the key and the command — until the check finds the
  state restorable, then takes over afresh (`exod.serve._lead`): no election is lost to it, no node exits;
* the controller, which has the state in memory, writes it back (`exod.cluster.etcd_state.EtcdState.heal`).

`repair` is the operator's: each value that cannot be restored, and each batch of the log that is not exod's, is
moved aside in one transaction of its own — copied under ``damaged/`` and deleted, only if it is still the value
that was read — and the controller resumes from what is left: an empty state where the snapshot was, the log
going on. A meta is not deleted but rebuilt from the log's batches (where the log ends and starts): without it the
next controller would number its entries from 1 again, over the log's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from exod.cluster.damage import Damage, Kind, aside_key
from exod.cluster.etcd import Compare, Delete, Etcd, EtcdError, KeyValue, Put, version_is
from exod.cluster.etcd_state import LOG, LOG_END, META, SNAPSHOT, EtcdState, parse_batch, parse_meta, restorable
from exod.state.sqlite import StoreError
from exod.state.store import StateUnavailable
from fsm.cluster import LogEntry

log = logging.getLogger("exod.repair")

CHECK_S = 2.0  # how often every node reads the snapshot and the meta: how soon a repair is seen
_PAGE = 64  # batches of the log read at a time


def _damage(etcd: Etcd, prefix: bytes, kind: Kind, kv: KeyValue, reason: str) -> Damage:
    return Damage(kind, kv.key, reason, kv.mod_revision, etcd.url, prefix)


def _examine(etcd: Etcd, prefix: bytes, kv: KeyValue) -> Damage | None:
    """What is wrong with the value ``kv``, one of the state's (snapshot, meta, a batch of the log), if anything."""
    relative = kv.key.removeprefix(prefix)
    kind = Kind.SNAPSHOT if relative == SNAPSHOT else Kind.META if relative == META else Kind.LOG
    if kind is Kind.SNAPSHOT:
        reason = restorable(kv.value)
        return None if reason is None else _damage(etcd, prefix, kind, kv, reason)
    try:
        parse_meta(kv.value) if kind is Kind.META else parse_batch(kv.value)
    except ValueError as exc:
        return _damage(etcd, prefix, kind, kv, str(exc))
    return None


async def inspect(etcd: Etcd, prefix: bytes) -> list[Damage]:
    """The snapshot and the meta, where either cannot be restored: what stops a controller's take-over.
    `EtcdUnavailable` if etcd cannot be reached."""
    found = []
    for key in (SNAPSHOT, META):
        kv = await etcd.get(prefix + key)
        if kv is not None and (damage := _examine(etcd, prefix, kv)) is not None:
            found.append(damage)
    return found


async def inspect_log(etcd: Etcd, prefix: bytes) -> list[Damage]:
    """Every batch of the log that is not exod's (each reader skips it), read a page at a time."""
    found, start = [], prefix + LOG
    while True:
        batches = await etcd.range(start, prefix + LOG_END, limit=_PAGE)
        found += [damage for kv in batches if (damage := _examine(etcd, prefix, kv)) is not None]
        if len(batches) < _PAGE:
            return found
        start = batches[-1].key + b"\0"


def why(found: Sequence[Damage]) -> str | None:
    """What the operator is told: the first value, and the keys of the others."""
    if not found:
        return None
    more = f" (also {', '.join(d.key.decode(errors='replace') for d in found[1:])})" if found[1:] else ""
    return f"{found[0]}{more}"


class StateCheck:
    """The snapshot and the meta in etcd, read every `CHECK_S` seconds: `found` is what cannot be restored."""

    def __init__(self, etcd: Etcd, prefix: bytes, *, every: float = CHECK_S) -> None:
        self.etcd, self.prefix, self.every = etcd, prefix, every
        self.found: tuple[Damage, ...] = ()
        self._checked = trio.Event()  # set (and replaced) after each check

    @property
    def why(self) -> str | None:
        """Why the cluster's state cannot be restored, as last read, and what to do; None: it can."""
        return why(self.found)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.check()
        task_status.started()
        while True:
            await trio.sleep(self.every)
            await self.check()

    async def check(self) -> None:
        """Read it now. etcd out of reach: what was found stays (the membership says etcd is away)."""
        try:
            found = tuple(await inspect(self.etcd, self.prefix))
        except EtcdError as exc:  # out of reach, or refusing: the membership says it; the check goes on
            log.debug("the state's check cannot read etcd: %s", exc)
        else:
            if found and found != self.found:  # said in full by /health; here, what and where
                for damage in found:
                    log.error("%s cannot be restored: %s", damage.key.decode(errors="replace"), damage.reason)
            elif self.found and not found:
                log.warning("the cluster's state in etcd can be restored again")
            self.found = found
        self._checked.set()
        self._checked = trio.Event()

    async def until(self, holds: Callable[[tuple[Damage, ...]], bool]) -> None:
        """Return after the first check from now whose finding ``holds``."""
        while True:
            await self._checked.wait()
            if holds(self.found):
                return


class Guarded:
    """`exod.state.store.StateStore` over a node's `EtcdState` while ``refused`` may say its snapshot or meta
    cannot be restored: nothing is then restored from it (`load`: None) nor written over it (`save` refuses,
    saying why); the log is read as ever. A follower's, with the check's finding; the elected node's while it
    holds its term degraded, with what its take-over found."""

    def __init__(self, state: EtcdState, refused: Callable[[], str | None]) -> None:
        self.state, self._refused = state, refused
        self.where = state.where

    @property
    def refused(self) -> str | None:
        return self._refused()

    async def load(self) -> dict[str, Any] | None:
        return None if self.refused is not None else await self.state.load()

    async def save(self, snapshot: dict[str, Any], entries: Sequence[LogEntry], now: float) -> int:
        if (refused := self.refused) is not None:
            raise StateUnavailable(refused)
        return await self.state.save(snapshot, entries, now)

    async def transitions(self, after: int = 0, limit: int | None = None) -> list[tuple[int, LogEntry]]:
        return await self.state.transitions(after, limit)

    async def log_start(self) -> int:
        return await self.state.log_start()

    async def changed(self, after: int) -> None:
        await self.state.changed(after)

    def snapshot_error(self, reason: str) -> StoreError:
        return self.state.snapshot_error(reason)


# -- exod repair ------------------------------------------------------------------------------------------


@attrs.frozen
class Moved:
    """What `repair` did with one value."""

    damage: Damage
    aside: bytes  # where the value is kept now
    rebuilt: bytes | None = None  # a meta: the value written in its place, from the log (None: deleted)


class RepairConflict(Exception):
    """A value changed between the read and the move: nothing of it was moved; the message says to run again."""


async def repair(etcd: Etcd, prefix: bytes, *, now: float | None = None) -> list[Moved]:
    """Move aside each value of the state that cannot be restored (the log's batches first, then the meta rebuilt
    from them, then the snapshot), each in one transaction that holds only if it is still the value read.
    `RepairConflict` on the first that changed meanwhile; `EtcdUnavailable` if etcd cannot be reached."""
    moved = []
    for damage in await inspect_log(etcd, prefix):
        moved.append(await _move(etcd, damage, now))
    for damage in await inspect(etcd, prefix):
        rebuilt = await _rebuilt_meta(etcd, prefix) if damage.kind is Kind.META else None
        moved.append(await _move(etcd, damage, now, rebuilt))
    return moved


async def _move(etcd: Etcd, damage: Damage, now: float | None, rebuilt: bytes | None = None) -> Moved:
    aside = aside_key(damage, now)
    value = await etcd.get(damage.key)
    if value is None or value.mod_revision != damage.revision:
        raise RepairConflict(f"{damage.key.decode(errors='replace')} changed while exod repair read it: run it again")
    put_back: Put | Delete = Delete(damage.key) if rebuilt is None else Put(damage.key, rebuilt)
    compare = [Compare(damage.key, "MOD", "EQUAL", damage.revision), version_is(aside, 0)]
    result = await etcd.txn(compare, [Put(aside, value.value), put_back])
    if not result.succeeded:
        raise RepairConflict(f"{damage.key.decode(errors='replace')} changed while exod repair moved it: run it again")
    log.warning("moved %s aside to %s", damage.key.decode(errors="replace"), aside.decode(errors="replace"))
    return Moved(damage, aside, rebuilt)


async def _rebuilt_meta(etcd: Etcd, prefix: bytes) -> bytes:
    """The meta as the log's batches say it: where the log ends (the last entry of the last batch) and starts
    (the first of the first), as `exod.cluster.etcd_state` writes it."""
    first: tuple[int, LogEntry] | None = None
    last_seq, start = 0, prefix + LOG
    while True:
        batches = await etcd.range(start, prefix + LOG_END, limit=_PAGE)
        for kv in batches:
            try:
                entries = parse_batch(kv.value)
            except ValueError:
                continue
            if entries:
                first = first or entries[0]
                last_seq = max(last_seq, entries[-1][0])
        if len(batches) < _PAGE:
            break
        start = batches[-1].key + b"\0"
    meta = {
        "last_seq": last_seq,
        "log_start": last_seq + 1 if first is None else first[0],
        "oldest_time": None if first is None else first[1].time,
    }
    return json.dumps(meta).encode()
