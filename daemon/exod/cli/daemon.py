"""Running daemons: `exod serve`, and `exod cluster-demo`'s cluster of them on this machine."""

from __future__ import annotations

from pathlib import Path

import click

from exod.cli._common import STATE_DIR, etcd_options, etcd_security


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A TOML file like daemon/exod/default.toml (default: the embedded one).",
)
@click.option("--host", default=None, help="Address to bind (default 127.0.0.1).")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="Port (default 8420; 0 picks a free one).")
@STATE_DIR
@click.option("--hf-home", type=click.Path(file_okay=False, path_type=Path), default=None, help="HF cache root.")
@click.option("--offline/--online", default=None, help="Never try the hub (default: HF_HUB_OFFLINE decides).")
@click.option("--no-place", is_flag=True, help="Ignore the [[place]] entries of the configuration.")
@click.option(
    "--api-key", envvar="EXOD_API_KEY", default=None, help="Bearer token required on every endpoint but /health."
)
@click.option("--insecure", is_flag=True, help="Allow binding beyond loopback without an API key.")
@click.option("--cluster", "cluster_url", default=None, metavar="URL", help="Join the etcd cluster at URL.")
@click.option("--node-id", default=None, help="This node's name in the cluster (default: the host name).")
@click.option("--advertise", default=None, help="The address the other nodes reach this one at (default: --host).")
@click.option(
    "--cluster-token-file",
    envvar="EXOD_CLUSTER_TOKEN_FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The cluster's secret, the same file on every node (`exod cluster-token FILE` makes one).",
)
@click.option(
    "--place",
    "extra",
    multiple=True,
    metavar="MODEL_OR_DIR[:RANKS]",
    help="Also keep this placed: a repo id, or a local model directory (the CLI and config only). Repeatable.",
)
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    metavar="ORIGIN",
    help="Let browser pages of ORIGIN (scheme://host[:port], or * for any) call the API; off by default. "
    "Repeatable; replaces [api] cors_origins.",
)
@click.option(
    "--on-demand/--no-on-demand",
    default=None,
    help="A request for a model that is not placed places it ([models] default_ranks) and waits for it "
    "(default: [models] on_demand, off).",
)
@etcd_options
def serve(
    config_path,
    host,
    port,
    state_dir,
    hf_home,
    offline,
    no_place,
    api_key,
    insecure,
    cluster_url,
    node_id,
    advertise,
    cluster_token_file,
    extra,
    cors_origins,
    on_demand,
    **etcd,
) -> None:
    """Run the daemon: restore state, reap orphans, place, serve the API until SIGINT/SIGTERM."""
    import logging

    import attrs
    import trio

    import fsm
    from exod.api.http_server import BindError
    from exod.config import ConfigError, cors_origin, load
    from exod.host.models import ModelNotFound
    from exod.placer import PlacementRefused
    from exod.serve import ClusterUnavailable
    from exod.serve import serve as run_daemon
    from exod.state.sqlite import StoreError
    from exod.state.statedir import StateDirError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load(
            config_path,
            host=host,
            port=port,
            state_dir=state_dir,
            hf_home=hf_home,
            offline=offline,
            on_demand=on_demand,
        )
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        added = tuple(_parse_place(text) for text in extra)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--place") from exc
    # the embedded configuration's [[place]] is one host's demo: a cluster places only what it is asked to
    embedded_in_cluster = config_path is None and cluster_url is not None
    kept = () if no_place or embedded_in_cluster else cfg.placements
    cfg = attrs.evolve(cfg, placements=kept + added, api_key=api_key, insecure=insecure)
    if cors_origins:
        try:
            cfg = attrs.evolve(cfg, cors_origins=tuple(cors_origin(o) for o in cors_origins))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--cors-origin") from exc
    if cluster_url or cfg.cluster:
        import socket

        from exod.cluster.membership import ClusterConfig
        from exod.cluster.token import ClusterTokenError, read_token

        base = cfg.cluster or ClusterConfig(cluster_url, node_id or socket.gethostname(), advertise or cfg.host)
        try:
            token = read_token(cluster_token_file) if cluster_token_file else base.token
        except ClusterTokenError as exc:
            raise click.BadParameter(str(exc), param_hint="--cluster-token-file") from exc
        cfg = attrs.evolve(
            cfg,
            cluster=attrs.evolve(
                base,
                url=cluster_url or base.url,
                node_id=node_id or base.node_id,
                advertise=advertise or base.advertise,
                token=token,
                etcd=etcd_security(**etcd, base=base.etcd),
            ),
        )
    try:
        cfg.check_exposure()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        trio.run(run_daemon, cfg)
    except (StateDirError, StoreError, ModelNotFound, fsm.InvalidConfig, ClusterUnavailable, BindError) as exc:
        raise click.ClickException(str(exc)) from exc
    except PlacementRefused as exc:
        raise click.ClickException(f"cannot place what the configuration asks: {exc}") from exc


def _parse_place(text: str):
    from exod.config import Placement
    from exod.host.models import validate_model_id

    target, _, ranks = text.rpartition(":") if ":" in text else (text, "", "1")
    if not ranks.isdigit() or int(ranks) < 1:
        raise ValueError(f"{text!r}: RANKS must be an int >= 1")
    if Path(target).expanduser().is_dir():
        return Placement(int(ranks), path=Path(target).expanduser())
    return Placement(int(ranks), model=validate_model_id(target))


@click.command("cluster-demo")
@click.option("--nodes", type=click.IntRange(1, 8), default=3, show_default=True, help="Nodes, on 127.0.0.1 …")
@click.option("--layers", type=click.IntRange(1, 64), default=8, show_default=True, help="Layers of the tiny model.")
@click.option("--ranks", type=click.IntRange(1, 64), default=3, show_default=True, help="Ranks to place it on.")
def cluster_demo(nodes: int, layers: int, ranks: int) -> None:
    """A cluster on this machine (`make cluster`): an etcd, NODES nodes, the tiny model on RANKS ranks across
    them. Ctrl-C stops all of it and leaves no process behind."""
    from exod.cluster.devcluster import DevClusterError, run

    try:
        run(nodes=nodes, layers=layers, ranks=ranks, announce=click.echo)
    except DevClusterError as exc:
        raise click.ClickException(str(exc)) from exc


@click.command("cluster-token")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
def cluster_token(path: Path) -> None:
    """Write a new cluster token to PATH (readable by you alone): give every node of the cluster a copy, as
    --cluster-token-file. Nodes authenticate to each other with it; clients never hold it."""
    from exod.cluster.token import ClusterTokenError, write_token

    try:
        write_token(path)
    except (ClusterTokenError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"wrote a new cluster token to {path}: copy it to every node (mode 600), pass --cluster-token-file")
