"""Open Inference Protocol (KServe v2) REST routes, next to the native API, on the same engine path.

Spec: github.com/kserve/open-inference-protocol (``inference_rest.md``). Routes:

    GET  /v2                          server metadata {name, version, extensions}       open
    GET  /v2/health/live              {"live": true}                                    open
    GET  /v2/health/ready             200 {"ready": true} | 400 {"ready": false}         open
    GET  /v2/models/{name}            model metadata {name, platform, inputs, outputs}  API key
    GET  /v2/models/{name}/ready      200 {"name", "ready": true} | 400 ready false     open
    GET  /v2/models/{name}/config     Triton's model configuration (v2_model_config.py)  API key
    POST /v2/models/{name}/infer      inference                                         API key

Health answers follow the spec: 200 is true, a 4xx (400) is false. The spec files model readiness
under its health API and KServe probes (and Triton users) poll it, so like ``/v2/health/*`` it stays
open when ``--api-key`` is set: it tells no more than the open ``/ui/status`` and ``/metrics``
(the served name, ready or not). The model is unversioned: no
``versions`` in its metadata, no ``model_version`` in answers, no ``/versions/<v>`` routes. ``name``
is the served model name (``--served-model-name``, else the loaded model's); another name is a 404.

Inference: inputs ``question`` and ``context``, datatype ``BYTES`` (JSON strings), shape ``[N]`` or
``[N, 1]`` (data flat, or nested as the shape, row-major), N pairs; a duplicate input or output is a
400. Request ``parameters`` (all optional): ``top_k`` (K, default 1), ``max_answer_length``,
``null_threshold``, ``timeout_s`` - the fields of the native ``/v1/qa/batch``, with its limits -
or Triton's ``timeout`` (microseconds) in place of ``timeout_s``. Outputs (all, or those named in
``outputs``, in that order): ``answer`` BYTES [N, K], ``score`` FP32 [N, K], ``start`` / ``end``
INT64 [N, K] (character offsets: ``context[start:end] == answer``), ``no_answer`` BOOL [N]. Rows
with fewer than K answers (or none: no_answer) are padded with ``""``, score 0.0, start = end = -1.
The response ``id`` is the request's ``id``, else the request id (``X-Request-ID``).

The binary tensor data extension (``serving/frontend/v2_binary.py``; listed in the server metadata) takes
inputs as binary data and returns outputs so (``binary_data`` per output, ``binary_data_output``
for all): what Triton's clients (``tritonclient.http``) do by default.

The pairs go through ``serving.engine.answer.answer_pairs`` (``serving/frontend/qa_call.py``), the path of /v1/qa/batch: same admission
(429 with Retry-After), limits, deadlines and metrics (endpoint label ``v2_infer``). Errors are the
spec's ``{"error": "<message>"}``: 400 for a bad request (a tensor's name, shape, datatype or data, a
parameter, request validation, a text limit), 401 API key, 404 unknown model, 413 too many windows,
429 queue full, 503 not ready (both with Retry-After), 504 deadline.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Coroutine
from importlib import metadata
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.engine.core import Engine
from serving.engine.qa_types import EngineError
from serving.engine.repository import ModelRepository, ModelState
from serving.frontend import v2_binary
from serving.frontend.access import ApiKeyRoute, request_id_of
from serving.frontend.openapi import RETRY_AFTER_503_S
from serving.frontend.qa_call import answer_items
from serving.frontend.schemas import JsonInt, QAItem, qa_result

logger = logging.getLogger(__name__)

PLATFORM = "pytorch_shardserve"
INPUTS = ("question", "context")
OUTPUTS = ("answer", "score", "start", "end", "no_answer")
REQUEST_PARAMETERS = ("top_k", "max_answer_length", "null_threshold", "timeout_s")
PROTOCOL_PARAMETERS = ("timeout", "binary_data_output")  # Triton's deadline (µs); the binary extension's
EXTENSIONS = ["binary_tensor_data", "model_repository", "model_configuration"]
_STRICT = ConfigDict(strict=True, extra="forbid")

ParameterValue = bool | int | float | str


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


class V2RequestInput(BaseModel):
    """One input tensor: ``question`` or ``context``, BYTES, shape [N] or [N, 1]."""

    model_config = _STRICT

    name: str
    shape: list[JsonInt] = Field(description="[N] or [N, 1]")
    datatype: str = Field(description="BYTES")
    parameters: dict[str, ParameterValue] | None = Field(
        None, description="content_type str; binary_data_size (bytes after the JSON) in place of data"
    )
    data: list[Any] | None = Field(None, description="N strings, flat or nested as the shape (row-major)")


class V2RequestOutput(BaseModel):
    model_config = _STRICT

    name: str
    parameters: dict[str, ParameterValue] | None = None


class V2InferenceRequest(BaseModel):
    """POST /v2/models/{name}/infer body."""

    model_config = _STRICT

    id: str | None = Field(None, description="returned as the response's id")
    parameters: dict[str, ParameterValue] | None = Field(
        None,
        description="top_k, max_answer_length, null_threshold, timeout_s (as in /v1/qa/batch); Triton's "
        "timeout (µs); binary_data_output (all outputs as binary data)",
    )
    inputs: list[V2RequestInput]
    outputs: list[V2RequestOutput] | None = Field(None, description="the outputs to return (default: all)")


class V2ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, ParameterValue] | None = Field(
        None, description="binary_data_size: the output's data follows the JSON (binary extension)"
    )
    data: list[Any] | None = Field(None, description="row-major, flat; absent for a binary output")


class V2InferenceResponse(BaseModel):
    model_name: str
    id: str
    outputs: list[V2ResponseOutput]


_OUTPUT_TYPES = {"answer": "BYTES", "score": "FP32", "start": "INT64", "end": "INT64", "no_answer": "BOOL"}
MODEL_INPUTS = [V2TensorMetadata(name=n, datatype="BYTES", shape=[-1]) for n in INPUTS]
MODEL_OUTPUTS = [
    V2TensorMetadata(name=n, datatype=t, shape=[-1] if n == "no_answer" else [-1, -1])
    for n, t in _OUTPUT_TYPES.items()
]


# ------------------------------------------------------------------------------------------ errors


class V2InputError(ValueError):
    """A request the model cannot take (400): a tensor's name, shape, datatype or data, a parameter."""


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


