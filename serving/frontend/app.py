"""The FastAPI application factory: ``build_app(settings)`` + lifespan + ``app.state`` (vLLM style).

Nothing heavy happens at import or in ``build_app``: the lifespan resolves the model and loads the
tokenizer, then has the engine room assemble the served models from the settings' configs in one
call (``build_models``, ``serving/engine/builder.py``: the device pool, the placement, the model
repository with ``build_engine`` as its engine factory), gives the QA routes their clients
(``LocalClients``, ``serving/engine/client.py``) and starts the gangs in the background (so /healthz answers at once and /readyz turns 200 when a gang is
warm). On shutdown it refuses new work, drains admitted requests (``drain_timeout_s``), then stops
the gangs (``Engine.shutdown``).

``AccessMiddleware`` (``serving/frontend/http/access.py``, outermost) gives each request its ``X-Request-ID`` and
writes the access log; routes under /v1 and /v2/models (but model readiness, a health route) need
``--api-key`` when one is set; the Open Inference Protocol (KServe v2) routes are ``serving/frontend/v2/routes.py``.

``RequestGuard`` (a pure ASGI middleware) checks every request body BEFORE FastAPI parses it:
``Content-Length`` / streamed size over ``max_body_bytes`` -> 413, invalid UTF-8 -> 400; a gzip or
deflate ``Content-Encoding`` is inflated (within ``max_body_bytes``), another is a 415.

Paths match exactly: Starlette's ``redirect_slashes`` is off here and in the mounted ``/ui`` app
(``no_slash_redirects``), so ``/v1/qa/`` is a 404, not a 307 to a ``Location`` built from the
request's ``Host`` header (an open redirect).

    uvicorn.run(build_app(ServeSettings(model="tiny-bert")))        # or: shardserve serve
    build_app(settings, backend_factory=fake)                        # tests: fake gangs in-process

The status page (``/``), its JSON (``GET /ui/status``) and the offline ``/docs`` / ``/redoc`` are
``serving/frontend/status/pages.py``.

``app.state``: settings, metrics, status (``shardserve.serving.frontend.status.board.StatusBoard``), and after startup
``models`` (the ``ModelRepository``: each served model's engine, the front end's one handle on the
fleet) and, for tests and the CLI, the default model's engine, manager and supervisor;
``shutting_down`` flips when SIGTERM arrives (readiness -> 503).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Mount

from shardserve import __version__
from shardserve.partitioner.compiled import resolve_compile
from shardserve.partitioner.precision import DtypeChoice
from shardserve.serving.engine.builder import BackendFactory, ModelGeneration, build_models
from shardserve.serving.engine.client import LocalClients
from shardserve.serving.engine.core_client import MetricsRelay
from shardserve.serving.engine.core_server import CoreServer
from shardserve.serving.frontend.api_role import CoreLink, ForwardToCore, api_lifespan
from shardserve.serving.frontend.http import content_encoding
from shardserve.serving.frontend.http.access import AccessMiddleware, include_protected
from shardserve.serving.frontend.http.openapi import RETRY_AFTER_503_S, allowed_methods, install_openapi
from shardserve.serving.frontend.layout import fit_serve_layout, serve_precision
from shardserve.serving.frontend.qa_call import client_limits
from shardserve.serving.frontend.rest.routes import admin_router, api_router, health_router
from shardserve.serving.frontend.settings import ServeSettings
from shardserve.serving.frontend.status.board import StatusBoard
from shardserve.serving.frontend.status.pages import install_pages
from shardserve.serving.frontend.v2 import binary as v2_binary
from shardserve.serving.frontend.v2 import model_config as v2_model_config
from shardserve.serving.frontend.v2 import repository as v2_repository
from shardserve.serving.frontend.v2 import routes as v2_routes
from shardserve.serving.frontend.v2.statistics import router as statistics_router
from shardserve.serving.metrics import ServingMetrics

logger = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: ServeSettings = app.state.settings
    precision: DtypeChoice = app.state.precision
    models, pool = build_models(
        fleet=settings.fleet_config(dtype=precision.name, compile=app.state.compile),
        scheduler=settings.scheduler_config(),
        autoscaling=settings.autoscaling_config(),
        placement=settings.placement_config(dtype=precision.name),
        metrics=app.state.metrics,
        max_request_timeout_s=settings.max_request_timeout_s,
        root=Path(settings.model_repository).expanduser() if settings.model_repository else None,
        drain_timeout_s=settings.drain_timeout_s,
        ready_timeout_s=settings.gang_start_timeout_s,
        backend_factory=app.state.backend_factory,
    )
    app.state.models, placed = models, models.placement
    app.state.clients = LocalClients(models, limits=client_limits(settings))  # the QA routes' way in
    # the engines start their loops and supervisors (which start the gangs in the background)
    await models.start(settings.models(), preloaded=app.state.preloaded_models)
    app.state.preloaded_models = {}
    # the default model's engine and fleet parts, for tests and the CLI's start-up line
    if (engine := next(iter(models.engines()), None)) is not None:
        app.state.engine, app.state.manager, app.state.supervisor = engine, engine.manager, engine.supervisor
    await app.state.status.start()  # samples the metrics registry for the status page
    logger.info(
        "serving %s (%s) in %s (%s), compile %s, replicas %s%s x %d thread(s) per rank, pool %d slots",
        ", ".join(f"{e.name}={e.model.source.name}" for e in models.engines()) or "no model",
        f"placement {placed.groups.placement.describe()}"
        if placed
        else f"pp={settings.pp}, tp={settings.tp}",
        precision.name,
        precision.reason,
        "on" if app.state.compile else "off",
        settings.replica_bounds,
        " (auto-sized to the machine)" if settings.auto_sized else "",
        settings.rank_threads,
        pool.capacity,
    )
    freeze_startup_heap()
    grpc_front = core = None
    try:
        if settings.api_worker_count > 1:  # this process is the core of N API processes
            core, app.state.api_pool = await start_api_core(app)
        if settings.grpc_port is not None:  # KServe v2 / Triton gRPC beside REST, on this event loop
            from shardserve.serving.frontend.grpc.server import GrpcFront

            # the core of API processes: they serve the port, this only their forwarded RPCs
            internal = None if core is None else core.grpc_address
            grpc_front = await GrpcFront.start(
                app, host=settings.host, port=settings.grpc_port, address=internal
            )
            app.state.grpc_port = grpc_front.port if core is None else settings.grpc_port
        yield
    finally:
        release_startup_heap()
        app.state.shutting_down = True
        # gRPC refuses new calls at once; those in flight are admitted requests the models' drain answers
        grpc_stopped = (
            asyncio.ensure_future(grpc_front.stop(grace_s=settings.drain_timeout_s + 1.0))
            if grpc_front is not None
            else None
        )
        # the drain's time runs from the signal (serve_cli's handler began the drain) or from now; the
        # gangs get what is left of it (none when stopping now or when no gang was ever ready)
        await models.shutdown(timeout_s=settings.drain_timeout_s)
        if grpc_stopped is not None:
            await grpc_stopped
        if app.state.api_pool is not None:  # the answers of the drain are out: the API processes stop
            await app.state.api_pool.stop()
        if core is not None:
            await core.stop()
        await app.state.status.stop()
        app.state.clients.shutdown()
        logger.info("shut down")


async def start_api_core(app: FastAPI) -> tuple[CoreServer, Any]:
    """The engine core's socket, and its API processes when the CLI gave ``app.state.api_pool_factory``
    (``serving/frontend/api_workers.py``; tests run API apps in-process instead: ``build_app(settings,
    core=CoreLink(...))``)."""
    state = app.state
    core = CoreServer(
        models=state.models, metrics=state.metrics, app=app, stopping=lambda: state.shutting_down
    )
    await core.start()
    state.core_server = core
    if state.api_pool_factory is None:
        return core, None
    pool = state.api_pool_factory(core)
    await pool.start()
    return core, pool


_frozen_apps = 0  # apps of this process whose start-up heap is frozen (tests run several at once)
_frozen_lock = threading.Lock()  # each TestClient runs its app's lifespan on a thread of its own


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (modules, tokenizer, FastAPI, torch: ~250k objects) to
    the garbage collector's permanent generation, so full collections scan only what serving made.

    A full (generation 2) collection of the start-up heap took 190-300 ms on the 2-core CI machine, on
    the event loop; the first burst of requests after start triggers one (its allocations promote
    objects into generation 2), and every request in flight then waited for it: the 429 tail of the
    overload test (docs/benchmarks.md). After ``gc.freeze()`` a full collection takes milliseconds.
    Only the process's first app freezes (a test process starts apps inside a serving one): freezing
    again would also freeze the garbage the inner apps left, which is never collected while any app
    serves. ``release_startup_heap`` undoes it when the process's last app stops.
    """
    global _frozen_apps
    with _frozen_lock:
        _frozen_apps += 1
        if _frozen_apps == 1:
            gc.freeze()  # O(1); no gc.collect() first: it costs the same ~300 ms and start-up leaves little garbage
    logger.debug("gc: %d start-up objects frozen", gc.get_freeze_count())


