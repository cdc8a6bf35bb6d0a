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
