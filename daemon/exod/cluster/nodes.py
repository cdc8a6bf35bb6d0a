"""The nodes of a cluster: each daemon's record in etcd, alive for as long as its lease is renewed.

Each daemon keeps ``PREFIX/nodes/<node_id>`` — who it is, where to reach it, what memory and models it has —
under a lease of its own (`NodeRecord`, `Presence`). A daemon that stops renewing (killed, partitioned)
vanishes from the cluster once its lease expires, with no one having to decide it: that is the failure
detector (DESIGN §5). Any node lists them all (`list_nodes`), with each lease's age.

Time is etcd's: a lease's remaining TTL comes from etcd, so no two clocks are compared.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Callable

import attrs
import trio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from exod.cluster.etcd import Etcd, EtcdError, EtcdUnavailable, LeaseExpired

log = logging.getLogger("exod.nodes")

DEFAULT_TTL = 10  # seconds; tests use >= 5: two busy cores must not let a lease expire falsely
FENCE_MARGIN = 0.2  # of the TTL: a node's authority ends this much before its lease may expire


MAX_MEMORY = 1 << 50  # bytes (1 PiB): a record that claims more is not believed


class MalformedRecord(ValueError):
    """A value in etcd that is not what an exod node writes; the message says which and why."""


class _RecordSchema(BaseModel):
    """A node record as read from etcd: untrusted input (whoever can write to etcd can write anything)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    node_id: str = Field(..., max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    address: str = Field(..., min_length=1, max_length=255, pattern=r"^[A-Za-z0-9.:\[\]_-]+$")
    api_url: str = Field(..., max_length=300, pattern=r"^(https?://[^\s/]+)?$")
    memory_total: int = Field(..., ge=0, le=MAX_MEMORY)
    memory_free: int = Field(..., ge=0, le=MAX_MEMORY)
    models: list[str] = Field([], max_length=10_000)
    version: str = Field("", max_length=100)
    degraded: str = Field("", max_length=1000)


@attrs.frozen
class NodeRecord:
    node_id: str
    address: str  # what the other nodes reach it at (the MLX ring's host)
    api_url: str
    memory_total: int
    memory_free: int
    models: tuple[str, ...] = ()
    version: str = ""
    degraded: str = ""  # why the node cannot write its state now (its disk), or ""

    def to_json(self) -> bytes:
        return json.dumps(attrs.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> NodeRecord:
        """`MalformedRecord` unless ``raw`` is a record as a node writes it, within bounds."""
        try:
            data = _RecordSchema.model_validate_json(raw)
        except ValidationError as exc:
            raise MalformedRecord(f"not a node record: {exc.errors()[0]['msg']} at {exc.errors()[0]['loc']}") from None
        return cls(**{**data.model_dump(), "models": tuple(data.models)})


@attrs.frozen
class NodeStatus:
    """A node as any node sees it: its record, and its lease (age = granted TTL - what is left)."""

    record: NodeRecord
    lease: int
    lease_ttl: int  # granted
    lease_left: int  # seconds before it expires unless renewed

    @property
    def lease_age(self) -> int:
        return self.lease_ttl - self.lease_left


def node_key(prefix: bytes, node_id: str) -> bytes:
    return prefix + b"nodes/" + node_id.encode()


def runners_prefix(prefix: bytes, node_id: str) -> bytes:
    return prefix + f"runners/{node_id}/".encode()


def runner_key(prefix: bytes, node_id: str, runner_id: str, incarnation: int) -> bytes:
    """A runner process that ``node_id``'s agent runs, kept under the node's lease from before it is spawned
    until after it is reaped (`exod.cluster.agent`)."""
    return runners_prefix(prefix, node_id) + f"{runner_id}/{incarnation}".encode()


def all_runners_prefix(prefix: bytes) -> bytes:
    """Every node's runner keys are under it."""
    return prefix + b"runners/"


Alive = dict[str, set[tuple[str, int]]]  # node id → (runner id, incarnation) of each runner key it holds


async def live_runners(etcd: Etcd, prefix: bytes, malformed: Counter[str] | None = None) -> Alive:
    """The runner processes that may be alive on each node: those its agent holds a key for. A node that is
    gone is not listed (its keys went with its lease, after it fenced itself), so the controller never
    starts a new generation beside an old one that may still run (DESIGN §5, fencing). A key that is not
    one a node writes is skipped, said, and counted in ``malformed`` (as ``runner``)."""
    return (await read_runners(etcd, prefix, malformed))[0]


async def read_runners(etcd: Etcd, prefix: bytes, malformed: Counter[str] | None = None) -> tuple[Alive, int]:
    """`live_runners`, and the revision etcd read them at (what a claim compares against: `agent`)."""
    kvs, revision = await etcd.get_prefix(all_runners_prefix(prefix))
    alive: Alive = {}
    for kv in kvs:
        try:
            node_id, runner = kv.key[len(prefix) + len(b"runners/") :].decode().split("/", 1)
            runner_id, incarnation = runner.rsplit("/", 1)
            alive.setdefault(node_id, set()).add((runner_id, int(incarnation)))
        except ValueError:  # not UTF-8, no '/', no number
            _skipped(malformed, "runner", kv.key, "not NODE/INSTANCE/RANK/INCARNATION")
    return alive, revision


# -- the generation rule: never two generations of an instance alive at once (DESIGN §5) ----------------
#
# One rule, read from the runner keys, applied in two places: the controller starts no rank of a generation
# while a key of an earlier one is left (`exod.cluster.remote.Fleet.earlier_gone`), and an agent claims no
# runner while one is, nor one that a later generation (or the same runner) has superseded
# (`exod.cluster.agent`): a stale or replayed command cannot start what the controller would not. Instances
# restart all their ranks together (fsm's one_for_all, the daemon's only strategy), so the rule is the
# instance's, not each rank's.


def instance_of(runner_id: str) -> str:
    """The instance a runner belongs to: its id is INSTANCE/RANK."""
    return runner_id.rsplit("/", 1)[0]


Key = tuple[str, str, int]  # a runner key: (node id, runner id, incarnation)


def earlier_generations(alive: Alive, instance_id: str, generation: int) -> list[Key]:
    """Every key of an earlier generation of ``instance_id`` than ``generation``: while one is left, no rank of
    ``generation`` may run."""
    return sorted(
        (node, runner_id, incarnation)
        for node, keys in alive.items()
        for runner_id, incarnation in keys
        if instance_of(runner_id) == instance_id and incarnation < generation
    )


def superseding(alive: Alive, runner_id: str, generation: int) -> list[Key]:
    """Every key that makes a claim of ``runner_id`` in ``generation`` stale or a duplicate: a later generation
    of its instance, or the same rank of this one."""
    instance_id = instance_of(runner_id)
    return sorted(
        (node, other, incarnation)
        for node, keys in alive.items()
        for other, incarnation in keys
        if instance_of(other) == instance_id
        and (incarnation > generation or (incarnation == generation and other == runner_id))
    )


def described(keys: list[Key]) -> str:
    """The keys as an operator looks for them in etcd: RUNNER/INCARNATION on NODE, comma-separated."""
    return ", ".join(f"{runner_id}/{incarnation} on {node}" for node, runner_id, incarnation in keys)


async def list_nodes(etcd: Etcd, prefix: bytes, malformed: Counter[str] | None = None) -> list[NodeStatus]:
    """Every node whose lease is alive, sorted by id. A record that is not one a node writes (or that names
    another node than its key) is skipped, said, and counted in ``malformed`` (as ``node``): never trusted
    for placement, never an error of whoever asked."""
    kvs, _ = await etcd.get_prefix(prefix + b"nodes/")
    nodes = []
    for kv in kvs:
        try:
            record = NodeRecord.from_json(kv.value)
            if node_key(prefix, record.node_id) != kv.key:
                raise MalformedRecord(f"it names node {record.node_id!r}, another node than its key")
        except MalformedRecord as exc:
            _skipped(malformed, "node", kv.key, str(exc))
            continue
        left, granted = await etcd.time_to_live(kv.lease)
        if left > 0:
            nodes.append(NodeStatus(record, kv.lease, granted, left))
    return sorted(nodes, key=lambda n: n.record.node_id)


def _skipped(malformed: Counter[str] | None, kind: str, key: bytes, why: str) -> None:
    log.warning("skipped %s in etcd: %s", key.decode(errors="replace")[:200], why)
    if malformed is not None:
        malformed[kind] += 1


RENEWALS_PER_TTL = 6  # a renewal every TTL/6: one that fails leaves most of the authority (TTL less the margin)
RETRY_S = 0.05  # the first retry after a failed renewal (the next member of etcd); doubling up to the interval
MIN_ATTEMPT_S = 0.25  # the shortest an attempt is given, however little authority is left


@attrs.define
class Renewals:
    """How well the lease is being renewed, measured as it happens (`exod status` shows it): how late each
    renewal started against its schedule (a starved event loop shows here), how long etcd took, and the
    authority left when it was acknowledged — the slack between this node and stepping down."""

    interval: float  # seconds between renewals, as scheduled
    count: int = 0  # renewals acknowledged
    failures: int = 0  # attempts that failed (each retried at once on the next member, then backing off)
    late_last: float = 0.0  # seconds the last renewal started after it was due
    late_max: float = 0.0
    took_last: float = 0.0  # seconds etcd took to acknowledge the last one
    took_max: float = 0.0
    slack_last: float | None = None  # seconds of authority left when the last renewal was acknowledged
    slack_min: float | None = None

    def renewed(self, late: float, took: float, slack: float) -> None:
        """One renewal acknowledged: started ``late`` after it was due, ``took`` in etcd, ``slack`` left."""
        self.count += 1
        self.late_last, self.late_max = late, max(self.late_max, late)
        self.took_last, self.took_max = took, max(self.took_max, took)
        self.slack_last = slack
        self.slack_min = slack if self.slack_min is None else min(self.slack_min, slack)

    def report(self) -> dict[str, float | int | None]:
        """JSON-ready, in seconds rounded to the millisecond."""
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in attrs.asdict(self).items()}


class Presence:
    """This daemon's node record, kept alive: renewed every `RENEWALS_PER_TTL`-th of the TTL on a schedule
    (at once if a renewal is overdue, as after a slow start-up), a failed renewal retried at once on the
    next member of etcd and then backing off, each attempt bounded by the authority left; re-created if it
    expired. The record is refreshed after a renewal, every third of the TTL at most.

    `run` belongs in the daemon's nursery; `lease` is the lease the node's keys hang on (the controller
    election's key too). `lost` is set while etcd cannot be reached: the daemon is then degraded. `renewals`
    measures how it goes.
    """

    def __init__(
        self,
        etcd: Etcd,
        prefix: bytes,
        record: NodeRecord,
        *,
        ttl: int = DEFAULT_TTL,
        refresh: Callable[[NodeRecord], NodeRecord] | None = None,
    ) -> None:
        if ttl < 2:
            raise ValueError(f"a lease TTL must be at least 2 s, got {ttl}")
        self.etcd, self.prefix, self.record, self.ttl = etcd, prefix, record, ttl
        self.refresh = refresh  # what changes about the node (free memory, cached models), read after renewals
        self.lease = 0
        self._written: NodeRecord | None = None  # the record etcd holds, as far as this node knows
        self.lost: str | None = None  # why etcd cannot be reached, while it cannot
        self.renewed = trio.Event()  # set (and replaced) whenever the lease was renewed or re-created
        # (trio time) until when the lease is surely alive: TTL after the last renewal was *asked for*
        self.alive_until = -math.inf
        self.renewals = Renewals(interval=ttl / RENEWALS_PER_TTL)

    @property
    def authority_until(self) -> float:
        """(trio time) When this node's authority ends — as the controller, and as an agent allowed to run
        runners: its lease's surely-alive bound less `FENCE_MARGIN` of the TTL, by this node's own monotonic
        clock. Only a renewal that etcd acknowledged moves it on; no watch, no silence, no other clock does,
        so a node cut off in silence gives up before another node can take its place (DESIGN §5)."""
        return self.alive_until - FENCE_MARGIN * self.ttl

    async def authority_lost(self) -> None:
        """Return once `authority_until` has passed with no renewal moving it on."""
        while (left := self.authority_until - trio.current_time()) > 0:
            renewed = self.renewed
            with trio.move_on_after(left):
                await renewed.wait()

    async def authority_held(self) -> None:
        """Return once this node has authority (at once while it has). A node without it may not campaign: it
        would be elected only to step down at once (`fsm.fencing`: a campaign needs authority)."""
        while trio.current_time() >= self.authority_until:
            await self.renewed.wait()

    async def join(self) -> None:
        """Grant a lease and write the record on it (raises if etcd cannot be reached)."""
        asked = trio.current_time()
        self.lease = await self.etcd.grant(self.ttl)
        self.alive_until = asked + self.ttl
        record = self.record
        await self.etcd.put(node_key(self.prefix, record.node_id), record.to_json(), lease=self.lease)
        self._written = record

    async def update(self, record: NodeRecord) -> None:
        """Make ``record`` this node's: written now if etcd takes it, else at the next renewal that reaches it,
        never given up. Found by the fault campaign (#26, seed 723748302): a daemon restarted while etcd's
        first member was paused raised here, writing its API's address, and crashed with its API just bound."""
        self.record = record
        await self._write()

    async def _write(self) -> None:
        record = self.record
        try:
            await self.etcd.put(node_key(self.prefix, record.node_id), record.to_json(), lease=self.lease)
        except EtcdError as exc:
            log.warning("cannot write the record of node %s now (%s): at the next renewal", record.node_id, exc)
        else:
            self._written = record

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Renew for as long as the daemon runs. The schedule counts from the last renewal *asked for* (the
        join's included): a daemon whose start-up kept this task from running renews at once, not a whole
        interval later (#46: a controller stepped down at start under load). After a renewal the record is
        refreshed (every third of the TTL at most), within half an interval: a slow write never delays the
        next renewal."""
        if not self.lease:  # not joined yet (the daemon joins first, to fail early if etcd is not there)
            await self.join()
        task_status.started()
        interval = self.renewals.interval
        due = self.alive_until - self.ttl + interval  # the join asked at alive_until - ttl
        retry, refreshed = RETRY_S, -math.inf
        while True:
            await trio.sleep_until(due)
            started = trio.current_time()
            if not await self._renew(late=max(0.0, started - due)):
                # at once on the next member, then less often: an etcd that is down is not hammered
                due, retry = trio.current_time() + retry, min(2 * retry, interval)
                continue
            due, retry = started + interval, RETRY_S
            if started - refreshed >= self.ttl / 3 or self.record != self._written:
                refreshed = started
                with trio.move_on_after(interval / 2):
                    await self._refresh()
            self.renewed.set()
            self.renewed = trio.Event()

    async def _renew(self, *, late: float) -> bool:
        """One renewal (a re-join if the lease expired): whether it was acknowledged. The attempt is given
        half the authority left (`MIN_ATTEMPT_S` at least): should its member hang (killed in silence, or
        waiting for a new etcd leader), the other half is for the next member."""
        asked, authority = trio.current_time(), self.authority_until
        attempt = min(self.etcd.timeout, max(MIN_ATTEMPT_S, (authority - asked) / 2))
        try:
            try:
                await self.etcd.keep_alive(self.lease, timeout=attempt)
            except LeaseExpired:
                log.warning("the lease of node %s expired: joining again", self.record.node_id)
                await self.join()
        except EtcdUnavailable as exc:
            self.lost = str(exc)
            self.renewals.failures += 1
            log.error("cannot renew the lease of node %s: %s", self.record.node_id, exc)
            return False
        except EtcdError as exc:  # refused: log it, try again
            self.renewals.failures += 1
            log.error("etcd refused to renew node %s: %s", self.record.node_id, exc)
            return False
        now = trio.current_time()
        self.renewals.renewed(late, now - asked, authority - now)  # negative: it had lapsed (a re-join)
        self.alive_until = max(self.alive_until, asked + self.ttl)  # a re-join moved it already
        self.lost = None
        return True

    async def _refresh(self) -> None:
        if self.refresh is not None:
            self.record = self.refresh(self.record)
        if self.record != self._written:  # changed, or a write of it that did not reach etcd
            await self._write()

    async def leave(self) -> None:
        """Revoke the lease: the record (and every key on the lease) goes at once."""
        if self.lease:
            lease, self.lease, self.alive_until = self.lease, 0, -math.inf
            try:
                await self.etcd.revoke(lease)
            except EtcdUnavailable as exc:  # it expires on its own
                log.warning(
                    "cannot revoke the lease of node %s (%s): it expires in %d s", self.record.node_id, exc, self.ttl
                )
