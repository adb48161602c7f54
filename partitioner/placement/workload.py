"""Request streams for the placement simulator: per-model Gamma arrivals, trace files, burst scenarios.

Owns how a workload is described and turned into a request stream: a ``Trace`` (sorted
``(time_s, model)`` pairs over ``duration_s``). ``ArrivalSpec`` is one model's arrival process, a
Gamma renewal process (inter-arrival shape ``1/cv^2``, scale ``cv^2/rate``: mean ``1/rate``,
coefficient of variation ``cv``; ``cv=1`` is Poisson), optionally active only in ``[start_s, end_s)``.
``Workload`` draws every spec with one seeded numpy ``Generator``; ``load_trace`` reads a recorded
stream (JSON lines ``{"time_s": .., "model": ..}`` or CSV ``time_s,model``); ``fit_arrivals``
estimates each model's rate and CV from a trace; ``alternating_bursts`` is the scenario where the
models take turns at a high rate (AlpaServe's case for multiplexing). PURE LOGIC (numpy only).

    trace = Workload((ArrivalSpec("a", rate=20.0), ArrivalSpec("b", rate=5.0, cv=3.0)), duration_s=60.0).trace()
    trace = alternating_bursts(("a", "b"), burst_rate=150.0, period_s=2.0, duration_s=20.0, seed=1).trace()
    trace = load_trace("observed.jsonl")
    python -m pytest tests/partitioner/placement/test_workload.py -q
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


class WorkloadError(ValueError):
    """A workload or trace that cannot be used; the message prints the numbers."""


@dataclass(frozen=True)
class ArrivalSpec:
    """One model's arrivals: a Gamma process of mean ``rate`` req/s and inter-arrival CV ``cv``,
    active in ``[start_s, end_s)`` of the workload (``end_s`` None: to the end)."""

    model: str
    rate: float
    cv: float = 1.0
    start_s: float = 0.0
    end_s: float | None = None

    def __post_init__(self) -> None:
        problems = []
        if not self.model:
            problems.append("model name is empty")
        if not (math.isfinite(self.rate) and self.rate >= 0):
            problems.append(f"rate={self.rate!r} must be a finite number >= 0 (requests/s)")
        if not (math.isfinite(self.cv) and self.cv > 0):
            problems.append(f"cv={self.cv!r} must be a finite number > 0")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            problems.append(f"start_s={self.start_s!r} must be >= 0")
        if self.end_s is not None and not self.end_s > self.start_s:
            problems.append(f"end_s={self.end_s!r} must be > start_s={self.start_s!r}")
        if problems:
            raise WorkloadError(f"invalid ArrivalSpec for {self.model!r}: " + "; ".join(problems))

    def draw(self, rng: np.random.Generator, *, duration_s: float) -> np.ndarray:
        """Arrival times (seconds, sorted) of this spec inside ``[start_s, min(end_s, duration_s))``."""
        end = duration_s if self.end_s is None else min(self.end_s, duration_s)
        span = end - self.start_s
        if self.rate == 0 or span <= 0:
            return np.empty(0)
        shape, scale = 1.0 / self.cv**2, self.cv**2 / self.rate
        # draw in chunks until the cumulative sum passes the window (mean count = rate * span)
        expected = self.rate * span
        chunk = int(expected + 6 * math.sqrt(expected) * max(1.0, self.cv) + 16)
        gaps = rng.gamma(shape, scale, size=chunk)
        while gaps.sum() < span:
            gaps = np.concatenate([gaps, rng.gamma(shape, scale, size=chunk)])
        times = self.start_s + np.cumsum(gaps)
        return times[times < end]


@dataclass(frozen=True)
class Trace:
    """A request stream: ``requests`` sorted by time, each ``(time_s, model)``, over ``duration_s``."""

    requests: tuple[tuple[float, str], ...]
    duration_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise WorkloadError(f"trace duration_s={self.duration_s!r} must be a finite number > 0")
        times = [t for t, _ in self.requests]
        if any(b < a for a, b in itertools.pairwise(times)):
            raise WorkloadError("trace requests must be sorted by time")
        if times and (times[0] < 0 or times[-1] > self.duration_s):
            raise WorkloadError(
                f"trace times span [{times[0]:g}, {times[-1]:g}] s, outside [0, duration_s={self.duration_s:g}]"
            )

    @functools.cached_property
    def models(self) -> tuple[str, ...]:
        """The models that receive requests, in order of first arrival."""
        return tuple(dict.fromkeys(m for _, m in self.requests))

    def counts(self) -> dict[str, int]:
        """Requests per model."""
        return dict(Counter(m for _, m in self.requests))

    def rates(self) -> dict[str, float]:
        """Mean requests/s per model over ``duration_s``."""
        return {m: n / self.duration_s for m, n in self.counts().items()}


def look_back(arrivals: Iterable[tuple[float, str]], *, now: float, window_s: float) -> Trace:
    """What a re-plan at ``now`` fits: the ``(time, model)`` arrivals of ``(now - window_s, now]`` (on
    any clock), sorted, their times from the window's start, over ``window_s``."""
    since = now - window_s
    got = sorted((min(t - since, window_s), m) for t, m in arrivals if since < t <= now)
    return Trace(tuple(got), duration_s=window_s)


