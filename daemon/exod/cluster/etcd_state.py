"""The cluster's state in etcd: the `exod.state.store.StateStore` of a cluster's controller.

Keys, under the cluster's prefix (``/exod/`` by default)::

    state/snapshot        every machine, as `fsm.cluster.Cluster.to_dict` writes it (JSON)
    state/meta            {"last_seq": N, "log_start": M, "oldest_time": T}: where the log ends and starts
    log/<first seq>       one batch of transition-log entries: the entries of one save, numbered from it

Every save is one transaction, guarded by the controller's term (`exod.cluster.election.Term`): the snapshot, the
meta and the batch, all or nothing, and only while this node is the controller. A deposed controller's
save is refused by etcd and raises `exod.cluster.election.Deposed`. One batch per save keeps a save inside etcd's
limit on operations per transaction (128 by default) however many transitions it carries.

A save also compares the mod revision of ``state/meta`` with the one it builds on (which every save rewrites), so
that a save whose answer was lost (it timed out at a paused member, and was retried at another) can never be
applied after anything written since: the next save first reads ``state/meta`` to learn whether it was applied
(`EtcdState._resolve`).

Why our own sequence numbers, not etcd's revisions, as the log's ids: a transaction writes all its keys
at one revision, so the entries of one save share it. The sequence is as global (one writer at a time,
each continuing from ``last_seq`` in etcd) and dense, so ``GET /events`` resumes exactly as on one host.

The log is bounded like the one host's (`exod.state.retention.Retention`): a save that passes ``max_log_rows``
or finds its oldest batch older than ``max_log_age_days`` deletes the oldest batches in the same
transaction, down to nine tenths of the bound; and every `COMPACT_EVERY` revisions etcd's own history
(each save rewrites the snapshot key) is compacted.

What is read back is untrusted input (anyone who can write to etcd can write any value at any key): a snapshot
or a meta that cannot be restored raises `exod.cluster.damage.Unrestorable`, which names the key and what to
do, and is never written over by a controller that has not read it (`exod.serve` holds the term, degraded); a
log batch that is not exod's is skipped by every reader. A controller that *has* the state, and finds a value
it cannot read where it wrote one, writes back what it wrote (`heal`, `save`), keeping a copy under
``damaged/``: a successor could not take over from what is there.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from exod.cluster.damage import Damage, Kind, Unrestorable, aside_key
from exod.cluster.election import Deposed, Term, guarded_write
from exod.cluster.etcd import Compare, Delete, Etcd, EtcdError, EtcdUnavailable, KeyValue, Put
from exod.state.retention import Retention
from exod.state.sqlite import PRUNE_TO, StoreError
from exod.state.store import StateUnavailable
from fsm import PhaseLimits, SnapshotError
from fsm.cluster import Cluster, LogEntry

log = logging.getLogger("exod.etcd_state")


class MalformedState(Exception):
    """The cluster's state in etcd is not what exod writes; the message says where and what to do."""


COMPACT_EVERY = 10_000  # revisions of history etcd keeps before we compact it
_SEQ_DIGITS = 20  # log keys sort by key as by sequence number
SNAPSHOT, META, LOG = b"state/snapshot", b"state/meta", b"log/"  # under the cluster's prefix
LOG_END = b"log0"  # b"/" + 1: the first key after every log key
# A snapshot written before the watchdogs were saved, read only to be checked or shown: the controller
# restores it with its configured limits (`fsm.Cluster.from_dict` refuses it without).
_UNWATCHED = PhaseLimits()


@attrs.frozen
class _Meta:
    last_seq: int = 0
    log_start: int = 1
    oldest_time: float | None = None  # of the entry at log_start


# -- reading a value: what exod wrote, or why it is not ------------------------------------------------------


def parse_snapshot(value: bytes) -> dict[str, Any]:
    """The snapshot as `load` returns it (a JSON object); `ValueError` saying what else it is."""
    try:
        snapshot = json.loads(value)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(snapshot, dict):
        raise ValueError(f"expected a JSON object, got {type(snapshot).__name__}")
    return snapshot


def restorable(value: bytes) -> str | None:
    """Why no controller can restore the snapshot ``value`` (the machines refuse it too), or None if one can."""
    try:
        snapshot = parse_snapshot(value)
        Cluster.from_dict(snapshot, limits=_UNWATCHED if "limits" not in snapshot else None)  # the controller's own
    except (ValueError, RecursionError) as exc:  # SnapshotError is a ValueError
        return str(exc)
    return None


