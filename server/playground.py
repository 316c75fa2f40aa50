"""The browser side: the playground at `/` with its KV-map API, and offline `/docs`, `/redoc`.

Every asset ships in the package (server/static/ and fastapi-offline's Swagger UI and ReDoc
bundles), so nothing is fetched from a CDN: the pages work on a machine with no internet.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

from engine.kv_view import KVView
from server.kv_api import build_kv_router

STATIC_DIR = Path(__file__).parent / "static"
DOCS_ASSETS = "/docs-assets"


def install_playground(app: FastAPI, kv_view: KVView) -> None:
    """GET / (the page), /playground/* (its script and styles), /kv/snapshot, /kv/stream."""
    index = STATIC_DIR / "index.html"

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(index, media_type="text/html")

    app.mount("/playground", StaticFiles(directory=STATIC_DIR), name="playground")
    app.include_router(build_kv_router(kv_view))


def install_offline_docs(app: FastAPI) -> None:
    """Swagger UI at /docs and ReDoc at /redoc from local files (build the app with
    docs_url=None, redoc_url=None so FastAPI's CDN-backed pages are not registered)."""
    assets = Path(str(files("fastapi_offline") / "static"))
    app.mount(DOCS_ASSETS, StaticFiles(directory=assets), name="docs-assets")
    title = f"{app.title} API"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url,
            title=title,
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},  # the validator badge is remote
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=app.openapi_url,
            title=title,
            redoc_js_url=f"{DOCS_ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{DOCS_ASSETS}/favicon.png",
            with_google_fonts=False,
        )