@dataclass(frozen=True)
class Workload:
    """Arrival specs drawn over ``duration_s`` with one seeded generator (same seed: same trace)."""

    arrivals: tuple[ArrivalSpec, ...]
    duration_s: float
    seed: int = 0
    _cache: dict[str, Trace] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arrivals", tuple(self.arrivals))
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise WorkloadError(f"duration_s={self.duration_s!r} must be a finite number > 0")
        if not self.arrivals:
            raise WorkloadError("a workload needs at least one ArrivalSpec")

    def trace(self) -> Trace:
        """The request stream, sorted by time (ties: in spec order); computed once."""
        if "trace" not in self._cache:
            rng = np.random.default_rng(self.seed)
            merged: list[tuple[float, int, str]] = []
            for k, spec in enumerate(self.arrivals):
                merged += [(float(t), k, spec.model) for t in spec.draw(rng, duration_s=self.duration_s)]
            merged.sort()
            requests = tuple((t, m) for t, _, m in merged)
            self._cache["trace"] = Trace(requests, self.duration_s)
            logger.debug("workload seed %d: %d requests in %.1f s", self.seed, len(requests), self.duration_s)
        return self._cache["trace"]

    def requests(self) -> list[tuple[float, str]]:
        """``trace().requests`` as a list of ``(time_s, model)``."""
        return list(self.trace().requests)


def steady(
    models: Sequence[str],
    *,
    rate: float,
    cv: float = 1.0,
    duration_s: float,
    seed: int = 0,
    skew: float = 0.0,
) -> Workload:
    """The models share ``rate`` req/s (the total), each with inter-arrival CV ``cv``: evenly, or with
    ``skew`` > 0 Zipf-like, the ``k``-th model (from 1) in proportion to ``1 / k**skew``."""
    if not models:
        raise WorkloadError("steady() needs at least one model")
    if not (math.isfinite(skew) and skew >= 0):
        raise WorkloadError(f"skew={skew!r} must be a finite number >= 0")
    weights = [1.0 / (k + 1) ** skew for k in range(len(models))]
    shares = [rate * w / sum(weights) for w in weights]
    specs = tuple(ArrivalSpec(m, share, cv) for m, share in zip(models, shares, strict=True))
    return Workload(specs, duration_s=duration_s, seed=seed)


def alternating_bursts(
    models: Sequence[str],
    *,
    burst_rate: float,
    period_s: float,
    duration_s: float,
    base_rate: float = 0.0,
    cv: float = 1.0,
    seed: int = 0,
) -> Workload:
    """The models take turns: in phase ``i`` (``[i*period_s, (i+1)*period_s)``) ``models[i % n]``
    receives ``burst_rate`` req/s, the others ``base_rate`` (0: none)."""
    if not models:
        raise WorkloadError("alternating_bursts() needs at least one model")
    if not (math.isfinite(period_s) and period_s > 0):
        raise WorkloadError(f"period_s={period_s!r} must be a finite number > 0")
    specs = []
    for i in range(math.ceil(duration_s / period_s)):
        start, end = i * period_s, min((i + 1) * period_s, duration_s)
        for k, model in enumerate(models):
            rate = burst_rate if k == i % len(models) else base_rate
            if rate > 0:
                specs.append(ArrivalSpec(model, rate, cv, start_s=start, end_s=end))
    return Workload(tuple(specs), duration_s=duration_s, seed=seed)


def load_trace(path: str | Path, *, duration_s: float | None = None) -> Trace:
    """A recorded stream: JSON lines (``{"time_s": 0.12, "model": "a"}``) or CSV with a header
    ``time_s,model``; sorted on reading. ``duration_s`` defaults to the last arrival time."""
    path = Path(path)
    lines = path.read_text().splitlines()
    rows: list[tuple[float, str]] = []
    jsonl = bool(lines) and lines[0].lstrip().startswith("{")
    if not jsonl:
        header = [h.strip() for h in (lines[0].split(",") if lines else [])]
        if header[:2] != ["time_s", "model"]:
            raise WorkloadError(f"{path}: a CSV trace starts with the header 'time_s,model' (got {header})")
    for n, line in enumerate(lines[0 if jsonl else 1 :], 1 if jsonl else 2):
        if not line.strip():
            continue
        try:
            if jsonl:
                item = json.loads(line)
                t, m = float(item["time_s"]), str(item["model"]).strip()
            else:
                cells = line.split(",")
                t, m = float(cells[0]), cells[1].strip()
        except (KeyError, IndexError, ValueError, TypeError) as err:
            raise WorkloadError(
                f"{path} line {n}: not a time_s,model row: {line.strip()!r} ({err})"
            ) from None
        if not (math.isfinite(t) and t >= 0) or not m:
            raise WorkloadError(
                f"{path} line {n}: time_s={t} must be >= 0 and the model named ({line.strip()!r})"
            )
        rows.append((t, m))
    rows.sort()
    if not rows:
        raise WorkloadError(f"{path}: the trace has no requests")
    end = rows[-1][0] if duration_s is None else duration_s
    return Trace(tuple(rows), duration_s=max(end, 1e-9))


def fit_arrivals(trace: Trace) -> tuple[ArrivalSpec, ...]:
    """Each model's rate (requests / duration) and inter-arrival CV (1 when it has < 3 requests):
    the Gamma process that regenerates a trace like the observed one."""
    by_model: dict[str, list[float]] = {}
    for t, m in trace.requests:
        by_model.setdefault(m, []).append(t)
    specs = []
    for model, times in by_model.items():
        gaps = np.diff(np.asarray(times))
        cv = float(gaps.std() / gaps.mean()) if len(gaps) >= 2 and gaps.mean() > 0 else 1.0
        specs.append(ArrivalSpec(model, len(times) / trace.duration_s, max(cv, 1e-3)))
    return tuple(specs)


def write_trace(path: str | Path, requests: Iterable[tuple[float, str]]) -> None:
    """Write ``(time_s, model)`` pairs as JSON lines (what ``load_trace`` reads)."""
    lines = [json.dumps({"time_s": round(t, 6), "model": m}) for t, m in requests]
    Path(path).write_text("\n".join(lines) + "\n")
