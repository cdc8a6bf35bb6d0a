"""exod: the daemon that drives real runner processes through the `fsm` machines.

Its rooms, bottom to top; each imports only its own layer and those below (tests/test_house_rules.py):

* `exod.runner` — the runner process (``python -m exod.runner``) and its wire protocol: it imports nothing
  of the daemon, since each import there is paid once per rank.
* `exod.state` — the state directory and the stores (SQLite, the store interface, the journal, retention):
  they keep what they are given and decide nothing.
* `exod.host` — this machine: runner processes and their supervisors, orphans, ring ports, the model cache.
* `exod.cluster` — only with ``--cluster``: etcd, the node's lease, the election, the agent and the other
  nodes; it never reaches up into the controller that uses it.
* the core, at the top level — the controller, the request book, what runners report, the status document,
  placement, downloads, the configuration, and what a generation says (`exod.generated`).
* `exod.api` — the HTTP front end: it asks the controller and the request book, never a store or the
  runner's wire (`exod.state`, `exod.runner`).
* the shell — `exod.serve` (the task tree) and `exod.cli`: the only code that imports `exod.api`; and
  `exod.chaos`, the fault campaign (`exod chaos`), which drives whole daemons from outside.

Importing `exod` imports nothing else.
"""

from typing import Any

# The top-level import names of the `daemon` extra (pyproject.toml); tests/test_packaging.py keeps them in step.
DAEMON_IMPORTS = frozenset(
    {
        "click",
        "mlx",
        "mlx_lm",
        "huggingface_hub",
        "tokenizers",
        "safetensors",
        "numpy",
        "trio",
        "fastapi",
        "hypercorn",
        "h11",
        "gguf",
        "transformers",
        "httpx",
        "httpx_sse",
        "psutil",
        "platformdirs",
        "prometheus_client",
        "llguidance",
    }
)


def main() -> None:
    """The `exod` console script: the CLI, or one clear line when the daemon's extra is not installed.

    ``pip install exod`` installs the library `fsm` alone; the daemon needs ``exod[daemon]``.
    """
    try:
        from exod.cli import main as cli
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in DAEMON_IMPORTS:
            raise
        import sys

        print(
            f'exod: the daemon needs its dependencies: pip install "exod[daemon]" (missing: {missing})',
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    cli()


def __getattr__(name: str) -> Any:
    if name == "__version__":  # one source of truth, loaded only when asked for
        from fsm import __version__

        return __version__
    raise AttributeError(f"module 'exod' has no attribute {name!r}")
