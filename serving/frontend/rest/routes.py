"""HTTP routes: QA (/v1/qa, /v1/qa/batch, /v1/models), health (/healthz, /readyz, /metrics), admin.

Handlers are thin: validate settings-dependent limits (``validate_qa_inputs``), hand the pairs to
the engine, turn ``EngineError`` into a JSON error with its status (429 carries ``Retry-After``),
and watch for the client disconnecting so its queued work is cancelled. Every error body is
``{"error": code, "detail": reason}``. Admin routes need ``Authorization: Bearer <admin_token>``
(401 otherwise, and always 401 when no token is configured). With ``--api-key`` the QA routes need
``Authorization: Bearer <api_key>`` (``serving/frontend/http/access.py``, which also owns request ids and the access
log). Both tokens are checked before the body is read (``AdminRoute``, ``ApiKeyRoute``); a body the
JSON parser gives up on is a JSON decode error like any other (``serving/frontend/http/json_body.py``). The Open
Inference Protocol (v2) routes are ``serving/frontend/v2/routes.py``; both protocols answer through
``shardserve.serving.engine.answer.answer_pairs`` (``serving/frontend/qa_call.py``), and reach the fleet (replicas, scaling, reload) only through
the engine's facade (``app.state.engine``).

Status codes: 200; 400 invalid UTF-8; 401 admin auth or API key; 409 reload conflict (another
reload, another tokenizer); 413 body too large, more than max_windows_per_request windows, or more
windows than the deadline allows at the measured rate; 422 invalid input (types, missing fields,
empty text, limits, top_k range, a replica count over the device pool's cap); 429 queue full
(checked before tokenizing); 503 not ready / shutting down / replica failed; 504 deadline passed
before compute. Every 429 and 503 carries ``Retry-After``. Nothing unauthenticated (and no error
detail) shows file-system paths or worker tracebacks.

    pytest tests/serving/frontend/rest/test_routes.py tests/serving/frontend/test_api*.py
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request, Response, Security
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST

from shardserve.serving.engine.core import Engine
from shardserve.serving.engine.qa_types import EngineError
from shardserve.serving.fleet.repository import ModelRepository
from shardserve.serving.frontend.http.access import (
    ApiKeyRoute,
    Handler,
    check_first,
    request_id_of,
    token_matches,
)
from shardserve.serving.frontend.http.json_body import JsonBodyRoute
from shardserve.serving.frontend.http.openapi import RETRY_AFTER_503_S, responses
from shardserve.serving.frontend.qa_call import answer_items
from shardserve.serving.frontend.schemas import (
    ModelInfo,
    QABatchRequest,
    QABatchResponse,
    QAItem,
    QARequest,
    QAResponse,
    ReloadRequest,
    ReplicasRequest,
    qa_result,
)
from shardserve.serving.redact import one_line

logger = logging.getLogger(__name__)

_ERRORS = responses(400, 404, 408, 413, 415, 422, 429, 500, 503, 504)  # every status the QA routes answer

api_router = APIRouter(tags=["question answering"], route_class=ApiKeyRoute)
health_router = APIRouter(tags=["health"])


def _error(status: int, code: str, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON error body; every 503 (and 429) carries ``Retry-After``; a 422 has the shape of
    ``ValidationErrorResponse`` (``errors`` is empty: the server's own checks name the field in
    ``detail``)."""
    if status in (429, 503) and not any(k.lower() == "retry-after" for k in headers or {}):
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_503_S)}
    body: dict[str, Any] = {"error": code, "detail": detail}
    if status == 422:
        body["errors"] = []
    return JSONResponse(body, status_code=status, headers=headers)


def _native_field(endpoint: str) -> Callable[[int, str], str]:
    return lambda i, field: f"items[{i}].{field}" if endpoint == "batch" else field


