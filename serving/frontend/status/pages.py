"""Browser pages, served by the package itself (no CDN, no build step, works offline).

- ``GET /``: the status page + QA playground (``serving/frontend/status/ui/index.html``); it polls
  ``GET /ui/status`` and asks questions through ``POST /v1/qa`` (with the API key typed into the
  page when the server has ``--api-key``). Sent with a ``Content-Security-Policy`` that allows the
  page's own origin only.
- ``/ui``: a small FastAPI application of its own, mounted on the server (the page's component):
  ``GET /ui/status`` (the JSON the page polls, ``shardserve.serving.frontend.status.board.collect_status``), documented in
  ``/ui/openapi.json``; ``/ui/static/`` (the page's ``app.js`` / ``app.css``) and ``/ui/vendor/``
  (Swagger UI and ReDoc from the PyPI package ``fastapi-offline``). ``/ui/status`` is open like
  ``/metrics`` and ``/readyz``: counts, the plan, replica states, path-free error lines, no request
  content. Errors are the server's JSON ``{error, detail}`` (the server's exception handlers).
- ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) of the server's API with those local assets;
  ``build_app`` turns FastAPI's CDN-based pages off (``docs_url=None, redoc_url=None``). ReDoc's own
  Redocly logo (a CDN image in every ReDoc 2.x) is kept off the network by the page's CSP.

    install_pages(app)     # in build_app, after the API routers and exception handlers
"""

from __future__ import annotations

import logging
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from shardserve.serving.frontend.status.board import collect_status
from shardserve.serving.frontend.status.schemas import StatusResponse

logger = logging.getLogger(__name__)

UI_DIR = Path(__file__).parent / "ui"
VENDOR_DIR = Path(str(files("fastapi_offline") / "static"))  # swagger-ui-bundle.js, redoc.standalone.js
PAGE_CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'self'; form-action 'self'"
)
# ReDoc 2.x always shows a Redocly logo loaded from its CDN: this policy keeps the browser from
# fetching it (the logo hides itself); ReDoc injects its styles and runs its search in a blob worker
REDOC_CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; script-src 'self'; "
    "worker-src 'self' blob:; connect-src 'self'; frame-ancestors 'none'; base-uri 'self'"
)


def status_app(server: FastAPI) -> FastAPI:
    """The /ui application: ``GET /status`` of ``server``, the page's files and the docs' assets."""
    ui = FastAPI(
        title="shardserve status page",
        version=server.version,
        description="The JSON the status page at / polls. Every rate and percentile is read from the "
        "same Prometheus registry as /metrics; a number the server does not measure is null.",
        docs_url=None,
        redoc_url=None,
    )
    ui.state.server = server
    router = APIRouter(tags=["status"])
    router.add_api_route("/status", _status, methods=["GET"], response_model=StatusResponse)
    ui.include_router(router)
    ui.mount("/static", StaticFiles(directory=UI_DIR), name="static")
    ui.mount("/vendor", StaticFiles(directory=VENDOR_DIR), name="vendor")
    ui.exception_handlers.update(server.exception_handlers)  # the same JSON errors as the server
    return ui


# The endpoints are module-level functions that find their app on the request: FastAPI caches what it
# learns of each endpoint in module-level LRU caches (4096 entries), so an endpoint that closed over
# its app would keep every app built in the process alive (35 MB each: a test process grew to 7 GB).
async def _status(request: Request) -> StatusResponse:
    """Model, precision and partition plan; replica gangs; queue, throughput and latency
    percentiles over the last minute and five minutes; per-stage busy time and pipeline bubble;
    the autoscaler's target and last decisions; recent errors."""
    return collect_status(request.app.state.server)


def _root(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def install_pages(app: FastAPI) -> None:
    """Add the page at /, the /ui application, and the offline /docs and /redoc."""
    app.mount("/ui", status_app(app), name="ui")
    app.add_api_route("/", _page, include_in_schema=False)
    app.add_api_route("/docs", _swagger, include_in_schema=False)
    app.add_api_route("/docs/oauth2-redirect", _swagger_redirect, include_in_schema=False)
    app.add_api_route("/redoc", _redoc, include_in_schema=False)


async def _page() -> HTMLResponse:
    return HTMLResponse(
        (UI_DIR / "index.html").read_text(encoding="utf-8"),
        headers={"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-cache"},
    )


def _openapi_url(request: Request) -> str:
    return _root(request) + (request.app.openapi_url or "/openapi.json")


async def _swagger(request: Request) -> HTMLResponse:
    root = _root(request)
    return get_swagger_ui_html(
        openapi_url=_openapi_url(request),
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=f"{root}/ui/vendor/swagger-ui-bundle.js",
        swagger_css_url=f"{root}/ui/vendor/swagger-ui.css",
        swagger_favicon_url=f"{root}/ui/vendor/favicon.png",
        oauth2_redirect_url=f"{root}/docs/oauth2-redirect",
        swagger_ui_parameters={"validatorUrl": None},  # no call to the public validator
    )


async def _swagger_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


async def _redoc(request: Request) -> HTMLResponse:
    root = _root(request)
    response = get_redoc_html(
        openapi_url=_openapi_url(request),
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{root}/ui/vendor/redoc.standalone.js",
        redoc_favicon_url=f"{root}/ui/vendor/favicon.png",
        with_google_fonts=False,
    )
    response.headers["Content-Security-Policy"] = REDOC_CSP
    return response