def _elements(name: str, data: list[Any], shape: list[int]) -> list[Any]:
    """The elements of a tensor's ``data``: flat, or nested exactly as ``shape`` ([N, 1]: N rows of 1)."""
    if not any(isinstance(x, list) for x in data):
        return data
    rows, width = shape[0], shape[-1]
    if len(shape) == 2 and len(data) == rows and all(isinstance(r, list) and len(r) == width for r in data):
        return [x for r in data for x in r]
    raise V2InputError(f"input {name!r}: data is nested otherwise than its shape {shape} (give it flat)")


def binary_size(tensor: V2RequestInput) -> int | None:
    """The input's ``binary_data_size`` (its data follows the JSON), None when its data is JSON."""
    size = (tensor.parameters or {}).get("binary_data_size")
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise V2InputError(f"input {tensor.name!r}: binary_data_size {size!r} is not a number of bytes")
    if tensor.data is not None:
        raise V2InputError(f"input {tensor.name!r} has both data and binary_data_size; give one")
    return size


def decode_input(tensor: V2RequestInput, binary: bytes | None = None) -> list[str]:
    """The N strings of a BYTES tensor of shape [N] or [N, 1], from its JSON data or its ``binary``
    data (the binary extension); ``V2InputError`` names what is wrong."""
    name = tensor.name
    if tensor.datatype != "BYTES":
        raise V2InputError(f"input {name!r} has datatype {tensor.datatype!r}; this model takes BYTES")
    shape = tensor.shape
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)) or shape[0] < 1:
        raise V2InputError(f"input {name!r} has shape {shape}; this model takes [N] or [N, 1] with N >= 1")
    for key, value in (tensor.parameters or {}).items():
        if key not in ("content_type", "binary_data_size"):
            raise V2InputError(f"input {name!r}: unknown parameter {key!r} (content_type, binary_data_size)")
        if key == "content_type" and value not in ("str", "bytes", "BYTES"):
            raise V2InputError(f"input {name!r}: content_type {value!r} is not str")
    if binary is not None:
        try:
            flat: list[Any] = v2_binary.decode_bytes(binary)
        except ValueError as err:
            raise V2InputError(f"input {name!r} binary data: {err}") from None
    elif tensor.data is None:
        raise V2InputError(f"input {name!r} has no data (and no binary_data_size)")
    else:
        flat = _elements(name, tensor.data, shape)
    if len(flat) != math.prod(shape):
        raise V2InputError(
            f"input {name!r} has {len(flat)} elements; its shape {shape} needs {math.prod(shape)}"
        )
    for i, x in enumerate(flat):
        if not isinstance(x, str):
            raise V2InputError(f"input {name!r}[{i}] is {type(x).__name__}; BYTES elements are JSON strings")
    return flat


