"""``exod repair``: move aside what in a cluster's etcd no controller can restore (`exod.cluster.repair`)."""

from __future__ import annotations

from pathlib import Path

import click

from exod.cli._common import etcd_options, etcd_security


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A node's TOML file: its [cluster] table says where etcd is, the prefix and how to reach it.",
)
@click.option("--cluster", "cluster_url", default=None, metavar="URL", help="The cluster's etcd (http://HOST:2379).")
@click.option("--prefix", default=None, help="The cluster's prefix in etcd (default: [cluster] prefix, or /exod/).")
@click.option("--check", is_flag=True, help="Only say what is wrong; move nothing.")
@etcd_options
def repair(config_path, cluster_url, prefix, check, **etcd) -> None:
    """Move aside each value in the cluster's etcd that no controller can restore: a snapshot or a meta that is
    not exod's (every node is degraded while one is there, and the controller serves nothing), and each batch of
    the transition log that is not (readers skip it). Each is copied under PREFIX/damaged/ and deleted, in one
    transaction that holds only if it is still the value read; a meta is rebuilt from the log instead. The
    controller then resumes on its own, from what is left. With nothing wrong, nothing is changed.

    One host's state.db is not for this command: a daemon refuses one it cannot restore when it starts, and
    says how to move it aside."""
    import trio

    from exod.cluster.etcd import Etcd, EtcdError
    from exod.cluster.membership import DEFAULT_PREFIX
    from exod.config import ConfigError, load

    base = None
    if config_path is not None:
        try:
            base = load(config_path).cluster
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from exc
    url = cluster_url or (base.url if base is not None else None)
    if url is None:
        raise click.UsageError(
            "name the cluster's etcd: --cluster URL, or --config FILE with a [cluster] table. (One host's state.db "
            "is not repaired here: `exod serve` says how to move aside one it cannot restore.)"
        )
    prefix = prefix or (base.prefix if base is not None else DEFAULT_PREFIX)
    if not prefix.endswith("/"):
        raise click.BadParameter("a prefix ends with / (as [cluster] prefix does)", param_hint="--prefix")
    security = etcd_security(**etcd, base=None if base is None else base.etcd)

    async def run() -> list[str]:
        client = Etcd(url, security=security)
        try:
            return await _repair(client, prefix.encode(), check)
        finally:
            await client.aclose()

    try:
        lines = trio.run(run)
    except EtcdError as exc:
        raise click.ClickException(f"cannot reach the cluster's etcd: {exc}. Is etcd running at {url}?") from exc
    for line in lines:
        click.echo(line)


async def _repair(etcd, prefix: bytes, check: bool) -> list[str]:
    """What ``exod repair`` says, having done it (``check``: nothing done)."""
    from exod.cluster.damage import Kind
    from exod.cluster.election import leader
    from exod.cluster.repair import RepairConflict, inspect, inspect_log, repair

    where = f"the cluster's state in etcd at {etcd.url} ({prefix.decode()})"
    found = [*await inspect_log(etcd, prefix), *await inspect(etcd, prefix)]
    if not found:
        return [f"{where} can be restored: nothing to repair, nothing changed"]
    if check:
        return [f"{d.key.decode(errors='replace')}: {d.reason}" for d in found] + [
            f"{len(found)} value(s) cannot be restored; `exod repair` without --check moves them aside"
        ]
    try:
        moved = await repair(etcd, prefix)
    except RepairConflict as exc:
        raise click.ClickException(str(exc)) from exc
    lines = []
    for m in moved:
        key, aside = m.damage.key.decode(errors="replace"), m.aside.decode(errors="replace")
        done = "rebuilt from the log" if m.rebuilt is not None else "deleted"
        lines.append(f"moved {key} ({m.damage.reason}) to {aside}; {key} {done}")
    kinds = {m.damage.kind for m in moved}
    controller = await leader(etcd, prefix)
    who = f"the controller, node {controller}," if controller else "the next node elected controller"
    if kinds & {Kind.SNAPSHOT, Kind.META}:
        state = (
            "an empty state (no instance: place again what should run)"
            if Kind.SNAPSHOT in kinds
            else "the snapshot as it was"
        )
        lines.append(
            f"next: {who} finds the state restorable within a few seconds and takes over from {state}, its "
            "transition log going on where it ended; every node's /health is ok again"
        )
    if Kind.LOG in kinds:
        lines.append("the transition log has a gap where each batch was (readers skipped it already)")
    lines.append(f"the values moved are kept: etcdctl get --prefix {(prefix + b'damaged/').decode()}")
    return lines
