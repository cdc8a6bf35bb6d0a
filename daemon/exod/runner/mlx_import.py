"""Importing mlx-lm without its side effect on the process's descriptor limit.

``mlx_lm.utils`` calls ``setrlimit(RLIMIT_NOFILE, (2048, 4096))`` when imported (``import mlx_lm`` does it
too). Where the hard limit is lower (containers, systemd units, ``ulimit -Hn 1024``) that raised ValueError and
every runner failed, every generation; where the limits are higher it *lowered* them, for good: found by the
fault campaign (#26), a daemon's hard limit fell from 20,000 to 4,096 the first time it looked into mlx-lm's
code (`exod.host.models.has_pipeline`), behind the back of whoever had set it. Both the runner and the daemon
import mlx-lm through `import_mlx_lm`, which lets it raise the soft limit up to the hard one and nothing else.
"""

from __future__ import annotations

import resource
import sys


def import_mlx_lm() -> None:
    """Import mlx-lm; its limit of open files only ever raises the soft limit, within the hard one."""
    if "mlx_lm.utils" in sys.modules:
        return
    real = resource.setrlimit

    def kept(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            real(which, limits)
            return
        soft, hard = resource.getrlimit(which)
        wanted = limits[0] if hard == resource.RLIM_INFINITY else min(limits[0], hard)
        if soft != resource.RLIM_INFINITY and wanted > soft:
            real(which, (wanted, hard))

    resource.setrlimit = kept  # type: ignore[assignment]
    try:
        import mlx_lm.utils  # noqa: F401
    finally:
        resource.setrlimit = real
