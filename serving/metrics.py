"""Prometheus metrics of one server (a registry per app, so tests can build many apps).

GET /metrics renders ``ServingMetrics.render()``. Names are prefixed ``shardserve_``:

- model_info{model,precision,pp,tp} = 1: the served model (``--served-model-name``, else the loaded
  model's name), its compute dtype and partition; one series, replaced by ``set_model_info`` after
  ``/admin/reload``. The other metrics carry no model label (a server serves one model): join them
  with ``* on() group_left(model) shardserve_model_info`` where a model label is wanted.
- requests_total{endpoint,status}, request_latency_seconds{endpoint} (histogram)
- queue_wait_seconds (submit -> last window dispatched), queue_depth_requests / _windows (gauges)
- batch_size_windows, batch_tokens_padded (histograms), batches_total{reason}, padding_ratio
- replicas{state}, replica_failures_total, replica_restarts_total, retried_windows_total
- autoscale_decisions_total{direction}, autoscale_target_replicas
- stage_busy_seconds_total{replica,stage} and pipeline_bubble_fraction{replica}: the seconds each
  stage's rank spent inside micro-batches, as its heartbeats report them (``serving.fleet.replicas.busy_seconds``,
  at most 0.5 s behind); the bubble fraction
  of a replica is 1 - (sum of stage busy time) / (stages x time the replica had work in flight).
  A gang's series go with the gang (``forget_replica``, when the replica manager retires it): replica
  ids grow with every restart and scale-up, so keeping them would grow /metrics without bound.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServingMetrics:
    """All metric objects of one app, registered in a private registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "shardserve_requests_total",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "shardserve_request_latency_seconds",
            "end-to-end request latency",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "shardserve_queue_wait_seconds",
            "time from admission until the request's last window was dispatched",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "shardserve_queue_depth_requests", "requests waiting for dispatch", registry=r
        )
        self.queue_windows = Gauge(
            "shardserve_queue_depth_windows", "windows waiting for dispatch", registry=r
        )
        self.inflight_requests = Gauge(
            "shardserve_ongoing_requests", "admitted requests not yet answered", registry=r
        )
        self.batch_size = Histogram(
            "shardserve_batch_size_windows", "windows per micro-batch", buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "shardserve_batch_tokens_padded",
            "padded tokens per micro-batch",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.batches = Counter(
            "shardserve_batches_total", "micro-batches dispatched by release reason", ["reason"], registry=r
        )
        self.padding_ratio = Gauge(
            "shardserve_padding_ratio", "padding tokens / padded tokens over all batches", registry=r
        )
        self.replicas = Gauge("shardserve_replicas", "replica gangs by state", ["state"], registry=r)
        self.replica_failures = Counter(
            "shardserve_replica_failures_total",
            "replica gangs that failed (a rank died, raised or stalled, or the gang failed to start)",
            registry=r,
        )
        self.replica_restarts = Counter(
            "shardserve_replica_restarts_total", "gangs restarted after a failure", registry=r
        )
        self.retried_windows = Counter(
            "shardserve_retried_windows_total", "windows re-queued after their replica failed", registry=r
        )
        self.autoscale = Counter(
            "shardserve_autoscale_decisions_total", "applied autoscaling decisions", ["direction"], registry=r
        )
        self.autoscale_target = Gauge(
            "shardserve_autoscale_target_replicas", "replica count the autoscaler asks for", registry=r
        )
        self.model_info = Gauge(
            "shardserve_model_info",
            "the served model (1): its public name, compute dtype and partition (pp x tp ranks per gang)",
            ["model", "precision", "pp", "tp"],
            registry=r,
        )
        self.stage_busy = Counter(
            "shardserve_stage_busy_seconds_total",
            "sampled busy time of each pipeline stage (rank 0 of the stage)",
            ["replica", "stage"],
            registry=r,
        )
        self.bubble = Gauge(
            "shardserve_pipeline_bubble_fraction",
            "1 - stage busy time / (stages x time with work in flight), per replica",
            ["replica"],
            registry=r,
        )

    def set_model_info(self, *, model: str, precision: str, pp: int, tp: int) -> None:
        """Make ``model_info`` name the model now served (the previous series, if any, is dropped)."""
        self.model_info.clear()
        self.model_info.labels(model=model, precision=precision, pp=str(pp), tp=str(tp)).set(1)

    def forget_replica(self, replica_id: str) -> None:
        """Drop the per-replica series (stage busy time, bubble fraction) of a gang that is gone."""
        for metric, names in ((self.stage_busy, ("replica", "stage")), (self.bubble, ("replica",))):
            labelled = {
                tuple(sample.labels[name] for name in names)
                for family in metric.collect()
                for sample in family.samples
                if sample.labels.get("replica") == replica_id
            }
            for values in labelled:
                metric.remove(*values)

    def render(self) -> bytes:
        return generate_latest(self.registry)
