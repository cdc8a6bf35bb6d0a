"""Who may call: a client with the API key that every route but /health asks for (a bearer token, or
Anthropic's ``x-api-key``), and, in a cluster, another node with the cluster's token (`exod.cluster.token`):
the only credential the agents' endpoints take, and one that stands for a client's key on a request a node
forwards (the node checked that key itself, and sends it on to no one)."""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Annotated, Any

from fastapi import Header, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from exod.api.errors import ApiError
from exod.cluster.token import HEADER

# module-level, as FastAPI resolves the annotations that name them in this module's namespace
_BEARER = HTTPBearer(scheme_name="bearer", auto_error=False)
_X_API_KEY = APIKeyHeader(name="x-api-key", scheme_name="apiKey", auto_error=False)
# the cluster's token: a plain header, out of the OpenAPI document (clients never hold it)
_ClusterToken = Annotated[str | None, Header(alias=HEADER, include_in_schema=False)]

WRONG_KEY = "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"


def matches(given: str | None, expected: str) -> bool:
    """In constant time; the bytes as they came (Starlette decodes headers as latin-1): any value compares."""
    return given is not None and secrets.compare_digest(given.encode("latin-1"), expected.encode())


def holds_key(raw_headers: Iterable[tuple[bytes, bytes]], api_key: str) -> bool:
    """Whether an ASGI request's headers carry the client's API key, read as the routes read it (a bearer
    token, or ``x-api-key``): for middleware that answers before any route does (`exod.api.forward`)."""
    headers = {k.lower(): v.decode("latin-1") for k, v in raw_headers}
    scheme, _, bearer = headers.get(b"authorization", "").partition(" ")
    given = bearer.strip() if scheme.lower() == "bearer" else headers.get(b"x-api-key")
    return matches(given, api_key)


def holds_cluster_token(raw_headers: Iterable[tuple[bytes, bytes]], cluster_token: str) -> bool:
    """Whether an ASGI request's headers carry the cluster's token: another node's request, authenticated as the
    cluster's at every node, whatever that node is now (a request forwarded carries no client key any more)."""
    name = HEADER.lower().encode()
    given = next((v.decode("latin-1") for k, v in raw_headers if k.lower() == name), None)
    return bool(cluster_token) and matches(given, cluster_token)


def authentication(api_key: str | None, cluster_token: str = "") -> list[Any]:
    """The dependency every client route but /health carries: a bearer token, or Anthropic's ``x-api-key``
    (its clients send that one), or — a request another node forwards — the cluster's token. FastAPI's
    security helpers read the headers and document the schemes."""
    if not api_key:
        return []

    async def authenticated(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)],
        x_api_key: Annotated[str | None, Security(_X_API_KEY)],
        token: _ClusterToken = None,
    ) -> None:
        given = credentials.credentials if credentials is not None else x_api_key
        if not (matches(given, api_key) or (cluster_token and matches(token, cluster_token))):
            raise ApiError(401, WRONG_KEY, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return [Security(authenticated)]


def node_authentication(cluster_token: str) -> list[Any]:
    """The agents' endpoints: the cluster's token alone. A client's API key is refused there."""

    async def authenticated(token: _ClusterToken = None) -> None:
        if not matches(token, cluster_token):
            message = f"the agent obeys only the nodes of its cluster: missing or wrong {HEADER}"
            raise ApiError(401, message, code="invalid_cluster_token")

    return [Security(authenticated)]
