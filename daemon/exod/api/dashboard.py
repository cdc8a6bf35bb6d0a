"""The dashboard: one page whose assets are committed in the package (`exod/ui/`): no build step, no CDN.

The page is a client of the API like any other (it reads /nodes, /instances, /events and /diagrams, and
posts to /instances and /v1/chat/completions, with the key a person gives it). It holds no data itself,
so it is served without the key; the API behind it asks for the key as always. Its Content-Security-Policy
lets it load nothing from anywhere but this daemon.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

ASSETS = "/ui"  # where the page's script and style sheet are served
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def install(app: FastAPI, *, api_key: bool) -> None:
    """Serve the page at ``/`` and its assets under `ASSETS`; ``api_key``: the page asks for the key first."""
    page = (
        (files("exod") / "ui" / "index.html")
        .read_text(encoding="utf-8")
        .replace("{{auth}}", "key" if api_key else "none")
    )
    headers = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

    @app.get("/", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers=headers)

    app.mount(ASSETS, StaticFiles(packages=[("exod", "ui")]), name="ui")
