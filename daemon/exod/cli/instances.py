"""The instances of a daemon: `exod place`, `delete`, `park`, `unpark`, `status` and their runners' `logs`."""

from __future__ import annotations

from pathlib import Path

import click

import fsm
from exod.cli._common import STATE_DIR, URL, _call, _client, _state_dir


@click.command()
@click.argument("model_id")
@click.option("--ranks", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--nodes", default=None, metavar="A,B", help="In a cluster: place on these nodes only.")
@click.option(
    "--keep-alive",
    default=None,
    metavar="DURATION",
    help="Park it when unused this long (seconds, or 5m, 1h …; -1: never). Default: [models] keep_alive.",
)
@URL
@STATE_DIR
def place(model_id: str, ranks: int, nodes: str | None, keep_alive: str | None, url, state_dir) -> None:
    """Place MODEL_ID (a Hugging Face repo id) on RANKS ranks."""
    body: dict = {"model": model_id, "ranks": ranks}
    if nodes:
        body["nodes"] = [node.strip() for node in nodes.split(",") if node.strip()]
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    with _client(url, state_dir) as client:
        instance = _call(client, "POST", "/instances", json=body)
    click.echo(instance["instance_id"])


@click.command()
@click.argument("instance_id")
@URL
@STATE_DIR
def delete(instance_id: str, url, state_dir) -> None:
    """Delete an instance: its runners are stopped and its requests end with an error."""
    with _client(url, state_dir) as client:
        _call(client, "DELETE", f"/instances/{instance_id}")
    click.echo(f"deleted {instance_id}")


@click.command()
@click.argument("instance_id")
@URL
@STATE_DIR
def park(instance_id: str, url, state_dir) -> None:
    """Park an instance: its runners stop and free their memory; its placement stays, and a request brings it
    back."""
    with _client(url, state_dir) as client:
        instance = _call(client, "POST", f"/instances/{instance_id}/park")
    click.echo(f"{instance_id} {instance['residency']}")


@click.command()
@click.argument("instance_id")
@URL
@STATE_DIR
def unpark(instance_id: str, url, state_dir) -> None:
    """Bring a parked instance back now (parking idle ones if it needs their memory)."""
    with _client(url, state_dir) as client:
        instance = _call(client, "POST", f"/instances/{instance_id}/unpark")
    click.echo(f"{instance_id} {instance['residency']}")


@click.command()
@URL
@STATE_DIR
@click.option("--json", "as_json", is_flag=True, help="Print the raw status document.")
def status(url, state_dir, as_json: bool) -> None:
    """Instances, runners, states, attempts, next retry and causes (from the daemon, or its state dir)."""
    import json
    import time

    from exod.serve import daemon_address

    if url or daemon_address(_state_dir(state_dir)):
        with _client(url, state_dir) as client:
            doc = _call(client, "GET", "/instances")
            cluster = _call(client, "GET", "/nodes")
        source = "live"
        if cluster["cluster"] is not None:
            doc = {**doc, "cluster": cluster}
    else:
        doc = _offline_status(_state_dir(state_dir))
        source = "no daemon is running: its runners are gone; the instances resume when it starts again"
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(f"# {source}")
    if cluster_doc := doc.get("cluster"):
        click.echo(
            f"cluster {cluster_doc['cluster']}: {len(cluster_doc['nodes'])} node(s), this one {cluster_doc['node_id']}"
        )
        for node in cluster_doc["nodes"]:
            role = "controller" if node["controller"] else "agent"
            where = f"{node['address']}  {node['api_url']}"
            click.echo(f"  node {node['node_id']}  {where}  {role}  lease age {node['lease_age']} s")
        if "fence_in" in cluster_doc:
            click.echo(f"  this node's runners end in {cluster_doc['fence_in']:.1f} s unless its lease is renewed")
        if renewal := cluster_doc.get("renewal"):
            click.echo(f"  {_renewal(renewal)}")
    if doc.get("degraded"):
        click.echo(f"DEGRADED: {doc['degraded']} (serving goes on; placements wait)")
    if not doc["instances"]:
        click.echo("no instances; place one with: exod place MODEL --ranks N")
    for inst in doc["instances"]:
        retry = "-"
        if inst["next_retry_at"] is not None:
            retry = f"in {max(0.0, inst['next_retry_at'] - time.time()):.1f} s"
        state = inst["state"] + (f" ({inst['delete_reason']})" if inst["delete_reason"] else "")
        click.echo(
            f"{inst['instance_id']}  {inst['model_id']}  ranks={inst['ranks']}  {state}  gen={inst['generation']}"
            f"  attempts={inst['attempts']}/{inst['max_failures']}"
            + (f" (+{inst['uncharged']} the host's, uncharged)" if inst.get("uncharged") else "")
            + f"  next retry: {retry}"
        )
        if inst.get("residency") and inst["delete_reason"] is None:
            click.echo(f"  {_residency(inst, time.time())}")
        if inst.get("batch"):
            click.echo(f"  decodes {inst['batch']['max_sequences']} at once: {inst['batch']['why']}")
        if inst.get("waiting_for"):
            click.echo(f"  waiting for: {inst['waiting_for']}")
        if inst["last_failure"]:
            click.echo(f"  last failure: {inst['last_failure']}")
        download = inst.get("download")
        if download and download["state"] != fsm.DownloadState.COMPLETED.value:
            click.echo(f"  download: {download['state']} (attempts {download['attempts']}) {download['last_error']}")
        for r in inst["runners"]:
            where = r["state"] or "not created"
            if r["phase"]:
                where += f".{r['phase']}"
            failure = f"  ({r['failure']})" if r["failure"] else ""
            node = f"  on {r['node']}" if r.get("node", "local") != "local" else ""
            click.echo(f"  rank {r['rank']}  {r['runner_id']}{node}  incarnation {r['incarnation']}  {where}{failure}")


def _renewal(r: dict) -> str:
    """This node's lease renewals: how late they start against their schedule (a starved daemon), how long
    etcd takes, and the authority left when one lands (0: the node steps down)."""
    slack = "-" if r["slack_last"] is None else f"{r['slack_last']:.2f} s (least {r['slack_min']:.2f} s)"
    return (
        f"lease renewed every {r['interval']:.2f} s: {r['count']} renewed, {r['failures']} failed; "
        f"late {r['late_last']:.3f} s (most {r['late_max']:.3f} s), etcd took {r['took_last']:.3f} s "
        f"(most {r['took_max']:.3f} s); authority left at renewal {slack}"
    )


def _residency(inst: dict, now: float) -> str:
    """``loaded, last used 12 s ago, parked in 288 s`` — what is in memory, and for how long."""
    said = [inst["residency"]]
    if inst.get("last_used") is not None:
        said.append(f"last used {max(0.0, now - inst['last_used']):.0f} s ago")
    if inst.get("park_at") is not None:
        said.append(f"parked in {max(0.0, inst['park_at'] - now):.0f} s")
    elif inst["residency"] == fsm.Residency.LOADED.value and inst.get("keep_alive") is None:
        said.append("kept loaded")
    return ", ".join(said)


def _offline_status(state_dir: Path) -> dict:
    import time

    from exod.state.sqlite import Store, StoreError
    from exod.status import status_of
    from fsm import SnapshotError
    from fsm.cluster import Cluster

    db = state_dir / "state.db"
    if not db.exists():
        return {"instances": []}
    try:
        store = Store.open(db)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        snapshot = store.load()
        if not snapshot:
            return {"instances": []}
        unwatched = fsm.PhaseLimits() if "limits" not in snapshot else None  # an old snapshot, only shown here
        cluster = Cluster.from_dict(snapshot, limits=unwatched)
        cluster.recover(time.time())  # no daemon, no runner: what was Ready is not, and resumes at the next start
        return status_of(cluster)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    except SnapshotError as exc:
        raise click.ClickException(str(store.snapshot_error(str(exc)))) from exc
    finally:
        store.close()


@click.command()
@click.argument("instance_id")
@click.option("--rank", type=click.IntRange(0), default=None, help="One rank (default: every rank).")
@click.option("--generation", type=click.IntRange(1), default=None, help="Default: the newest kept here.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing what the runners write, until Ctrl-C.")
@STATE_DIR
def logs(instance_id: str, rank: int | None, generation: int | None, follow: bool, state_dir) -> None:
    """Print the runner logs of INSTANCE_ID kept in this node's state dir (in a cluster, each node keeps the
    logs of the ranks it ran)."""
    import time

    from exod.state import retention

    directory = _state_dir(state_dir)
    try:
        kept = retention.runner_logs(directory, instance_id)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="INSTANCE_ID") from exc
    if not kept:
        raise click.ClickException(
            f"no runner logs of {instance_id} in {directory}: see `exod status` for the instances, "
            "or pass the node's --state-dir"
        )
    chosen = generation or max(g for _, g in kept)
    paths = [path for (r, g), path in sorted(kept.items()) if g == chosen and rank in (None, r)]
    if not paths:
        ranks = sorted(r for r, g in kept if g == chosen)
        raise click.ClickException(f"generation {chosen} of {instance_id} has logs of ranks {ranks} here, not {rank}")
    offsets = {}
    for path in paths:
        click.echo(f"==> {path} <==")
        text = path.read_text(errors="replace")
        click.echo(text, nl=False)
        offsets[path] = len(text.encode())
    while follow:
        time.sleep(0.5)
        for path in paths:
            with path.open("rb") as file:
                file.seek(offsets[path])
                if more := file.read():
                    offsets[path] += len(more)
                    prefix = f"[{path.stem}] " if len(paths) > 1 else ""
                    for line in more.decode(errors="replace").splitlines():
                        click.echo(prefix + line)
