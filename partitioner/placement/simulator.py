"""Discrete-event simulation of a placement serving a request stream: predicted SLO attainment.

Owns the simulated scheduler and its result (``SimConfig``, ``simulate``, ``SimResult``). It mirrors
the server's engine (``serving/engine/batcher.py``, ``admission.py``; knobs of ``SchedulerConfig``
in ``serving/config.py``, which this package may not import: ``SimConfig.from_scheduler`` reads the
same-named attributes) with one window per request:

- the front (HTTP, tokenizing, span decoding: the server process) takes ``overhead_s / 2`` of a
  request on its way in and as much on its way out, one request at a time (a burst is tokenized
  one after the other; answers wait for it too);
- each model has a FIFO queue; a request's deadline is its arrival + the model's SLO;
- admission, at arrival: a request is refused when more than ``max_batch_size`` requests of its
  model are ahead of it (in the front, queued or in flight) and those plus itself cannot be
  computed within ``admission_margin`` of its time to the deadline (less its wait for the front) at
  the model's measured service rate: as the server's ledger measures it, requests completed per
  second with a batch of the model in flight, averaged over ``RATE_TAU_S`` busy seconds (none
  before the first completion: then everything is admitted);
- a micro-batch holds ONE model's requests, up to ``max_batch_size``; each model sends its batches
  to the groups holding it, at most ``max_inflight`` in flight on each (a model's own cap on a shared
  group, as each model's engine keeps it on a shared gang: a burst of one model delays another's
  micro-batch by at most that many of its own), to the least-loaded one with room (fewest of its
  micro-batches in flight, then the lowest index); a batch goes at once unless
  ``max_queue_delay_s`` > 0 (then a partial batch waits until its oldest request has waited that
  long, unless a group holding the model has none of its batches in flight, as the server's batcher
  releases to an idle replica; ``wait_when_idle``: it waits then too); requests whose deadline
  passed while queued expire (never computed);
- a micro-batch runs stage by stage: each stage computes one micro-batch at a time in the order
  they were sent (whatever their model), so latency = sum of stages on an idle pipeline and
  throughput is bounded by the slowest stage.

A request meets its SLO when its answer leaves the front within it; refused, expired and late
requests are misses. PURE LOGIC: a heap of completion, front and batch-timer events merged with the
sorted arrivals.

    result = simulate(placement, profiles, trace, slo_s=0.05)
    result.attainment, result.per_model["a"].p99_s
    python -m pytest tests/partitioner/placement/test_simulator.py -q
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardserve.partitioner.placement.latency import ModelProfile, PlacementError, by_name
from shardserve.partitioner.placement.layout import Placement
from shardserve.partitioner.placement.workload import Trace

logger = logging.getLogger(__name__)

_COMPLETE, _TIMER, _ENTER = 0, 1, 2
COUNT_KEYS = ("requests", "good", "late", "rejected", "expired")
RATE_TAU_S = 10.0  # the service rate's averaging time (busy seconds), as the server's ledger


@dataclass(frozen=True)
class SimConfig:
    """The scheduler knobs the simulation uses (``SchedulerConfig`` names; ``max_inflight`` is its
    ``max_inflight_per_replica``)."""

    max_batch_size: int = 32
    max_inflight: int = 2
    max_queue_delay_s: float = 0.0
    wait_when_idle: bool = False
    admission: bool = True
    overhead_s: float = 0.0  # a request's time in the front (HTTP, tokenizing, decoding), in and out
    admission_margin: float = 1.0  # the share of its SLO the work ahead of a request must fit in

    def __post_init__(self) -> None:
        problems = []
        for name in ("max_batch_size", "max_inflight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1")
        for name in ("max_queue_delay_s", "overhead_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                problems.append(f"{name}={getattr(self, name)!r} must be >= 0")
        if problems:
            raise PlacementError("invalid SimConfig: " + "; ".join(problems))

    @classmethod
    def from_scheduler(cls, scheduler: Any, *, admission: bool = True, overhead_s: float = 0.0) -> SimConfig:
        """From a ``shardserve.serving.config.SchedulerConfig`` (read by attribute name)."""
        return cls(
            max_batch_size=scheduler.max_batch_size,
            max_inflight=scheduler.max_inflight_per_replica,
            max_queue_delay_s=scheduler.max_queue_delay_ms / 1000.0,
            wait_when_idle=scheduler.wait_when_idle,
            admission=admission,
            overhead_s=overhead_s,
            admission_margin=scheduler.admission_margin,
        )


@dataclass(frozen=True)
class ModelStats:
    """One model's (or, as ``"*"``, every model's) outcome."""

    model: str
    requests: int
    good: int  # finished within the SLO
    late: int  # finished after it
    rejected: int  # refused at arrival (admission, or no group holds the model)
    expired: int  # deadline passed while queued
    p50_s: float  # latency percentiles of the finished requests (nan when none)
    p99_s: float

    @property
    def attainment(self) -> float:
        """Fraction of the requests finished within the SLO (1.0 when there were none)."""
        return self.good / self.requests if self.requests else 1.0

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("requests", "good", "late", "rejected", "expired")}
        out.update(
            attainment=round(self.attainment, 6),
            p50_ms=None if math.isnan(self.p50_s) else round(self.p50_s * 1000, 3),
            p99_ms=None if math.isnan(self.p99_s) else round(self.p99_s * 1000, 3),
        )
        return out


@dataclass(frozen=True)
class SimResult:
    """Per-model and overall stats of one simulation over ``duration_s``."""

    per_model: dict[str, ModelStats]
    overall: ModelStats
    duration_s: float

    @property
    def attainment(self) -> float:
        """Fraction of all requests finished within their SLO."""
        return self.overall.attainment

    @property
    def goodput(self) -> float:
        """Requests/s finished within their SLO."""
        return self.overall.good / self.duration_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "attainment": round(self.attainment, 6),
            "goodput_rps": round(self.goodput, 3),
            "overall": self.overall.to_dict(),
            "models": {
                m: {**s.to_dict(), "goodput_rps": round(s.good / self.duration_s, 3)}
                for m, s in self.per_model.items()
            },
        }


class _Group:
    """Mutable simulation state of one group."""

    __slots__ = ("free_at", "inflight", "models", "pp", "tp")

    def __init__(self, pp: int, tp: int, models: tuple[str, ...]) -> None:
        self.pp, self.tp, self.models = pp, tp, models
        self.free_at = [0.0] * pp  # when each stage finishes its last accepted micro-batch
        self.inflight = dict.fromkeys(models, 0)  # micro-batches in flight per model


def simulate(
    placement: Placement,
    profiles: Sequence[ModelProfile] | Mapping[str, ModelProfile],
    trace: Trace,
    *,
    slo_s: float | Mapping[str, float],
    config: SimConfig | None = None,
) -> SimResult:
    """Serve ``trace`` with ``placement`` (see module doc); per-model ``slo_s`` or one for all."""
    models, counts, latencies = simulate_parts(placement, profiles, trace, slo_s=slo_s, config=config)
    return _result(models, counts, latencies, trace.duration_s)


def simulate_parts(
    placement: Placement,
    profiles: Sequence[ModelProfile] | Mapping[str, ModelProfile],
    trace: Trace,
    *,
    slo_s: float | Mapping[str, float],
    config: SimConfig | None = None,
) -> tuple[tuple[str, ...], dict[str, dict[str, int]], dict[str, list[float]]]:
    """``simulate``'s raw outcome: the models (profile order first), each one's counts (requests,
    good, late, rejected, expired) and the latencies of its finished requests."""
    cfg = config or SimConfig()
    prof = by_name(profiles)
    models = tuple(dict.fromkeys((*(m for m in prof if m in trace.models), *trace.models, *placement.models)))
    if isinstance(slo_s, Mapping) and (no_slo := [m for m in trace.models if m not in slo_s]):
        raise PlacementError(f"no SLO for models {no_slo} (have {sorted(slo_s)})")
    slo = {m: slo_s[m] if isinstance(slo_s, Mapping) else slo_s for m in models if m in trace.models}
    for m, s in slo.items():
        if not (math.isfinite(s) and s > 0):
            raise PlacementError(f"SLO of model {m!r} is {s!r} s: must be > 0")
    for g in placement.groups:
        for m in g.models:
            if m not in prof:
                raise PlacementError(f"no profile for model {m!r} placed on devices {g.devices}")
            if not prof[m].latency.has(g.pp, g.tp):
                raise PlacementError(
                    f"model {m!r} has no latencies for pp={g.pp} tp={g.tp} "
                    f"(have {list(prof[m].latency.configs)})"
                )
    groups = [_Group(g.pp, g.tp, g.models) for g in placement.groups]
    holders = {m: [k for k, g in enumerate(placement.groups) if m in g.models] for m in models}
    queues: dict[str, deque[tuple[float, float]]] = {m: deque() for m in models}  # (arrival, deadline)
    busy = dict.fromkeys(models, 0)  # micro-batches in flight per model
    computing = dict.fromkeys(models, 0)  # requests in flight per model
    entering = dict.fromkeys(models, 0)  # requests admitted, still in the front (being tokenized)
    timer_at = dict.fromkeys(models, math.inf)  # pending max_queue_delay wake-up per model
    # the measured service rate, as the server's ledger keeps it: requests per busy second (a batch
    # of the model in flight), an exponentially weighted average over RATE_TAU_S busy seconds
    rate_done, rate_busy = dict.fromkeys(models, 0.0), dict.fromkeys(models, 0.0)
    busy_since: dict[str, float] = {}
    latencies: dict[str, list[float]] = {m: [] for m in models}
    counts = {m: dict.fromkeys(COUNT_KEYS, 0) for m in models}
    events: list[tuple[float, int, int, int, str, tuple[float, ...]]] = []
    seq = 0
    delay, max_b, max_inflight = cfg.max_queue_delay_s, cfg.max_batch_size, cfg.max_inflight
    front_s = cfg.overhead_s / 2  # the front's time per request on its way in, and again on its way out
    front_free = 0.0  # when the front (one at a time) is done with what it has

    def dispatch(m: str, now: float) -> None:
        """Send model ``m``'s releasable batches to its least-loaded groups with room."""
        nonlocal seq
        q = queues[m]
        while True:
            while q and q[0][1] <= now:  # deadline passed while queued: expires uncomputed
                q.popleft()
                counts[m]["expired"] += 1
            if not q:
                return
            ready_at = q[0][0] + delay
            if (
                len(q) < max_b
                and ready_at > now
                and (cfg.wait_when_idle or all(groups[k].inflight[m] for k in holders[m]))
            ):  # a partial batch waits for more (unless a replica is idle)
                if ready_at < timer_at[m]:
                    timer_at[m] = ready_at
                    heapq.heappush(events, (ready_at, seq, _TIMER, -1, m, ()))
                    seq += 1
                return
            k = -1  # the replica with room and the fewest of m's batches in flight (ties: lowest index)
            for h in holders[m]:
                n = groups[h].inflight[m]
                if n < max_inflight and (k < 0 or n < groups[k].inflight[m]):
                    k = h
            if k < 0:
                return
            g = groups[k]
            batch = [q.popleft() for _ in range(min(max_b, len(q)))]
            t = now
            for s, lat in enumerate(prof[m].latency.stages(g.pp, g.tp, len(batch))):
                t = max(t, g.free_at[s]) + lat  # each stage takes micro-batches in the order sent
                g.free_at[s] = t
            g.inflight[m] += 1
            if busy[m] == 0:
                busy_since[m] = now
            busy[m] += 1
            computing[m] += len(batch)
            heapq.heappush(events, (t, seq, _COMPLETE, k, m, tuple(a for a, _ in batch)))
            seq += 1

    def completed(k: int, m: str, now: float, arrivals: tuple[float, ...]) -> None:
        nonlocal front_free
        groups[k].inflight[m] -= 1
        busy[m] -= 1
        computing[m] -= len(arrivals)
        decay = math.exp(-(now - busy_since[m]) / RATE_TAU_S)
        rate_done[m] = rate_done[m] * decay + len(arrivals)
        rate_busy[m] = rate_busy[m] * decay + now - busy_since[m]
        busy_since[m] = now
        c, limit = counts[m], slo[m]
        for a in arrivals:  # each answer through the front, one at a time
            front_free = max(now, front_free) + front_s
            lat = front_free - a
            latencies[m].append(lat)
            if lat <= limit + 1e-12:
                c["good"] += 1
            else:
                c["late"] += 1

    def admitted(m: str, now: float) -> bool:
        """The server's admission: refused when more than a batch is ahead (entering, queued or in
        flight) and it cannot be computed in ``admission_margin`` of the time left at the measured rate."""
        ahead = entering[m] + len(queues[m]) + computing[m]
        if not cfg.admission or ahead <= max_b or rate_busy[m] <= 0:
            return True
        left = slo[m] - max(0.0, front_free - now)  # the wait for the front is spent first
        return (
            (ahead + 1) * rate_busy[m] / rate_done[m] <= cfg.admission_margin * left
            if rate_done[m]
            else False
        )

    requests = trace.requests
    i, n_req = 0, len(requests)
    while i < n_req or events:
        if events and (i >= n_req or events[0][0] <= requests[i][0]):
            now, _, kind, k, m, arrivals = heapq.heappop(events)
            if kind == _COMPLETE:
                completed(k, m, now, arrivals)
            elif kind == _ENTER:
                entering[m] -= 1
                queues[m].append((arrivals[0], arrivals[0] + slo[m]))
            elif timer_at[m] == now:
                timer_at[m] = math.inf
            dispatch(m, now)
            continue
        now, m = requests[i]
        i += 1
        counts[m]["requests"] += 1
        if not holders[m] or not admitted(m, now):
            counts[m]["rejected"] += 1
            continue
        if front_s == 0:
            queues[m].append((now, now + slo[m]))
            dispatch(m, now)
            continue
        front_free = max(now, front_free) + front_s  # parsed and tokenized, then queued
        entering[m] += 1
        heapq.heappush(events, (front_free, seq, _ENTER, -1, m, (now,)))
        seq += 1
    for m, q in queues.items():  # still queued at the end: unreachable (the loop drains), kept honest
        counts[m]["expired"] += len(q)
    return models, counts, latencies


def model_stats(name: str, c: Mapping[str, int], lat: Sequence[float] | np.ndarray) -> ModelStats:
    """``ModelStats`` from counts and the finished requests' latencies."""
    p50, p99 = np.percentile(lat, [50, 99]).tolist() if len(lat) else (math.nan, math.nan)
    return ModelStats(name, c["requests"], c["good"], c["late"], c["rejected"], c["expired"], p50, p99)


def _result(
    models: tuple[str, ...],
    counts: dict[str, dict[str, int]],
    latencies: dict[str, list[float]],
    duration_s: float,
) -> SimResult:
    per_model = {m: model_stats(m, counts[m], latencies[m]) for m in models if counts[m]["requests"]}
    total = {k: sum(counts[m][k] for m in models) for k in COUNT_KEYS}
    overall = model_stats("*", total, [x for m in models for x in latencies[m]])
    return SimResult(per_model, overall, duration_s)
