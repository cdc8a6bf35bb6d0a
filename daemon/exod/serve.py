"""``exod serve``: the daemon's whole task tree in one function.

::

    serve
    ├── controller.run      plan → act; one supervisor task per runner process
    ├── exod.api.http_server    the HTTP API (h11 and hypercorn, with read timeouts and a connection limit)
    ├── membership.run      with --cluster: the node's record and the election (exod.cluster.membership), and
    │   └── _lead           while elected, the controller's term: controller.run on etcd's state
    ├── check.run           with --cluster: whether etcd's state can be restored (exod.cluster.repair)
    └── signal watcher      SIGINT/SIGTERM → drain the requests (exod.api.drain; a second signal: end them now),
                            then stop and reap every runner, then cancel all

One daemon per state directory, which is private to its user (`exod.state.statedir`); the
daemon's address is written to ``daemon.json`` there so the CLI finds it. With ``--cluster`` the
cluster's state is in etcd and only the elected controller runs the controller, as a one-host daemon
would after a restart: it resumes from what the last controller wrote (`Controller.take_over`). A state there
that cannot be restored ends no daemon: the node elected holds its term degraded, restoring nothing, until an
operator has moved the value aside (`exod repair`), then takes over (`_lead`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import sys
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path

import attrs
import trio

import fsm
from exod.api.app import create_app
from exod.api.drain import Drain, Gate
from exod.api.http_server import bind, serve_http
from exod.cluster.agent import Agent
from exod.cluster.damage import Damage, Unrestorable
from exod.cluster.election import Deposed, Term
from exod.cluster.etcd import Etcd, EtcdError
from exod.cluster.etcd_state import EtcdState
from exod.cluster.membership import Membership
from exod.cluster.nodes import NodeRecord, live_runners
from exod.cluster.remote import Fleet
from exod.cluster.repair import Guarded, StateCheck
from exod.config import DEFAULT, Default, ServeConfig
from exod.controller import Controller, StoreUnavailable
from exod.host.memory import free_memory
from exod.host.models import ModelFiles, preload_in_background
from exod.host.orphans import reap_orphans
from exod.host.packaged import DEFAULT_MODEL
from exod.state.sqlite import Store
from exod.state.statedir import AlreadyRunning as AlreadyRunning  # re-exported: callers catch it from here too
from exod.state.statedir import HeldDir, StateDirError, state_dir_lock, write_private
from exod.state.store import SqliteState, StateStore, StateUnavailable

log = logging.getLogger("exod.serve")
STATE_DIR_CHECK_S = 1.0  # how often the daemon checks that its state directory is still the one it holds


class ClusterUnavailable(RuntimeError):
    """``--cluster`` names an etcd that cannot be reached."""


def daemon_address(state_dir: Path) -> str | None:
    """The URL of the daemon serving ``state_dir``, if one is running."""
    try:
        info = json.loads((state_dir / "daemon.json").read_text())
        os.kill(info["pid"], 0)
    except (OSError, ValueError, KeyError):
        return None
    return info["url"]


async def serve(config: ServeConfig, *, announce=print) -> None:
    state_dir = config.daemon.state_dir
    with state_dir_lock(state_dir) as held:
        sockets = bind(config)  # first: a port in use is one line, with nothing started and no state written
        store = Store.open(config.daemon.db_path, retention=config.daemon.retention)
        try:
            c = config.daemon
            models = ModelFiles(hf_home=c.hf_home, offline=c.offline, timeout=c.download_timeout)  # the node's
            preload_in_background()  # off the event loop: the lease renewals must not wait for an import
            agent = None if config.cluster is None else _agent(config, store, models)
            membership = await _join(config, agent)
            check = None if membership is None else StateCheck(membership.etcd, membership.prefix)
            # in a cluster, a follower until elected: nothing to write (`_lead` gives it etcd's state, guarded),
            # degraded while the check finds that state cannot be restored
            state: StateStore = SqliteState(store)
            if membership is not None and check is not None:
                state = Guarded(_cluster_state(membership, config, None), lambda: check.why)
            fleet = None if membership is None else _fleet(membership, config)
            controller = Controller(config.daemon, store, state=state, fleet=fleet, models=models)
            named = [(p.model or controller.register_local_model(p.path), p) for p in config.placements]
            wanted = [(model_id, p.ranks) for model_id, p in named]
            kept = {model_id: p.keep_alive for model_id, p in named}  # the last entry wins, as for its ranks
            if membership is None:
                await _restore(controller, state)
                await _place_configured(controller, wanted, kept)
            logging.getLogger("hypercorn.error").propagate = False  # it has its own handler
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:  # from the first: a SIGTERM
                # right after daemon.json appears (a script's quick stop) drains like any other, not the default death
                async with trio.open_nursery() as nursery:
                    if membership is None:
                        await nursery.start(controller.run)
                    app = create_app(
                        controller,
                        api_key=config.api_key,
                        max_body_bytes=config.max_body_bytes,
                        max_tokens_ceiling=config.max_tokens,
                        membership=membership,
                        agent=agent,
                        cors_origins=config.cors_origins,
                        allowed_hosts=config.host_names,
                    )
                    drain = Drain()
                    app = Gate(app, drain)
                    urls = await nursery.start(partial(serve_http, app, config, sockets))
                    url = urls[0]
                    # what starting made (modules, the app, its schemas) lives as long as the daemon: its garbage
                    # collected once, the rest kept out of the collector's full passes, which walked it all while
                    # every task stalled (57 ms; 1 ms frozen, bench/README.md)
                    gc.collect()
                    gc.freeze()
                    try:  # how the CLI finds the daemon; on a full disk it serves all the same
                        write_private(state_dir / "daemon.json", json.dumps({"pid": os.getpid(), "url": url}))
                    except OSError as exc:
                        log.error("cannot write %s (%s): pass --url %s to the CLI", state_dir / "daemon.json", exc, url)
                    if membership is not None:  # the record gets the API's address once it is bound
                        await membership.presence.update(attrs.evolve(membership.presence.record, api_url=url))
                        assert agent is not None and check is not None
                        await nursery.start(check.run)
                        await nursery.start(membership.run)
                        await nursery.start(agent.run, membership.presence)
                        nursery.start_soon(_lead, controller, membership, config, wanted, kept, check)
                        announce(f"exod: node {membership.node_id} of the cluster at {membership.config.url}")
                    announce(f"exod serving on {url} (state in {state_dir})")
                    exod = _command()
                    placed = next((p.model for p in config.placements if p.model), DEFAULT_MODEL)
                    announce(
                        f"  try:  {exod} status --state-dir {state_dir}\n"
                        f"        {exod} chat {placed} 'What is the capital of France?' --url {url}\n"
                        f"        curl {url}/instances\n"
                        "  stop: Ctrl-C (requests in progress finish, then every runner is stopped and reaped)"
                    )
                    why = await _until_asked_to_stop(signals, held)
                    announce(
                        f"exod: {why}: taking no new requests, letting those in progress finish "
                        f"(at most {config.drain_timeout:g} s; signal again to end them now)"
                    )
                    async with trio.open_nursery() as stopping:  # signals stay caught until the runners are reaped
                        stopping.start_soon(_hurry_on_signal, signals, drain, announce)
                        ended = await drain.run(config.drain_timeout, controller.requests.fail_all)
                        if ended:
                            announce(f"exod: ended {ended} request(s) still in progress with an error")
                        announce("exod: stopping runners")
                        await controller.shutdown()
                        if membership is not None:  # at once, rather than when the lease runs out
                            await membership.leave()
                        stopping.cancel_scope.cancel()
                    nursery.cancel_scope.cancel()
            if (gone := held.replaced()) is not None:
                raise StateDirError(f"{gone}; this daemon stopped its runners: start exod again to use the new one")
        finally:
            if held.replaced() is None:  # a daemon on a new directory at the path has its own
                with contextlib.suppress(OSError):
                    (state_dir / "daemon.json").unlink()
            store.close()


def _command() -> str:
    """How to run `exod` from the caller's shell, as it is: ``exod`` when that is on the PATH and is this one,
    else the path it was started by (`make run` starts ``.venv/bin/exod``), else ``python -m exod``."""
    started = Path(sys.argv[0])
    on_path = shutil.which("exod")
    if started.name == "exod" and on_path and Path(on_path).resolve() == started.resolve():
        return "exod"
    if started.name == "exod" and started.exists():
        return str(started)
    return f"{sys.executable} -m exod"


async def _restore(controller: Controller, state: StateStore) -> None:
    try:
        await controller.restore()
    except (fsm.SnapshotError, RecursionError) as exc:  # RecursionError: nested deeper than the machines read
        raise state.snapshot_error(str(exc)) from exc
    if controller.reaped_orphans:
        log.warning("reaped %d runner(s) left by a previous daemon", len(controller.reaped_orphans))


async def _place_configured(
    controller: Controller, wanted: list[tuple[str, int]], kept: dict[str, float | Default | None]
) -> None:
    """Place what the configuration asks for and is not placed yet (`fsm.to_place`), each with its keep-alive."""
    for model_id, ranks in fsm.to_place(wanted, controller.placed_models()):
        try:
            await controller.place(model_id, ranks, keep_alive=kept.get(model_id, DEFAULT))
        except StoreUnavailable as exc:  # serve what is placed; the configuration places again next start
            log.error("%s not placed: %s", model_id, exc)


def _fleet(membership: Membership, config: ServeConfig) -> Fleet:
    async def runners() -> dict[str, set[tuple[str, int]]]:
        return await live_runners(membership.etcd, membership.prefix, membership.malformed)

    def term() -> int | None:
        return None if membership.term is None else membership.term.revision

    token, tls = membership.config.token, membership.config.tls
    return Fleet(membership.node_id, membership.records, runners, token, term, tls=tls)


def _agent(config: ServeConfig, store: Store, models: ModelFiles) -> Agent:
    """This node's agent; the runners a killed daemon's agent left are reaped first."""
    reaped = reap_orphans(store.processes())
    for record in store.processes():
        store.forget_process(record.runner_id, record.incarnation)
    if reaped:
        log.warning("reaped %d runner(s) left by a previous daemon", len(reaped))
    assert config.cluster is not None
    return Agent(config.daemon, store, config.cluster.advertise, models=models)


def _cluster_state(membership: Membership, config: ServeConfig, term: Term | None) -> EtcdState:
    return EtcdState(membership.etcd, membership.prefix, term, retention=config.daemon.retention)


async def _lead(
    controller: Controller, membership: Membership, config: ServeConfig, wanted, kept, check: StateCheck
) -> None:
    """Each time this node is elected: the controller's term, on etcd's state, until the term ends. Then
    its runners are stopped (cancelling `controller.run` kills and reaps them): the next controller
    resumes the instances from etcd, as a restarted one-host daemon resumes from SQLite.

    A snapshot or a meta in etcd that cannot be restored (`Unrestorable`) does not end the term: were it
    given up, the next node elected would find the same value, and so on round the cluster. It is held,
    degraded (`_degraded`), until the check finds the state restorable again (an operator moved the value
    aside), and then taken over afresh in the same term."""
    while True:
        term = await membership.elected()
        state: StateStore = _cluster_state(membership, config, term)
        await controller.take_over(state)
        unreachable = deposed = repaired = False
        damage: Damage | None = None
        try:
            try:
                await _restore(controller, state)
            except Unrestorable as exc:
                damage = exc.damage
                state = await _degraded(controller, membership, term, state, damage, check)
            await _place_configured(controller, wanted, kept)  # while degraded, each is refused: said in the log
            async with trio.open_nursery() as leading:
                await leading.start(controller.run)
                if damage is None:
                    leading.start_soon(_heal, state, check)
                else:

                    async def restorable() -> None:
                        nonlocal repaired
                        await check.until(lambda found: not found)
                        repaired = True
                        leading.cancel_scope.cancel()

                    leading.start_soon(restorable)
                await membership.deposed(term)
                leading.cancel_scope.cancel()
        except* StateUnavailable as lost:  # etcd went away while taking over: again, once it is back
            log.error("cannot take over as the controller: %s", lost.exceptions[0])
            unreachable = True
        except* Deposed as refused:  # etcd refused a write: another node holds the election key, or this turn ended
            log.error("%s", refused.exceptions[0])
            deposed = True
        if repaired and membership.term is term:
            log.warning("node %s resumes as the controller: the cluster's state can be restored", membership.node_id)
            continue
        if unreachable and membership.term is term:
            await trio.sleep(1.0)
            continue
        controller.requests.fail_all(f"node {membership.node_id} is no longer the cluster's controller")
        log.warning("node %s is no longer the controller: its runners were stopped", membership.node_id)
        if deposed:  # a turn refused while the election key is still this node's (its meta written by another):
            await trio.sleep(1.0)  # a new turn reads the state afresh, once the election has had its say
            if membership.term is term:
                continue
        await membership.deposed(term)


async def _degraded(
    controller: Controller, membership: Membership, term: Term, state: StateStore, damage: Damage, check: StateCheck
) -> Guarded:
    """Take over on ``state`` guarded: nothing restored from it (no instance resumed, no runner of an earlier term
    kept), nothing written over it, and the journal degraded saying why, so that a placement is refused (503)
    with the key and the command; as long as the term is this node's, or until the check finds it repaired."""
    log.error(
        "node %s is the controller but cannot restore the cluster's state: %s. It holds the term, serving nothing "
        "from that state, until the state can be restored",
        membership.node_id,
        damage,
    )
    guarded = Guarded(state, lambda: check.why or (str(damage) if membership.term is term else None))
    await controller.take_over(guarded)
    await _restore(controller, guarded)  # an empty cluster: what recovering one does (the fleet read), no more
    return guarded


