"""The browser side: the playground at `/` with its KV-map API, and offline `/docs`, `/redoc`.

Every asset ships in the package (server/static/ and fastapi-offline's Swagger UI and ReDoc
bundles), so nothing is fetched from a CDN: the pages work on a machine with no internet.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from engine.core.kv_view import KVView
from server.kv_api import build_kv_router

STATIC_DIR = Path(__file__).parent / "static"
DOCS_ASSETS = "/docs-assets"
# ReDoc's bundle draws its vendor's logo from a CDN; an inline blank image keeps it offline.
_REDOC_REMOTE_LOGO = b'"https://cdn.redoc.ly/redoc/logo-mini.svg"'
_BLANK_SVG = b"\"data:image/svg+xml,%3Csvg xmlns='http://www.w3.org/2000/svg'/%3E\""


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
    redoc_js = (assets / "redoc.standalone.js").read_bytes().replace(_REDOC_REMOTE_LOGO, _BLANK_SVG)
    title = f"{app.title} API"

    @app.get(f"{DOCS_ASSETS}/redoc.standalone.js", include_in_schema=False)
    async def redoc_bundle() -> Response:  # registered before the mount, so it wins
        return Response(redoc_js, media_type="text/javascript")

    app.mount(DOCS_ASSETS, StaticFiles(directory=assets), name="docs-assets")

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
