"""The cluster's credential: one secret every node of a cluster holds, and no client.

Nodes authenticate to each other with it (header `HEADER`): a controller to the agents it drives, a node
to the controller it forwards a client's request to. The agents' endpoints accept nothing else, so a client
API key — which every chat client holds — drives no runner, and neither does any local user on a node's
loopback. It is a file, as k3s's cluster token is: one secret to hand to every node, readable by its owner
alone. (Mutual TLS with a cluster CA would authenticate each node by its own certificate, but needs a CA,
one certificate per node and their renewal; the threat it would add protection against — one node
impersonating another — is already out of reach here, since whoever holds a node holds its etcd
credentials, and who can write to etcd owns the cluster, as in Kubernetes.) What the token cannot do alone
is keep itself secret on a shared network: where the cluster has TLS between nodes (`exod.cluster.tls`),
it is sent and taken only over TLS, between peers that verified each other's certificates.

A request one node forwards to another also says so (`FORWARDED_BY`, the forwarding node's id): the controller
then keeps the stream it answers audibly alive (`NODE_KEEPALIVE_S`), as the forwarding node ends one that
goes silent (`exod.api.forward`).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

HEADER = "X-Exod-Cluster-Token"
FORWARDED_BY = "X-Exod-Forwarded-By"  # on a request a node forwards: its node id (one hop only)
# a forwarded stream's keep-alive while it has nothing to say: well under any `[cluster] forward_idle`
# (`MIN_FORWARD_IDLE_S`), so that only a controller gone or stopped is ever silent that long
NODE_KEEPALIVE_S = 2.0
MIN_FORWARD_IDLE_S = 5.0  # two keep-alives and a late third
MIN_LENGTH = 32  # characters: `new_token`'s are 43


class ClusterTokenError(ValueError):
    """The cluster's token file cannot be used; the message says what to do."""


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token(path: Path) -> str:
    """Write a new token to ``path`` (which must not exist), readable by its owner alone; the token."""
    token = new_token()
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ClusterTokenError(f"{path} exists already: every node must keep the token it has") from None
    with os.fdopen(descriptor, "w") as file:
        file.write(token + "\n")
    return token


def read_secret(path: Path, what: str) -> str:
    """The secret in ``path`` (its one line), which must be a file no one but its owner can read."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ClusterTokenError(f"no {what} file at {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ClusterTokenError(f"cannot read the {what} file {path}: {exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ClusterTokenError(f"{path} can be read by others (mode {stat.S_IMODE(mode):o}): `chmod 600 {path}`")
    if not text:
        raise ClusterTokenError(f"the {what} file {path} is empty")
    return text


def read_token(path: Path) -> str:
    """The token in ``path``: at least `MIN_LENGTH` characters, in a file no one but its owner can read."""
    if not path.exists():
        raise ClusterTokenError(f"no cluster token file at {path}: make one with `exod cluster-token {path}`")
    text = read_secret(path, "cluster token")
    if len(text) < MIN_LENGTH or any(c.isspace() for c in text):
        raise ClusterTokenError(
            f"{path} holds no usable token (one line of at least {MIN_LENGTH} characters, no spaces): "
            f"make one with `exod cluster-token FILE`"
        )
    return text
