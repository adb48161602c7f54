"""Open Inference Protocol (KServe v2) REST routes, next to the native API, on the same engine path.

Spec: github.com/kserve/open-inference-protocol (``inference_rest.md``). Routes:

    GET  /v2                          server metadata {name, version, extensions}       open
    GET  /v2/health/live              {"live": true}                                    open
    GET  /v2/health/ready             200 {"ready": true} | 400 {"ready": false}         open
    GET  /v2/models/{name}            model metadata {name, platform, inputs, outputs}  API key
    GET  /v2/models/{name}/ready      200 {"name", "ready": true} | 400 ready false     open
    GET  /v2/models/{name}/config     Triton's model configuration (model_config.py)    API key
    GET  /v2/models/{name}/stats      Triton's statistics (statistics.py)               API key
    POST /v2/models/{name}/infer      inference                                         API key

Health answers follow the spec: 200 is true, a 4xx (400) is false. The spec files model readiness
under its health API and KServe probes (and Triton users) poll it, so like ``/v2/health/*`` it stays
open when ``--api-key`` is set: it tells no more than the open ``/ui/status`` and ``/metrics``
(the served name, ready or not). The model is unversioned: no
``versions`` in its metadata, no ``model_version`` in answers, no ``/versions/<v>`` routes. ``name``
is the served model name (``--served-model-name``, else the loaded model's); another name is a 404.

Inference: inputs ``question`` and ``context`` (BYTES, shape [N] or [N, 1]), request ``parameters``
(``top_k``, ``max_answer_length``, ``null_threshold``, ``timeout_s`` or Triton's ``timeout``) and the
outputs ``answer``, ``score``, ``start``, ``end``, ``no_answer``: ``serving/frontend/v2/tensors.py``,
which gRPC shares. The response ``id`` is the request's ``id``, else the request id (``X-Request-ID``).

The binary tensor data extension (``serving/frontend/v2/binary.py``; listed in the server metadata) takes
inputs as binary data and returns outputs so (``binary_data`` per output, ``binary_data_output``
for all): what Triton's clients (``tritonclient.http``) do by default.

The pairs go through ``shardserve.serving.engine.answer.answer_pairs`` (``serving/frontend/qa_call.py``), the path of /v1/qa/batch: same admission
(429 with Retry-After), limits, deadlines and metrics (endpoint label ``v2_infer``). Errors are the
spec's ``{"error": "<message>"}``: 400 for a bad request (a tensor's name, shape, datatype or data, a
parameter, request validation, a text limit), 401 API key, 404 unknown model, 413 too many windows,
429 queue full, 503 not ready (both with Retry-After), 504 deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardserve import __version__
from shardserve.serving.engine.core import Engine
from shardserve.serving.engine.qa_types import EngineError
from shardserve.serving.fleet.repository import ModelRepository
from shardserve.serving.frontend.http.access import ApiKeyRoute, request_id_of
from shardserve.serving.frontend.http.openapi import RETRY_AFTER_503_S
from shardserve.serving.frontend.qa_call import answer_items
from shardserve.serving.frontend.schemas import qa_result
from shardserve.serving.frontend.v2 import binary as v2_binary
from shardserve.serving.frontend.v2.tensors import (
    INPUTS,
    OUTPUT_TYPES,
    V2InferenceRequest,
    V2InputError,
    V2ResponseOutput,
    parse_call,
    v2_field,
)

logger = logging.getLogger(__name__)

PLATFORM = "pytorch_shardserve"
EXTENSIONS = ["binary_tensor_data", "model_repository", "model_configuration", "statistics"]


# ------------------------------------------------------------------------------------------ schemas


class V2Error(BaseModel):
    """Every error of the v2 routes (the spec's error object)."""

    error: str = Field(description="what went wrong")


class V2ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class V2TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1: a variable-size dimension")


class V2ModelMetadata(BaseModel):
    name: str
    platform: str
    inputs: list[V2TensorMetadata]
    outputs: list[V2TensorMetadata]


class V2Live(BaseModel):
    live: bool


class V2Ready(BaseModel):
    ready: bool


class V2ModelReady(BaseModel):
    name: str
    ready: bool


class V2InferenceResponse(BaseModel):
    model_name: str
    id: str
    outputs: list[V2ResponseOutput]


MODEL_INPUTS = [V2TensorMetadata(name=n, datatype="BYTES", shape=[-1]) for n in INPUTS]
MODEL_OUTPUTS = [
    V2TensorMetadata(name=n, datatype=t, shape=[-1] if n == "no_answer" else [-1, -1])
    for n, t in OUTPUT_TYPES.items()
]


# ------------------------------------------------------------------------------------------ errors


def is_v2_path(path: str) -> bool:
    """Whether ``path`` is under the protocol's ``/v2``: its errors are ``{"error": message}``."""
    return path == "/v2" or path.startswith("/v2/")


def error_body(path: str, code: str, detail: Any) -> dict[str, Any]:
    """An error answered outside the routes (the body guard, routing's 404 / 405) in the shape of
    ``path``'s API: ``{"error": "code: detail"}`` under /v2, else ``{"error": code, "detail": ...}``."""
    return {"error": f"{code}: {detail}"} if is_v2_path(path) else {"error": code, "detail": detail}


def v2_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """``{"error": message}``; every 429 and 503 carries ``Retry-After``."""
    if status in (429, 503) and not any(k.lower() == "retry-after" for k in headers or {}):
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_503_S)}
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _engine_error(err: EngineError) -> JSONResponse:
    """An engine's refusal as the v2 error object ``{"error": "code: detail"}`` (422 -> 400)."""
    retry = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return v2_error(400 if err.status == 422 else err.status, f"{err.code}: {err.detail}", retry)


