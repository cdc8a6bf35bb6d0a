"""Injecting a `schedule.Step` into the rig, and undoing it after its hold: signals to runners, daemons and etcd
members, cuts of node-1's links, a state dir filled up, a lowered fd limit. Each step runs in a thread of its
own, so that faults overlap as the schedule says; each ends as a `FaultRecord` in the history."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import threading
import time
from collections.abc import Callable

import httpx
import psutil

from exod.chaos.history import FaultRecord, History, ProcessLife
from exod.chaos.rig import Node, Rig, RigError
from exod.chaos.schedule import Area, Kind, Role, Step
from exod.cluster.devcluster import DevClusterError, LocalEtcd

FILLER = ".chaos-filler"


class NoTarget(LookupError):
    """Nothing of the role the step names exists now (no runner alive, a node already down …)."""


class Injector:
    def __init__(
        self, rig: Rig, history: History, clock: Callable[[], float], runners: Callable[[], dict[int, ProcessLife]]
    ) -> None:
        self.rig, self.history, self.clock, self.runners = rig, history, clock, runners
        self.runner_kills: dict[int, float] = {}  # pid → when: the runner faults that surely end a generation
        self.runner_hits: dict[int, float] = {}  # … and those that may (a pause)
        self._busy: set[str] = set()  # targets a fault holds now: one fault at a time on each
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []  # what the rig could not do: the campaign is void, whatever it saw

    def start(self, step: Step) -> None:
        thread = threading.Thread(target=self._run, args=(step,), name=step.kind.value, daemon=True)
        self._threads.append(thread)
        thread.start()

    def join(self) -> None:
        for thread in self._threads:
            thread.join()

    def _run(self, step: Step) -> None:
        started = self.clock()
        try:
            target, nodes, undo = self._inject(step)
        except NoTarget as exc:
            self.history.fault(FaultRecord(step.kind.value, "-", started, started, (), f"not injected: {exc}"))
            return
        except Exception as exc:  # the rig failed to inject it: the campaign fails, saying so
            self.errors.append(f"{step.text()}: could not be injected: {exc!r}")
            return
        try:
            time.sleep(step.hold)
            undo()
        except Exception as exc:
            self.errors.append(f"{step.text()}: could not be undone: {exc!r}")
        finally:
            with self._lock:
                self._busy.difference_update(target.split("+"))
            self.history.fault(FaultRecord(step.kind.value, target, started, self.clock(), nodes))

    def _claim(self, candidates: list[str], step: Step) -> str:
        """One of ``candidates`` that no other fault holds now, picked as the step says."""
        with self._lock:
            free = [c for c in candidates if c not in self._busy]
            if not free:
                raise NoTarget(f"no {step.role.value} free of other faults")
            target = free[step.pick % len(free)]
            self._busy.add(target)
            return target

    def _claim_all(self, names: list[str], step: Step) -> list[str]:
        with self._lock:
            if self._busy & set(names):
                raise NoTarget(f"a {step.role.value} is held by another fault")
            self._busy |= set(names)
            return names

    def _inject(self, step: Step) -> tuple[str, tuple[str, ...], Callable[[], None]]:
        """Do it; (what it hit, the nodes it made unreachable or unresponsive, how to undo it)."""
        kind = step.kind
        if kind in (Kind.RUNNER_KILL, Kind.RUNNER_PAUSE):
            return self._runner(step)
        if kind in (Kind.ETCD_KILL, Kind.ETCD_PAUSE, Kind.ETCD_PAUSE_ALL):
            return self._etcd(step)
        if kind is Kind.STORAGE_MODEL_GONE:
            return self._model_gone(step)
        node = self._node(step)
        try:
            return node.name, (node.name,), self._on_node(kind, node)
        except BaseException:
            with self._lock:
                self._busy.discard(node.name)
            raise

    # -- runners ----------------------------------------------------------------------

    def _runner(self, step: Step) -> tuple[str, tuple[str, ...], Callable[[], None]]:
        alive = sorted(self.runners().values(), key=lambda p: (p.instance, p.rank, p.generation))
        pid = int(self._claim([str(p.pid) for p in alive], step))
        now = self.clock()
        if step.kind is Kind.RUNNER_KILL:
            self.runner_kills[pid] = self.runner_hits[pid] = now
            _signal(pid, signal.SIGKILL)
            return str(pid), (), lambda: None
        self.runner_hits[pid] = now
        _signal(pid, signal.SIGSTOP)
        return str(pid), (), lambda: _signal(pid, signal.SIGCONT)

    # -- daemons, node-1's links, state dirs, fd limits -----------------------------------

    def _node(self, step: Step) -> Node:
        """A live node of the step's role; for a network fault, the namespaced one, if it plays that role now."""
        alive = [n.name for n in self.rig.nodes if n.alive and (n.namespaced or step.kind.area is not Area.NETWORK)]
        if step.role is not Role.NAMESPACED:
            controller = self._controller()
            is_controller = step.role is Role.CONTROLLER
            alive = [name for name in alive if (name == controller) == is_controller]
        if step.role is Role.RANK_AGENT:
            holding = {life.node for life in self.runners().values()}
            alive = [name for name in alive if name in holding]
        return self.rig.node(self._claim(alive, step))

    def _controller(self) -> str | None:
        try:
            return self.rig.controller()
        except RigError:  # no node answers: none is the controller, as far as a client can tell
            return None

    def _on_node(self, kind: Kind, node: Node) -> Callable[[], None]:
        assert node.process is not None
        pid = node.process.pid
        if kind is Kind.DAEMON_KILL:
            node.process.kill()
            node.process.wait()
            return lambda: _restart_node(node)
        if kind is Kind.DAEMON_TERM:
            node.stop()
            return lambda: _restart_node(node)
        if kind is Kind.DAEMON_PAUSE:
            _signal(pid, signal.SIGSTOP)
            return lambda: _signal(pid, signal.SIGCONT)
        if kind is Kind.STORAGE_FULL:
            return _fill(node.home / "state")
        if kind is Kind.STORAGE_FDS:
            return _lower_fd_limit(pid)
        space = self.rig.space
        assert space is not None
        etcd, peers = self.rig.etcd_address, self.rig.peers()
        if kind is Kind.NETWORK_ALL:
            space.cut()
            return space.heal
        if kind is Kind.NETWORK_ETCD:
            space.cut_from(etcd)
            return lambda: space.heal_from(etcd)
        if kind is Kind.NETWORK_DEAF:
            space.deafen_to(etcd)
            return lambda: space.hear(etcd)
        assert kind is Kind.NETWORK_PEERS
        for address in peers:
            space.cut_from(address)

        def heal() -> None:
            for address in peers:
                space.heal_from(address)

        return heal

    def _model_gone(self, step: Step) -> tuple[str, tuple[str, ...], Callable[[], None]]:
        """A model's files moved out of the cache every node reads (`huggingface-cli delete-cache` while it
        serves), and back after the hold. A rank of the model is SIGKILLed as they go (a cache cleaned while a
        rank restarts), so that a load comes while they are gone: the host's failure, uncharged, and the model
        fetched again (offline: in vain, and retried) until they are back. Without that kill a load rarely met
        the gap, and the download machine's invalidate, fail and retry went untaken by real processes."""
        model = self._claim(list(self.rig.models), step)
        cache = self.rig.hf_home / "hub" / ("models--" + model.replace("/", "--"))
        aside = cache.with_name(cache.name + ".chaos-aside")
        cache.rename(aside)
        name = model.split("/")[-1]
        ranks = [p for p in self.runners().values() if p.instance.rsplit("-", 1)[0] == name]
        target = model
        with contextlib.suppress(NoTarget):
            pid = int(self._claim([str(p.pid) for p in sorted(ranks, key=lambda p: (p.instance, p.rank))], step))
            self.runner_kills[pid] = self.runner_hits[pid] = self.clock()  # a runner's fault: charged once
            _signal(pid, signal.SIGKILL)
            target = f"{model}+{pid}"
        return target, (), lambda: aside.rename(cache)

    # -- etcd ---------------------------------------------------------------------------

    def _etcd(self, step: Step) -> tuple[str, tuple[str, ...], Callable[[], None]]:
        members = self.rig.members()
        if step.kind is Kind.ETCD_PAUSE_ALL:
            names = self._claim_all([m.name for m in members], step)
            for member in members:
                _signal(member.process.pid, signal.SIGSTOP) if member.process else None
            return "+".join(names), (), lambda: _resume(members)
        leader = _leader(members)
        wanted = [m.name for m in members if (m.name == leader) == (step.role is Role.LEADER) and m.process]
        name = self._claim(wanted, step)
        member = next(m for m in members if m.name == name)
        assert member.process is not None
        if step.kind is Kind.ETCD_PAUSE:
            pid = member.process.pid
            _signal(pid, signal.SIGSTOP)
            return member.name, (), lambda: _signal(pid, signal.SIGCONT)
        member.process.kill()
        member.process.wait()
        member.process = None
        return member.name, (), lambda: _restart(member)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _resume(members: list[LocalEtcd]) -> None:
    for member in members:
        if member.process is not None:
            _signal(member.process.pid, signal.SIGCONT)


