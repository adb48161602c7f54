"""Prometheus metrics of one server (a registry per app, so tests can build many apps).

GET /metrics renders ``ServingMetrics.render()``. Names are prefixed ``shardserve_``:

Every series of a model's work carries its ``model`` label (its public name: ``--model NAME=...``,
``--served-model-name`` or the loaded model's name); the engine, the dispatcher and the fleet of one
model write through ``ServingMetrics.for_model(name)`` (a ``ModelMetrics``: the same attribute names,
the label bound), and ``forget_model`` drops a model's series when it is unloaded.

- model_info{model,precision,pp,tp} = 1: each served model, its compute dtype and partition; one
  series per model, replaced by ``set_model_info`` after a reload.
- requests_total{model,endpoint,status}, request_latency_seconds{model,endpoint} (histogram): every
  HTTP answer; ``model`` is empty for routes of no model (health, metrics, admin)
- queue_wait_seconds (submit -> last window dispatched), queue_depth_requests / _windows (gauges)
- what Triton's statistics extension reports (``serving/frontend/v2/statistics.py`` reads them). The
  engine writes them, so requests of every protocol count, whatever their endpoint:
  - inference_request_duration_seconds{model,outcome} (histogram): each request the engine admitted,
    from its arrival (before tokenizing) until ``Engine.wait`` ends: answered (``success``) or failed
    (``fail``: 504 deadline, 503 replica failure or shutdown, 500 decoding, the client gone);
  - inferences_total: pairs answered (a request of N pairs is N inferences);
    last_inference_timestamp_seconds: Unix time the last admitted request ended;
  - request_phase_seconds{model,phase} (histogram): the phases of each ANSWERED request, observed
    together when it is answered (Triton's: every phase counts the same requests): compute_input
    (tokenizing and windowing), queue (queued until its last window is dispatched), compute_infer
    (that dispatch until the logits of all its windows are back), compute_output (span decoding);
  - execution_seconds{model,batch_size} (summary: count and sum): each micro-batch that came back with
    logits, dispatch to result, by its windows (``batch_size``).
- batch_size_windows, batch_tokens_padded (histograms), batches_total{reason}, padding_ratio
- api_workers, api_worker_restarts_total: the API processes of ``--api-workers N`` alive, and replaced
  (``serving/frontend/api_workers.py``); their requests count in the series above like this process's
- replicas{state}, replica_failures_total, replica_restarts_total, retried_windows_total
- autoscale_decisions_total{direction}, autoscale_target_replicas
- stage_busy_seconds_total{replica,stage} and pipeline_bubble_fraction{replica}: the seconds each
  stage's rank spent inside micro-batches, as its heartbeats report them (``shardserve.serving.fleet.replicas.busy_seconds``,
  at most 0.5 s behind); the bubble fraction
  of a replica is 1 - (sum of stage busy time) / (stages x time the replica had work in flight).
  A gang's series go with the gang (``forget_replica``, when the replica manager retires it): replica
  ids grow with every restart and scale-up, so keeping them would grow /metrics without bound.
"""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest
from prometheus_client.metrics import MetricWrapperBase

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# a request's phases (tokenizing, decoding: often under a millisecond; execution)
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


# the attributes of ``ServingMetrics`` that a model's engine and fleet write (each labelled ``model`` first)
MODEL_METRICS = (
    "queue_wait",
    "queue_depth",
    "queue_windows",
    "inflight_requests",
    "batch_size",
    "batch_tokens",
    "batches",
    "padding_ratio",
    "replicas",
    "replica_failures",
    "replica_restarts",
    "retried_windows",
    "autoscale",
    "autoscale_target",
    "stage_busy",
    "bubble",
    "request_duration",
    "inferences",
    "last_inference",
    "request_phase",
    "context_cache",
    "executions",
)


class RequestCounter(Protocol):
    """Where an answered HTTP request is counted: ``ServingMetrics``, or in an API process the relay to
    the core's (``serving/engine/core_client.py``)."""

    def count_request(self, *, model: str, endpoint: str, status: int, seconds: float) -> None: ...


