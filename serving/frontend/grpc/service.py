"""Triton's ``inference.GRPCInferenceService`` (KServe v2 gRPC + Triton's extensions) on the REST code paths.

The protobuf messages and the service stub are Triton's own (``tritonclient.grpc.service_pb2`` and
``model_config_pb2``, the definitions Triton's clients and perf_analyzer speak). Each RPC does what its
REST route does, through the same functions, inside ``call.run_rpc`` (request id, key, errors
as status codes, access log, metrics):

    ServerLive, ServerReady, ServerMetadata, ModelReady     open        GET /v2/health/*, /v2, .../ready
    ModelMetadata, ModelConfig, ModelStatistics             API key     GET /v2/models/NAME[/config|/stats]
    ModelInfer                                              API key     POST /v2/models/NAME/infer
    RepositoryIndex, RepositoryModelLoad / Unload           admin       /v2/repository/...

``ModelInfer``: the inputs ``question`` and ``context`` (BYTES, shape [N] or [N, 1]) come as
``raw_input_contents`` (what tritonclient and perf_analyzer send: 4-byte little-endian length +
UTF-8 per element, the binary extension's layout) or as ``contents.bytes_contents``; the request's
``parameters`` are REST's (``top_k``, ``max_answer_length``, ``null_threshold``, ``timeout_s``, Triton's
``timeout`` in µs); the outputs return as ``raw_output_contents``, in the order of ``outputs`` (all
when none is named). The client's gRPC deadline is the request's deadline too (capped at
``max_request_timeout_s``); a client that cancels has its queued windows dropped.
``model_version`` is empty or the served one (the repository index's: generation + 1). The streaming, shared-memory,
trace and log RPCs are not served (UNIMPLEMENTED).

Tests: ``pytest tests/serving/frontend/grpc/test_grpc.py``.
"""

from __future__ import annotations

import math
from typing import Any

import grpc
from fastapi import FastAPI
from google.protobuf import json_format
from pydantic import ValidationError
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from shardserve.serving.config import MODEL_NAME
from shardserve.serving.engine.core import Engine
from shardserve.serving.engine.qa_types import EngineError
from shardserve.serving.fleet.repository import ModelRepository, model_version
from shardserve.serving.frontend.grpc.call import Access, Call, GrpcError, run_rpc
from shardserve.serving.frontend.qa_call import answer_for
from shardserve.serving.frontend.schemas import qa_result
from shardserve.serving.frontend.v2 import binary as v2_binary
from shardserve.serving.frontend.v2 import routes as v2_routes
from shardserve.serving.frontend.v2.model_config import triton_config
from shardserve.serving.frontend.v2.statistics import model_statistics
from shardserve.serving.frontend.v2.tensors import (
    V2InferenceRequest,
    V2InputError,
    V2RequestInput,
    V2RequestOutput,
    parse_call,
    v2_field,
)

_CONTENTS = service_pb2.InferTensorContents.DESCRIPTOR.fields_by_name


def add_service(server: grpc.aio.Server, app: FastAPI) -> None:
    """Serve Triton's ``GRPCInferenceService`` of ``app`` on ``server``."""
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(app), server)


# ------------------------------------------------------------------------------------------ messages


