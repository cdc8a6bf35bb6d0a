"""The ``exod`` command line."""

from __future__ import annotations

import os
from pathlib import Path

import click

import fsm


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(fsm.__version__, prog_name="exod")
def main() -> None:
    """exod: explicit lifecycles for LLM inference runners."""


@main.command()
def machines() -> None:
    """List the lifecycle machines and their states."""
    for name, cls in fsm.MACHINES.items():
        leaves = [s.id for s in cls.states_map.values() if not s.states]
        click.echo(f"{name:<9} {cls.__name__:<18} {' '.join(leaves)}")


@main.group()
def model() -> None:
    """Models in the local Hugging Face cache."""


@model.command("make-tiny")
@click.option("--repo-id", default="exod/tiny-qwen2", show_default=True, help="Cache name, org/name.")
@click.option("--arch", type=click.Choice(["qwen2", "llama"]), default="qwen2", show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--hidden", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option(
    "--hf-home",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Cache root (default: $HF_HOME or huggingface_hub's default).",
)
def make_tiny(repo_id: str, arch: str, layers: int, hidden: int, seed: int, hf_home: Path | None) -> None:
    """Write a deterministic tiny random model into the cache and print its snapshot path."""
    from exod.host.tiny_model import make_tiny_model

    try:
        path = make_tiny_model(repo_id, arch=arch, layers=layers, hidden=hidden, seed=seed, hf_home=hf_home)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    click.echo(str(path))


@model.command("pull")
@click.argument("model_id")
@click.option("--hf-home", type=click.Path(file_okay=False, path_type=Path), default=None, help="Cache root.")
@click.option("--offline/--online", default=None, help="Only look in the cache (default: HF_HUB_OFFLINE decides).")
@click.option(
    "--stall-timeout",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="Give up after this many seconds without a byte.",
)
def pull(model_id: str, hf_home: Path | None, offline: bool | None, stall_timeout: float) -> None:
    """Fetch MODEL_ID into the cache (progress bars on the terminal) and print its snapshot path."""
    from exod.host.models import InvalidModelId, ModelNotFound, resolve_model

    try:
        path = resolve_model(model_id, hf_home=hf_home, offline=offline, timeout=stall_timeout, show_progress=True)
    except (InvalidModelId, ModelNotFound) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(path))


@model.command("list")
@click.option("--hf-home", type=click.Path(file_okay=False, path_type=Path), default=None, help="Cache root.")
def list_models(hf_home: Path | None) -> None:
    """List cached models: repo id, revision, size and snapshot path."""
    from exod.host.models import list_cached_models

    models = list_cached_models(hf_home)
    if not models:
        click.echo("no cached models; make one with: exod model make-tiny")
        return
    width = max(len("REPO"), *(len(m.repo_id) for m in models))
    click.echo(f"{'REPO':<{width}}  {'REVISION':<12}  {'SIZE':>10}  PATH")
    for m in models:
        click.echo(f"{m.repo_id:<{width}}  {m.revision[:12]:<12}  {_human_size(m.size_bytes):>10}  {m.path}")


def _human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# -- the daemon ----------------------------------------------------------------------------

STATE_DIR = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the daemon keeps its state (default: the user's data dir).",
)
URL = click.option("--url", default=None, help="A running daemon's URL (default: found through --state-dir).")


def _state_dir(state_dir: Path | None) -> Path:
    from exod.config import default_state_dir

    return state_dir or default_state_dir()