def release_startup_heap() -> None:
    """An app stopped: once no other app of this process runs, what start-up kept alive may be
    collected again (tests build many apps). Unfreezing while another app serves would hand its whole
    heap back to full collections: a 0.5-1.4 s pause under load in a test process late in the suite."""
    global _frozen_apps
    with _frozen_lock:
        _frozen_apps = max(0, _frozen_apps - 1)
        if _frozen_apps == 0:
            gc.unfreeze()


_BINARY_HEADER = v2_binary.HEADER.lower().encode()


class RequestGuard:
    """Reject oversized (413) and non-UTF-8 (400) bodies before any parsing, and bodies that do not
    arrive within ``body_timeout_s`` (408, connection closed: a stalled client cannot hold it);
    inflate a gzip / deflate body (``serving/frontend/http/content_encoding.py``, within the same limit); replay
    the rest. A body with binary tensor data (``serving/frontend/v2/binary.py``) is not text: its route
    checks its JSON part."""

    def __init__(self, app: Any, *, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                await _send_error(
                    scope, send, 400, "invalid_content_length", f"Content-Length {declared!r} is not a number"
                )
                return
            if n > limit:
                await _send_error(
                    scope, send, 413, "body_too_large", f"body of {n} bytes exceeds max_body_bytes={limit}"
                )
                return
        chunks, size = [], 0
        try:
            # one timer for the whole body (asyncio.wait_for per message costs each message a task and
            # two event-loop turns: under a burst that delayed every request, the 429s most)
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    chunk = msg.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        detail = f"body over {limit} bytes (max_body_bytes)"
                        await _send_error(scope, send, 413, "body_too_large", detail)
                        return
                    chunks.append(chunk)
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            detail = f"request body not received within {self.body_timeout_s:g} s ({size} bytes came)"
            await _send_error(scope, send, 408, "request_timeout", detail, close=True)
            return
        body = b"".join(chunks)
        headers = dict(scope["headers"])
        if (encoding := headers.get(b"content-encoding")) is not None:
            try:
                body = content_encoding.inflate(body, encoding.decode("latin-1"), limit=limit)
            except content_encoding.BodyEncodingError as err:
                await _send_error(scope, send, err.status, err.code, err.detail)
                return
            kept = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
            scope = {**scope, "headers": [*kept, (b"content-length", str(len(body)).encode())]}
        text = body if _BINARY_HEADER not in headers else b""  # its JSON part: the route checks it
        try:
            text.decode("utf-8")
        except UnicodeDecodeError as err:
            await _send_error(scope, send, 400, "invalid_utf8", v2_binary.utf8_problem(err))
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: http.disconnect (the engine watches for it)

        await self.app(scope, replay, send)


async def _send_error(
    scope: dict, send: Any, status: int, code: str, detail: str, *, close: bool = False
) -> None:
    """A JSON error answer in the shape of the path's API; ``close``: and the connection closes after
    it (the body was not read)."""
    payload = json.dumps(v2_routes.error_body(scope["path"], code, detail)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _validation_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's request validation as a ``ValidationErrorResponse`` (the shape of every 422)."""
    errors = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in exc.errors()
    ]
    detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors) or "invalid request"
    return JSONResponse({"error": "invalid_request", "detail": detail, "errors": errors}, status_code=422)


