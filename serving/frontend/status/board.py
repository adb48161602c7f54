"""The numbers of the status page (``GET /ui/status``, polled by the page at ``/``): one JSON document.

One source of truth: every rate, percentile and busy time here is read from the app's Prometheus
registry (``ServingMetrics``, what ``/metrics`` exports), never counted a second time; the rest is
read from the engine's facade (replicas, health, scaling; ``serving/engine/core.py``) and the
settings. Where a rank runs (host, pid) is what the rank itself reports in its heartbeats
(``ReplicaDetail.processes``), never guessed from this server's host.

- ``StatusBoard`` (``app.state.status``) samples the registry every ``every_s`` (a background task
  started and stopped by the app lifespan), keeps ``history_s`` of snapshots, and collects recent
  WARNING/ERROR log records of the server's packages (one path-free line each, ``shardserve.serving.redact``).
- Windowed numbers are differences between the newest snapshot and the one ``window_s`` earlier
  (like PromQL ``rate()``); latency percentiles interpolate inside the histogram buckets like
  ``histogram_quantile`` (so they are as coarse as ``LATENCY_BUCKETS``). A number the server does
  not measure (no requests in the window, a backend that cannot report busy ranks) is ``null``.
- ``collect_status(app)`` builds the ``StatusResponse`` (pydantic models: ``serving/frontend/status/schemas.py``).

    board = StatusBoard(metrics); await board.start(); ...; await board.stop()
    collect_status(app).model_dump()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from shardserve.serving.engine.core import Engine
from shardserve.serving.engine.replica_detail import ReplicaDetail
from shardserve.serving.fleet.repository import ModelEntry, ModelRepository
from shardserve.serving.frontend.status.schemas import (
    ApiWorkerStatus,
    AutoscalerStatus,
    Decision,
    LogLine,
    ModelStatus,
    PlacementStatus,
    QueueStatus,
    RankStatus,
    ReplicaStatus,
    SeriesPoint,
    StageStatus,
    StatusResponse,
    WindowStats,
)
from shardserve.serving.metrics import ServingMetrics
from shardserve.serving.redact import one_line

logger = logging.getLogger(__name__)

WINDOWS_S = (60.0, 300.0)  # the windows the page shows ("last minute", "last 5 minutes")
LOGGERS = ("shardserve",)  # whose warnings are "recent errors": the whole namespace
QUANTILES = (0.5, 0.95, 0.99)

Key = tuple[str, tuple[tuple[str, str], ...]]
Snapshot = dict[Key, float]


def read_registry(registry: CollectorRegistry) -> Snapshot:
    """Every sample of the registry: (sample name, sorted labels) -> value."""
    out: Snapshot = {}
    for family in registry.collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def total(snap: Snapshot, name: str, where: Callable[[dict[str, str]], bool] | None = None) -> float:
    """Sum of the samples called ``name`` whose labels satisfy ``where``."""
    return sum(v for (n, labels), v in snap.items() if n == name and (where is None or where(dict(labels))))


def by_label(snap: Snapshot, name: str, label: str) -> dict[str, float]:
    """Samples called ``name`` summed per value of ``label``."""
    out: dict[str, float] = {}
    for (n, labels), v in snap.items():
        if n == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def buckets(snap: Snapshot, histogram: str) -> list[tuple[float, float]]:
    """Cumulative (upper bound, count) of a histogram, summed over its other labels, by bound."""
    acc: dict[float, float] = {}
    for (n, labels), v in snap.items():
        if n == f"{histogram}_bucket":
            le = float(dict(labels)["le"])
            acc[le] = acc.get(le, 0.0) + v
    return sorted(acc.items())


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket holding rank
    ``q * count`` (the lowest bucket starts at 0; in the +Inf bucket: the last finite bound)."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _delta(new: list[tuple[float, float]], old: list[tuple[float, float]]) -> list[tuple[float, float]]:
    before = dict(old)
    return [(le, c - before.get(le, 0.0)) for le, c in new]


def _answered(labels: dict[str, str]) -> bool:
    return labels.get("status", "").startswith("2")


@dataclass
class Sample:
    """One registry snapshot, with the few totals the time series needs read once."""

    mono: float  # time.monotonic() of the snapshot
    wall: float  # time.time() of the snapshot
    snap: Snapshot

    def __post_init__(self) -> None:
        s = self.snap
        self.queue_depth = total(s, "shardserve_queue_depth_requests")
        self.ongoing = total(s, "shardserve_ongoing_requests")
        self.answered = total(s, "shardserve_requests_total", _answered)
        self.latency_count = total(s, "shardserve_request_latency_seconds_count")
        self.latency_sum = total(s, "shardserve_request_latency_seconds_sum")


class RecentLog(logging.Handler):
    """Ring of the last WARNING+ records of the server's loggers, each one path-free line."""

    def __init__(self, maxlen: int = 50) -> None:
        super().__init__(level=logging.WARNING)
        self.records: deque[LogLine] = deque(maxlen=maxlen)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = one_line(record.getMessage())
        except Exception:  # a bad format string must not break logging
            message = one_line(str(record.msg))
        self.records.append(
            LogLine(time=record.created, level=record.levelname, logger=record.name, message=message)
        )


