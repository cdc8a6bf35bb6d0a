"""The machines held to account: `exod check` explores them, `exod replay` runs a log against them."""

from __future__ import annotations

from pathlib import Path

import click

from exod.cli._common import _state_dir, etcd_options, etcd_security
from fsm.fencing import Mechanism  # a small pure module: the choices of --without


@click.command("check-fencing")
@click.option("--nodes", type=click.IntRange(2, 4), default=3, show_default=True)
@click.option("--ranks", type=click.IntRange(1, 4), default=1, show_default=True)
@click.option("--faults", "max_faults", type=click.IntRange(0, 4), default=1, show_default=True, help="Faults at most.")
@click.option("--generations", type=click.IntRange(1, 6), default=2, show_default=True)
@click.option("--horizon", type=click.IntRange(1, 40), default=8, show_default=True, help="Ticks of the clock.")
@click.option("--max-states", type=click.IntRange(1), default=2_000_000, show_default=True)
@click.option(
    "--without",
    multiple=True,
    type=click.Choice([m.name.lower().replace("_", "-") for m in Mechanism]),
    help="Switch a fencing mechanism off (repeatable): plants the bug it prevents.",
)
def check_fencing(nodes, ranks, max_faults, generations, horizon, max_states, without) -> None:
    """Model-check the cluster's control plane (fsm.fencing): never two generations, nor two processes of a rank,
    alive, and Ready again after every heal; a violation prints its shortest trace and exits 1."""
    import time

    from fsm.fencing import MECHANISMS, FencingConfig
    from fsm.fencing import check_fencing as run_check

    off = {Mechanism[name.upper().replace("-", "_")] for name in without}
    try:
        config = FencingConfig(
            nodes=nodes,
            ranks=ranks,
            max_faults=max_faults,
            generations=generations,
            horizon=horizon,
            max_states=max_states,
            mechanisms=MECHANISMS - off,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    result = run_check(config, timer=time.perf_counter)
    click.echo(result.report())
    if not result.ok:
        raise SystemExit(1)


@click.command()
@click.option("--ranks", type=click.IntRange(1, 4), default=2, show_default=True)
@click.option("--max-retries", type=click.IntRange(1, 10), default=5, show_default=True)
@click.option("--depth", type=click.IntRange(1), default=200, show_default=True, help="Events per path at most.")
@click.option("--max-states", type=click.IntRange(1), default=400_000, show_default=True)
@click.option("--no-deletes", is_flag=True, help="Leave user deletes out of the adversary.")
@click.option("--fine", is_flag=True, help="Each completion and each node's planner as its own event (slower).")
@click.option("--requests", type=click.IntRange(0, 3), default=0, show_default=True, help="Chat requests to send.")
@click.option(
    "--faults",
    default="crash,error,fatal",
    show_default=True,
    help="What the adversary does to runners, of crash, error, fatal, host (the host's failures: uncharged).",
)
@click.option("--horizon", type=click.FloatRange(min=1), default=None, help="Seconds of the clock to explore.")
@click.option(
    "--hosts",
    type=click.IntRange(0, 6),
    default=0,
    show_default=True,
    help="Nodes of a cluster the ranks run on (at least --ranks); 0: one node per rank, never failing.",
)
@click.option(
    "--node-failures",
    type=click.IntRange(0, 4),
    default=0,
    show_default=True,
    help="Times the adversary may kill or cut off a node (needs --hosts); a cut node may heal.",
)
@click.option(
    "--parks",
    type=click.IntRange(0, 3),
    default=0,
    show_default=True,
    help="Times the instance is parked from outside its plan (an operator, an eviction), at any moment.",
)
@click.option(
    "--keep-alive",
    type=click.FloatRange(min=0),
    default=None,
    help="The instance's keep-alive in seconds: its plan parks it once idle that long (default: kept forever).",
)
@click.option(
    "--strategy",
    type=click.Choice(["one_for_all", "one_for_one"]),
    default="one_for_all",
    show_default=True,
    help="What a rank's failure takes down: the whole generation (a ring), or that rank alone (replicas).",
)
@click.option(
    "--instances",
    type=click.IntRange(1, 4),
    default=1,
    show_default=True,
    help="Instances of the model on the same nodes, sharing each node's memory (see --node-memory).",
)
@click.option(
    "--node-memory",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks a node's memory holds (default: all of them): fewer makes placements and unparks evict.",
)
def check(
    ranks: int,
    max_retries: int,
    depth: int,
    max_states: int,
    no_deletes: bool,
    fine: bool,
    requests: int,
    faults: str,
    horizon: float | None,
    hosts: int,
    node_failures: int,
    parks: int,
    keep_alive: float | None,
    strategy: str,
    instances: int,
    node_memory: int | None,
) -> None:
    """Model-check the composed system; a violated invariant prints its shortest trace and exits 1."""
    import fsm
    from fsm.check import CheckConfig, Fault
    from fsm.check import check as run_check

    try:
        chosen = tuple(Fault(name.strip()) for name in faults.split(",") if name.strip())
    except ValueError as exc:
        raise click.BadParameter(
            f"{exc}; choose from {', '.join(f.value for f in Fault)}", param_hint="--faults"
        ) from None
    try:
        config = CheckConfig(
            faults=chosen,
            horizon=horizon,
            ranks=ranks,
            policy=fsm.RetryPolicy(max_failures=max_retries, strategy=fsm.RestartStrategy(strategy)),
            depth=depth,
            max_states=max_states,
            deletes=not no_deletes,
            coarse=not fine,
            requests=requests,
            hosts=hosts,
            node_failures=node_failures,
            parks=parks,
            keep_alive=keep_alive,
            instances=instances,
            node_memory=node_memory,
        )
    except (ValueError, fsm.InvalidConfig) as exc:  # --hosts below --ranks, node failures without hosts …
        raise click.UsageError(str(exc)) from None
    import time

    result = run_check(config, timer=time.perf_counter)
    click.echo(result.report())
    if not result.ok:
        raise SystemExit(1)


def _cluster_log(url: str, security) -> tuple[int, list]:
    """Where the cluster's log starts, and its entries, as the etcd at ``url`` holds them."""
    import trio

    from exod.cluster.etcd import Etcd
    from exod.cluster.etcd_state import EtcdState
    from exod.cluster.membership import DEFAULT_PREFIX
    from exod.state.store import StateUnavailable

    async def read() -> tuple[int, list]:
        etcd = Etcd(url, security=security)
        try:
            state = EtcdState(etcd, DEFAULT_PREFIX.encode(), None)
            return await state.log_start(), [entry for _, entry in await state.transitions()]
        finally:
            await etcd.aclose()

    try:
        return trio.run(read)
    except StateUnavailable as exc:
        raise click.ClickException(f"{exc}. Is etcd running at {url}?") from exc


@click.command()
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Replay the log of this daemon's state dir (default: the user's data dir).",
)
@click.option(
    "--jsonl",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="Replay an exported log: one JSON object per line (time, machine, id, event, from, to, cause).",
)
@click.option(
    "--export",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the log as JSONL to this file.",
)
@click.option(
    "--cluster",
    "cluster_url",
    default=None,
    metavar="URL",
    help="Replay the log of the cluster whose state is in the etcd at URL (http://HOST:2379).",
)
@etcd_options
def replay(state_dir, jsonl, export, cluster_url, **etcd) -> None:
    """Replay a transition log against the machines: first divergence, and coverage. Exits 1 on divergence.

    A log that [retention] pruned is replayed from its oldest entry kept, and says so.
    """
    import fsm
    from fsm.conformance import replay as run_replay

    if jsonl is not None:
        try:
            entries = fsm.log.loads(jsonl.read_text())
        except (OSError, UnicodeDecodeError, fsm.SnapshotError) as exc:
            raise click.ClickException(f"{jsonl} is not a transition log (JSON lines): {exc}") from exc
    elif cluster_url is not None:
        start, entries = _cluster_log(cluster_url, etcd_security(**etcd))
    else:
        from exod.state.sqlite import Store, StoreError

        db = _state_dir(state_dir) / "state.db"
        if not db.exists():
            raise click.ClickException(f"no state database at {db}; pass --state-dir or --jsonl")
        try:
            store = Store.open(db)
        except StoreError as exc:
            raise click.ClickException(str(exc)) from exc
        try:
            start = store.log_start()
            entries = [entry for _, entry in store.transitions()]
        finally:
            store.close()
    if jsonl is None and start > 1:
        from datetime import datetime

        when = f" ({datetime.fromtimestamp(entries[0].time).astimezone():%Y-%m-%d %H:%M:%S %z})" if entries else ""
        click.echo(
            f"history before seq {start}{when} was pruned by the [retention] settings of the config; "
            "replaying from there"
        )
    if export is not None:
        export.write_text(fsm.log.dumps(entries))
    report = run_replay(entries)
    click.echo(report.text())
    if not report.ok:
        raise SystemExit(1)
