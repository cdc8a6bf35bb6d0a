"""exod: the daemon that drives real runner processes through the `fsm` machines.

Importing `exod` imports nothing else: every runner process starts with
``python -m exod.runner``, and each import there is paid once per rank.
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
        "httpx",
        "httpx_sse",
        "sse_starlette",
        "psutil",
        "platformdirs",
        "prometheus_client",
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
