"""Triton's model configuration extension over REST: ``GET /v2/models/NAME/config``.

Triton's clients and its load tool read it before they send anything: ``perf_analyzer`` stops with
``failed to get model config: http_error: Not Found`` without it. The answer is Triton's model
configuration (its protobuf as JSON), describing the same tensors as the model metadata
(``GET /v2/models/NAME``):

- ``max_batch_size: 0``: a request's batch is the first dimension of its own tensors (N pairs:
  ``question`` and ``context`` of shape ``[N]``), not a dimension Triton's clients add. So
  ``perf_analyzer --shape question:1 --shape context:1`` sends one pair per request, and
  ``--shape question:8`` eight. The server batches the requests' windows into micro-batches itself.
- ``input``: ``question`` and ``context``, ``TYPE_STRING`` (v2's BYTES), dims ``[-1]``.
- ``output``: ``answer`` (``TYPE_STRING``), ``score`` (``TYPE_FP32``), ``start`` and ``end``
  (``TYPE_INT64``), each dims ``[-1, -1]`` (N pairs by top_k), and ``no_answer`` (``TYPE_BOOL``,
  ``[-1]``).

Like the metadata it needs the API key when one is set. Errors are v2's ``{"error": ...}``: 404 an
unknown model, 503 while starting.

    curl -s localhost:8000/v2/models/default/config

Tests: ``pytest tests/serving/frontend/v2/test_model_config.py``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from shardserve.serving.frontend.v2.routes import (
    MODEL_INPUTS,
    MODEL_OUTPUTS,
    PLATFORM,
    V2ModelRoute,
    model_engine,
    v2_responses,
)

# v2 datatype -> Triton's model configuration data type
TRITON_TYPES = {"BYTES": "TYPE_STRING", "FP32": "TYPE_FP32", "INT64": "TYPE_INT64", "BOOL": "TYPE_BOOL"}


class TritonTensorConfig(BaseModel):
    name: str
    data_type: str = Field(description="Triton's type name: TYPE_STRING is v2's BYTES")
    dims: list[int] = Field(description="the whole shape (max_batch_size is 0): -1 is any size")


class TritonModelConfig(BaseModel):
    name: str
    platform: str
    backend: str = "shardserve"
    max_batch_size: int = Field(0, description="0: the batch is the first dimension of each tensor")
    input: list[TritonTensorConfig]
    output: list[TritonTensorConfig]


def _tensors(metadata: list[Any]) -> list[TritonTensorConfig]:
    return [
        TritonTensorConfig(name=t.name, data_type=TRITON_TYPES[t.datatype], dims=list(t.shape))
        for t in metadata
    ]


router = APIRouter(tags=["open inference protocol (v2)"], route_class=V2ModelRoute)


@router.get(
    "/v2/models/{model_name}/config", response_model=TritonModelConfig, responses=v2_responses(404, 503)
)
async def model_config(model_name: str, request: Request) -> Any:
    """Triton's model configuration of the model: what its clients and perf_analyzer read first."""
    engine = model_engine(request, model_name)
    if isinstance(engine, JSONResponse):
        return engine
    return triton_config(model_name)


def triton_config(model_name: str) -> TritonModelConfig:
    """The configuration of a served model (REST's JSON; gRPC's ``ModelConfig`` is its protobuf)."""
    return TritonModelConfig(
        name=model_name, platform=PLATFORM, input=_tensors(MODEL_INPUTS), output=_tensors(MODEL_OUTPUTS)
    )
