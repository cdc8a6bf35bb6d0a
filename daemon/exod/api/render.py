"""Diagrams of the machines for the API: text from `fsm.diagram`, SVG from Graphviz's ``dot``."""

from __future__ import annotations

import shutil
from enum import StrEnum

import trio

import fsm
from fsm import diagram


class Format(StrEnum):
    MERMAID = "mermaid"
    DOT = "dot"
    SVG = "svg"


class GraphvizMissing(RuntimeError):
    """SVG needs Graphviz's ``dot`` on PATH."""


MEDIA_TYPES = {Format.MERMAID: "text/plain", Format.DOT: "text/vnd.graphviz", Format.SVG: "image/svg+xml"}


async def render(machine: type | fsm.runner.RunnerLifecycle, fmt: Format, highlight: str | None = None) -> bytes:
    if fmt is Format.MERMAID:
        return diagram.mermaid(machine, highlight=highlight).encode()
    source = diagram.dot(machine, highlight=highlight)
    if fmt is Format.DOT:
        return source.encode()
    if shutil.which("dot") is None:
        raise GraphvizMissing("SVG export needs Graphviz: install it (e.g. `apt-get install graphviz`), or ask for dot")
    with trio.fail_after(30):
        result = await trio.run_process(["dot", "-Tsvg"], stdin=source.encode(), capture_stdout=True)
    return result.stdout
