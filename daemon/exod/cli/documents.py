"""The machines described from their code: `exod machines`, `diagram` and `specs`."""

from __future__ import annotations

from pathlib import Path

import click

import fsm


@click.command()
def machines() -> None:
    """List the lifecycle machines and their states."""
    for name, cls in fsm.MACHINES.items():
        leaves = [s.id for s in cls.states_map.values() if not s.states]
        click.echo(f"{name:<9} {cls.__name__:<18} {' '.join(leaves)}")


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


@click.command()
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


@click.command()
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
