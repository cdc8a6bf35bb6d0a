"""This host's memory as admission sees it: what the platform says, not a guess.

Eviction and admission decide on these numbers, so they come from the platform's own accounting: psutil
for total and available memory (Linux's MemAvailable, macOS's free + inactive; never "all of physical
memory is free"), and on Apple silicon MLX's Metal ceiling, the device's recommended working-set size,
which is what a model may really use of unified memory. MLX is imported only when asked, and a missing
or failing MLX leaves total memory as the room: reading memory never stops the daemon.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import psutil

log = logging.getLogger(__name__)


def total_memory() -> int:
    """This machine's physical memory, in bytes."""
    return int(psutil.virtual_memory().total)


def free_memory() -> int:
    """Memory a new process may take without swapping, in bytes: Linux's MemAvailable (free plus the page
    cache it would give back); on macOS free plus inactive pages."""
    return int(psutil.virtual_memory().available)


def metal_working_set() -> int | None:
    """The Metal device's recommended working-set size in bytes (Apple silicon), or None: no MLX, no Metal
    device, or MLX failed to say."""
    try:
        mx: Any = importlib.import_module("mlx.core")
    except ImportError:
        return None
    try:
        if not mx.metal.is_available():
            return None
        # Newer MLX: mx.device_info(device); older: mx.metal.device_info() only (deprecated where both exist).
        info = mx.device_info(mx.gpu) if hasattr(mx, "device_info") else mx.metal.device_info()
        size = info.get("max_recommended_working_set_size")
    except Exception as exc:  # whatever MLX raises, the room falls back to total memory
        log.warning("MLX did not give the Metal working-set size (%s); using total memory", exc)
        return None
    return size if isinstance(size, int) and size > 0 else None


def model_room() -> int:
    """What this node may reserve for models, in bytes: on Apple silicon the Metal working-set size (capped
    at physical memory), elsewhere physical memory."""
    total = total_memory()
    working_set = metal_working_set()
    return total if working_set is None else min(working_set, total)
