"""The API key that every route but /health asks for: a bearer token, or Anthropic's ``x-api-key``."""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from fastapi import Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from exod.api.errors import ApiError

# module-level, as FastAPI resolves the annotations that name them in this module's namespace
_BEARER = HTTPBearer(scheme_name="bearer", auto_error=False)
_X_API_KEY = APIKeyHeader(name="x-api-key", scheme_name="apiKey", auto_error=False)


def authentication(api_key: str | None) -> list[Any]:
    """The dependency every route but /health carries: a bearer token, or Anthropic's ``x-api-key`` (its
    clients send that one). FastAPI's security helpers read the headers and document both schemes."""
    if not api_key:
        return []
    expected = api_key.encode()

    async def authenticated(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)],
        x_api_key: Annotated[str | None, Security(_X_API_KEY)],
    ) -> None:
        given = credentials.credentials if credentials is not None else x_api_key
        # bytes as they came (Starlette decodes headers as latin-1): any value compares, none raises
        if given is None or not secrets.compare_digest(given.encode("latin-1"), expected):
            raise ApiError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return [Security(authenticated)]
