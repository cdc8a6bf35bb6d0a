"""The runner process: one rank of an instance, started as ``python -m exod.runner`` by its supervisor.

Everything here runs in the child, not in the daemon: the process itself (`exod.runner.process`: the ring,
loading, warm-up), its continuous batch (`batch`), what one generation says as it comes (`output`), and
fault injection on the runner's side (`faults`). The supervisor ⇄ runner wire protocol (`protocol`) lives
here too, so that both sides import it from one place.

It imports nothing of the daemon: every import here is paid once per rank, and a runner must start on a
machine where only this package and MLX are loaded. This ``__init__`` imports nothing, so the daemon's
``import exod.runner.protocol`` does not load MLX.
"""
