"""Response models of ``GET /ui/status`` (the JSON the status page polls), as the OpenAPI document shows them.

Numbers the server does not measure are ``null``, never a made-up zero: percentiles of a window
without requests, busy time of a backend that cannot report its busy ranks, a pid of a rank that
has not been heard from. Filled in by ``shardserve.serving.frontend.status.board.collect_status``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class RankStatus(BaseModel):
    rank: int = Field(description="global rank in the gang")
    stage: int = Field(description="pipeline stage of the rank")
    tp_rank: int = Field(description="tensor-parallel rank within its stage")
    host: str | None = Field(
        description="host name the rank reports in its heartbeats (null: not heard from yet, e.g. an "
        "external rank that has not joined)"
    )
    pid: int | None = Field(
        description="the rank's process id on that host, as it reports it (null: not heard)"
    )
    device: str | None = Field(description="the device slot it holds (cpu, cuda:N)")


class StageStatus(BaseModel):
    stage: int
    busy_s: float | None = Field(
        description="sampled busy seconds of the stage since the gang started "
        "(shardserve_stage_busy_seconds_total); null: not measured by this backend"
    )
    busy_fraction_recent: float | None = Field(
        description="share of the last minute the stage was busy (0..1); null: not measured"
    )


class ReplicaStatus(BaseModel):
    id: str
    model: str = Field(description="the model the gang serves")
    state: Literal["starting", "ready", "draining", "failed", "stopped"]
    generation: int = Field(description="model generation (grows with each /admin/reload)")
    hosts: list[str] = Field(
        description="the hosts its ranks report running on, in rank order (several for a gang with "
        "--external-ranks; empty until a rank is heard)"
    )
    world_size: int = Field(description="ranks in the gang (pp x tp)")
    restarts: int = Field(
        description="restarts of this gang's line: a gang replacing a failed one carries its count on, +1"
    )
    replaces: str | None = Field(description="id of the failed gang this one replaced (null: a fresh gang)")
    ranks: list[RankStatus]
    inflight_batches: int
    age_s: float = Field(description="seconds since the gang was launched")
    error: str | None = Field(description="why it failed (one line, no paths)")
    stages: list[StageStatus]
    bubble_fraction: float | None = Field(
        description="1 - stage busy time / (stages x time with work in flight), since the gang started "
        "(shardserve_pipeline_bubble_fraction); null: not measured yet"
    )


class WindowStats(BaseModel):
    """Rates and percentiles over the last ``window_s`` (differences of /metrics counters)."""

    window_s: float
    covered_s: float = Field(description="seconds actually covered (less while the server is young)")
    requests: int = Field(description="HTTP requests counted by shardserve_requests_total, any status")
    answered_per_s: float = Field(description="2xx answers per second")
    windows_per_s: float = Field(description="context windows computed per second")
    batches_per_s: float = Field(description="micro-batches dispatched per second")
    mean_batch_windows: float | None = Field(description="windows per micro-batch; null: no batch")
    context_cache_hits: float | None = Field(
        description="share of the contexts looked up that the tokenized-context cache held "
        "(shardserve_context_cache_lookups_total); null: none looked up"
    )
    latency_ms: dict[str, float | None] = Field(
        description="request latency p50/p95/p99 (histogram_quantile of the buckets); null: no request"
    )
    queue_wait_ms: dict[str, float | None] = Field(description="queue wait p50/p95/p99; null: none")
    error_responses: dict[str, int] = Field(description="4xx/5xx responses by status code")


class SeriesPoint(BaseModel):
    t: float = Field(description="unix time of the sample")
    queue_depth: float
    ongoing: float
    answered_per_s: float
    mean_latency_ms: float | None = Field(description="mean latency in the interval; null: no request")


class QueueStatus(BaseModel):
    depth_requests: int
    depth_windows: int
    ongoing_requests: int = Field(description="admitted requests not yet answered")
    max_queue_size: int
    padding_ratio: float = Field(description="padding tokens / padded tokens over all batches")


class Decision(BaseModel):
    time: float = Field(description="unix time of the decision")
    source: Literal["autoscaler", "admin", "placement"] = Field(
        description="the autoscaler, POST /admin/replicas, or a change of the placement (--placement)"
    )
    before: int = Field(description="target before")
    after: int = Field(description="target after")
    reason: str


class AutoscalerStatus(BaseModel):
    target: int = Field(description="replica gangs asked for")
    autoscaling: bool = Field(description="false while pinned by --replicas or POST /admin/replicas")
    pinned: int | None
    min_replicas: int
    max_replicas: int
    pool_limit: int = Field(description="gangs the device pool fits")
    target_ongoing_requests: float
    decisions: dict[str, int] = Field(description="applied decisions by direction (up, down)")
    last_decision: str
    recent: list[Decision] = Field(description="the last applied target changes, oldest first")


class LogLine(BaseModel):
    time: float = Field(description="unix time")
    level: str
    logger: str
    message: str = Field(description="one line, file-system paths replaced by <path>")


class ModelStatus(BaseModel):
    """One served model (the repository's view, and its own series of /metrics)."""

    name: str
    state: Literal["LOADING", "READY", "UNLOADING", "UNAVAILABLE"]
    reason: str = Field(description="why it is not served (empty when it is)")
    checkpoint: str | None = Field(description="its checkpoint's folder name (no path); null: not loaded")
    generation: int | None = Field(description="grows with each reload; null: not loaded")
    ready_replicas: int
    answered_per_s: float = Field(description="2xx answers per second over the last minute")
    latency_ms: dict[str, float | None] = Field(description="latency p50/p95/p99 over the last minute")
    queue_depth: int
    ongoing_requests: int


class PlacementStatus(BaseModel):
    """Where the models run with ``--placement``: the device groups and why (``serving/fleet/placement.py``)."""

    policy: Literal["dedicated", "multiplexed", "auto"]
    devices: int
    device_memory_bytes: int
    groups: list[dict[str, Any]] = Field(
        description="each device group: devices, pp, tp, models, its gang's name and whether it runs"
    )
    unplaced: dict[str, str] = Field(description="models the placement left out, and why")
    prediction: dict[str, Any] | None = Field(
        description="the simulated outcome it was chosen by: attainment, goodput, per model"
    )
    history: list[dict[str, Any]] = Field(
        description="placements rolled out, oldest first: time, policy, placement, attainment, reason"
    )
    searches: dict[str, Any] = Field(
        description="placement searches since the start (re-plans, loads, unloads): count, seconds in "
        "all, last_s (each runs on a thread of the server's process)"
    )


class ApiWorkerStatus(BaseModel):
    """One API process of ``--api-workers`` (``serving/frontend/api_workers.py``)."""

    index: int
    pid: int | None
    alive: bool
    connected: bool = Field(description="connected to the core: it answers on the port")
    restarts: int = Field(description="times this slot's process was replaced after it died")


class StatusResponse(BaseModel):
    """What the status page shows; every rate is read from the same registry as /metrics."""

    time: float = Field(description="server unix time of this document")
    state: Literal["starting", "ready", "not_ready", "failed", "shutting_down"]
    uptime_s: float
    model: dict[str, Any] = Field(
        description="the default model (of requests naming none): name, checkpoint file name, architecture, generation"
    )
    models: list[ModelStatus] = Field(description="every model of the server, the default first")
    placement: PlacementStatus | None = Field(
        None, description="the device groups the models share (--placement); null without one"
    )
    precision: dict[str, str] = Field(
        description="compute dtype, why it was chosen, device, compile (on/off)"
    )
    plan: dict[str, Any] | None = Field(
        description="the partition plan (stages, ranks, layers); null: starting"
    )
    api_key_required: bool = Field(description="/v1 and /v2/models need Authorization: Bearer <api_key>")
    replicas: list[ReplicaStatus]
    replica_counts: dict[str, int] = Field(description="gangs by state (shardserve_replicas)")
    replica_failures: int
    replica_restarts: int = Field(
        description="gangs restarted after a failure, since the server started (all gangs, also those "
        "since stopped; each gang's own count: replicas[].restarts)"
    )
    retried_windows: int
    queue: QueueStatus
    windows: list[WindowStats] = Field(description="the last minute and the last five minutes")
    series: list[SeriesPoint] = Field(description="one point per second over the last five minutes")
    autoscaler: AutoscalerStatus | None
    last_failure: str | None = Field(description="the last gang failure (one line, no paths)")
    recent_errors: list[LogLine] = Field(description="last warnings and errors of the server, newest first")
    api_workers: list[ApiWorkerStatus] = Field(
        default_factory=list,
        description="the API processes of --api-workers N (none when HTTP runs in the core)",
    )
