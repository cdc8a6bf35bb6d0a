"""exod: the daemon that drives real runner processes through the `fsm` machines.

Importing `exod` imports nothing else: every runner process starts with
``python -m exod.runner``, and each import there is paid once per rank.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "__version__":  # one source of truth, loaded only when asked for
        from fsm import __version__

        return __version__
    raise AttributeError(f"module 'exod' has no attribute {name!r}")