@main.command()
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
    "--place",
    "extra",
    multiple=True,
    metavar="MODEL_OR_DIR[:RANKS]",
    help="Also keep this placed: a repo id, or a local model directory (the CLI and config only). Repeatable.",
)
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
    extra,
) -> None:
    """Run the daemon: restore state, reap orphans, place, serve the API until SIGINT/SIGTERM."""
    import logging

    import attrs
    import trio

    import fsm
    from exod.api.http_server import BindError
    from exod.config import ConfigError, load
    from exod.controller import PlacementRefused
    from exod.host.models import ModelNotFound
    from exod.serve import ClusterUnavailable
    from exod.serve import serve as run_daemon
    from exod.state.sqlite import StoreError
    from exod.state.statedir import StateDirError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load(config_path, host=host, port=port, state_dir=state_dir, hf_home=hf_home, offline=offline)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        added = tuple(_parse_place(text) for text in extra)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--place") from exc
    cfg = attrs.evolve(cfg, placements=(() if no_place else cfg.placements) + added, api_key=api_key, insecure=insecure)
    if cluster_url or cfg.cluster:
        import socket

        from exod.cluster.membership import ClusterConfig

        base = cfg.cluster or ClusterConfig(cluster_url, node_id or socket.gethostname(), advertise or cfg.host)
        cfg = attrs.evolve(
            cfg,
            cluster=attrs.evolve(
                base,
                url=cluster_url or base.url,
                node_id=node_id or base.node_id,
                advertise=advertise or base.advertise,
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


def _client(url: str | None, state_dir: Path | None):
    import httpx

    from exod.serve import daemon_address

    address = url or daemon_address(_state_dir(state_dir))
    if address is None:
        raise click.ClickException(
            f"no exod daemon is running for {_state_dir(state_dir)}; start one with `exod serve` or pass --url"
        )
    key = os.environ.get("EXOD_API_KEY")
    return httpx.Client(base_url=address, timeout=30, headers={"Authorization": f"Bearer {key}"} if key else {})


def _call(client, method: str, path: str, **kwargs):
    import httpx

    try:
        response = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        raise click.ClickException(f"cannot reach the daemon at {client.base_url}: {exc}") from exc
    if response.status_code >= 400:
        _call_failed(response)
    return response.json()


@main.command()
@click.argument("model_id")
@click.option("--ranks", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--nodes", default=None, metavar="A,B", help="In a cluster: place on these nodes only.")
@URL
@STATE_DIR
def place(model_id: str, ranks: int, nodes: str | None, url, state_dir) -> None:
    """Place MODEL_ID (a Hugging Face repo id) on RANKS ranks."""
    body: dict = {"model": model_id, "ranks": ranks}
    if nodes:
        body["nodes"] = [node.strip() for node in nodes.split(",") if node.strip()]
    with _client(url, state_dir) as client:
        instance = _call(client, "POST", "/instances", json=body)
    click.echo(instance["instance_id"])


@main.command()
@click.argument("instance_id")
@URL
@STATE_DIR
def delete(instance_id: str, url, state_dir) -> None:
    """Delete an instance: its runners are stopped and its requests end with an error."""
    with _client(url, state_dir) as client:
        _call(client, "DELETE", f"/instances/{instance_id}")
    click.echo(f"deleted {instance_id}")


@main.command()
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
            f"  attempts={inst['attempts']}/{inst['max_retries']}"
            + (f" (+{inst['uncharged']} the host's, uncharged)" if inst.get("uncharged") else "")
            + f"  next retry: {retry}"
        )
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
        cluster = Cluster.from_dict(snapshot)
        cluster.recover(time.time())  # no daemon, no runner: what was Ready is not, and resumes at the next start
        return status_of(cluster)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    except SnapshotError as exc:
        raise click.ClickException(str(store.snapshot_error(str(exc)))) from exc
    finally:
        store.close()


@main.command()
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


@main.command()
@click.argument("model_id")
@click.argument("prompt")
@click.option("--max-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(0, 2), default=0.0, show_default=True)
@click.option("--seed", type=click.IntRange(0), default=None)
@URL
@STATE_DIR
def chat(model_id: str, prompt: str, max_tokens: int, temperature: float, seed, url, state_dir) -> None:
    """Stream an answer to PROMPT from MODEL_ID on a running daemon."""
    import json

    import httpx
    from httpx_sse import connect_sse

    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
    }
    if seed is not None:
        body["seed"] = seed
    with _client(url, state_dir) as client:
        try:
            with connect_sse(client, "POST", "/v1/chat/completions", json=body, timeout=None) as source:
                if source.response.status_code >= 400:
                    source.response.read()
                    _call_failed(source.response)
                for event in source.iter_sse():
                    if event.data == "[DONE]":
                        continue
                    doc = json.loads(event.data)
                    if "error" in doc:
                        click.echo()
                        raise click.ClickException(doc["error"]["message"])
                    click.echo(doc["choices"][0]["delta"].get("content", ""), nl=False)
        except httpx.HTTPError as exc:
            raise click.ClickException(f"cannot reach the daemon at {client.base_url}: {exc}") from exc
    click.echo()


def _call_failed(response) -> None:
    try:
        detail = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        detail = response.text or response.reason_phrase
    raise click.ClickException(f"{response.status_code}: {detail}")


# -- diagrams and specs ------------------------------------------------------------------

_GRAPHVIZ_MISSING = (
    "SVG export needs Graphviz's `dot` on PATH: install it (e.g. `apt-get install graphviz`), or use --format dot"
)


def _leaf_ids(cls) -> list[str]:
    return [s.id for s in cls.states_map.values() if not s.states]


def _svg(source: str) -> str:
    import shutil
    import subprocess

    dot = shutil.which("dot")
    if dot is None:
        raise click.ClickException(_GRAPHVIZ_MISSING)
    try:
        result = subprocess.run([dot, "-Tsvg"], input=source, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise click.ClickException(f"Graphviz `dot` failed: {exc}") from exc
    if result.returncode != 0:
        raise click.ClickException(f"Graphviz `dot` exited with {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def _markdown(cls, state: str | None) -> str:
    from fsm import diagram

    table = diagram.markdown_table(cls)
    if state is None:
        return table
    lines = table.splitlines()
    marked = [
        line.replace(f"| `{state}` |", f"| **`{state}`** |", 1) if line.startswith(f"| `{state}` |") else line
        for line in lines
    ]
    return f"Current state: **`{state}`** (its rows in bold).\n\n" + "\n".join(marked) + "\n"


@main.command()
@click.argument("machine", type=click.Choice(list(fsm.MACHINES)))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["mermaid", "dot", "svg", "md"]),
    default="mermaid",
    show_default=True,
    help="mermaid and dot are byte-for-byte deterministic; svg runs Graphviz's dot; md is the transition table.",
)
@click.option("--state", default=None, metavar="STATE", help="Highlight this leaf state (e.g. busy).")
@click.option(
    "--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write here, not stdout."
)
def diagram(machine: str, fmt: str, state: str | None, output: Path | None) -> None:
    """Draw MACHINE (runner, instance or download) from its code."""
    from fsm import diagram as draw

    cls = fsm.MACHINES[machine]
    leaves = _leaf_ids(cls)
    if state is not None and state not in leaves:
        raise click.BadParameter(
            f"{machine} has no state {state!r}; its states: {', '.join(leaves)}", param_hint="--state"
        )
    if fmt == "mermaid":
        text = draw.mermaid(cls, highlight=state)
    elif fmt == "md":
        text = _markdown(cls, state)
    else:
        text = draw.dot(cls, highlight=state)
        if fmt == "svg":
            text = _svg(text)
    if output is None:
        click.echo(text, nl=False)
    else:
        output.write_text(text, encoding="utf-8")
        click.echo(f"wrote {output}", err=True)


@main.command()
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if a file differs from what the code generates.")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("specs"),
    show_default=True,
    help="Where the machine documents live.",
)
def specs(check: bool, directory: Path) -> None:
    """Generate specs/<machine>.md (diagram, transitions, invariants, defaults) from the code."""
    from exod.specs import drifted, write_specs

    if check:
        stale = drifted(directory)
        if stale:
            for name in stale:
                click.echo(f"{directory / (name + '.md')} differs from the code; run `make specs`", err=True)
            raise SystemExit(1)
        click.echo(f"{directory}: up to date")
        return
    for path in write_specs(directory):
        click.echo(f"wrote {path}")


@main.command()
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
            policy=fsm.RetryPolicy(max_retries=max_retries),
            depth=depth,
            max_states=max_states,
            deletes=not no_deletes,
            coarse=not fine,
            requests=requests,
            hosts=hosts,
            node_failures=node_failures,
        )
    except ValueError as exc:  # --hosts below --ranks, or node failures without hosts
        raise click.UsageError(str(exc)) from None
    import time

    result = run_check(config, timer=time.perf_counter)
    click.echo(result.report())
    if not result.ok:
        raise SystemExit(1)


