"""The MLX ring of one generation: the ports its ranks listen on, in the hostfile every rank reads.

MLX's ring backend takes a JSON hostfile, one ``["HOST:PORT"]`` per rank; every rank of a generation
reads the same file, so it is written once, when the first rank of that generation is created. It is
private (0600, in 0700 directories): it names the ports a peer would connect to.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from exod.state.statedir import private_dir, write_private


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports the kernel says are free now on ``host`` (bound, then released: another process may still
    take one)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def hostfile(path: Path, world_size: int) -> Path:
    """The generation's hostfile at ``path``, written on first use: every rank on loopback."""
    if not path.exists():
        private_dir(path.parent)
        write_private(path, json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(world_size)]))
    return path


def endpoints(path: Path) -> list[str]:
    """The HOST:PORT of every rank in a generation's hostfile, rank 0 first."""
    return [entry[0] for entry in json.loads(path.read_text())]


def write_hostfile(path: Path, endpoints: list[str]) -> Path:
    """A generation's hostfile across nodes: ``HOST:PORT`` of every rank, rank 0 first."""
    private_dir(path.parent)
    write_private(path, json.dumps([[endpoint] for endpoint in endpoints]))
    return path
