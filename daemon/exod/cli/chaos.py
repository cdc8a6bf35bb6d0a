"""`exod chaos`: a seeded fault campaign against a real cluster on this machine (exod.chaos)."""

from __future__ import annotations

import secrets
from pathlib import Path

import click

SPEC = Path("specs/reliability.md")
MATRIX_ROWS = Path("specs/transitions-fault-matrix.json")  # written by the fault matrix (make reliability)
AROUND_S = 5.0  # seconds of history shown either side of a violation
RIG_FAILED = 3  # the exit status when the rig could not be set up: nothing was checked (1: a violation)


@click.command()
@click.option("--seed", type=int, default=None, help="The campaign's seed (default: a fresh one, printed).")
@click.option(
    "--duration",
    type=click.FloatRange(min=30),
    default=180.0,
    show_default=True,
    help="Seconds of workload; faults stop 40% of it before the end, or two minutes in a long run.",
)
@click.option("--nodes", type=click.IntRange(2, 5), default=3, show_default=True)
@click.option("--ttl", type=click.IntRange(2, 60), default=5, show_default=True, help="The nodes' lease TTL.")
@click.option("--no-netns", is_flag=True, help="Keep every node on loopback (no network faults).")
@click.option(
    "--report",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"Write the report as the campaign's section of this file ({SPEC} for `make reliability`).",
)
@click.option(
    "--keep",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the history (JSON lines) and the nodes' and etcd's logs in this directory.",
)
def chaos(seed, duration, nodes, ttl, no_netns, report, keep) -> None:
    """Start a 3-member etcd and NODES exod nodes, place instances, run a client workload and inject faults
    drawn from SEED (runners, daemons, network, etcd, storage); check the seven invariants of issue #26 on
    what an outsider saw. A violation prints the seed, the schedule up to it and the history around it, and
    exits 1; the same --seed replays the same schedule. A rig that cannot be set up (etcd or a node not up,
    the standing instances not placed) says why and exits 3: nothing was checked. Needs etcd (installed with
    exod's test extra); network faults and a full disk need root."""
    from exod.chaos import campaign
    from exod.chaos import report as reporting
    from exod.chaos.rig import RigError

    seed = secrets.randbelow(2**31) if seed is None else seed
    settings = campaign.Settings(seed, duration, nodes=nodes, ttl=ttl, namespaces=not no_netns, keep=keep)
    try:
        result = campaign.run(settings, announce=lambda line: click.echo(line, err=True))
    except RigError as exc:
        click.echo(f"seed {seed}: the rig failed, nothing was checked: {exc}", err=True)
        raise SystemExit(RIG_FAILED) from None
    if keep is not None:
        result.history.dump(keep / "history.jsonl")
    if report is not None:
        matrix = reporting.read_rows(report.parent / MATRIX_ROWS.name)
        reporting.write_section(report, "chaos", reporting.section(result, matrix))
    click.echo(result.replay)
    for error in result.errors:
        click.echo(f"the rig failed: {error}")
    if not result.violations:
        click.echo(
            f"seed {seed}: no violation in {len(result.history.faults)} faults and "
            f"{len(result.history.operations)} operations"
        )
    else:
        _explain(result)
    if not result.ok:
        raise SystemExit(1)


def _explain(result) -> None:
    first = result.violations[0]
    click.echo(
        f"seed {result.settings.seed}: {len(result.violations)} violation(s); reproduce with "
        f"`exod chaos --seed {result.settings.seed} --duration {result.settings.duration:g}`"
    )
    for violation in result.violations:
        click.echo("  " + violation.line())
    click.echo(f"the schedule up to t+{first.time:.1f}s:")
    for step in result.schedule:
        if step.at <= first.time:
            click.echo("  " + step.text())
    low, high = first.time - AROUND_S, first.time + AROUND_S
    click.echo(f"the history from t+{low:.1f}s to t+{high:.1f}s:")
    h = result.history
    for f in h.faults:
        if f.start <= high and low <= f.end:
            click.echo(f"  fault {f.kind} on {f.target}: t+{f.start:.2f}s → t+{f.end:.2f}s {f.note}")
    for p in h.processes.values():
        if p.first <= high and low <= p.last:
            click.echo(
                f"  runner {p.instance}/{p.rank} gen {p.generation} pid {p.pid} on {p.node}: "
                f"t+{p.first:.2f}s → t+{p.last:.2f}s"
            )
    for op in h.operations:
        if op.start <= high and low <= op.end:
            click.echo(
                f"  {op.client} to {op.node}: t+{op.start:.2f}s → t+{op.end:.2f}s {op.outcome.value} "
                f"{op.instance} {op.detail}"
            )