class StatusBoard:
    """Registry history + recent warnings of one app (see module doc)."""

    def __init__(
        self,
        metrics: ServingMetrics,
        *,
        every_s: float = 2.0,  # reading the registry costs ~2 ms of the event loop's time
        history_s: float = max(WINDOWS_S),
        loggers: Iterable[str] = LOGGERS,
    ) -> None:
        self.metrics = metrics
        self.every_s = every_s
        self.history: deque[Sample] = deque(maxlen=int(history_s / every_s) + 2)
        self.log = RecentLog()
        self.started_wall = time.time()
        self._loggers = tuple(loggers)
        self._task: asyncio.Task | None = None
        self.sample()  # the zero point: rates are defined from the first poll on

    def sample(self) -> Sample:
        s = Sample(time.monotonic(), time.time(), read_registry(self.metrics.registry))
        self.history.append(s)
        return s

    async def start(self) -> None:
        for name in self._loggers:
            logging.getLogger(name).addHandler(self.log)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="shardserve-status")

    async def stop(self) -> None:
        for name in self._loggers:
            logging.getLogger(name).removeHandler(self.log)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                self.sample()
            except Exception:  # never let the sampler die
                logger.exception("status sample failed")

    # ------------------------------------------------------------------ derived numbers
    def baseline(self, now: Sample, window_s: float) -> Sample:
        """The oldest kept snapshot no older than ``window_s`` before ``now`` (or the oldest kept)."""
        for s in self.history:
            if s.mono >= now.mono - window_s - self.every_s / 2:
                return s
        return self.history[0] if self.history else now

    def window(self, now: Sample, window_s: float, *, model: str | None = None) -> WindowStats:
        """Rates and percentiles over the last ``window_s``; of one model's series when ``model`` is given."""
        old = self.baseline(now, window_s)
        dt = max(now.mono - old.mono, 1e-9)
        new_s, old_s = now.snap, old.snap
        if model is not None:
            new_s, old_s = (
                {k: v for k, v in snap.items() if dict(k[1]).get("model") == model} for snap in (new_s, old_s)
            )

        def diff(name: str, where: Callable[[dict[str, str]], bool] | None = None) -> float:
            return max(0.0, total(new_s, name, where) - total(old_s, name, where))

        lat = _delta(
            buckets(new_s, "shardserve_request_latency_seconds"),
            buckets(old_s, "shardserve_request_latency_seconds"),
        )
        wait = _delta(
            buckets(new_s, "shardserve_queue_wait_seconds"), buckets(old_s, "shardserve_queue_wait_seconds")
        )
        statuses = by_label(new_s, "shardserve_requests_total", "status")
        before = by_label(old_s, "shardserve_requests_total", "status")
        errors = {
            st: n - before.get(st, 0.0)
            for st, n in statuses.items()
            if st.startswith(("4", "5")) and n > before.get(st, 0.0)
        }
        answered = diff("shardserve_requests_total", _answered)
        windows = diff("shardserve_batch_size_windows_sum")
        batches = diff("shardserve_batch_size_windows_count")
        lookups = diff("shardserve_context_cache_lookups_total")
        hits = diff("shardserve_context_cache_lookups_total", lambda labels: labels.get("result") == "hit")
        return WindowStats(
            window_s=window_s,
            covered_s=round(dt, 3),
            requests=int(diff("shardserve_requests_total")),
            answered_per_s=answered / dt,
            windows_per_s=windows / dt,
            batches_per_s=batches / dt,
            mean_batch_windows=windows / batches if batches else None,
            context_cache_hits=hits / lookups if lookups else None,
            latency_ms={f"p{round(q * 100)}": _ms(histogram_quantile(q, lat)) for q in QUANTILES},
            queue_wait_ms={f"p{round(q * 100)}": _ms(histogram_quantile(q, wait)) for q in QUANTILES},
            error_responses={st: int(n) for st, n in sorted(errors.items())},
        )

    def series(self, now: Sample) -> list[SeriesPoint]:
        """Per sampling interval: queue depth, ongoing requests, answered requests/s, mean latency."""
        samples = [*self.history, now]
        points: list[SeriesPoint] = []
        for prev, cur in itertools.pairwise(samples):
            dt = cur.mono - prev.mono
            if dt <= 0:
                continue
            n = cur.latency_count - prev.latency_count
            points.append(
                SeriesPoint(
                    t=round(cur.wall, 3),
                    queue_depth=cur.queue_depth,
                    ongoing=cur.ongoing,
                    answered_per_s=max(0.0, cur.answered - prev.answered) / dt,
                    mean_latency_ms=1000 * (cur.latency_sum - prev.latency_sum) / n if n > 0 else None,
                )
            )
        return points


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)


