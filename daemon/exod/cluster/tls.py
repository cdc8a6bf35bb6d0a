"""Node-to-node HTTPS: the controller's commands to the agents, and requests a node forwards, over TLS that
both ends verify with the cluster's CA.

Why: the cluster's token (`exod.cluster.token`) rides on every node-to-node request, with the controller's
term and its report stream; on plain HTTP whoever shares the network reads them and can command an agent.
With ``[cluster] tls_cert`` and ``tls_key`` (and ``tls_ca``, by default etcd's ``etcd_ca``), every node:

* serves its API on the same port to TLS as well as to plain HTTP (its first byte says which: a TLS
  handshake opens with 0x16, an HTTP request with a letter), showing its certificate; a client of the API
  needs none, a node shows its own, which must be signed by the CA (`server_context`: a certificate of
  another CA fails the handshake);
* takes the cluster's token, and serves the agents' endpoints, only over TLS from a peer whose certificate
  the CA signed (`exod.api.http_server`'s node gate): the token sent over plain HTTP, or by a peer without
  such a certificate, is refused (403);
* reaches the other nodes at ``https://`` (`peer_url`), checking that the certificate they show is the
  CA's and names the address it dialled (`client_context`), and shows its own.

A node's certificate is its identity as a server and as a client: it must name the node's advertise address
(its API's host) in its subjectAltName, and allow both uses (extendedKeyUsage serverAuth, clientAuth).
`NodeTls.check` proves it at start-up with a handshake in memory, so a wrong file is a clear error at once,
not a cluster whose nodes cannot talk.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import attrs
import httpx


class NodeTlsError(ValueError):
    """The node's TLS files cannot secure node-to-node traffic; the message says which and what to do."""


@attrs.frozen
class NodeTls:
    """The CA every node's certificate is signed by, and this node's certificate and key."""

    ca: Path
    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        """What this node's API shows, and how it checks a peer's certificate: optional (clients of the API show
        none), but one shown must be the CA's."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca))
        context.load_cert_chain(str(self.cert), str(self.key))
        context.verify_mode = ssl.CERT_OPTIONAL
        return context

    def client_context(self) -> ssl.SSLContext:
        """How this node reaches another: the CA's certificate for the address dialled, and its own shown."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))
        context.load_cert_chain(str(self.cert), str(self.key))
        return context

    def check(self, address: str) -> None:
        """A handshake in memory, this node to itself at ``address``, both ways verified: `NodeTlsError` saying
        what is wrong (a file, the CA, the address the certificate names, its usage)."""
        try:
            server, client = self.server_context(), self.client_context()
        except (OSError, ssl.SSLError) as exc:
            raise NodeTlsError(
                f"cannot load tls_ca {self.ca}, tls_cert {self.cert} or tls_key {self.key}: {exc}"
            ) from None
        server.verify_mode = ssl.CERT_REQUIRED  # its own certificate must do as a client's too
        to_client, to_server = ssl.MemoryBIO(), ssl.MemoryBIO()
        serving = server.wrap_bio(to_server, to_client, server_side=True)
        dialling = client.wrap_bio(to_client, to_server, server_hostname=address.strip("[]"))
        try:
            for _ in range(10):  # a TLS 1.3 handshake takes two round trips
                done = [_step(dialling), _step(serving)]
                if all(done):
                    return
        except ssl.SSLError as exc:
            why = getattr(exc, "verify_message", None) or exc.reason or exc  # "IP address mismatch", say
            raise NodeTlsError(
                f"tls_cert {self.cert} cannot secure this node's traffic at {address}: {why}. It must "
                f"be signed by tls_ca {self.ca}, name {address} (the advertise address) in its subjectAltName, and "
                "allow serverAuth and clientAuth (extendedKeyUsage)"
            ) from None
        raise NodeTlsError(f"tls_cert {self.cert}: a handshake with itself did not complete")


def _step(end: ssl.SSLObject) -> bool:
    """One step of ``end``'s handshake; True once it is done."""
    try:
        end.do_handshake()
    except ssl.SSLWantReadError:
        return False
    return True


def node_tls(ca: Path | None, cert: Path | None, key: Path | None, address: str) -> NodeTls | None:
    """The node's TLS from ``[cluster]`` (``ca`` is ``tls_ca``, or ``etcd_ca`` when not given), checked for
    ``address``; None when no certificate is given (node-to-node traffic is plain HTTP)."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise NodeTlsError("tls_cert needs tls_key, and tls_key tls_cert: give both")
    if ca is None:
        raise NodeTlsError("tls_cert needs the CA that signs every node's certificate: give tls_ca (or etcd_ca)")
    tls = NodeTls(ca, cert, key)
    tls.check(address)
    return tls


def peer_url(url: str, tls: NodeTls | None) -> str:
    """Where a node reaches the API that another node serves at ``url`` (its record's): over TLS when the
    cluster has it. A node serves both on the same port."""
    if tls is None or not url.startswith("http://"):
        return url
    return "https://" + url.removeprefix("http://")


def verify(tls: NodeTls | None) -> ssl.SSLContext | bool:
    """What an HTTP client of node-to-node traffic verifies the other end with (httpx's ``verify``)."""
    return True if tls is None else tls.client_context()


# TCP keep-alive between nodes: a peer gone silent (its host down, packets dropped) is found out in
# IDLE + INTERVAL × COUNT seconds on a connection with nothing to send, rather than never
TCP_KEEPALIVE = (5, 2, 3)  # idle, interval, count


def keepalive_options() -> list[tuple[int, int, int]]:
    """Socket options that turn TCP keep-alive on, as often as `TCP_KEEPALIVE` says where the system lets a
    socket say so (Linux; macOS names the idle time ``TCP_KEEPALIVE``)."""
    idle, interval, count = TCP_KEEPALIVE
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    names = (("TCP_KEEPIDLE", "TCP_KEEPALIVE"), ("TCP_KEEPINTVL",), ("TCP_KEEPCNT",))
    for candidates, value in zip(names, (idle, interval, count), strict=True):
        option = next((getattr(socket, n) for n in candidates if hasattr(socket, n)), None)
        if option is not None:
            options.append((socket.IPPROTO_TCP, option, value))
    return options


def peer_transport(tls: NodeTls | None) -> httpx.AsyncHTTPTransport:
    """How a node's HTTP client reaches the other nodes: TLS verified both ways where the cluster has it, and
    TCP keep-alive on, so that a connection to a host gone silent ends (the controller's commands and report
    streams to its agents, a forwarded request to the controller)."""
    return httpx.AsyncHTTPTransport(verify=verify(tls), socket_options=keepalive_options())