def _error_of(err: EngineError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return _error(err.status, err.code, err.detail, headers)


async def _answer(
    request: Request, endpoint: str, items: list[QAItem], timeout_s: float | None, model: str | None
) -> Any:
    """Shared path of /v1/qa and /v1/qa/batch: (results, model name, request id) or an error response.
    Requests are counted (shardserve_requests_total, latency) by ``AccessMiddleware``, every status."""
    try:
        answered = await answer_items(request, items, timeout_s, model=model, locate=_native_field(endpoint))
    except EngineError as err:
        return _error_of(err)
    rid = request_id_of(request) or answered.job_id  # the X-Request-ID (serving/frontend/http/access.py)
    logger.debug("request %s was engine job %s", rid, answered.job_id)
    return answered.results, answered.model_name, rid


@api_router.post("/v1/qa", response_model=QAResponse, responses=_ERRORS)
async def qa(body: QARequest, request: Request) -> Any:
    """Answer one question about one context (best ``top_k`` spans; ``context[start:end] == text``)."""
    t0 = time.perf_counter()
    out = await _answer(request, "qa", [body], body.timeout_s, body.model)
    if isinstance(out, Response):
        return out
    results, model, rid = out
    r = qa_result(results[0])
    return QAResponse(
        **r.model_dump(), model=model, request_id=rid, latency_ms=1000 * (time.perf_counter() - t0)
    )


@api_router.post("/v1/qa/batch", response_model=QABatchResponse, responses=_ERRORS)
async def qa_batch(body: QABatchRequest, request: Request) -> Any:
    """Answer many (question, context) pairs in one call; results in item order."""
    t0 = time.perf_counter()
    limit = request.app.state.settings.max_batch_items
    if len(body.items) > limit:
        out: Any = _error(422, "too_many_items", f"{len(body.items)} items, max_batch_items={limit}")
    else:
        out = await _answer(request, "batch", body.items, body.timeout_s, body.model)
    if isinstance(out, Response):
        return out
    results, model, rid = out
    return QABatchResponse(
        results=[qa_result(r) for r in results],
        model=model,
        request_id=rid,
        latency_ms=1000 * (time.perf_counter() - t0),
    )


@api_router.get("/v1/models", response_model=list[ModelInfo], responses=responses(503))
async def models(request: Request) -> Any:
    """The served models, the default first: name, checkpoint, partition plan, generation, replica gangs."""
    models: ModelRepository | None = getattr(request.app.state, "models", None)
    if models is None:
        return _error(503, "starting", "the server is starting")
    return [
        ModelInfo(
            model=engine.name,
            checkpoint=engine.public_checkpoint(),
            plan=engine.model.plan().to_dict(),
            generation=engine.model.generation,
            replicas=[public_replica(r) for r in engine.replicas()],
        )
        for engine in models.engines()
    ]


def public_replica(described: dict[str, Any]) -> dict[str, Any]:
    """A replica's description with its error cut to one path-free line."""
    err = described.get("error")
    return {**described, "error": one_line(err) if err else None}


@health_router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive (says nothing about replicas)."""
    return {"status": "alive"}


@health_router.get("/readyz", responses=responses(503))
async def readyz(request: Request) -> Any:
    """200 only while a model has a replica gang loaded, warm and healthy, every model asked for at
    start has answered once or failed, and the server is not shutting down; the detail is per model."""
    state = request.app.state
    models: ModelRepository | None = getattr(state, "models", None)
    health = {"ready_replicas": 0, "starting_replicas": 0} if models is None else models.health()
    if state.shutting_down:
        return _error(503, "shutting_down", health)
    if models is None or not models.ready():
        code = "failed" if models is not None and models.fatal_error() is not None else "not_ready"
        return _error(503, code, health)
    return {"status": "ready", **health}


@health_router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------------------------------- admin


_bearer = HTTPBearer(auto_error=False, description="the server's admin_token (401 when unset or wrong)")


def require_admin(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
) -> None:
    """Bearer-token check of every /admin route (401 when unset, missing or wrong); the OpenAPI
    document declares it as an HTTP bearer security scheme."""
    token = request.app.state.settings.admin_token
    challenge = {"WWW-Authenticate": "Bearer"}
    if not token:
        raise HTTPException(
            401, {"error": "admin_disabled", "detail": "no admin token is configured"}, challenge
        )
    if not token_matches(credentials.credentials if credentials is not None else None, token):
        raise HTTPException(
            401, {"error": "unauthorized", "detail": "missing or wrong bearer token"}, challenge
        )


class AdminRoute(JsonBodyRoute):
    """The admin token is checked before the body is read (``require_admin`` is also each route's
    dependency: it declares the bearer scheme in the OpenAPI document)."""

    def get_route_handler(self) -> Handler:
        return check_first(super().get_route_handler(), require_admin, _bearer)


admin_router = APIRouter(prefix="/admin", tags=["admin"], route_class=AdminRoute)


def _engine(request: Request, name: str | None) -> Engine:
    """The engine of model ``name`` (None: the default); 503 while starting, 404 / 503 for a model
    not served."""
    models: ModelRepository | None = getattr(request.app.state, "models", None)
    if models is None:
        raise HTTPException(503, {"error": "starting", "detail": "the server is starting"})
    try:
        return models.engine(name)
    except EngineError as err:
        raise HTTPException(err.status, {"error": err.code, "detail": err.detail}) from err


@admin_router.get("/replicas", dependencies=[Depends(require_admin)], responses=responses(401, 404, 503))
async def get_replicas(request: Request, model: str | None = None) -> dict[str, Any]:
    """Replica gangs, target, autoscaling state and decision counts of ``?model=`` (default: the first)."""
    return _engine(request, model).scaling()


@admin_router.post(
    "/replicas",
    dependencies=[Depends(require_admin)],
    responses=responses(400, 401, 404, 408, 413, 415, 422, 503),
)
async def set_replicas(body: ReplicasRequest, request: Request, model: str | None = None) -> Any:
    """``{"replicas": n}`` pins the count (autoscaling pauses); ``{"min_replicas", "max_replicas"}`` resumes
    it; of the model ``?model=`` (default: the first)."""
    engine = _engine(request, model)
    try:
        if body.replicas is not None:
            if body.min_replicas is not None or body.max_replicas is not None:
                return _error(422, "invalid_request", "give either replicas or min_replicas/max_replicas")
            engine.pin(body.replicas)
        elif body.min_replicas is not None or body.max_replicas is not None:
            engine.set_bounds(min_replicas=body.min_replicas, max_replicas=body.max_replicas)
        else:
            return _error(422, "invalid_request", "give replicas, or min_replicas and/or max_replicas")
    except ValueError as err:  # over the device pool's cap, bounds out of order
        return _error(422, "invalid_request", str(err))
    return engine.scaling()


@admin_router.post(
    "/reload",
    dependencies=[Depends(require_admin)],
    responses=responses(400, 401, 404, 408, 409, 413, 415, 422, 503),
)
async def reload(body: ReloadRequest, request: Request) -> Any:
    """Load another checkpoint into fresh gangs of model ``name`` (default: the first), switch its
    traffic to them, drain the old ones; the other models are not touched."""
    engine = _engine(request, body.name)
    try:
        model = await engine.reload(body.model)
    except EngineError as err:
        return _error_of(err)
    return {"model": model.source.name, "generation": model.generation, "replicas": engine.replicas()}
