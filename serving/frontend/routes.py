"""HTTP routes: QA (/v1/qa, /v1/qa/batch, /v1/models), health (/healthz, /readyz, /metrics), admin.

Handlers are thin: validate settings-dependent limits (``validate_qa_inputs``), hand the pairs to
the engine, turn ``EngineError`` into a JSON error with its status (429 carries ``Retry-After``),
and watch for the client disconnecting so its queued work is cancelled. Every error body is
``{"error": code, "detail": reason}``. Admin routes need ``Authorization: Bearer <admin_token>``
(401 otherwise, and always 401 when no token is configured). With ``--api-key`` the QA routes need
``Authorization: Bearer <api_key>`` (``serving/frontend/access.py``, which also owns request ids and the access
log). Both tokens are checked before the body is read (``AdminRoute``, ``ApiKeyRoute``); a body the
JSON parser gives up on is a JSON decode error like any other (``serving/frontend/json_body.py``). The Open
Inference Protocol (v2) routes are ``serving/frontend/kserve_v2.py``, on ``answer_pairs``.

Status codes: 200; 400 invalid UTF-8; 401 admin auth or API key; 409 reload conflict (another
reload, another tokenizer); 413 body too large, more than max_windows_per_request windows, or more
windows than the deadline allows at the measured rate; 422 invalid input (types, missing fields,
empty text, limits, top_k range, a replica count over the device pool's cap); 429 queue full
(checked before tokenizing); 503 not ready / shutting down / replica failed; 504 deadline passed
before compute. Every 429 and 503 carries ``Retry-After``. Nothing unauthenticated (and no error
detail) shows file-system paths or worker tracebacks.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import PurePath
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request, Response, Security
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST

from models.config import ModelConfigError
from models.hf_weights import CheckpointError
from models.qa_processing import QAInputError, validate_qa_inputs
from serving.engine.qa_types import ClientGone, EngineError, PairResult, QAPair
from serving.fleet.model_loader import load_generation
from serving.frontend.access import ApiKeyRoute, Handler, check_first, note_windows, request_id_of
from serving.frontend.json_body import JsonBodyRoute
from serving.frontend.openapi import responses
from serving.frontend.schemas import (
    AnswerOut,
    ModelInfo,
    QABatchRequest,
    QABatchResponse,
    QAItem,
    QARequest,
    QAResponse,
    QAResult,
    ReloadRequest,
    ReplicasRequest,
)
from serving.redact import one_line

logger = logging.getLogger(__name__)

_ERRORS = responses(400, 408, 413, 415, 422, 429, 500, 503, 504)  # every status the QA routes answer

api_router = APIRouter(tags=["question answering"], route_class=ApiKeyRoute)
health_router = APIRouter(tags=["health"])


RETRY_AFTER_503_S = 1  # a 503 (starting, restarting, draining) says when to come back


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


def _disconnect_watcher(request: Request) -> Callable[[], Awaitable[None]]:
    async def disconnected() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return
            await asyncio.sleep(0.05)  # a server that keeps sending empty chunks: do not spin

    return disconnected


def _result(pr: PairResult) -> QAResult:
    p = pr.prediction
    answers = (
        []
        if p.no_answer
        else [AnswerOut(text=a.text, score=a.score, start=a.start, end=a.end) for a in p.answers]
    )
    diff = p.null_score_diff
    return QAResult(
        answers=answers,
        no_answer=p.no_answer,
        null_score_diff=diff if diff not in (float("inf"), float("-inf")) else None,
        windows=pr.windows,
    )


def _native_field(endpoint: str) -> Callable[[int, str], str]:
    return lambda i, field: f"items[{i}].{field}" if endpoint == "batch" else field


def _input_error(err: QAInputError, locate: Callable[[int, str], str]) -> str:
    """The 422 detail of a tokenizer-time ``QAInputError``, its field named by ``locate`` as the
    ``validate_qa_inputs`` errors are: ``items[1].context: yields no tokens``."""
    where = err.field if err.pair is None else locate(err.pair, err.field)
    return f"{where}: {err.reason}"


async def _answer(
    request: Request,
    endpoint: str,
    items: list[QAItem],
    timeout_s: float | None,
    *,
    locate: Callable[[int, str], str] | None = None,
) -> Any:
    """Shared path of /v1/qa and /v1/qa/batch: (results, model name, request id) or an error response.

    ``locate(i, field)`` names item ``i``'s field in a 422 (default: the native request's names)."""
    locate = locate or _native_field(endpoint)
    state = request.app.state
    settings = state.settings
    try:
        for i, it in enumerate(items):
            try:
                validate_qa_inputs(
                    it.question,
                    it.context,
                    top_k=it.top_k,
                    max_answer_length=it.max_answer_length,
                    max_context_chars=settings.max_context_chars,
                    max_question_chars=settings.max_question_chars,
                    null_threshold=it.null_threshold,
                )
            except QAInputError as err:
                return _error(422, "invalid_input", f"{locate(i, err.field)}: {err.reason}")
        if state.shutting_down or not hasattr(state, "engine"):
            return _error(
                503, "shutting_down" if state.shutting_down else "starting", "the server is not serving"
            )
        engine = state.engine
        pairs = [
            QAPair(it.question, it.context, it.top_k, it.max_answer_length, it.null_threshold) for it in items
        ]
        try:
            job = await engine.submit_async(pairs, timeout_s=timeout_s)
        except QAInputError as err:
            return _error(422, "invalid_input", _input_error(err, locate))
        except (TypeError, ValueError) as err:  # the tokenizer refused the text
            logger.info("tokenizer rejected a request: %s", err)
            return _error(422, "invalid_input", f"the text cannot be tokenized: {err}")
        results = await engine.wait(job, disconnected=_disconnect_watcher(request))
        note_windows(request, sum(r.windows for r in results))
        rid = request_id_of(request) or job.request_id  # the X-Request-ID (serving/frontend/access.py)
        logger.debug("request %s was engine job %s", rid, job.request_id)
        return results, settings.public_model_name(job.model_name), rid
    except EngineError as err:
        headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
        return _error(err.status, err.code, err.detail, headers)
    except ClientGone:
        return _error(499, "client_closed_request", "the client disconnected")


# the shared QA path, public for the Open Inference Protocol routes (serving/frontend/kserve_v2.py); requests
# are counted (shardserve_requests_total, latency) by serving.frontend.access.AccessMiddleware, every status
answer_pairs, pair_result = _answer, _result


@api_router.post("/v1/qa", response_model=QAResponse, responses=_ERRORS)
async def qa(body: QARequest, request: Request) -> Any:
    """Answer one question about one context (best ``top_k`` spans; ``context[start:end] == text``)."""
    t0 = time.perf_counter()
    out = await _answer(request, "qa", [body], body.timeout_s)
    if isinstance(out, Response):
        return out
    results, model, rid = out
    r = _result(results[0])
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
        out = await _answer(request, "batch", body.items, body.timeout_s)
    if isinstance(out, Response):
        return out
    results, model, rid = out
    return QABatchResponse(
        results=[_result(r) for r in results],
        model=model,
        request_id=rid,
        latency_ms=1000 * (time.perf_counter() - t0),
    )


@api_router.get("/v1/models", response_model=list[ModelInfo], responses=responses(503))
async def models(request: Request) -> Any:
    """The served model: name, checkpoint, partition plan, generation, replica gangs."""
    state = request.app.state
    if not hasattr(state, "manager"):
        return _error(503, "starting", "the server is starting")
    model = state.manager.model
    return [
        ModelInfo(
            model=state.settings.public_model_name(model.source.name),
            checkpoint=public_checkpoint(model.source.describe()),
            plan=model.plan().to_dict(),
            generation=model.generation,
            replicas=[public_replica(r) for r in state.manager.describe()],
        )
    ]


def public_checkpoint(described: dict[str, Any]) -> dict[str, Any]:
    """``ModelSource.describe()`` for unauthenticated clients: file names, never absolute paths."""
    out = dict(described)
    out["checkpoint"] = PurePath(str(described.get("checkpoint", ""))).name
    out["overlays"] = [PurePath(str(p)).name for p in described.get("overlays", [])]
    return out


def publish_model_info(state: Any, model: Any) -> None:
    """``shardserve_model_info`` names ``model`` (a ``ModelGeneration``) as clients see it: the served
    name (kept across reloads), the compute dtype, the partition. Called at startup and after a reload."""
    state.metrics.set_model_info(
        model=state.settings.public_model_name(model.source.name),
        precision=state.precision.name,
        pp=model.dims.pp,
        tp=model.dims.tp,
    )


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
    """200 only while at least one replica gang is loaded, warm and healthy, and not shutting down."""
    state = request.app.state
    manager = getattr(state, "manager", None)
    health = manager.health() if manager is not None else {"ready_replicas": 0, "starting_replicas": 0}
    if state.shutting_down:
        return _error(503, "shutting_down", health)
    if health["ready_replicas"] < 1:
        code = "failed" if health.get("fatal") else "not_ready"
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
    given = credentials.credentials.strip() if credentials is not None else ""
    if credentials is None or not hmac.compare_digest(given.encode(), token.encode()):
        raise HTTPException(
            401, {"error": "unauthorized", "detail": "missing or wrong bearer token"}, challenge
        )


class AdminRoute(JsonBodyRoute):
    """The admin token is checked before the body is read (``require_admin`` is also each route's
    dependency: it declares the bearer scheme in the OpenAPI document)."""

    def get_route_handler(self) -> Handler:
        return check_first(super().get_route_handler(), require_admin, _bearer)


admin_router = APIRouter(prefix="/admin", tags=["admin"], route_class=AdminRoute)


def _supervisor(request: Request) -> Any:
    sup = getattr(request.app.state, "supervisor", None)
    if sup is None:
        raise HTTPException(503, {"error": "starting", "detail": "the server is starting"})
    return sup


@admin_router.get("/replicas", dependencies=[Depends(require_admin)], responses=responses(401, 503))
async def get_replicas(request: Request) -> dict[str, Any]:
    """Replica gangs, target, autoscaling state and decision counts."""
    return _supervisor(request).describe()


@admin_router.post(
    "/replicas", dependencies=[Depends(require_admin)], responses=responses(400, 401, 408, 413, 415, 422, 503)
)
async def set_replicas(body: ReplicasRequest, request: Request) -> Any:
    """``{"replicas": n}`` pins the count (autoscaling pauses); ``{"min_replicas", "max_replicas"}`` resumes it."""
    sup = _supervisor(request)
    if body.replicas is not None:
        if body.min_replicas is not None or body.max_replicas is not None:
            return _error(422, "invalid_request", "give either replicas or min_replicas/max_replicas")
        try:
            sup.pin(body.replicas)
        except ValueError as err:  # over the device pool's cap
            return _error(422, "invalid_request", str(err))
    elif body.min_replicas is not None or body.max_replicas is not None:
        lo = body.min_replicas if body.min_replicas is not None else sup.config.min_replicas
        hi = body.max_replicas if body.max_replicas is not None else max(lo, sup.config.max_replicas)
        try:
            sup.set_bounds(lo, hi)
        except ValueError as err:
            return _error(422, "invalid_request", str(err))
    else:
        return _error(422, "invalid_request", "give replicas, or min_replicas and/or max_replicas")
    return sup.describe()


@admin_router.post(
    "/reload",
    dependencies=[Depends(require_admin)],
    responses=responses(400, 401, 408, 409, 413, 415, 422, 503),
)
async def reload(body: ReloadRequest, request: Request) -> Any:
    """Load another checkpoint into fresh gangs, switch traffic to them, drain the old ones."""
    from serving.fleet.replicas import ReloadError, ReloadInProgress

    state = request.app.state
    _supervisor(request)
    manager = state.manager
    current = manager.model
    try:
        model = await asyncio.to_thread(
            load_generation, state.settings, body.model, generation=current.generation + 1
        )
    except (ModelConfigError, CheckpointError, OSError) as err:
        # one answer whatever the reason (missing, a directory without a model, unreadable weights):
        # the reply must not map the server's file system; the log has the reason
        # the warning reaches the open status page: the model's base name only; the reason at INFO
        logger.warning("reload to model %r refused (the reason is logged at INFO)", PurePath(body.model).name)
        logger.info("reload to %r refused: %s", body.model, err)
        return _error(
            422,
            "invalid_model",
            f"{body.model!r} is not a loadable model (a registry name, or a model directory with "
            "config.json and weights the server can read); the server log has the reason",
        )
    except ValueError as err:  # the model loads but does not fit the settings (numbers, no paths)
        return _error(422, "invalid_model", f"{body.model!r}: {one_line(err)}")
    if model.tokenizer.get_vocab() != current.tokenizer.get_vocab():
        return _error(
            409,
            "tokenizer_mismatch",
            f"{body.model!r} has another tokenizer than {current.source.name!r}; restart instead",
        )
    try:
        await manager.reload(model)
    except ReloadInProgress as err:
        return _error(409, "reload_in_progress", str(err))
    except ReloadError as err:
        logger.error("reload to %r failed: %s", body.model, err)
        return _error(422, "reload_failed", one_line(err))
    publish_model_info(state, model)
    return {"model": model.source.name, "generation": model.generation, "replicas": manager.describe()}
