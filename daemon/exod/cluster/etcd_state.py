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
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Sequence
from typing import Any

import attrs

from exod.cluster.election import Deposed, Term, guarded_write
from exod.cluster.etcd import Compare, Delete, Etcd, EtcdError, EtcdUnavailable, KeyValue, Put
from exod.state.retention import Retention
from exod.state.sqlite import PRUNE_TO, StoreError
from exod.state.store import StateUnavailable
from fsm import SnapshotError
from fsm.cluster import Cluster, LogEntry

log = logging.getLogger("exod.etcd_state")


class MalformedState(Exception):
    """The cluster's state in etcd is not what exod writes; the message says where and what to do."""


COMPACT_EVERY = 10_000  # revisions of history etcd keeps before we compact it
_SEQ_DIGITS = 20  # log keys sort by key as by sequence number


@attrs.frozen
class _Meta:
    last_seq: int = 0
    log_start: int = 1
    oldest_time: float | None = None  # of the entry at log_start


@attrs.frozen
class _Attempt:
    """A save sent to etcd whose answer never came: etcd may have applied it, may still (a paused member that
    resumes), or never will. Every attempt still unknown builds on the same revision of ``state/meta``."""

    meta: _Meta  # what it writes to state/meta: how it is recognised there
    entries: tuple[LogEntry, ...]  # what it appends to the log


class EtcdState:
    """The cluster's state as one controller term reads and writes it."""

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

    @property
    def _snapshot_key(self) -> bytes:
        return self.prefix + b"state/snapshot"

    @property
    def _meta_key(self) -> bytes:
        return self.prefix + b"state/meta"

    @property
    def _turn_key(self) -> bytes:
        return self.prefix + b"state/turn"

    def _log_key(self, seq: int) -> bytes:
        return self.prefix + b"log/" + str(seq).zfill(_SEQ_DIGITS).encode()

    @property
    def _log_end(self) -> bytes:
        return self.prefix + b"log0"  # b"/" + 1: the first key after every log key

    # -- StateStore ------------------------------------------------------------------------------

    async def load(self) -> dict[str, Any] | None:
        """The last snapshot saved. A controller's turn begins here: its token is written first (guarded by its
        term), so that what it reads next is all an earlier turn will ever have written."""
        if self.term is not None:
            await self._begin()
        kv = await self._read(self._snapshot_key)
        self._meta, self._revision = await self._read_meta()
        self._unknown = []  # this is what the turn builds on: an attempt applied after this read is refused
        if kv is None:
            return None
        try:
            snapshot = json.loads(kv.value)
        except ValueError as exc:
            raise self.snapshot_error(f"not JSON: {exc}") from exc
        if not isinstance(snapshot, dict):
            raise self.snapshot_error(f"expected a JSON object, got {type(snapshot).__name__}")
        return snapshot

    async def save(self, snapshot: dict[str, Any], entries: Sequence[LogEntry], now: float) -> int:
        """After a `StateUnavailable`, the next save must carry the failed one's entries first (the journal keeps
        them queued): that save may have been applied all the same, and they are then not written twice."""
        if self.term is None:
            raise Deposed("this node is not the controller: only the controller writes the cluster's state")
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
            self._unknown.pop()  # answered: applied or refused, for good
            if result.succeeded:
                self._meta, self._revision, self._unknown = meta, result.revision, []
                await self._compact(result.revision)
                return meta.last_seq
            await self._still_this_turn()
            # The term and the turn hold, so the meta moved under this save: only an attempt of this turn whose
            # answer was lost can have moved it (applied after this save read the meta; a paused member resumed).
            resolved = await self._resolve(todo) if self._unknown else None
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
        meta, _ = await self._read_meta()
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

    def snapshot_error(self, reason: str) -> StoreError:
        return StoreError(
            f"{self.where} holds a state snapshot that cannot be restored ({reason}). It was left untouched: "
            f"an operator may delete {self._snapshot_key.decode()} (`etcdctl del`) to start from an empty state."
        )

    # -- the log's bounds ----------------------------------------------------------------------------

    async def _prune(self, meta: _Meta, now: float) -> tuple[_Meta, list[Delete]]:
        """The deletes that keep the log inside `retention` (none, almost always) and the meta after them."""
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
        # batches are in order: keep from the first one that must stay
        first_kept = kept[0] if kept else None
        end = first_kept.key if first_kept is not None else self._log_end
        entries = _entries(first_kept) if first_kept is not None else []
        log_start = entries[0][0] if entries else meta.last_seq + 1
        oldest = entries[0][1].time if entries else None
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
        if entries:
            first = meta.last_seq + 1
            batch = {"first": first, "entries": [e.as_record() for e in entries]}
            ops.append(Put(self._log_key(first), json.dumps(batch).encode()))
            oldest = meta.oldest_time if meta.last_seq >= meta.log_start else entries[0].time
            meta = attrs.evolve(meta, last_seq=meta.last_seq + len(entries), oldest_time=oldest)
        meta, prune = await self._prune(meta, now)
        ops += prune
        ops.append(Put(self._meta_key, json.dumps(attrs.asdict(meta)).encode()))
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
        meta = self._parse_meta(kv)
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
            return _Meta(**json.loads(kv.value))
        except (ValueError, TypeError) as exc:
            raise self.snapshot_error(f"{self._meta_key.decode()} is not exod's: {exc}") from exc


async def stored_cluster(etcd: Etcd, prefix: bytes) -> Cluster:
    """The cluster's machines as etcd holds them: what a node that is not the controller shows (as of the
    controller's last write). `EtcdUnavailable` if etcd cannot be reached; the message says where."""
    state = EtcdState(etcd, prefix, None)
    try:
        snapshot = await state.load()
        return Cluster() if snapshot is None else Cluster.from_dict(snapshot)
    except StateUnavailable as exc:
        raise EtcdUnavailable(str(exc)) from exc
    except StoreError as exc:  # not JSON, not an object
        raise MalformedState(str(exc)) from exc
    except SnapshotError as exc:  # written by someone who is not exod: never trusted
        raise MalformedState(str(state.snapshot_error(str(exc)))) from exc


def _entries(kv: KeyValue) -> list[tuple[int, LogEntry]]:
    """A batch of the log as exod writes it; one that is not (anyone who can write to etcd can write it) is
    skipped with a warning: a reader of the log is never failed by it."""
    try:
        batch = json.loads(kv.value)
        return [(int(batch["first"]) + i, LogEntry.from_record(r)) for i, r in enumerate(batch["entries"])]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("skipped %s in etcd: not a batch of exod's log (%s)", kv.key.decode(errors="replace"), exc)
        return []
