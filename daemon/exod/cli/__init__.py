"""The ``exod`` command line: the root group; each command lives in the module named for what it does."""

from __future__ import annotations

import click

import fsm
from exod.cli.chaos import chaos
from exod.cli.completions import chat
from exod.cli.daemon import cluster_demo, cluster_token, serve
from exod.cli.documents import diagram, machines, specs
from exod.cli.instances import delete, logs, park, place, status, unpark
from exod.cli.models import model
from exod.cli.repair import repair
from exod.cli.verify import check, check_fencing, replay


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(fsm.__version__, prog_name="exod")
def main() -> None:
    """exod: explicit lifecycles for LLM inference runners."""


main.add_command(machines)
main.add_command(model)
main.add_command(serve)
main.add_command(place)
main.add_command(delete)
main.add_command(park)
main.add_command(unpark)
main.add_command(status)
main.add_command(logs)
main.add_command(chat)
main.add_command(diagram)
main.add_command(specs)
main.add_command(check)
main.add_command(check_fencing)
main.add_command(cluster_demo)
main.add_command(cluster_token)
main.add_command(replay)
main.add_command(repair)
main.add_command(chaos)