def _validation_message(exc: RequestValidationError) -> str:
    parts = [f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}" for e in exc.errors()]
    return "; ".join(parts) or "invalid request"


class V2Route(APIRoute):
    """Answers request validation (400) and HTTP errors (e.g. the API key's 401) as ``{"error": ...}``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def v2_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return v2_error(400, _validation_message(exc))
            except StarletteHTTPException as exc:
                detail = exc.detail
                if isinstance(detail, dict):
                    detail = f"{detail.get('error')}: {detail.get('detail')}"
                return v2_error(exc.status_code, str(detail), dict(exc.headers or {}))

        return v2_handler


def v2_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a v2 route: each status with its meaning, as ``V2Error``."""
    described = {
        400: "bad request: a tensor's name, shape, datatype or data, a parameter, a text limit; a model "
        "that cannot be loaded",
        401: "the token (Authorization: Bearer) is missing or wrong",
        404: "no model of that name",
        409: "a load or unload of that model is under way",
        408: "the request body did not arrive within client_timeout_s (the connection is closed)",
        413: "body larger than max_body_bytes, or more windows than max_windows_per_request / the deadline",
        415: "a Content-Type other than JSON (none is read as JSON; octet-stream with binary data), "
        "or a Content-Encoding other than gzip / deflate",
        429: "queue full (see Retry-After)",
        500: "span decoding failed (a server bug; the log has it)",
        503: "not ready, starting, shutting down, replica failed, or the model not served now (see Retry-After)",
        504: "deadline passed before the request was computed",
    }
    retry = {"Retry-After": {"required": True, "schema": {"type": "integer", "minimum": 0}}}
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": V2Error, "description": described[status]}
        if status in (429, 503):
            entry["headers"] = retry
        out[status] = entry
    return out


class V2ModelRoute(V2Route, ApiKeyRoute, v2_binary.BinaryTensorRoute):
    """A model route: the API key checked before the body (``ApiKeyRoute``), its 401 as ``{"error": ...}``;
    a body may carry binary tensor data (``BinaryTensorRoute``)."""


open_router = APIRouter(tags=["open inference protocol (v2)"], route_class=V2Route)
model_router = APIRouter(tags=["open inference protocol (v2)"], route_class=V2ModelRoute)


# ------------------------------------------------------------------------------------------ helpers


def _is_ready(request: Request) -> bool:
    """The server is ready (``ModelRepository.ready``) and not shutting down."""
    state = request.app.state
    models: ModelRepository | None = getattr(state, "models", None)
    return models is not None and not state.shutting_down and models.ready()


def model_engine(request: Request, model_name: str) -> Engine | JSONResponse:
    """The engine of ``model_name``, or the v2 error: 503 while starting, 404 unknown, 503 not served now."""
    models: ModelRepository | None = getattr(request.app.state, "models", None)
    if models is None:
        return v2_error(503, "the server is starting")
    try:
        return models.engine(model_name)
    except EngineError as err:
        return _engine_error(err)


# ------------------------------------------------------------------------------------------ routes