def _http_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    detail = exc.detail
    code = "http_error"
    if isinstance(detail, dict) and "error" in detail:
        code, detail = detail["error"], detail.get("detail")
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 503 and not any(k.lower() == "retry-after" for k in headers):
        headers["Retry-After"] = str(RETRY_AFTER_503_S)  # every 503 says when to come back
    if exc.status_code == 405:  # Starlette names only the first route of the path (GET of GET+POST)
        code = "method_not_allowed"
        headers["Allow"] = ", ".join(allowed_methods(request))
    return JSONResponse(
        v2_routes.error_body(request.url.path, code, detail),
        status_code=exc.status_code,
        headers=headers or None,
    )


def build_app(
    settings: ServeSettings | None = None,
    *,
    backend_factory: BackendFactory | None = None,
    models: Mapping[str, ModelGeneration] | None = None,
    core: CoreLink | None = None,
) -> FastAPI:
    """The server application; ``backend_factory`` replaces real gangs (tests); ``models``: generations
    already loaded by ``load_model``, by public name (the CLI checks the models before uvicorn starts);
    ``core``: the app of an API process of that core instead (``--api-workers``)."""
    settings = settings or ServeSettings()
    if core is not None:
        return _api_app(settings, core)
    if settings.auto_layout:  # pp/tp auto: the fewest ranks that fit (the CLI chose it already)
        settings, chosen = fit_serve_layout(settings)
        logger.info("%s", chosen)
    app = _fastapi(lifespan)
    app.state.settings = settings
    app.state.precision = serve_precision(settings)  # PrecisionError names the device
    app.state.compile = resolve_compile(settings.compile, device=settings.device, tp=settings.tp)
    app.state.metrics = ServingMetrics()
    app.state.status = StatusBoard(app.state.metrics)  # registry history for GET /ui/status
    app.state.backend_factory = backend_factory
    app.state.preloaded_models = dict(models or {})
    app.state.shutting_down = False
    app.state.api_pool_factory = None  # CoreServer -> ApiWorkerPool: set by the CLI (``--api-workers``)
    app.state.api_pool = None
    _install_routes(app, settings)
    return app


