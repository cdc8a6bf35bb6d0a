"""What the commands that find or call a daemon share: the --state-dir and --url options, the HTTP client."""

from __future__ import annotations

import os
from pathlib import Path

import click

STATE_DIR = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the daemon keeps its state (default: the user's data dir).",
)
URL = click.option("--url", default=None, help="A running daemon's URL (default: found through --state-dir).")


def etcd_options(command):
    """How a command reaches a secured etcd: TLS files and etcd's own user (README, Several hosts)."""
    file = click.Path(dir_okay=False, exists=True, path_type=Path)
    for name, kind, text in reversed(
        [
            ("--etcd-ca", file, "The CA etcd's members' certificates are signed by (https:// endpoints)."),
            ("--etcd-cert", file, "This node's client certificate, for an etcd that asks for one."),
            ("--etcd-key", file, "The key of --etcd-cert."),
            ("--etcd-user", str, "A user of etcd's own authentication."),
            ("--etcd-password-file", file, "The file with --etcd-user's password (mode 600)."),
        ]
    ):
        envvar = "EXOD_" + name.removeprefix("--").upper().replace("-", "_")
        command = click.option(name, type=kind, envvar=envvar, default=None, help=text)(command)
    return command


def etcd_security(etcd_ca, etcd_cert, etcd_key, etcd_user, etcd_password_file, base=None):
    """The options as an `exod.cluster.etcd.EtcdSecurity`, over ``base`` (the configuration's); a usage error
    says what is wrong."""
    import attrs

    from exod.cluster.etcd import EtcdSecurity
    from exod.cluster.token import ClusterTokenError, read_secret

    base = base or EtcdSecurity()
    try:
        password = read_secret(etcd_password_file, "etcd password") if etcd_password_file else base.password
        return attrs.evolve(
            base,
            ca=etcd_ca or base.ca,
            cert=etcd_cert or base.cert,
            key=etcd_key or base.key,
            user=etcd_user or base.user,
            password=password,
        )
    except (ClusterTokenError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc


def _state_dir(state_dir: Path | None) -> Path:
    from exod.config import default_state_dir

    return state_dir or default_state_dir()


def _client(url: str | None, state_dir: Path | None):
    import httpx

    from exod.serve import daemon_address

    address = url or daemon_address(_state_dir(state_dir))
    if address is None:
        raise click.ClickException(
            f"no exod daemon is running for {_state_dir(state_dir)}; start one with `exod serve` or pass --url"
        )
    key = os.environ.get("EXOD_API_KEY")
    return httpx.Client(base_url=address, timeout=30, headers={"Authorization": f"Bearer {key}"} if key else {})


def _call(client, method: str, path: str, **kwargs):
    import httpx

    try:
        response = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        raise click.ClickException(f"cannot reach the daemon at {client.base_url}: {exc}") from exc
    if response.status_code >= 400:
        _call_failed(response)
    return response.json()


def _call_failed(response) -> None:
    try:
        detail = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        detail = response.text or response.reason_phrase
    raise click.ClickException(f"{response.status_code}: {detail}")
