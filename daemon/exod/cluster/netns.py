"""A host of its own on one machine, for partition drills: a network namespace joined to this one by a veth
pair, whose link can be cut and healed (DESIGN §5). Used by the partition tests, `bench/overlap.py` and
anyone who wants to watch the cluster's fencing at work. Needs root and iproute2; `unusable` says why not.

Addresses are in 10.231.N.0/24, on the pair only: ``.2`` inside, ``.1``, ``.3``, ``.4`` … on this side.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator

import attrs


class NamespaceError(RuntimeError):
    """A namespace could not be made here; the message says why."""


@attrs.frozen
class Namespace:
    name: str
    inside: str  # the namespace's address
    outside: tuple[str, ...]  # addresses of this side of the pair (two nodes, or etcd and a node …)
    _link: str  # the namespace's end of the pair

    def run(self, argv: list[str]) -> list[str]:
        """``argv`` as it runs inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def cut(self) -> None:
        """Nothing crosses the pair any more, either way (packets dropped: no reset, as when a cable goes)."""
        _ip("netns", "exec", self.name, "ip", "link", "set", self._link, "down")

    def heal(self) -> None:
        _ip("netns", "exec", self.name, "ip", "link", "set", self._link, "up")

    def cut_from(self, address: str) -> None:
        """Nothing from inside reaches ``address`` any more (a blackhole route); the rest of the link stays.
        (Traffic control, which would drop packets in silence, finds no queueing disciplines on the CI machines.)"""
        _ip("netns", "exec", self.name, "ip", "route", "add", "blackhole", f"{address}/32")

    def heal_from(self, address: str) -> None:
        _ip("netns", "exec", self.name, "ip", "route", "del", "blackhole", f"{address}/32")

    def deafen_to(self, address: str) -> None:
        """Nothing from ``address`` arrives inside any more, while what is sent to it still leaves: a one-way cut
        (a policy rule that blackholes what comes from it, ahead of the local table's rule, which would deliver it
        first and which the namespace's own routing can move)."""
        rules = subprocess.run(self.run(["ip", "rule"]), capture_output=True, text=True, check=True).stdout
        if rules.startswith("0:"):
            _ip("netns", "exec", self.name, "ip", "rule", "add", "pref", "100", "lookup", "local")
            _ip("netns", "exec", self.name, "ip", "rule", "del", "pref", "0")
        _ip("netns", "exec", self.name, "ip", "rule", "add", "pref", "50", "from", f"{address}/32", "blackhole")

    def hear(self, address: str) -> None:
        _ip("netns", "exec", self.name, "ip", "rule", "del", "pref", "50", "from", f"{address}/32", "blackhole")

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, check=False)
        return [int(pid) for pid in out.stdout.split()]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unusable() -> str | None:
    """Why no namespace can be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "making a network namespace needs root"
    tag = secrets.token_hex(3)
    probe, outer, inner = f"exod-probe-{tag}", f"exq{tag}", f"exr{tag}"
    steps = [
        ["ip", "netns", "add", probe],
        ["ip", "link", "add", outer, "type", "veth", "peer", "name", inner],
        ["ip", "link", "set", inner, "netns", probe],
        ["ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:  # all `namespace` does, once: a sandbox may allow namespaces but not veth pairs
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                return f"{' '.join(step[:3])} failed: {done.stderr.strip()}"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", outer], capture_output=True, check=False)


@contextlib.contextmanager
def namespace(outside: int = 2) -> Iterator[Namespace]:
    """A namespace and its pair, with ``outside`` addresses on this side; removed on the way out with every
    process still inside it (killed)."""
    if (why := unusable()) is not None:
        raise NamespaceError(why)
    tag = secrets.token_hex(3)
    taken = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    net = next(f"10.231.{n}" for n in range(1, 255) if f" 10.231.{n}." not in taken)
    name, outer, inner = f"exod-{tag}", f"exo{tag}", f"exi{tag}"
    _ip("netns", "add", name)
    try:
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", name)
        ours = tuple(f"{net}.{host}" for host in (1, *range(3, outside + 2)))
        for address in ours:
            _ip("addr", "add", f"{address}/24", "dev", outer)
        _ip("link", "set", outer, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{net}.2/24", "dev", inner)
        _ip("netns", "exec", name, "ip", "link", "set", inner, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield Namespace(name, f"{net}.2", ours, inner)
    finally:
        for pid in Namespace(name, "", ("", ""), inner).pids():  # what was left inside goes with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", outer], capture_output=True, check=False)  # gone with it, usually
