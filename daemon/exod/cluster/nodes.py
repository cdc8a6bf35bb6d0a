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


class Presence:
    """This daemon's node record, kept alive: renewed every third of the TTL, re-created if it expired.

    `run` belongs in the daemon's nursery; `lease` is the lease the node's keys hang on (the controller
    election's key too). `lost` is set while etcd cannot be reached: the daemon is then degraded.
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
        self.refresh = refresh  # what changes about the node (free memory, cached models), read at each renewal
        self.lease = 0
        self._written: NodeRecord | None = None  # the record etcd holds, as far as this node knows
        self.lost: str | None = None  # why etcd cannot be reached, while it cannot
        self.renewed = trio.Event()  # set (and replaced) whenever the lease was renewed or re-created
        # (trio time) until when the lease is surely alive: TTL after the last renewal was *asked for*
        self.alive_until = -math.inf

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
        if not self.lease:  # not joined yet (the daemon joins first, to fail early if etcd is not there)
            await self.join()
        task_status.started()
        while True:
            await trio.sleep(self.ttl / 3)
            try:
                try:
                    asked = trio.current_time()
                    await self.etcd.keep_alive(self.lease)
                    self.alive_until = asked + self.ttl
                except LeaseExpired:
                    log.warning("the lease of node %s expired: joining again", self.record.node_id)
                    await self.join()
            except EtcdUnavailable as exc:
                self.lost = str(exc)
                log.error("cannot renew the lease of node %s: %s", self.record.node_id, exc)
                continue
            except EtcdError as exc:  # refused: log it, try again at the next renewal
                log.error("etcd refused to renew node %s: %s", self.record.node_id, exc)
                continue
            self.lost = None
            await self._refresh()
            self.renewed.set()
            self.renewed = trio.Event()

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