def _parameter(p: Any) -> Any:
    """The value of an ``InferParameter`` / ``ModelRepositoryParameter`` (None when unset)."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _input(tensor: Any, raw: bytes | None) -> V2RequestInput:
    """REST's input tensor of a gRPC one: its ``raw`` bytes as binary data, else its bytes_contents."""
    name = tensor.name
    params = {k: _parameter(v) for k, v in tensor.parameters.items()}
    if raw is not None:
        return V2RequestInput(
            name=name,
            shape=list(tensor.shape),
            datatype=tensor.datatype,
            parameters={**params, "binary_data_size": len(raw)},
        )
    other = [f for f in _CONTENTS if f != "bytes_contents" and len(getattr(tensor.contents, f))]
    if other:
        raise V2InputError(
            f"input {name!r} has {other[0]}; BYTES data goes in bytes_contents or raw_input_contents"
        )
    data = []
    for i, b in enumerate(tensor.contents.bytes_contents):
        try:
            data.append(b.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise V2InputError(f"input {name!r}[{i}] is not UTF-8 text (byte {err.start})") from None
    return V2RequestInput(
        name=name,
        shape=list(tensor.shape),
        datatype=tensor.datatype,
        parameters=params or None,
        data=data or None,
    )


def v2_request(request: Any) -> tuple[V2InferenceRequest, bytes | None]:
    """REST's request of a ``ModelInferRequest`` and its binary tensor data (None: none was raw)."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise V2InputError(
            f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give one per input, or none"
        )
    inputs = [_input(t, raw[i] if raw else None) for i, t in enumerate(request.inputs)]
    outputs = []
    for o in request.outputs:
        params = {k: _parameter(v) for k, v in o.parameters.items() if k != "binary_data"}  # always raw here
        outputs.append(V2RequestOutput(name=o.name, parameters=params or None))
    params = {k: _parameter(v) for k, v in request.parameters.items()}
    try:
        body = V2InferenceRequest(
            id=request.id or None,
            parameters=params or None,
            inputs=inputs,
            outputs=outputs or None,
        )
    except ValidationError as err:
        e = err.errors()[0]
        raise V2InputError(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', 'invalid')}") from None
    return body, (b"".join(raw) if raw else None)


def _tensor_metadata(tensors: list[v2_routes.V2TensorMetadata]) -> list[Any]:
    return [
        service_pb2.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape)
        for t in tensors
    ]


# ------------------------------------------------------------------------------------------ the service


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The RPCs (module doc); the unimplemented ones answer UNIMPLEMENTED (the base class)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    # ---- helpers

    def _models(self, *, admin: bool = False) -> ModelRepository:
        state = self.app.state
        models: ModelRepository | None = getattr(state, "models", None)
        if models is None:
            raise GrpcError(503, "starting: the server is starting")
        if admin and state.shutting_down:
            raise GrpcError(503, "shutting_down: the server is shutting down")
        return models

    def _engine(self, name: str, version: str = "") -> Engine:
        """The engine of ``name``; ``version``: empty, or the one served (``model_version``)."""
        try:
            engine = self._models().engine(name)
        except EngineError as err:
            raise GrpcError.of(err) from None
        if version and version != model_version(engine):
            raise GrpcError(
                404,
                f"model_not_found: model {name!r} serves version {model_version(engine)}, not {version!r}",
            )
        return engine

    async def _run(self, context: Any, method: str, handler: Any, request: Any, **kw: Any) -> Any:
        return await run_rpc(self.app, context, method, handler, request, **kw)

    # ---- health and metadata (open)

    async def ServerLive(self, request: Any, context: Any) -> Any:
        async def live(request: Any, call: Call, context: Any) -> Any:
            return service_pb2.ServerLiveResponse(live=True)

        return await self._run(context, "ServerLive", live, request, access=Access.OPEN)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        async def ready(request: Any, call: Call, context: Any) -> Any:
            models = getattr(self.app.state, "models", None)
            ok = models is not None and not self.app.state.shutting_down and models.ready()
            return service_pb2.ServerReadyResponse(ready=ok)

        return await self._run(context, "ServerReady", ready, request, access=Access.OPEN)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        async def ready(request: Any, call: Call, context: Any) -> Any:
            try:
                ok = self._models().model_ready(request.name) and not self.app.state.shutting_down
            except EngineError as err:
                raise GrpcError.of(err) from None
            call.model = request.name
            return service_pb2.ModelReadyResponse(ready=ok)

        return await self._run(context, "ModelReady", ready, request, access=Access.OPEN)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        async def metadata(request: Any, call: Call, context: Any) -> Any:
            m = await v2_routes.server_metadata()
            return service_pb2.ServerMetadataResponse(name=m.name, version=m.version, extensions=m.extensions)

        return await self._run(context, "ServerMetadata", metadata, request, access=Access.OPEN)

    # ---- a model's metadata, configuration, statistics (API key)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        async def metadata(request: Any, call: Call, context: Any) -> Any:
            call.model = self._engine(request.name, request.version).name
            return service_pb2.ModelMetadataResponse(
                name=request.name,
                platform=v2_routes.PLATFORM,
                inputs=_tensor_metadata(v2_routes.MODEL_INPUTS),
                outputs=_tensor_metadata(v2_routes.MODEL_OUTPUTS),
            )

        return await self._run(context, "ModelMetadata", metadata, request, access=Access.API_KEY)

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        async def config(request: Any, call: Call, context: Any) -> Any:
            call.model = self._engine(request.name, request.version).name
            proto = json_format.ParseDict(
                triton_config(request.name).model_dump(), model_config_pb2.ModelConfig()
            )
            return service_pb2.ModelConfigResponse(config=proto)

        return await self._run(context, "ModelConfig", config, request, access=Access.API_KEY)

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        async def statistics(request: Any, call: Call, context: Any) -> Any:
            if request.name:  # one model; none named: every served model (Triton's)
                engines = [self._engine(request.name, request.version)]
            else:
                engines = self._models().engines()
            stats = model_statistics(self.app.state.metrics, engines)
            return json_format.ParseDict(stats, service_pb2.ModelStatisticsResponse())

        return await self._run(context, "ModelStatistics", statistics, request, access=Access.API_KEY)

    # ---- inference (API key)

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        return await self._run(
            context, "ModelInfer", self._infer, request, access=Access.API_KEY, endpoint="grpc_infer"
        )

    async def _infer(self, request: Any, call: Call, context: Any) -> Any:
        call.model = request.model_name  # the access log's and the metrics' model, refusals too
        engine = self._engine(request.model_name, request.model_version)
        call.model = engine.name
        settings = self.app.state.settings
        try:
            body, binary = v2_request(request)
            parsed = parse_call(body, binary, max_batch_items=settings.max_batch_items)
        except V2InputError as err:
            raise GrpcError(400, str(err)) from None
        timeout_s = parsed.timeout_s
        if (remaining := context.time_remaining()) is not None:  # the client's deadline, within the cap
            timeout_s = min(timeout_s or math.inf, remaining, settings.max_request_timeout_s)
        try:
            answered = await answer_for(
                self.app.state,
                self.app.state.clients.client(engine.name),
                [it.pair() for it in parsed.items],
                timeout_s=max(timeout_s, 1e-3) if timeout_s is not None else None,
                locate=v2_field,
            )
        except EngineError as err:
            raise GrpcError.of(err) from None
        call.windows = sum(r.windows for r in answered.results)
        outputs = parsed.encode([qa_result(r) for r in answered.results])
        return service_pb2.ModelInferResponse(
            model_name=answered.model_name,
            id=request.id or call.request_id,
            outputs=[
                service_pb2.ModelInferResponse.InferOutputTensor(
                    name=o.name, datatype=o.datatype, shape=o.shape
                )
                for o in outputs
            ],
            raw_output_contents=[v2_binary.encode(o.datatype, o.data or []) for o in outputs],
        )

    # ---- the model repository (admin token)

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        async def index(request: Any, call: Call, context: Any) -> Any:
            entries = self._models(admin=True).index()
            if request.ready:
                entries = [e for e in entries if e["state"] == "READY"]
            return service_pb2.RepositoryIndexResponse(
                models=[service_pb2.RepositoryIndexResponse.ModelIndex(**e) for e in entries]
            )

        return await self._run(context, "RepositoryIndex", index, request, access=Access.ADMIN)

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        async def load(request: Any, call: Call, context: Any) -> Any:
            name = call.model = _model_name(request.model_name)
            path = _parameter(request.parameters["path"]) if "path" in request.parameters else None
            if path is not None and not (isinstance(path, str) and path):
                raise GrpcError(400, "invalid_request: parameters.path must be a non-empty string_param")
            try:
                await self._models(admin=True).load(name, path)
            except EngineError as err:
                raise GrpcError.of(err) from None
            return service_pb2.RepositoryModelLoadResponse()

        return await self._run(context, "RepositoryModelLoad", load, request, access=Access.ADMIN)

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        async def unload(request: Any, call: Call, context: Any) -> Any:
            name = call.model = _model_name(request.model_name)
            try:
                await self._models(admin=True).unload(name)
            except EngineError as err:
                raise GrpcError.of(err) from None
            return service_pb2.RepositoryModelUnloadResponse()

        return await self._run(context, "RepositoryModelUnload", unload, request, access=Access.ADMIN)


def _model_name(name: str) -> str:
    if not MODEL_NAME.fullmatch(name):
        raise GrpcError(400, f"invalid_request: model name {name!r} is not 1-64 letters, digits, . _ -")
    return name