@main.command("cluster-demo")
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


def _cluster_log(url: str) -> tuple[int, list]:
    """Where the cluster's log starts, and its entries, as the etcd at ``url`` holds them."""
    import trio

    from exod.cluster.etcd import Etcd
    from exod.cluster.etcd_state import EtcdState
    from exod.cluster.membership import DEFAULT_PREFIX
    from exod.state.store import StateUnavailable

    async def read() -> tuple[int, list]:
        etcd = Etcd(url)
        try:
            state = EtcdState(etcd, DEFAULT_PREFIX.encode(), None)
            return await state.log_start(), [entry for _, entry in await state.transitions()]
        finally:
            await etcd.aclose()

    try:
        return trio.run(read)
    except StateUnavailable as exc:
        raise click.ClickException(f"{exc}. Is etcd running at {url}?") from exc


@main.command()
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
def replay(state_dir, jsonl, export, cluster_url) -> None:
    """Replay a transition log against the machines: first divergence, and coverage. Exits 1 on divergence.

    A log that [retention] pruned is replayed from its oldest entry kept, and says so.
    """
    import json

    from fsm.cluster import LogEntry
    from fsm.conformance import replay as run_replay

    if jsonl is not None:
        try:
            lines = jsonl.read_text().splitlines()
            entries = [LogEntry.from_record(json.loads(line)) for line in lines if line.strip()]
        except (ValueError, KeyError, TypeError) as exc:
            raise click.ClickException(f"{jsonl} is not a transition log (JSON lines): {exc}") from exc
    elif cluster_url is not None:
        start, entries = _cluster_log(cluster_url)
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
        export.write_text("".join(json.dumps(e.as_record()) + "\n" for e in entries))
    report = run_replay(entries)
    click.echo(report.text())
    if not report.ok:
        raise SystemExit(1)