def _binary_inputs(inputs: list[V2RequestInput], binary: bytes | None) -> dict[str, bytes]:
    """Each binary input's slice of the tensor data after the JSON, in input order."""
    sizes = [(t.name, size) for t in inputs if (size := binary_size(t)) is not None]
    if binary is None:
        if sizes:
            raise V2InputError(
                f"input {sizes[0][0]!r} has binary_data_size but the request has no {v2_binary.HEADER}"
            )
        return {}
    total = sum(size for _, size in sizes)
    if total != len(binary):
        raise V2InputError(
            f"{len(binary)} bytes of binary data follow the JSON; the inputs' binary_data_size sum to {total}"
        )
    out, at = {}, 0
    for name, size in sizes:
        out[name], at = binary[at : at + size], at + size
    return out


def decode_request(body: V2InferenceRequest, binary: bytes | None = None) -> list[QAItem]:
    """The (question, context) pairs of a v2 request with its parameters, as /v1/qa/batch items
    (their server limits are checked on the shared path, ``answer_pairs``); ``binary``: the tensor
    data after the JSON (the binary extension), None when the body is all JSON."""
    tensors: dict[str, V2RequestInput] = {}
    for t in body.inputs:
        if t.name not in INPUTS:
            raise V2InputError(f"unknown input {t.name!r}; this model takes question and context (BYTES)")
        if t.name in tensors:
            raise V2InputError(f"input {t.name!r} is given twice")
        tensors[t.name] = t
    missing = [n for n in INPUTS if n not in tensors]
    if missing:
        raise V2InputError(f"missing input {missing[0]!r}; this model takes question and context (BYTES)")
    data = _binary_inputs(body.inputs, binary)
    questions, contexts = (decode_input(tensors[n], data.get(n)) for n in INPUTS)
    if len(questions) != len(contexts):
        raise V2InputError(
            f"{len(questions)} questions but {len(contexts)} contexts; give one question per context"
        )
    params = dict(body.parameters or {})
    params.pop("content_type", None)
    unknown = sorted(set(params) - set(REQUEST_PARAMETERS) - set(PROTOCOL_PARAMETERS))
    if unknown:
        known = ", ".join(REQUEST_PARAMETERS + PROTOCOL_PARAMETERS)
        raise V2InputError(f"unknown parameter {unknown[0]!r}; supported: {known}")
    for name in ("timeout_s", *PROTOCOL_PARAMETERS):
        params.pop(name, None)
    items = []
    for i, (q, c) in enumerate(zip(questions, contexts, strict=True)):
        try:
            item = QAItem.model_validate({"question": q, "context": c, **params})
        except ValidationError as err:
            e = err.errors()[0]
            loc = ".".join(str(x) for x in e.get("loc", ()))
            raise V2InputError(f"{_v2_field(i, loc)}: {e.get('msg', 'invalid')}") from None
        items.append(item)
    return items


def _v2_field(i: int, field: str) -> str:
    """Where a field of pair ``i`` lives in a v2 request: an input tensor's element, or a parameter."""
    return f"{field}[{i}]" if field in INPUTS else f"parameters.{field}"


def _timeout(body: V2InferenceRequest) -> float | None:
    """The deadline in seconds: ``timeout_s``, or Triton's ``timeout`` in microseconds."""
    params = body.parameters or {}
    if "timeout_s" in params and "timeout" in params:
        raise V2InputError("parameters: give timeout_s (seconds) or timeout (microseconds), not both")
    name, unit = ("timeout", 1e-6) if "timeout" in params else ("timeout_s", 1.0)
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or math.isinf(value):
        what = "microseconds" if name == "timeout" else "seconds"
        raise V2InputError(f"parameters.{name}: {value!r} is not a number of {what} > 0")
    return float(value) * unit


