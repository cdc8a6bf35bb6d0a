"""The ``exod`` command line."""

from __future__ import annotations

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