def _restart_node(node: Node, tries: int = 3) -> None:
    """Start ``node`` again; a start can fail while its etcd is away (serve exits, saying so): tried again."""
    for attempt in range(tries):
        try:
            node.start()
            return
        except DevClusterError:
            if attempt == tries - 1:
                raise
            time.sleep(2)


def _restart(member: LocalEtcd) -> None:
    member.launch()
    member.wait_healthy(60)


def _leader(members: list[LocalEtcd]) -> str | None:
    """The name of etcd's leader, as a member that answers says."""
    ids = {}
    leader = None
    for member in members:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            status = httpx.post(f"{member.url}/v3/maintenance/status", json={}, timeout=1).json()
            ids[status["header"]["member_id"]] = member.name
            leader = status["leader"]
    return ids.get(leader) if leader else None


def _fill(directory: os.PathLike[str] | str) -> Callable[[], None]:
    """Fill the file system of ``directory`` up; the undo frees it."""
    path = os.path.join(directory, FILLER)
    with open(path, "wb") as out:
        block = b"\0" * (1 << 20)
        with contextlib.suppress(OSError):
            while True:
                out.write(block)
                out.flush()
    return lambda: _remove(path)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _lower_fd_limit(pid: int) -> Callable[[], None]:
    """The daemon's soft limit of open files down to a few more than it holds; the undo gives it back."""
    process = psutil.Process(pid)
    soft, hard = process.rlimit(resource.RLIMIT_NOFILE)
    process.rlimit(resource.RLIMIT_NOFILE, (process.num_fds() + 8, hard))

    def restore() -> None:
        if not process.is_running():  # gone, or its pid already another's: nothing of it to give back
            return
        try:  # the soft limit is what the fault took; the hard one is the target's own (it may lower it meanwhile)
            now_hard = process.rlimit(resource.RLIMIT_NOFILE)[1]
            process.rlimit(resource.RLIMIT_NOFILE, (min(soft, now_hard), now_hard))
        except psutil.NoSuchProcess:
            return
        except psutil.AccessDenied as exc:  # found once lowered by the target itself (mlx-lm's import): see why
            with process.oneshot():
                state = f"status {_quietly(process.status)}, uids {_quietly(process.uids)}"
            limits = f"limits now {_quietly(lambda: process.rlimit(resource.RLIMIT_NOFILE))}, to restore {(soft, hard)}"
            raise RuntimeError(f"restoring pid {pid}'s open-file limit was refused ({state}; {limits})") from exc

    return restore


def _quietly(read: Callable[[], object]) -> str:
    """A detail for an error message, or why it could not be read."""
    try:
        return repr(read())
    except psutil.Error as exc:
        return f"<{type(exc).__name__}>"
