"""What a campaign runs on: a 3-member etcd, N `exod serve --cluster` nodes and, where this machine allows, one
node in a network namespace (so its links can be cut) and every node's state dir on a small tmpfs (so it can
fill up). All of it made under one scratch directory and all of it undone by `Rig.close`.

Addresses: with a namespace, node-1 is inside it, the other nodes on the pair's outside addresses and etcd's
members on the last of them, so that a blackhole route inside the namespace cuts node-1 from etcd alone, from
its peers alone (and from clients: this side's connections leave from the pair's first address, whoever makes
them), or (the link down) from everything. Etcd's address is never a connection's source: a cut from etcd cuts
nothing else. Without a namespace, everything is on 127.0.0.1–N.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import httpx

from exod.chaos.schedule import ARMED
from exod.cluster import netns
from exod.cluster.devcluster import LocalEtcd, LocalEtcdCluster, cluster_token_file, wait_until

API_KEY = "exod-chaos"  # a node on a namespace's address is not on loopback: it needs a client key
TMPFS_MB = 64
# A hung runner is found by the timeouts; the campaign's are shorter than the defaults (minutes), so that a hang
# ends within the campaign's bounds. They are the campaign's only departure from the default configuration.
TIMEOUTS = {"connect": 20.0, "load_progress": 20.0, "warm_up": 20.0, "generate": 10.0}


class RigError(RuntimeError):
    """The rig could not be set up; the message says what failed."""


@attrs.define
class Node:
    n: int
    address: str
    home: Path
    argv: list[str]
    env: dict[str, str]
    namespaced: bool
    process: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return f"node-{self.n}"

    @property
    def url(self) -> str:
        """Its API URL now (port 0 in its config: a restart moves it)."""
        return json.loads((self.home / "state" / "daemon.json").read_text())["url"]

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 60.0) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.home / "state" / "daemon.json").unlink()  # left by a killed daemon: wait for the new one's
        with (self.home / "serve.log").open("ab") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        wait_until(self._serving, f"{self.name} to serve", timeout, self.process, self.home)

    def _serving(self) -> bool:
        try:
            return bool(self.url)
        except OSError:  # not written yet
            return False

    def stop(self, timeout: float = 60.0) -> None:
        """The graceful way (it drains and reaps its runners); killed if it has not ended by ``timeout``."""
        if not self.alive:
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def can_mount_tmpfs(where: Path) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    if done.returncode == 0:
        subprocess.run(["umount", str(where)], capture_output=True)
    return done.returncode == 0


class Rig:
    def __init__(
        self,
        root: Path,
        hf_home: Path,
        models: tuple[str, ...],
        *,
        nodes: int,
        members: int,
        ttl: int,
        namespace: bool,
        tmpfs: bool,
    ):
        self.root, self.hf_home, self.models, self.ttl = root, hf_home, models, ttl
        self._stack = contextlib.ExitStack()
        self.space: netns.Namespace | None = None
        self.mounts: list[Path] = []
        self.nodes: list[Node] = []
        try:
            if namespace:
                self.space = self._stack.enter_context(netns.namespace(outside=1 + (nodes - 1)))
            self.etcd = LocalEtcdCluster(root / "etcd", members, host=self.etcd_address)
            self.etcd.start()
            self._stack.callback(self.etcd.stop)
            for n in range(1, nodes + 1):
                self.nodes.append(self._node(n, tmpfs))
                self.nodes[-1].start()
                if n == 1:  # node-1 first, so that it is the controller (and, cut off, the one that must step down)
                    wait_until(
                        lambda: self._seen(lambda: self.controller() == "node-1"), "node-1 to be the controller", 60
                    )
            wait_until(lambda: self._seen(lambda: len(self.get("/nodes")["nodes"]) == nodes), "every node to join", 60)
        except BaseException:
            self.close()
            raise

    def _seen(self, check: Callable[[], bool]) -> bool:
        """``check()``, where no node answering yet (a 503 while etcd elects, say) is not yet, never the end."""
        try:
            return check()
        except RigError:
            return False

    @property
    def etcd_address(self) -> str:
        return self.space.outside[-1] if self.space else "127.0.0.1"

    def _node(self, n: int, tmpfs: bool) -> Node:
        home = self.root / f"node-{n}"
        (home / "state").mkdir(parents=True)
        if tmpfs:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(home / "state")], check=True
            )
            self.mounts.append(home / "state")
        namespaced = self.space is not None and n == 1
        address = (self.space.inside if namespaced else self.space.outside[n - 2]) if self.space else f"127.0.0.{n}"
        config = f'[daemon]\nport = 0\noffline = true\n\n[cluster]\nurl = "{self.etcd.url}"\nnode_id = "node-{n}"\n'
        config += f'token_file = "{cluster_token_file(self.root)}"\nadvertise = "{address}"\nlease_ttl = {self.ttl}\n'
        config += "\n[timeouts]\n" + "".join(f"{name} = {value}\n" for name, value in TIMEOUTS.items())
        for armed in (a for a in ARMED if a.node == n):
            phase, _, kind = armed.fault.partition(":")
            config += f'\n[[fault]]\nphase = "{phase}"\nkind = "{kind}"\nrank = {armed.rank}\n'
            config += f"generation = {armed.generation}\n"
        (home / "exod.toml").write_text(config)
        argv = [sys.executable, "-m", "exod", "serve", "--config", str(home / "exod.toml")]
        argv += ["--state-dir", str(home / "state"), "--host", address]
        if namespaced:
            assert self.space is not None
            argv = self.space.run(argv)
        env = {**os.environ, "HF_HOME": str(self.hf_home), "EXOD_API_KEY": API_KEY}
        return Node(n, address, home, argv, env, namespaced)

    def peers(self) -> tuple[str, ...]:
        """This side's addresses that node-1 hears its peers (and clients) from."""
        return self.space.outside[:-1] if self.space else ()

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def urls(self) -> dict[str, str]:
        """The API URL of every node that serves now."""
        found = {}
        for node in self.nodes:
            with contextlib.suppress(OSError, ValueError, KeyError):
                found[node.name] = node.url
        return found

    def daemons(self) -> dict[int, str]:
        """pid → node, of every daemon alive (the namespaced one's pid is `ip netns exec`'s: it execs)."""
        return {n.process.pid: n.name for n in self.nodes if n.process is not None and n.alive}

    def get(self, path: str) -> dict:
        """``path`` from the first node that answers."""
        for url in self.urls().values():
            with contextlib.suppress(httpx.HTTPError, ValueError):
                answer = httpx.get(url + path, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5)
                if answer.is_success:
                    return answer.json()
        raise RigError(f"no node answered {path}")

    def controller(self) -> str | None:
        return self.get("/nodes").get("controller")

    def members(self) -> list[LocalEtcd]:
        return self.etcd.members

    def stop_nodes(self) -> None:
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        self.stop_nodes()
        self._stack.close()  # etcd, then the namespace
        for mount in self.mounts:
            subprocess.run(["umount", "--lazy", str(mount)], capture_output=True)
