"""One campaign: set up the rig, place instances, run the workload, inject the seeded schedule, heal, let the
cluster recover, and hold what was recorded to the seven invariants; then take it all down and look for
anything left behind.

The campaign's clock starts when the faults may start (t+0); a violation names the time on it, so that the
schedule up to it (`schedule.draw`) and the history around it can be read side by side.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import psutil
import trio

import fsm
from exod.chaos import invariants as inv
from exod.chaos.faults import Injector
from exod.chaos.history import FaultRecord, History, InstanceSample, Operation, Outcome
from exod.chaos.rig import API_KEY, TIMEOUTS, Rig, RigError, can_mount_tmpfs
from exod.chaos.schedule import Abilities, Kind, Step, draw, fault_window
from exod.chaos.watch import STATE_POLL_S, Watcher, runner_processes, wait
from exod.chaos.workload import Workload
from exod.cluster import netns
from exod.cluster.etcd import Etcd
from exod.cluster.etcd_state import stored_cluster
from exod.cluster.membership import DEFAULT_PREFIX
from exod.host.tiny_model import make_tiny_model
from fsm.cluster import LogEntry
from fsm.conformance import MachineCoverage
from fsm.conformance import replay as replay_log

MODELS = ("exod/tiny-qwen2", "exod/tiny-qwen2-b")
LAYERS = 4  # room for 3 ranks
QUEUE_TIMEOUT_S = 30.0  # [limits] queue_timeout's default: a request no Ready runner takes by then fails
POLICY = fsm.RetryPolicy()  # the nodes' [retry]: the defaults
# A set-up request (placing the standing instances) answered "not now" — 502, 503 or 504 (a controller deposed
# mid-placement, an election under way), or no connection — is asked again, as its Retry-After says, for this
# long at most; any other answer, or this long without one, is the rig's failure (`RigError`), never a crash.
SETUP_S = 120.0
RETRYABLE = frozenset({502, 503, 504})
RETRY_AFTER_S = 1.0  # between tries where the answer names no Retry-After


@attrs.frozen
class Settings:
    seed: int
    duration: float = 180.0  # seconds of workload; faults in its `fault_window`
    nodes: int = 3
    members: int = 3
    ttl: int = 5
    namespaces: bool = True  # put node-1 in a network namespace, if this machine can
    tmpfs: bool = True  # put the state dirs on small tmpfs mounts, if this machine can
    keep: Path | None = None  # where to copy the history and the nodes' logs


@attrs.define
class Result:
    settings: Settings
    abilities: Abilities
    schedule: tuple[Step, ...]
    history: History
    bounds: inv.Bounds
    cold_start: float
    violations: list[inv.Violation]
    errors: list[str]  # what the rig could not do: the campaign proves nothing
    coverage: dict[str, MachineCoverage]
    replay: str
    healed: float
    standing: tuple[str, ...]  # the instances placed before the faults began

    @property
    def ok(self) -> bool:
        return not self.violations and not self.errors


def run(settings: Settings, announce: Callable[[str], object] = print) -> Result:
    with tempfile.TemporaryDirectory(prefix="exod-chaos-") as scratch:
        root = Path(scratch)
        try:
            return _run(root, settings, announce)
        finally:
            if settings.keep is not None:
                _keep(root, settings.keep)


def _run(root: Path, settings: Settings, announce: Callable[[str], object]) -> Result:
    hf_home = root / "hf"
    for n, model in enumerate(MODELS):
        make_tiny_model(model, layers=LAYERS, seed=n, hf_home=hf_home)
    abilities = Abilities(
        namespaces=settings.namespaces and netns.unusable() is None,
        tmpfs=settings.tmpfs and os.geteuid() == 0 and can_mount_tmpfs(root / "probe"),
        nodes=settings.nodes,
        members=settings.members,
    )
    for kind in Kind:
        if (why := abilities.why_not(kind)) is not None:
            announce(f"not injected: {kind.value}: {why}")
    steps = draw(settings.seed, settings.duration, abilities, ttl=settings.ttl)
    announce(
        f"seed {settings.seed}: {len(steps)} faults in {settings.duration:.0f} s; reproduce with "
        f"`exod chaos --seed {settings.seed} --duration {settings.duration:g}`"
    )
    history = History()
    try:
        rig = Rig(
            root,
            hf_home,
            MODELS,
            nodes=settings.nodes,
            members=settings.members,
            ttl=settings.ttl,
            namespace=abilities.namespaces,
            tmpfs=abilities.tmpfs,
        )
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # etcd or a node did not come up
        raise RigError(f"the cluster could not be set up: {exc}") from exc
    leftovers: list[str] = []
    try:
        announce(
            f"etcd ({settings.members} members) and {settings.nodes} nodes up"
            + (f"; node-1 in network namespace {rig.space.name}" if rig.space else "")
        )
        cold, placed = _place_first(rig, settings.nodes)
        bounds = inv.Bounds(
            request_s=QUEUE_TIMEOUT_S + TIMEOUTS["generate"] + 20.0,
            recovery_s=2 * settings.ttl + POLICY.backoff.cap + TIMEOUTS["load_progress"] + 3 * cold,
        )
        announce(
            f"placed {len(MODELS)} instances (cold start {cold:.1f} s); bounds: a request {bounds.request_s:.0f} s, "
            f"Ready after the last heal {bounds.recovery_s:.0f} s"
        )
        injector, healed = _observe(rig, settings, steps, bounds, placed, history, leftovers, announce)
        cluster = _read_cluster(rig.etcd.url)
        if settings.keep is not None:
            settings.keep.mkdir(parents=True, exist_ok=True)
            (settings.keep / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in cluster.log))
        _armed_faults(history, injector)
    finally:
        rig.stop_nodes()
        if not wait(lambda: not _claims(rig.etcd.url), settings.ttl + 10):
            leftovers.append(f"claim keys in etcd after every node stopped: {_claims(rig.etcd.url)}")
        space = rig.space.name if rig.space else None
        rig.close()
    leftovers += _left_behind(root, space, {life.instance for life in history.processes.values()})
    violations = _check(history, injector, cluster, bounds, healed, leftovers, settle=settings.ttl)
    return Result(
        settings,
        abilities,
        steps,
        history,
        bounds,
        cold,
        violations,
        list(injector.errors),
        cluster.coverage,
        cluster.replay,
        healed,
        tuple(iid for iid, _, _ in placed),
    )


def _observe(
    rig: Rig,
    settings: Settings,
    steps: tuple[Step, ...],
    bounds: inv.Bounds,
    placed: list[tuple[str, float, float]],
    history: History,
    leftovers: list[str],
    announce: Callable[[str], object],
) -> tuple[Injector, float]:
    """t+0 onwards: the watcher and the clients running, the schedule injected, every fault healed and the
    cluster given its bound to recover; the injector (what it hit) and when the last fault ended."""
    t0 = time.monotonic()

    def clock() -> float:
        return time.monotonic() - t0

    for iid, began, ended in placed:  # before t+0
        history.operation(Operation("place", "node-2", began - t0, ended - t0, Outcome.OK, "", iid))

    def overlap(text: str) -> None:
        announce(f"VIOLATION as it happens (invariant 1): {text}")

    with Watcher(history, clock, rig.daemons, rig.etcd.url, overlap=overlap) as watcher:
        injector = Injector(rig, history, clock, lambda: watcher.latest)
        workload = Workload(
            history,
            clock,
            rig.urls,
            seed=settings.seed,
            models=MODELS,
            api_key=API_KEY,
            bound=bounds.request_s,
            placements_until=fault_window(settings.duration),
        )
        with workload:
            for step in steps:
                time.sleep(max(0.0, step.at - clock()))
                announce(step.text())
                injector.start(step)
            injector.join()
            healed = _last_heal(history, watcher, clock())
            announce(f"t+{healed:.1f}s healed; waiting for every instance to be Ready again")
            wait(lambda: _all_ready(history, healed), bounds.recovery_s + 5)
            time.sleep(max(0.0, settings.duration - clock()))
            if (later := _last_heal(history, watcher, healed)) > healed:  # an armed fault fired meanwhile
                healed = later
                announce(f"t+{healed:.1f}s an armed runner fault ended a generation; waiting again")
                wait(lambda: _all_ready(history, healed), bounds.recovery_s + 5)
            if hung := workload.stop():
                leftovers.append(f"clients still waiting at the end: {hung}")
        time.sleep(2 * STATE_POLL_S)  # a last sample of etcd's state
    return injector, healed


def _check(
    history: History,
    injector: Injector,
    cluster: _ClusterRead,
    bounds: inv.Bounds,
    healed: float,
    leftovers: list[str],
    *,
    settle: float,
) -> list[inv.Violation]:
    """The seven invariants on what was recorded, earliest violation first."""
    deletes = {op.instance: op.start for op in history.operations if op.client == "delete"}
    host = [f for f in history.faults if not f.note and not f.kind.startswith(("runner", "armed"))]
    lives = history.processes.values()
    found = [
        *inv.one_generation_at_a_time(lives),
        *inv.nothing_lost(history.operations, cluster.log, cluster.kept),
        *inv.every_request_ends(history, bounds),
        *inv.retries_charged(
            history.samples, lives, injector.runner_hits, injector.runner_kills, host, deletes, settle=settle
        ),
        *inv.ready_after_the_last_heal(history.samples, healed, bounds, inv.left_parked(history.operations)),
        *inv.the_log_replays(cluster.divergence, history.events, cluster.log, cluster.start),
        *inv.nothing_left_behind(leftovers),
    ]
    return sorted(found, key=lambda v: v.time)


def _place_first(rig: Rig, nodes: int) -> tuple[float, list[tuple[str, float, float]]]:
    """The campaign's standing instances: the first model on every node (pinned), the second on one rank
    wherever the placer puts it; the first's cold start (place → Ready), which the bounds scale with, and each
    placement (instance, asked, acknowledged)."""
    pinned = {"ranks": nodes, "nodes": [f"node-{n}" for n in range(1, nodes + 1)]}
    placed = [_place(rig, MODELS[0], pinned), _place(rig, MODELS[1], {"ranks": 1})]
    iid, asked, _ = placed[0]
    cold = _ready(rig, iid) - asked
    _ready(rig, placed[1][0])
    return cold, placed


def _client() -> httpx.Client:
    """The set-up's client (a test gives it a transport of its own)."""
    return httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def _place(rig: Rig, model: str, body: dict[str, Any]) -> tuple[str, float, float]:
    """A standing instance placed (on node-2, which the schedule never cuts first); `RigError` if it cannot be."""
    started = time.monotonic()
    with _client() as client:
        answer = setup_request(client, "POST", lambda: f"{rig.urls()['node-2']}/instances", {"model": model, **body})
    try:
        return answer.json()["instance_id"], started, time.monotonic()
    except (ValueError, KeyError, TypeError) as exc:
        raise RigError(f"placing {model}: an answer without its instance: {answer.text[:200]!r}") from exc