class ServingMetrics:
    """All metric objects of one app, registered in a private registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._children: dict[tuple, Any] = {}  # labelled series kept by ``child``
        self._models: dict[str, ModelMetrics] = {}  # ``for_model``'s
        m = ["model"]
        self.requests = Counter(
            "shardserve_requests_total",
            "HTTP requests by model, endpoint and status",
            [*m, "endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "shardserve_request_latency_seconds",
            "end-to-end request latency",
            [*m, "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "shardserve_queue_wait_seconds",
            "time from admission until the request's last window was dispatched",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "shardserve_queue_depth_requests", "requests waiting for dispatch", m, registry=r
        )
        self.queue_windows = Gauge(
            "shardserve_queue_depth_windows", "windows waiting for dispatch", m, registry=r
        )
        self.inflight_requests = Gauge(
            "shardserve_ongoing_requests", "admitted requests not yet answered", m, registry=r
        )
        self.batch_size = Histogram(
            "shardserve_batch_size_windows",
            "windows per micro-batch",
            m,
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "shardserve_batch_tokens_padded",
            "padded tokens per micro-batch",
            m,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.batches = Counter(
            "shardserve_batches_total",
            "micro-batches dispatched by release reason",
            [*m, "reason"],
            registry=r,
        )
        self.padding_ratio = Gauge(
            "shardserve_padding_ratio", "padding tokens / padded tokens over all batches", m, registry=r
        )
        self.replicas = Gauge("shardserve_replicas", "replica gangs by state", [*m, "state"], registry=r)
        self.replica_failures = Counter(
            "shardserve_replica_failures_total",
            "replica gangs that failed (a rank died, raised or stalled, or the gang failed to start)",
            m,
            registry=r,
        )
        self.replica_restarts = Counter(
            "shardserve_replica_restarts_total", "gangs restarted after a failure", m, registry=r
        )
        self.retried_windows = Counter(
            "shardserve_retried_windows_total", "windows re-queued after their replica failed", m, registry=r
        )
        self.autoscale = Counter(
            "shardserve_autoscale_decisions_total",
            "applied autoscaling decisions",
            [*m, "direction"],
            registry=r,
        )
        self.autoscale_target = Gauge(
            "shardserve_autoscale_target_replicas", "replica count the autoscaler asks for", m, registry=r
        )
        self.api_workers = Gauge(
            "shardserve_api_workers",
            "API processes alive (--api-workers; 0 when HTTP runs in this one)",
            registry=r,
        )
        self.api_worker_restarts = Counter(
            "shardserve_api_worker_restarts_total", "API processes replaced after they died", registry=r
        )
        self.model_info = Gauge(
            "shardserve_model_info",
            "each served model (1): its public name, compute dtype and partition (pp x tp ranks per gang)",
            [*m, "precision", "pp", "tp"],
            registry=r,
        )
        self.stage_busy = Counter(
            "shardserve_stage_busy_seconds_total",
            "sampled busy time of each pipeline stage (rank 0 of the stage)",
            [*m, "replica", "stage"],
            registry=r,
        )
        self.bubble = Gauge(
            "shardserve_pipeline_bubble_fraction",
            "1 - stage busy time / (stages x time with work in flight), per replica",
            [*m, "replica"],
            registry=r,
        )

        self.request_duration = Histogram(
            "shardserve_inference_request_duration_seconds",
            "requests the engine admitted, arrival to answer (outcome=success) or failure (outcome=fail)",
            [*m, "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inferences = Counter(
            "shardserve_inferences", "pairs answered (a request of N pairs: N inferences)", m, registry=r
        )
        self.last_inference = Gauge(
            "shardserve_last_inference_timestamp_seconds",
            "Unix time the last admitted request ended",
            m,
            registry=r,
        )
        self.request_phase = Histogram(
            "shardserve_request_phase_seconds",
            "phases of each answered request: compute_input (tokenizing), queue, compute_infer (its last "
            "window's dispatch until all its logits are back), compute_output (span decoding)",
            [*m, "phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.context_cache = Counter(
            "shardserve_context_cache_lookups",
            "contexts looked up in the tokenized-context cache (--context-cache-mb): hit (not tokenized "
            "again) or miss; a context given twice in one request is looked up once",
            [*m, "result"],
            registry=r,
        )
        self.executions = Summary(
            "shardserve_execution_seconds",
            "micro-batches that came back with logits: dispatch to result, by windows in the batch",
            [*m, "batch_size"],
            registry=r,
        )

    def count_request(self, *, model: str, endpoint: str, status: int, seconds: float) -> None:
        """One answered HTTP request of a question-answering endpoint: ``requests_total`` and latency."""
        self.child(self.requests, model=model, endpoint=endpoint, status=str(status)).inc()
        self.child(self.latency, model=model, endpoint=endpoint).observe(seconds)

    def child(self, metric: MetricWrapperBase, **labels: str) -> Any:
        """``metric.labels(**labels)``, kept: prometheus_client's ``labels`` validates and locks on every
        call, a cost paid per request on the hot path. ``remove_where`` forgets what it kept."""
        key = (id(metric), *labels.items())
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(**labels)
        return found

    def for_model(self, model: str) -> ModelMetrics:
        """The metrics one model's engine and fleet write, with its ``model`` label bound (one per model
        until ``forget_model``)."""
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = ModelMetrics(self, model)
        return found

    def forget_model(self, model: str) -> None:
        """Drop every series of ``model`` (it was unloaded): /metrics names only the models served."""
        self._models.pop(model, None)
        for name in (*MODEL_METRICS, "requests", "latency", "model_info"):
            self.remove_where(getattr(self, name), model=model)

    def remove_where(self, metric: MetricWrapperBase, **match: str) -> None:
        """Remove the series of ``metric`` whose labels include ``match``."""
        names = metric._labelnames
        labelled = {
            tuple(sample.labels[n] for n in names)
            for family in metric.collect()
            for sample in family.samples
            if all(sample.labels.get(k) == v for k, v in match.items())
        }
        for values in labelled:
            metric.remove(*values)
        self._children.clear()  # a kept child of a removed series would write where nobody reads

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Bound:
    """One metric with its ``model`` label bound: ``.labels(**rest)`` for the others, or the child's
    ``inc`` / ``set`` / ``observe`` when ``model`` is its only label."""

    def __init__(self, metrics: ServingMetrics, metric: MetricWrapperBase, model: str) -> None:
        self.metrics, self.metric, self.model = metrics, metric, model

    def labels(self, **rest: str) -> Any:
        return self.metrics.child(self.metric, model=self.model, **rest)

    def __getattr__(self, name: str) -> Any:  # inc, set, observe of the model's own series
        return getattr(self.metrics.child(self.metric, model=self.model), name)


class ModelMetrics:
    """The metrics of one model (``ServingMetrics.for_model``): the attributes ``MODEL_METRICS`` names,
    each with the model's label bound, and the model's ``model_info`` and per-replica series."""

    def __init__(self, metrics: ServingMetrics, model: str) -> None:
        self.all, self.model = metrics, model
        for name in MODEL_METRICS:
            setattr(self, name, _Bound(metrics, getattr(metrics, name), model))

    def set_model_info(self, *, precision: str, pp: int, tp: int) -> None:
        """Make ``model_info`` describe this model as now served (its previous series is dropped)."""
        self.all.remove_where(self.all.model_info, model=self.model)
        self.all.model_info.labels(model=self.model, precision=precision, pp=str(pp), tp=str(tp)).set(1)

    def forget_replica(self, replica_id: str) -> None:
        """Drop the per-replica series (stage busy time, bubble fraction) of a gang that is gone."""
        for metric in (self.all.stage_busy, self.all.bubble):
            self.all.remove_where(metric, model=self.model, replica=replica_id)