# ------------------------------------------------------------------------------ the document


def _replica(r: ReplicaDetail, model: str, snap: Snapshot, old: Snapshot, dt: float) -> ReplicaStatus:
    # where each rank runs, as the rank itself reports it (its heartbeats): right for ranks that
    # joined from other hosts too; None for a rank not heard from (yet)
    where, devices = r.processes, r.devices
    ranks = []
    for rank, (stage, tp_rank) in enumerate(r.coords):
        host_pid = where[rank] if rank < len(where) else None
        ranks.append(
            RankStatus(
                rank=rank,
                stage=stage,
                tp_rank=tp_rank,
                host=host_pid[0] if host_pid else None,
                pid=host_pid[1] if host_pid else None,
                device=devices[rank] if rank < len(devices) else None,
            )
        )
    probed = r.reports_busy  # the gang reports busy time
    stages = []
    for stage in range(r.pp):

        def mine(lb: dict[str, str], stage: int = stage) -> bool:
            return (
                lb.get("model") == model
                and lb.get("replica") == r.replica_id
                and lb.get("stage") == str(stage)
            )

        measured = probed or any(
            n == "shardserve_stage_busy_seconds_total" and mine(dict(lb)) for n, lb in snap
        )
        busy = total(snap, "shardserve_stage_busy_seconds_total", mine)
        recent = busy - total(old, "shardserve_stage_busy_seconds_total", mine)
        stages.append(
            StageStatus(
                stage=stage,
                busy_s=busy if measured else None,
                busy_fraction_recent=max(0.0, min(1.0, recent / dt)) if measured and dt > 0 else None,
            )
        )
    bubble_key: Key = ("shardserve_pipeline_bubble_fraction", (("model", model), ("replica", r.replica_id)))
    return ReplicaStatus(
        id=r.replica_id,
        model=model,
        state=r.state,
        generation=r.generation,
        hosts=list(dict.fromkeys(k.host for k in ranks if k.host)),
        world_size=r.world_size,
        restarts=r.restarts,
        replaces=r.replaces,
        ranks=ranks,
        inflight_batches=r.inflight_batches,
        age_s=round(time.monotonic() - r.created_at, 3),
        error=one_line(r.error) if r.error else None,
        stages=stages,
        bubble_fraction=snap.get(bubble_key),
    )


def _model_status(entry: ModelEntry, now: Sample, board: StatusBoard) -> ModelStatus:
    """One model's row: state, generation, gangs, its last minute's answers and latency, its queue."""

    def mine(lb: dict[str, str]) -> bool:
        return lb.get("model") == entry.name

    last_minute = board.window(now, WINDOWS_S[0], model=entry.name)
    engine = entry.engine
    health = engine.health() if engine is not None else {}
    return ModelStatus(
        name=entry.name,
        state=entry.state.value,
        reason=entry.reason,
        checkpoint=engine.public_checkpoint()["checkpoint"] if engine is not None else None,
        generation=engine.model.generation if engine is not None else None,
        ready_replicas=health.get("ready_replicas", 0),
        answered_per_s=last_minute.answered_per_s,
        latency_ms=last_minute.latency_ms,
        queue_depth=int(total(now.snap, "shardserve_queue_depth_requests", mine)),
        ongoing_requests=int(total(now.snap, "shardserve_ongoing_requests", mine)),
    )