async def _heal(state: StateStore, check: StateCheck) -> None:
    """While this node is the controller (and has the state): whatever the check finds that no successor could
    restore, the controller writes back over (`EtcdState.heal`)."""
    assert isinstance(state, EtcdState)
    while True:
        await check.until(bool)
        try:
            if await state.heal():
                await check.check()
        except (StateUnavailable, EtcdError) as exc:  # etcd away or refusing: the next check tries again
            log.warning("cannot write the state back: %s", exc)


async def _join(config: ServeConfig, agent: Agent | None) -> Membership | None:
    """With ``--cluster``: this node's record in etcd, under its lease (`ClusterUnavailable` if etcd is not there)."""
    if config.cluster is None:
        return None
    from exod.host.models import list_cached_models

    c, total = config.cluster, config.daemon.memory_bytes

    def refresh(record: NodeRecord) -> NodeRecord:
        """What changes about a node while it runs: the memory it has free, the models in its cache, why it
        is degraded (its disk refuses the record of its runners)."""
        models = tuple(sorted({m.repo_id for m in list_cached_models(config.daemon.hf_home)}))
        degraded = "" if agent is None or agent.book.error is None else agent.book.error
        return attrs.evolve(record, memory_free=min(free_memory(), total), models=models, degraded=degraded)

    blank = NodeRecord(c.node_id, c.advertise, api_url="", memory_total=total, memory_free=0, version=fsm.__version__)
    membership = Membership(Etcd(c.url, security=c.etcd), c, refresh(blank), refresh)
    try:
        await membership.presence.join()
    except EtcdError as exc:
        raise ClusterUnavailable(f"cannot join the cluster: {exc}. Is etcd running at {c.url}?") from exc
    return membership


async def _until_asked_to_stop(signals: AsyncIterator[int], held: HeldDir) -> str:
    """Until SIGINT/SIGTERM, or until the state directory is not the one held any more (removed, replaced:
    a second daemon could start on the path, with none of this one's state, while this one runs on); why."""
    why = ""
    async with trio.open_nursery() as waiting:

        async def signalled() -> None:
            nonlocal why
            async for signum in signals:
                why = f"{signal.Signals(signum).name} received"
                break
            waiting.cancel_scope.cancel()

        async def directory() -> None:
            nonlocal why
            while (gone := held.replaced()) is None:
                await trio.sleep(STATE_DIR_CHECK_S)
            log.error("%s: stopping", gone)
            why = gone
            waiting.cancel_scope.cancel()

        waiting.start_soon(signalled)
        waiting.start_soon(directory)
    return why


async def _hurry_on_signal(signals: AsyncIterator[int], drain: Drain, announce: Callable[[str], object]) -> None:
    """A second SIGINT/SIGTERM: stop waiting for the requests in progress (the runners' stop has its own bound)."""
    async for signum in signals:
        announce(f"exod: {signal.Signals(signum).name} received again: not waiting for requests any longer")
        drain.hurry()