def _api_app(settings: ServeSettings, core: CoreLink) -> FastAPI:
    """The app of one API process (``serving/frontend/api_role.py``): the same routes, its models in
    the core; the routes off the hot path forwarded there."""
    app = _fastapi(api_lifespan)
    app.state.settings = settings
    app.state.core_link = core
    app.state.metrics = MetricsRelay(None)
    app.state.shutting_down = False
    app.add_middleware(ForwardToCore)
    _install_routes(app, settings)
    return app


def _fastapi(lifespan: Any) -> FastAPI:
    return FastAPI(
        title="shardserve",
        version=__version__,
        description="Model-parallel extractive question answering. Errors are JSON: {error, detail}.",
        lifespan=lifespan,
        docs_url=None,  # /docs and /redoc: serving/frontend/status/pages.py, with local assets (no CDN)
        redoc_url=None,
    )


def _install_routes(app: FastAPI, settings: ServeSettings) -> None:
    """The middleware, error handlers and routes every app of the server has."""
    app.add_middleware(
        RequestGuard, max_body_bytes=settings.max_body_bytes, body_timeout_s=settings.client_timeout_s
    )
    app.add_middleware(AccessMiddleware)  # outermost: request id + access log of every answer, 413s too
    app.add_exception_handler(RequestValidationError, _validation_handler)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_handler)  # type: ignore[arg-type]
    include_protected(app, api_router, settings=settings)  # behind --api-key when one is set
    app.include_router(health_router)
    app.include_router(admin_router)
    app.include_router(v2_routes.open_router)  # Open Inference Protocol: metadata + health (open)
    # Triton's statistics before the model routes: /v2/models/stats is not the metadata of a model "stats"
    include_protected(app, statistics_router, settings=settings, error_model=v2_routes.V2Error)
    include_protected(app, v2_routes.model_router, settings=settings, error_model=v2_routes.V2Error)
    include_protected(app, v2_model_config.router, settings=settings, error_model=v2_routes.V2Error)
    app.include_router(v2_repository.router)  # Triton's repository extension, behind the admin token
    install_pages(app)  # status page at /, GET /ui/status, offline /docs and /redoc
    install_openapi(app, settings)  # the document with the settings' limits (question length, ...)
    no_slash_redirects(app)


def no_slash_redirects(app: Starlette) -> None:
    """Turn Starlette's ``redirect_slashes`` off in ``app`` and in every application mounted in it
    (``/ui``): an unknown path with or without its trailing slash is a 404, never a redirect to a
    ``Location`` made of the request's ``Host`` header (module doc)."""
    app.router.redirect_slashes = False
    for route in app.router.routes:
        if isinstance(route, Mount) and isinstance(route.app, Starlette):
            no_slash_redirects(route.app)
