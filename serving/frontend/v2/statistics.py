"""Triton's statistics extension over REST: ``GET /v2/models/NAME/stats`` and ``GET /v2/models/stats``.

Triton's clients and ``perf_analyzer`` read it when ``GET /v2`` lists ``statistics``. The answer is
Triton's ``ModelStatisticsResponse`` (its protobuf as JSON: counts and nanoseconds as integers),
read by ``model_statistics`` from the same Prometheus registry as ``/metrics`` (``serving/metrics.py``):
the engine writes those series for every request it admitted, whatever protocol brought it.

- ``inference_stats.success`` / ``fail``: ``inference_request_duration_seconds{outcome}`` (count,
  sum): requests admitted by the engine and answered / failed (504, 503, 500, the client gone), from
  arrival to the end. Refusals before admission (400/422 input, 413, 429, 503 not serving) are not
  requests the model saw, and are not counted.
- ``queue``, ``compute_input``, ``compute_infer``, ``compute_output``: ``request_phase_seconds{phase}``
  (count, sum): the phases of each answered request (queued until its last window is dispatched;
  tokenizing and windowing; that dispatch until all its logits are back; span decoding), observed
  together when it is answered. As Triton's, every phase counts the same requests, ``success.count``
  (perf_analyzer checks that its compute counts agree).
- ``inference_count``: ``inferences_total`` (pairs answered: a request of N pairs is N inferences,
  the batch dimension of its tensors); ``execution_count``: the micro-batches that came back
  (``execution_seconds`` count); ``last_inference``: ``last_inference_timestamp_seconds`` in ms.
- ``batch_stats``: one entry per micro-batch size in windows; ``compute_infer`` is its executions
  (dispatch to result). Input and output processing are per request here (tokenizing, decoding),
  not per micro-batch: a batch's ``compute_input`` and ``compute_output`` are ``{count: 0, ns: 0}``.
- ``cache_hit`` / ``cache_miss``: zero (no response cache). ``version``: the served generation + 1, as
  in the repository index (perf_analyzer reads it as a number).

Like the model metadata it needs the API key when one is set; errors are v2's ``{"error": ...}``: 404
an unknown model, 503 while starting. The gRPC front end answers ``ModelStatistics`` with
``ParseDict(model_statistics(...), service_pb2.ModelStatisticsResponse())``.

    curl -s localhost:8000/v2/models/default/stats

Tests: ``pytest tests/serving/frontend/v2/test_statistics.py`` (the phases: ``tests/serving/engine/test_engine.py``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client.metrics import MetricWrapperBase
from pydantic import BaseModel, Field

from shardserve.serving.engine.core import Engine
from shardserve.serving.fleet.repository import ModelRepository, model_version
from shardserve.serving.frontend.v2.routes import V2ModelRoute, model_engine, v2_error, v2_responses
from shardserve.serving.metrics import ServingMetrics

NS_PER_S = 1_000_000_000
PHASES = ("queue", "compute_input", "compute_infer", "compute_output")
_Totals = dict[tuple[str, str, str], float]  # (model, its other label's value, sample suffix) -> value


# ------------------------------------------------------------------------------------------ schemas


class StatisticDuration(BaseModel):
    count: int = Field(description="how many")
    ns: int = Field(description="their cumulative duration, nanoseconds")


class InferStatistics(BaseModel):
    success: StatisticDuration = Field(description="requests answered, arrival to answer")
    fail: StatisticDuration = Field(description="requests admitted that failed (504, 503, 500, client gone)")
    queue: StatisticDuration = Field(description="waiting in the scheduler until dispatched")
    compute_input: StatisticDuration = Field(description="tokenizing and windowing")
    compute_infer: StatisticDuration = Field(description="model execution")
    compute_output: StatisticDuration = Field(description="span decoding")
    cache_hit: StatisticDuration = Field(description="always zero: no response cache")
    cache_miss: StatisticDuration = Field(description="always zero: no response cache")


class InferBatchStatistics(BaseModel):
    batch_size: int = Field(description="windows in the micro-batch")
    compute_input: StatisticDuration
    compute_infer: StatisticDuration = Field(description="micro-batches of this size: dispatch to result")
    compute_output: StatisticDuration


class ModelStatistics(BaseModel):
    name: str
    version: str = Field(description="the served generation + 1, as in the repository index")
    last_inference: int = Field(description="when the last request ended, ms since the epoch (0: none yet)")
    inference_count: int = Field(description="pairs answered")
    execution_count: int = Field(description="micro-batches executed")
    inference_stats: InferStatistics
    batch_stats: list[InferBatchStatistics]


class ModelStatisticsResponse(BaseModel):
    model_stats: list[ModelStatistics]


# ------------------------------------------------------------------------------------------ the reading


def _totals(metric: MetricWrapperBase, names: set[str]) -> _Totals:
    """The ``_count`` / ``_sum`` / ``_total`` / plain samples of ``metric`` for the models in ``names``,
    keyed by (model, the value of its label other than model ('' if none), sample suffix)."""
    out: _Totals = {}
    for family in metric.collect():
        for s in family.samples:
            model = s.labels.get("model")
            suffix = s.name[len(family.name) :]
            if model not in names or suffix not in ("", "_count", "_sum", "_total"):
                continue
            key = next((v for k, v in s.labels.items() if k not in ("model", "le")), "")
            out[(model, key, suffix)] = s.value
    return out


def _duration(t: _Totals, model: str, key: str = "") -> dict[str, int]:
    return {
        "count": int(t.get((model, key, "_count"), 0)),
        "ns": round(t.get((model, key, "_sum"), 0.0) * NS_PER_S),
    }


def _zero() -> dict[str, int]:
    return {"count": 0, "ns": 0}


def model_statistics(metrics: ServingMetrics, engines: list[Engine]) -> dict[str, Any]:
    """Triton's ``ModelStatisticsResponse`` (as JSON) of the models of ``engines``, from ``metrics``'
    registry (module doc); a model without requests yet has zeros."""
    versions = {e.name: model_version(e) for e in engines}
    names = list(versions)
    wanted = set(names)
    requests = _totals(metrics.request_duration, wanted)
    executions = _totals(metrics.executions, wanted)
    phases = _totals(metrics.request_phase, wanted)
    inferences = _totals(metrics.inferences, wanted)
    last = _totals(metrics.last_inference, wanted)
    out = []
    for name in names:
        sizes = sorted({int(k) for (m, k, sfx) in executions if m == name and sfx == "_count"})
        out.append(
            {
                "name": name,
                "version": versions[name],
                "last_inference": round(last.get((name, "", ""), 0.0) * 1000),
                "inference_count": int(inferences.get((name, "", "_total"), 0)),
                "execution_count": sum(_duration(executions, name, str(b))["count"] for b in sizes),
                "inference_stats": {
                    "success": _duration(requests, name, "success"),
                    "fail": _duration(requests, name, "fail"),
                    **{phase: _duration(phases, name, phase) for phase in PHASES},
                    "cache_hit": _zero(),
                    "cache_miss": _zero(),
                },
                "batch_stats": [
                    {
                        "batch_size": b,
                        "compute_input": _zero(),
                        "compute_infer": _duration(executions, name, str(b)),
                        "compute_output": _zero(),
                    }
                    for b in sizes
                ],
            }
        )
    return {"model_stats": out}


# ------------------------------------------------------------------------------------------ routes

router = APIRouter(tags=["open inference protocol (v2)"], route_class=V2ModelRoute)


@router.get("/v2/models/stats", response_model=ModelStatisticsResponse, responses=v2_responses(503))
async def all_statistics(request: Request) -> Any:
    """Triton's statistics of every served model."""
    models: ModelRepository | None = getattr(request.app.state, "models", None)
    if models is None:
        return v2_error(503, "the server is starting")
    return model_statistics(request.app.state.metrics, models.engines())


@router.get(
    "/v2/models/{model_name}/stats",
    response_model=ModelStatisticsResponse,
    responses=v2_responses(404, 503),
)
async def statistics(model_name: str, request: Request) -> Any:
    """Triton's statistics of the model: requests answered and failed, the time of each phase,
    inferences (pairs) and executions (micro-batches)."""
    engine = model_engine(request, model_name)
    if isinstance(engine, JSONResponse):
        return engine
    return model_statistics(request.app.state.metrics, [engine])