def parse_meta(value: bytes) -> _Meta:
    """``state/meta`` as exod writes it; `ValueError` saying what is wrong with it."""
    try:
        fields = json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(fields, dict) or set(fields) != {"last_seq", "log_start", "oldest_time"}:
        raise ValueError("expected a JSON object of last_seq, log_start and oldest_time, and nothing else")
    meta = _Meta(**fields)
    counts = (meta.last_seq, meta.log_start)
    if any(isinstance(n, bool) or not isinstance(n, int) for n in counts) or meta.last_seq < 0 or meta.log_start < 1:
        raise ValueError(f"last_seq and log_start: expected whole numbers (>= 0, >= 1), got {counts}")
    if meta.log_start > meta.last_seq + 1:
        raise ValueError(f"log_start {meta.log_start} is past the log's end ({meta.last_seq})")
    oldest = meta.oldest_time
    if oldest is not None and (isinstance(oldest, bool) or not isinstance(oldest, (int, float)) or oldest != oldest):
        raise ValueError(f"oldest_time: expected a number or null, got {oldest!r}")
    return meta


def parse_batch(value: bytes) -> list[tuple[int, LogEntry]]:
    """A batch of the log as exod writes it, its entries numbered; `ValueError` saying what is wrong with it."""
    try:
        batch = json.loads(value)
        first = batch["first"]
        if isinstance(first, bool) or not isinstance(first, int) or first < 1:
            raise ValueError(f"first: expected a whole number >= 1, got {first!r}")
        return [(first + i, LogEntry.from_record(r)) for i, r in enumerate(batch["entries"])]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from None


@attrs.frozen
class _Attempt:
    """A save sent to etcd whose answer never came: etcd may have applied it, may still (a paused member that
    resumes), or never will. Every attempt still unknown builds on the same revision of ``state/meta``."""

    meta: _Meta  # what it writes to state/meta: how it is recognised there
    entries: tuple[LogEntry, ...]  # what it appends to the log


