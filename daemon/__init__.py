"""exod: the daemon that drives real runner processes through the `fsm` machines."""

from fsm import __version__

__all__ = ["__version__"]