def setup_request(
    client: httpx.Client, method: str, url: Callable[[], str], body: Any = None, *, within: float = SETUP_S
) -> httpx.Response:
    """A set-up request's success, asked again while the answer is "not now" (`RETRYABLE`, or no connection),
    for ``within`` seconds at most; `RigError` saying what was answered otherwise. ``url``: where to ask now (a
    restarted node has a new port)."""
    give_up, what = time.monotonic() + within, method
    while True:
        try:
            target = url()
            what = f"{method} {target}"
            answer = client.request(method, target, json=body)
        except (httpx.TransportError, KeyError, OSError, ValueError) as exc:  # no answer, or the node's URL unknown
            said, wait_s = f"no answer ({type(exc).__name__}: {exc})", RETRY_AFTER_S
        else:
            if answer.is_success:
                return answer
            said = f"{answer.status_code} {_error_message(answer)}"
            if answer.status_code not in RETRYABLE:
                raise RigError(f"{what} was answered {said}: the rig cannot place its standing instances")
            wait_s = _retry_after(answer)
        if time.monotonic() + wait_s > give_up:
            raise RigError(f"{what} was still answered {said} after {within:.0f} s of asking again")
        time.sleep(wait_s)


def _error_message(answer: httpx.Response) -> str:
    try:
        return str(answer.json()["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return repr(answer.text[:300])


def _retry_after(answer: httpx.Response) -> float:
    """The seconds its Retry-After asks for (a date, or nothing, is `RETRY_AFTER_S`), at most a minute."""
    try:
        return min(60.0, max(0.0, float(answer.headers.get("retry-after", RETRY_AFTER_S))))
    except ValueError:
        return RETRY_AFTER_S


def _ready(rig: Rig, iid: str, timeout: float = 180.0) -> float:
    """When ``iid`` was seen Ready; `RigError` if not within ``timeout`` (no node answering counts as not yet)."""
    ready = fsm.InstanceState.READY.value

    def seen() -> bool:
        try:
            return rig.get(f"/instances/{iid}")["state"] == ready
        except (RigError, KeyError, TypeError):
            return False

    if not wait(seen, timeout):
        raise RigError(f"{iid} was not Ready within {timeout:.0f} s of its placement: the rig is broken")
    return time.monotonic()


def _all_ready(history: History, since: float) -> bool:
    latest: dict[str, InstanceSample] = {}
    for s in list(history.samples):
        latest[s.instance] = s
    fresh = [s for s in latest.values() if s.time > since and not s.deleted and not s.spent]
    return bool(fresh) and all(s.state == fsm.InstanceState.READY.value for s in fresh)


def _last_heal(history: History, watcher: Watcher, now: float) -> float:
    """When the last fault ended: the schedule's, or an armed runner's whose process is gone."""
    armed = [p.last for p in list(history.processes.values()) if p.fault and p.pid not in watcher.latest]
    return max([now, *(f.end for f in history.faults), *armed])


def _armed_faults(history: History, injector: Injector) -> None:
    """The armed runner faults that fired, as faults of the history (seen from their command lines)."""
    for life in list(history.processes.values()):
        if life.fault:
            injector.runner_hits.setdefault(life.pid, life.first)
            history.fault(FaultRecord(f"armed:{life.fault}", str(life.pid), life.first, life.last))


@attrs.frozen
class _ClusterRead:
    """The cluster as etcd holds it at the end, read as `exod replay --cluster` reads it."""

    kept: set[str]  # the instances in its state
    divergence: str | None  # the log's first divergence from the machines, or None
    log: list[dict[str, Any]]  # the log's entries, as exported
    start: int  # the first one's sequence number
    coverage: dict[str, MachineCoverage]
    replay: str  # what `exod replay` said


def _read_cluster(url: str) -> _ClusterRead:
    async def read() -> set[str]:
        etcd = Etcd(url)
        try:
            return set((await stored_cluster(etcd, DEFAULT_PREFIX.encode())).instances)
        finally:
            await etcd.aclose()

    kept = trio.run(read)
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as export:
        done = subprocess.run(
            [sys.executable, "-m", "exod", "replay", "--cluster", url, "--export", export.name],
            capture_output=True,
            text=True,
            timeout=120,
        )
        log = [json.loads(line) for line in Path(export.name).read_text().splitlines() if line.strip()]
    divergence = None if done.returncode == 0 else (done.stdout + done.stderr).strip()
    start = 1
    for line in done.stdout.splitlines():
        if line.startswith("history before seq "):
            start = int(line.split()[3])
    coverage = dict(replay_log([LogEntry.from_record(e) for e in log]).coverage)
    return _ClusterRead(kept, divergence, log, start, coverage, done.stdout.strip())


def _claims(url: str) -> list[str]:
    """The runner claims left in etcd (`exod.cluster.nodes.runner_key`)."""

    async def read() -> list[str]:
        etcd = Etcd(url)
        try:
            kvs, _ = await etcd.get_prefix(DEFAULT_PREFIX.encode() + b"runners/")
            return [kv.key.decode() for kv in kvs]
        finally:
            await etcd.aclose()

    try:
        return trio.run(read)
    except Exception as exc:  # etcd itself is not answering: say so, as something left
        return [f"(etcd did not answer: {exc})"]


def _left_behind(root: Path, space: str | None, instances: set[str]) -> list[str]:
    """Processes of the campaign (runners of its instances, anything run from its directory), its namespace,
    its mounts: all of it should be gone."""
    found = [
        f"runner process {pid}: {' '.join(argv)}"
        for pid, (_, argv) in runner_processes().items()
        if argv[argv.index("--runner-id") + 1].rpartition("/")[0] in instances
    ]
    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        if any(str(root) in a for a in argv):
            found.append(f"process {process.pid}: {' '.join(argv)[:200]}")
    if space is not None:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        if space in listed:
            found.append(f"network namespace {space}")
    mounts = Path("/proc/mounts").read_text()
    found += [f"mount {line.split()[1]}" for line in mounts.splitlines() if str(root) in line]
    return found


def _keep(root: Path, where: Path) -> None:
    """The nodes' and etcd's logs, for reading after a violation."""
    where.mkdir(parents=True, exist_ok=True)
    for log in [*root.glob("node-*/serve.log"), *root.glob("etcd/member-*/etcd.log")]:
        target = where / "-".join(log.relative_to(root).parts)
        with contextlib.suppress(OSError):
            target.write_bytes(log.read_bytes())