class EtcdState:
    """The cluster's state as one controller term reads and writes it."""

    refused: str | None = None  # what it cannot restore raises `Unrestorable` (`exod.cluster.repair.Guarded`)

    def __init__(self, etcd: Etcd, prefix: bytes, term: Term | None, *, retention: Retention | None = None) -> None:
        self.etcd, self.prefix, self.term = etcd, prefix, term
        self.retention = retention or Retention()
        self.where = f"etcd at {etcd.url} ({prefix.decode()})"
        self._meta: _Meta | None = None
        # The mod revision of state/meta as this turn last wrote or read it: what its next save builds on, and
        # compares (0: no meta yet; etcd compares an absent key's mod revision as 0).
        self._revision = 0
        self._unknown: list[_Attempt] = []  # saves sent whose answer was lost, none of them known applied
        self._compacted = 0
        # This turn's fencing token: written when the turn loads the state, compared by each of its saves. A node
        # that takes its own term back (same election key, same guard) starts a new turn, and a save of the
        # earlier turn still in flight (timed out at a paused member, applied when it resumed) must then be
        # refused, not written over the new turn's log: found by a 5-min campaign (seed 2074194091).
        self._turn = secrets.token_hex(8)
        self._begun = False
        self._loaded: KeyValue | None = None  # the snapshot as `load` read it
        self._last: bytes | None = None  # the snapshot as this turn last read or wrote it: what `heal` writes back
        self._writing = trio.Lock()  # a save or a heal at a time: each builds on the meta's revision
        self._aside: list[Put] = []  # copies of values a save writes over (`_foreign_meta`), kept with it

    def damage(self, kind: Kind, key: bytes, reason: str, revision: int) -> Damage:
        """A value of this cluster's that cannot be restored, for the operator."""
        return Damage(kind, key, reason, revision, self.etcd.url, self.prefix)

    @property
    def _snapshot_key(self) -> bytes:
        return self.prefix + SNAPSHOT

    @property
    def _meta_key(self) -> bytes:
        return self.prefix + META

    @property
    def _turn_key(self) -> bytes:
        return self.prefix + b"state/turn"

    def _log_key(self, seq: int) -> bytes:
        return self.prefix + LOG + str(seq).zfill(_SEQ_DIGITS).encode()

    @property
    def _log_end(self) -> bytes:
        return self.prefix + LOG_END

    # -- StateStore ------------------------------------------------------------------------------

    async def load(self) -> dict[str, Any] | None:
        """The last snapshot saved. A controller's turn begins here: its token is written first (guarded by its
        term), so that what it reads next is all an earlier turn will ever have written."""
        if self.term is not None:
            await self._begin()
        kv = self._loaded = await self._read(self._snapshot_key)
        self._meta, self._revision = await self._read_meta()
        self._unknown = []  # this is what the turn builds on: an attempt applied after this read is refused
        if kv is None:
            return None
        try:
            snapshot = parse_snapshot(kv.value)
        except ValueError as exc:
            raise self.snapshot_error(str(exc)) from None
        self._last = kv.value
        return snapshot

    async def save(self, snapshot: dict[str, Any], entries: Sequence[LogEntry], now: float) -> int:
        """After a `StateUnavailable`, the next save must carry the failed one's entries first (the journal keeps
        them queued): that save may have been applied all the same, and they are then not written twice."""
        if self.term is None:
            raise Deposed("this node is not the controller: only the controller writes the cluster's state")
        async with self._writing:
            return await self._save(snapshot, entries, now)

    async def _save(self, snapshot: dict[str, Any], entries: Sequence[LogEntry], now: float) -> int:
        assert self.term is not None
        if not self._begun:  # a turn that saves before it reads (a test's, a tool's) begins here
            await self._begin()
        if self._meta is None:
            self._meta, self._revision = await self._read_meta()
        todo = list(entries)
        if self._unknown:  # an earlier save's answer was lost: what it wrote is not to be written again
            resolved = await self._resolve(todo)
            todo = todo if resolved is None else resolved
        value = json.dumps(snapshot, sort_keys=True).encode()
        while True:  # twice at most: a refusal that an unknown attempt explains is resolved, and the save tried again
            meta, ops = await self._ops(value, todo, now)
            ops += self._aside
            # Why the revision it builds on, not only the term and the turn: a save that timed out at a paused
            # member holds both, and was applied when the member resumed, after its retry (sent to another
            # member) and later saves: the snapshot and the meta went back, and its batch replaced the retry's
            # at the same log key, so readers sent entry N were later shown another (the chaos campaign's
            # invariant 6). Each save moves this revision on: an attempt built on an older one is refused.
            compare = [
                *self.term.guard(),
                self._turn_compare(),
                Compare(self._meta_key, "MOD", "EQUAL", self._revision),
            ]
            self._unknown.append(_Attempt(meta, tuple(todo)))
            try:
                result = await self.etcd.txn(compare, ops)
            except EtcdUnavailable as exc:
                raise StateUnavailable(f"cannot write the state to {self.where}: {exc}") from exc
            except EtcdError as exc:  # answered: refused as a request (too large …), never applied: degraded, said
                self._unknown.pop()
                raise StateUnavailable(f"{self.where} refuses the state's write: {exc}") from exc
            self._unknown.pop()  # answered: applied or refused, for good
            if result.succeeded:
                self._meta, self._revision, self._unknown, self._aside = meta, result.revision, [], []
                self._last = value
                await self._compact(result.revision)
                return meta.last_seq
            await self._still_this_turn()
            # The term and the turn hold, so the meta moved under this save: only an attempt of this turn whose
            # answer was lost can have moved it (applied after this save read the meta; a paused member resumed).
            resolved = await self._resolve(todo) if self._unknown else None
            if resolved is None and not self._unknown and await self._foreign_meta():
                continue  # a value that no node could read: written over with this turn's, a copy kept
            if resolved is None:
                raise Deposed(
                    f"{self._meta_key.decode()} in {self.where} was written by someone other than this controller "
                    f"(node {self.term.node_id}) during its turn: the turn ends, and the next one reads the state "
                    "afresh. Only exod writes under its prefix in etcd: find who else does"
                )
            todo = resolved

    async def transitions(self, after: int = 0, limit: int | None = None) -> list[tuple[int, LogEntry]]:
        try:
            # the batch holding after + 1 is the last one that starts at or before it
            head = await self.etcd.range(self._log_key(0), self._log_key(after + 2), limit=1, descending=True)
            start = head[0].key if head else self._log_key(0)
            found: list[tuple[int, LogEntry]] = []
            while limit is None or len(found) < limit:
                batches = await self.etcd.range(start, self._log_end, limit=64)
                for kv in batches:
                    for seq, entry in _entries(kv):
                        if seq > after and (limit is None or len(found) < limit):
                            found.append((seq, entry))
                if len(batches) < 64:
                    break
                start = batches[-1].key + b"\0"
            return found
        except EtcdUnavailable as exc:
            raise StateUnavailable(f"cannot read the transition log from {self.where}: {exc}") from exc

    async def log_start(self) -> int:
        try:
            meta, _ = await self._read_meta()
        except Unrestorable as exc:  # a reader of the log is told it cannot be read now, and why
            raise StateUnavailable(str(exc)) from None
        return meta.log_start

    async def changed(self, after: int) -> None:
        """Watches the meta key from the revision it was read at: any node's view of any controller's writes."""
        try:
            kv, revision = await self.etcd.read(self._meta_key)
            if kv is not None and self._parse_meta(kv).last_seq > after:
                return
            async for _ in self.etcd.watch(self._meta_key, start_revision=revision + 1):
                return
        except EtcdUnavailable as exc:
            raise StateUnavailable(f"cannot watch the transition log in {self.where}: {exc}") from exc
        except Unrestorable as exc:
            raise StateUnavailable(str(exc)) from None

    def snapshot_error(self, reason: str) -> StoreError:
        """`Unrestorable`: the snapshot `load` read (or its machines) cannot be restored, for ``reason``."""
        revision = 0 if self._loaded is None else self._loaded.mod_revision
        return Unrestorable(self.damage(Kind.SNAPSHOT, self._snapshot_key, reason, revision))

    async def heal(self) -> bool:
        """Write back what this turn last read or wrote, over a snapshot or a meta that no controller could
        restore (found by `exod.cluster.repair.StateCheck`), keeping a copy of each under ``damaged/``: this
        controller has the state, and a successor could not take over from what is there now. True if it did;
        False where it is not this turn's to say: a save of its still unknown, a meta written by someone else
        that reads as exod's (the next save finds out: `Deposed`), or nothing wrong."""
        if self.term is None or not self._begun or self._meta is None:
            return False
        async with self._writing:
            if self._unknown:
                return False
            snapshot, meta = await self._read(self._snapshot_key), await self._read(self._meta_key)
            meta_revision = 0 if meta is None else meta.mod_revision
            compare = [*self.term.guard(), self._turn_compare(), Compare(self._meta_key, "MOD", "EQUAL", meta_revision)]
            ops: list[Put | Delete] = []
            healed: list[Damage] = []
            if meta is not None and meta_revision != self._revision:
                try:
                    parse_meta(meta.value)
                    return False
                except ValueError as exc:
                    healed.append(self.damage(Kind.META, self._meta_key, str(exc), meta_revision))
                    ops += [Put(aside_key(healed[-1]), meta.value), Put(self._meta_key, _meta_value(self._meta))]
            if snapshot is not None and (reason := restorable(snapshot.value)) is not None:
                healed.append(self.damage(Kind.SNAPSHOT, self._snapshot_key, reason, snapshot.mod_revision))
                compare.append(Compare(self._snapshot_key, "MOD", "EQUAL", snapshot.mod_revision))
                ops.append(Put(aside_key(healed[-1]), snapshot.value))
                ops.append(Delete(self._snapshot_key) if self._last is None else Put(self._snapshot_key, self._last))
            if not ops:
                return False
            try:
                result = await self.etcd.txn(compare, ops)
            except EtcdError as exc:  # out of reach, or refused as a request: the next check tries again
                raise StateUnavailable(f"cannot write the state back to {self.where}: {exc}") from exc
            if not result.succeeded:  # a save came between (it wrote its own), or the term or the turn ended
                return False
            if any(damage.kind is Kind.META for damage in healed):
                self._revision = result.revision
            for damage in healed:
                log.error(
                    "%s: written back by the controller (node %s), a copy kept", damage.key.decode(), self.term.node_id
                )
            return True

    # -- the log's bounds ----------------------------------------------------------------------------

    async def _prune(self, meta: _Meta, now: float, fresh: tuple[int, float] | None) -> tuple[_Meta, list[Delete]]:
        """The deletes that keep the log inside `retention` (none, almost always) and the meta after them.
        ``fresh``: the sequence number and time of the first entry of the batch this save writes, which stays."""
        r = self.retention
        rows = meta.last_seq - meta.log_start + 1
        too_old = meta.oldest_time is not None and meta.oldest_time < now - r.max_log_age
        if rows <= r.max_log_rows and not too_old:
            return meta, []
        keep_from = meta.last_seq - max(1, int(r.max_log_rows * PRUNE_TO)) + 1 if rows > r.max_log_rows else 0
        young = now - r.max_log_age * PRUNE_TO
        try:
            batches = await self.etcd.range(self._log_key(meta.log_start), self._log_end)
        except EtcdUnavailable as exc:
            raise StateUnavailable(f"cannot read the transition log from {self.where} to prune it: {exc}") from exc
        kept = [
            kv
            for kv in batches
            if (e := _entries(kv)) and e[-1][0] >= keep_from and (not too_old or e[-1][1].time >= young)
        ]
        # batches are in order: keep from the first one that must stay, or else from the batch this save writes
        # (a log older than its bound all through, after a month idle: deleting up to the log's end, the delete
        # took in the new batch's key too, and etcd refused the whole save, every controller's in turn)
        first_kept = kept[0] if kept else None
        entries = _entries(first_kept) if first_kept is not None else []
        if first_kept is not None and entries:
            end, log_start, oldest = first_kept.key, entries[0][0], entries[0][1].time
        elif fresh is not None:
            end, (log_start, oldest) = self._log_key(fresh[0]), fresh
        else:
            end, log_start, oldest = self._log_end, meta.last_seq + 1, None
        log.info("transition log pruned: entries before %d deleted (see [retention] in the config)", log_start)
        return attrs.evolve(meta, log_start=log_start, oldest_time=oldest), [Delete(self._log_key(0), range_end=end)]

    async def _compact(self, revision: int) -> None:
        if revision - self._compacted < COMPACT_EVERY:
            return
        try:
            await self.etcd.compact(revision - COMPACT_EVERY // 10)
        except EtcdError as exc:  # compacted already by another, or by etcd's own auto-compaction: fine
            log.debug("etcd compaction skipped: %s", exc)
        self._compacted = revision

    # -- a save's outcome ---------------------------------------------------------------------------------

    async def _ops(self, snapshot: bytes, entries: Sequence[LogEntry], now: float) -> tuple[_Meta, list[Put | Delete]]:
        """The meta a save of ``entries`` on `_meta` writes, and its operations."""
        assert self._meta is not None
        meta = self._meta
        ops: list[Put | Delete] = [Put(self._snapshot_key, snapshot)]
        fresh = None  # the first entry of the batch written: its sequence number and time
        if entries:
            first = meta.last_seq + 1
            batch = {"first": first, "entries": [e.as_record() for e in entries]}
            ops.append(Put(self._log_key(first), json.dumps(batch).encode()))
            oldest = meta.oldest_time if meta.last_seq >= meta.log_start else entries[0].time
            meta = attrs.evolve(meta, last_seq=meta.last_seq + len(entries), oldest_time=oldest)
            fresh = (first, entries[0].time)
        meta, prune = await self._prune(meta, now, fresh)
        ops += prune
        ops.append(Put(self._meta_key, _meta_value(meta)))
        return meta, ops

    def _turn_compare(self) -> Compare:
        return Compare(self._turn_key, "VALUE", "EQUAL", self._turn.encode())

    async def _still_this_turn(self) -> None:
        """`Deposed` unless the term and this turn still hold (asked with a transaction that writes nothing): only
        then is a refused save not this turn's end, and its refusal for `_resolve` to explain."""
        assert self.term is not None
        try:
            result = await self.etcd.txn([*self.term.guard(), self._turn_compare()], [])
        except EtcdUnavailable as exc:
            raise StateUnavailable(f"cannot ask {self.where} why it refused the state's write: {exc}") from exc
        if not result.succeeded:
            raise Deposed(
                f"node {self.term.node_id} is no longer the controller (or this turn of it is over): etcd refused "
                "its write"
            )

    async def _resolve(self, entries: list[LogEntry]) -> list[LogEntry] | None:
        """Whether a save whose answer was lost was applied, from ``state/meta`` as it is now. Applied: this turn
        builds on it (its meta and revision), and what is left to write is ``entries`` without its entries, which
        are in the log already (the mirror case: a save applied, its answer lost; written again, its entries
        were twice in the log, or its retry refused and counted a deposition). Not applied (None): it never will
        be once a save built on the same revision is, and this save builds on it. Every save of this turn writes
        the meta, so while the term and the turn hold, a meta that moved from `_revision` is one of them."""
        kv = await self._read(self._meta_key)
        revision = 0 if kv is None else kv.mod_revision
        if revision == self._revision or kv is None:
            return None
        try:
            meta = parse_meta(kv.value)
        except ValueError:  # not what any attempt wrote: none of them is known applied
            return None
        applied = next((attempt for attempt in self._unknown if attempt.meta == meta), None)
        if applied is None:
            return None
        n = len(applied.entries)
        if tuple(entries[:n]) != applied.entries:
            raise ValueError(
                f"a save after StateUnavailable must carry the entries of the save that failed first ({n} of them, "
                "as exod.state.journal.Journal keeps them queued): etcd applied that save after all"
            )
        log.info(
            "a write of the state whose answer was lost had been applied (seq %d): not written again", meta.last_seq
        )
        self._meta, self._revision, self._unknown = meta, revision, []
        return entries[n:]

    async def _foreign_meta(self) -> bool:
        """Whether ``state/meta`` now holds a value no node can read (while this turn holds, and knows each of
        its saves' outcome): the next attempt writes over it, a copy kept under ``damaged/``."""
        kv = await self._read(self._meta_key)
        if kv is None or kv.mod_revision == self._revision:
            return False
        try:
            parse_meta(kv.value)
            return False
        except ValueError as exc:
            damage = self.damage(Kind.META, self._meta_key, str(exc), kv.mod_revision)
        aside = aside_key(damage)
        log.error(
            "%s is not exod's meta (%s): this controller writes its own over it, keeping it at %s",
            self._meta_key.decode(),
            damage.reason,
            aside.decode(errors="replace"),
        )
        self._revision = kv.mod_revision
        self._aside.append(Put(aside, kv.value))
        return True

    # -- reading ----------------------------------------------------------------------------------------

    async def _begin(self) -> None:
        """Write this turn's token, while the term holds: every save of an earlier turn is refused from here."""
        assert self.term is not None
        try:
            await guarded_write(self.etcd, self.term, [Put(self._turn_key, self._turn.encode())])
        except EtcdUnavailable as exc:
            raise StateUnavailable(f"cannot begin a controller's turn at {self.where}: {exc}") from exc
        self._begun = True

    async def _read(self, key: bytes) -> KeyValue | None:
        try:
            return await self.etcd.get(key)
        except EtcdUnavailable as exc:
            raise StateUnavailable(f"cannot read the state from {self.where}: {exc}") from exc

    async def _read_meta(self) -> tuple[_Meta, int]:
        """The meta and its mod revision (0 if there is none yet)."""
        kv = await self._read(self._meta_key)
        return (_Meta(), 0) if kv is None else (self._parse_meta(kv), kv.mod_revision)

    def _parse_meta(self, kv: KeyValue) -> _Meta:
        try:
            return parse_meta(kv.value)
        except ValueError as exc:
            raise Unrestorable(self.damage(Kind.META, self._meta_key, str(exc), kv.mod_revision)) from None


async def stored_cluster(etcd: Etcd, prefix: bytes) -> Cluster:
    """The cluster's machines as etcd holds them: what a node that is not the controller shows (as of the
    controller's last write). `EtcdUnavailable` if etcd cannot be reached; the message says where."""
    state = EtcdState(etcd, prefix, None)
    try:
        snapshot = await state.load()
        if snapshot is None:
            return Cluster()
        return Cluster.from_dict(snapshot, limits=_UNWATCHED if "limits" not in snapshot else None)  # to show
    except StateUnavailable as exc:
        raise EtcdUnavailable(str(exc)) from exc
    except StoreError as exc:  # not JSON, not an object
        raise MalformedState(str(exc)) from exc
    except SnapshotError as exc:  # written by someone who is not exod: never trusted
        raise MalformedState(str(state.snapshot_error(str(exc)))) from exc


def _meta_value(meta: _Meta) -> bytes:
    return json.dumps(attrs.asdict(meta)).encode()


def _entries(kv: KeyValue) -> list[tuple[int, LogEntry]]:
    """A batch of the log as exod writes it; one that is not (anyone who can write to etcd can write it) is
    skipped with a warning: a reader of the log is never failed by it (`exod repair` moves it aside)."""
    try:
        return parse_batch(kv.value)
    except ValueError as exc:
        key = kv.key.decode(errors="replace")
        log.warning("skipped %s in etcd: not a batch of exod's log (%s); `exod repair` moves it aside", key, exc)
        return []