def collect_status(app: FastAPI) -> StatusResponse:
    """The status document of a running (or starting) app."""
    state = app.state
    settings = state.settings
    board: StatusBoard = state.status
    now = Sample(time.monotonic(), time.time(), read_registry(state.metrics.registry))
    snap = now.snap
    windows = [board.window(now, w) for w in WINDOWS_S]
    repository: ModelRepository | None = getattr(state, "models", None)
    engines = repository.engines() if repository is not None else []
    engine: Engine | None = engines[0] if engines else None  # the default model: the model section
    replicas: list[ReplicaStatus] = []
    model: dict[str, Any] = {"name": settings.models()[0][0] if settings.models() else ""}  # no paths
    plan: dict[str, Any] | None = None
    health: dict[str, Any] = {}
    if engine is not None:
        m = engine.model
        model = {**engine.public_checkpoint(), "name": engine.name, "generation": m.generation}
        plan = m.plan().to_dict()
        old = board.baseline(now, WINDOWS_S[0])
        dt = now.mono - old.mono
        replicas = [_replica(r, e.name, snap, old.snap, dt) for e in engines for r in e.replica_details()]
    if repository is not None:
        health = repository.health()
    if state.shutting_down:
        server_state = "shutting_down"
    elif repository is None:
        server_state = "starting"
    elif "fatal" in health:
        server_state = "failed"
    else:
        server_state = "ready" if repository.ready() else "not_ready"
    autoscaler = None
    if engine is not None and engine.supervisor is not None:
        d = engine.scaling()
        autoscaler = AutoscalerStatus(
            target=d["target"],
            autoscaling=d["autoscaling"],
            pinned=d["pinned"],
            min_replicas=d["min_replicas"],
            max_replicas=d["max_replicas"],
            pool_limit=d["pool_limit"],
            target_ongoing_requests=engine.scaling_config.target_ongoing_requests,
            decisions={k: int(v) for k, v in d["decisions"].items()},
            last_decision=d["last_decision"],
            recent=[Decision(**x) for x in engine.scaling_history()],
        )
    states = by_label(snap, "shardserve_replicas", "state")
    return StatusResponse(
        time=now.wall,
        state=server_state,
        uptime_s=round(now.wall - board.started_wall, 3),
        model=model,
        models=[_model_status(e, now, board) for e in repository.entries.values()] if repository else [],
        placement=(
            PlacementStatus(**repository.placement.describe())
            if repository is not None and repository.placement is not None
            else None
        ),
        precision={
            "dtype": state.precision.name,
            "reason": state.precision.reason,
            "device": settings.device,
            "compile": "on" if state.compile else "off",
        },
        plan=plan,
        api_key_required=bool(settings.api_key),
        replicas=replicas,
        replica_counts={k: int(v) for k, v in states.items()},
        replica_failures=int(total(snap, "shardserve_replica_failures_total")),
        replica_restarts=int(total(snap, "shardserve_replica_restarts_total")),
        retried_windows=int(total(snap, "shardserve_retried_windows_total")),
        queue=QueueStatus(
            depth_requests=int(total(snap, "shardserve_queue_depth_requests")),
            depth_windows=int(total(snap, "shardserve_queue_depth_windows")),
            ongoing_requests=int(total(snap, "shardserve_ongoing_requests")),
            max_queue_size=settings.max_queue_size,
            padding_ratio=total(snap, "shardserve_padding_ratio"),
        ),
        windows=windows,
        series=board.series(now),
        autoscaler=autoscaler,
        last_failure=engine.health().get("last_failure") if engine is not None else None,
        recent_errors=list(board.log.records)[::-1],
        api_workers=[ApiWorkerStatus(**w) for w in state.api_pool.describe()]
        if getattr(state, "api_pool", None)
        else [],
    )
