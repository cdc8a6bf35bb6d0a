"""The API's description of itself, /openapi.json and the Swagger UI at /docs, asking for the key like every route."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from exod.api import dashboard


def router(app: FastAPI) -> APIRouter:
    """The document of ``app``, and the page that reads it."""
    api = APIRouter()

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(  # Swagger UI served from the package (tools/vendor_swagger_ui.sh), not a CDN
            openapi_url="/openapi.json",
            title="exod API",
            swagger_js_url=f"{dashboard.ASSETS}/vendor/swagger-ui/swagger-ui-bundle.js",
            swagger_css_url=f"{dashboard.ASSETS}/vendor/swagger-ui/swagger-ui.css",
            swagger_favicon_url="data:,",
            swagger_ui_parameters={"validatorUrl": None},  # no badge fetched from validator.swagger.io
        )

    return api