def _flag(where: str, value: ParameterValue | None) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    raise V2InputError(f"{where}: {value!r} is not true or false")


def _requested_outputs(body: V2InferenceRequest) -> list[tuple[str, bool]]:
    """The outputs to return, in order, each with whether it goes as binary data."""
    binary = _flag("parameters.binary_data_output", (body.parameters or {}).get("binary_data_output"))
    if body.outputs is None:
        return [(name, binary) for name in OUTPUTS]
    out: dict[str, bool] = {}
    for requested in body.outputs:
        name, params = requested.name, dict(requested.parameters or {})
        if name not in OUTPUTS:
            raise V2InputError(f"unknown output {name!r}; this model has {', '.join(OUTPUTS)}")
        if name in out:
            raise V2InputError(f"output {name!r} is requested twice")
        flag = params.pop("binary_data", None)
        if params:
            key, value = next(iter(params.items()))
            raise V2InputError(f"output {name!r}: parameter {key}={value!r} is not supported")
        out[name] = binary if flag is None else _flag(f"output {name!r} binary_data", flag)
    return list(out.items())


def encode_outputs(results: list[Any], *, top_k: int, names: list[str]) -> list[V2ResponseOutput]:
    """The named output tensors of N results (``serving.frontend.schemas.QAResult``), K = top_k per row."""
    n = len(results)
    rows: dict[str, list[Any]] = {"answer": [], "score": [], "start": [], "end": []}
    for r in results:
        answers = r.answers[:top_k]
        pad = top_k - len(answers)
        rows["answer"] += [a.text for a in answers] + [""] * pad
        rows["score"] += [float(a.score) for a in answers] + [0.0] * pad
        rows["start"] += [int(a.start) for a in answers] + [-1] * pad
        rows["end"] += [int(a.end) for a in answers] + [-1] * pad
    rows["no_answer"] = [bool(r.no_answer) for r in results]
    return [
        V2ResponseOutput(
            name=name,
            shape=[n] if name == "no_answer" else [n, top_k],
            datatype=_OUTPUT_TYPES[name],
            data=rows[name],
        )
        for name in names
    ]


# ------------------------------------------------------------------------------------------ routes


def _version() -> str:
    try:
        return metadata.version("shardserve")
    except metadata.PackageNotFoundError:
        return "0.0.0"


@open_router.get("/v2", response_model=V2ServerMetadata)
async def server_metadata() -> V2ServerMetadata:
    """Server metadata: name, version, extensions. Open, like the health routes."""
    return V2ServerMetadata(name="shardserve", version=_version(), extensions=EXTENSIONS)


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
    if model_name not in models.entries:
        return v2_error(404, f"model_not_found: model {model_name!r} not found")
    state = models.entries[model_name].state
    ready = state is ModelState.READY and not request.app.state.shutting_down
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
    settings = request.app.state.settings
    try:
        items = decode_request(body, request.state.v2_binary)
        timeout_s = _timeout(body)
        requested = _requested_outputs(body)
    except V2InputError as err:
        return v2_error(400, str(err))
    if len(items) > settings.max_batch_items:
        return v2_error(
            400, f"too_many_items: {len(items)} pairs, max_batch_items={settings.max_batch_items}"
        )
    try:
        answered = await answer_items(request, items, timeout_s, model=engine.name, locate=_v2_field)
    except EngineError as err:
        return _engine_error(err)
    results = answered.results
    names = [n for n, _ in requested]
    outputs = encode_outputs([qa_result(r) for r in results], top_k=items[0].top_k, names=names)
    response = V2InferenceResponse(
        model_name=answered.model_name,
        id=body.id if body.id is not None else request_id_of(request) or "",
        outputs=outputs,
    )
    binary = [o for o, (_, as_binary) in zip(outputs, requested, strict=True) if as_binary]
    if not binary:
        return response
    data = [v2_binary.encode(o.datatype, o.data or []) for o in binary]
    for o, blob in zip(binary, data, strict=True):
        o.data, o.parameters = None, {"binary_data_size": len(blob)}
    return v2_binary.binary_response(response.model_dump(exclude_none=True), data)