@open_router.get("/v2", response_model=V2ServerMetadata)
async def server_metadata() -> V2ServerMetadata:
    """Server metadata: name, version, extensions. Open, like the health routes."""
    return V2ServerMetadata(name="shardserve", version=__version__, extensions=EXTENSIONS)


@open_router.get("/v2/health/live", response_model=V2Live)
async def server_live() -> V2Live:
    """The server can answer requests (the process is alive)."""
    return V2Live(live=True)


@open_router.get(
    "/v2/health/ready",
    response_model=V2Ready,
    responses={400: {"model": V2Ready, "description": "not ready (the spec: a 4xx status is false)"}},
)
async def server_ready(request: Request) -> Any:
    """200 while at least one replica gang is ready and the server is not shutting down, else 400."""
    ready = _is_ready(request)
    return JSONResponse({"ready": ready}, status_code=200 if ready else 400)


@model_router.get("/v2/models/{model_name}", response_model=V2ModelMetadata, responses=v2_responses(404, 503))
async def model_metadata(model_name: str, request: Request) -> Any:
    """The model's inputs (question, context: BYTES [N]) and outputs (answer, score, start, end, no_answer)."""
    engine = model_engine(request, model_name)
    if isinstance(engine, JSONResponse):
        return engine
    return V2ModelMetadata(name=model_name, platform=PLATFORM, inputs=MODEL_INPUTS, outputs=MODEL_OUTPUTS)


@open_router.get(
    "/v2/models/{model_name}/ready",
    response_model=V2ModelReady,
    responses={
        400: {"model": V2ModelReady, "description": "not ready (the spec: a 4xx status is false)"},
        **v2_responses(404, 503),
    },
)
async def model_ready(model_name: str, request: Request) -> Any:
    """200 {"name", "ready": true} while the model can answer, else 400 with ready false (404: a model
    the server does not know)."""
    models: ModelRepository | None = getattr(request.app.state, "models", None)
    if models is None:
        return v2_error(503, "the server is starting")
    try:
        ready = models.model_ready(model_name) and not request.app.state.shutting_down
    except EngineError as err:
        return _engine_error(err)
    return JSONResponse({"name": model_name, "ready": ready}, status_code=200 if ready else 400)


@model_router.post(
    "/v2/models/{model_name}/infer",
    response_model=V2InferenceResponse,
    response_model_exclude_none=True,
    responses={
        200: {
            "description": "the outputs; with binary outputs, application/octet-stream: the JSON "
            "(Inference-Header-Content-Length bytes), then the outputs' data",
            "content": {v2_binary.BINARY_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        },
        **v2_responses(400, 404, 408, 413, 415, 429, 500, 503, 504),
    },
)
async def infer(model_name: str, body: V2InferenceRequest, request: Request) -> Any:
    """Answer N (question, context) pairs: BYTES inputs in, answer/score/start/end/no_answer out.
    Inputs and outputs may travel as binary data after the JSON (header ``Inference-Header-Content-Length``:
    the binary tensor data extension; such a response is ``application/octet-stream``)."""
    return await _infer(model_name, body, request)


async def _infer(model_name: str, body: V2InferenceRequest, request: Request) -> Any:
    request.state.model = model_name  # the access log's and the metrics' model, 4xx too
    engine = model_engine(request, model_name)
    if isinstance(engine, JSONResponse):
        return engine
    try:
        call = parse_call(
            body, request.state.v2_binary, max_batch_items=request.app.state.settings.max_batch_items
        )
    except V2InputError as err:
        return v2_error(400, str(err))
    try:
        answered = await answer_items(request, call.items, call.timeout_s, model=engine.name, locate=v2_field)
    except EngineError as err:
        return _engine_error(err)
    outputs = call.encode([qa_result(r) for r in answered.results])
    response = V2InferenceResponse(
        model_name=answered.model_name,
        id=body.id if body.id is not None else request_id_of(request) or "",
        outputs=outputs,
    )
    binary = [o for o, (_, as_binary) in zip(outputs, call.outputs, strict=True) if as_binary]
    if not binary:
        return response
    data = [v2_binary.encode(o.datatype, o.data or []) for o in binary]
    for o, blob in zip(binary, data, strict=True):
        o.data, o.parameters = None, {"binary_data_size": len(blob)}
    return v2_binary.binary_response(response.model_dump(exclude_none=True), data)
