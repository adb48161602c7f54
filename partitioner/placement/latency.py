"""What the placement simulator knows of a model: its weights' size and its per-stage latencies.

Owns ``LatencyModel`` (per parallel config ``(pp, tp)``, the time each pipeline stage spends on a
micro-batch of ``b`` requests, from a measured table) and ``ModelProfile`` (a model's name, parameter
bytes, activation allowance and latency model). PURE LOGIC. A table maps batch sizes to stage
times: one number (every stage takes that long) or one per stage. Between measured batch sizes
the time is interpolated linearly; above the largest it is extrapolated along the last segment;
below the smallest it shrinks in proportion to the batch (a table of one batch size therefore
means no batching gain). ``partitioner/placement/cost_profile.py`` builds one from the analytic
cost model.

    lat = LatencyModel({(1, 1): {1: 0.010, 8: 0.050}, (2, 1): {1: (0.006, 0.006), 8: (0.027, 0.027)}})
    lat.stages(2, 1, 4)   # -> (0.015, 0.015): 3/7 of the way from batch 1 to batch 8
    ModelProfile("a", param_bytes=90_000_000, latency=lat)
    measured = MeasuredLatency(lat, overhead_s=0.004); measured.write("profile.json")
    MeasuredLatency.read("profile.json")      # what benchmarks/bench_multimodel.py measured
    python -m pytest tests/partitioner/placement/test_simulator.py -q
"""

from __future__ import annotations

import bisect
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ParallelConfig = tuple[int, int]  # (pp, tp)


class PlacementError(ValueError):
    """A profile, placement or search that cannot be; the message prints the numbers (``shardserve
    plan --placement`` reports it as one line, exit 2). A ``ValueError``, not the cost model's
    ``InfeasiblePlanError``, so that simulating imports no torch."""


def _stage_tuple(value: float | Sequence[float], pp: int, where: str) -> tuple[float, ...]:
    values = (float(value),) * pp if isinstance(value, int | float) else tuple(float(v) for v in value)
    if len(values) != pp:
        raise PlacementError(f"{where}: {len(values)} stage times for pp={pp}")
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise PlacementError(f"{where}: stage times must be finite and > 0 (got {values})")
    return values


@dataclass(frozen=True)
class LatencyModel:
    """Stage seconds of a micro-batch, per ``(pp, tp)`` and batch size (see module doc)."""

    table: Mapping[ParallelConfig, Mapping[int, float | Sequence[float]]]
    _points: dict[ParallelConfig, tuple[list[int], list[tuple[float, ...]]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _memo: dict[tuple[int, int, int], tuple[float, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.table:
            raise PlacementError("a LatencyModel needs at least one (pp, tp) entry")
        for key, by_batch in self.table.items():
            if not (
                isinstance(key, tuple) and len(key) == 2 and all(isinstance(x, int) and x >= 1 for x in key)
            ):
                raise PlacementError(f"latency table key {key!r} must be (pp, tp) with integers >= 1")
            pp, tp = key
            if not by_batch:
                raise PlacementError(f"latency table for pp={pp} tp={tp} has no batch sizes")
            sizes = sorted(by_batch)
            if sizes[0] < 1 or not all(isinstance(b, int) for b in sizes):
                raise PlacementError(
                    f"latency table for pp={pp} tp={tp}: batch sizes {sizes} must be integers >= 1"
                )
            stages = [
                _stage_tuple(by_batch[b], pp, f"latency table pp={pp} tp={tp} batch {b}") for b in sizes
            ]
            self._points[key] = (sizes, stages)

    @property
    def configs(self) -> tuple[ParallelConfig, ...]:
        """The ``(pp, tp)`` configs this model has latencies for, sorted."""
        return tuple(sorted(self._points))

    def points(self, pp: int, tp: int = 1) -> dict[int, tuple[float, ...]]:
        """The table's rows of ``(pp, tp)``: batch size -> stage times, as given."""
        sizes, stages = self._points[(pp, tp)]
        return dict(zip(sizes, stages, strict=True))

    def has(self, pp: int, tp: int = 1) -> bool:
        """Whether ``(pp, tp)`` is in the table."""
        return (pp, tp) in self._points

    def stages(self, pp: int, tp: int, batch: int) -> tuple[float, ...]:
        """Seconds each of the ``pp`` stages spends on a micro-batch of ``batch`` requests."""
        key = (pp, tp, batch)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        if (pp, tp) not in self._points:
            raise PlacementError(f"no latencies for pp={pp} tp={tp} (have {list(self.configs)})")
        if batch < 1:
            raise PlacementError(f"batch={batch} must be >= 1")
        sizes, stages = self._points[(pp, tp)]
        if batch <= sizes[0] or len(sizes) == 1:
            out = tuple(s * batch / sizes[0] for s in stages[0])  # in proportion to the batch
        else:
            # the segment [sizes[hi-1], sizes[hi]] holding batch, or the last one past the table
            hi = min(bisect.bisect_left(sizes, batch), len(sizes) - 1)
            a_b, b_b = sizes[hi - 1], sizes[hi]
            f = (batch - a_b) / (b_b - a_b)
            # past the table a stage never gets faster than at the largest measured batch
            out = tuple(
                max(a + f * (b - a), b if batch > b_b else 0.0)
                for a, b in zip(stages[hi - 1], stages[hi], strict=True)
            )
        self._memo[key] = out
        return out

    def latency(self, pp: int, tp: int, batch: int = 1) -> float:
        """Seconds from dispatch to result of one micro-batch on an idle pipeline: the sum of stages."""
        return sum(self.stages(pp, tp, batch))

    def capacity(self, pp: int, tp: int, batch: int, *, max_inflight: int) -> float:
        """Requests/s of a saturated pipeline at micro-batches of ``batch``: the slowest stage bounds
        it, and so do ``max_inflight`` micro-batches each in flight for the whole pipeline's latency."""
        st = self.stages(pp, tp, batch)
        return batch / max(max(st), sum(st) / max_inflight)


@dataclass(frozen=True)
class ModelProfile:
    """A model as the placement sees it: ``param_bytes`` of weights, ``activation_bytes`` a device
    reserves for the working set of the micro-batch it computes (the largest over the models it
    holds counts once), and its ``latency`` model. ``stage_bytes`` (optional, per ``(pp, tp)``): the
    weight bytes on one device of each stage (the embeddings make stage 0 heavier); without it the
    weights split evenly over a group's ``pp * tp`` devices."""

    name: str
    param_bytes: int
    latency: LatencyModel
    activation_bytes: int = 0
    stage_bytes: Mapping[ParallelConfig, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if not self.name:
            problems.append("name is empty")
        if not (isinstance(self.param_bytes, int) and self.param_bytes > 0):
            problems.append(f"param_bytes={self.param_bytes!r} must be an integer > 0")
        if not (isinstance(self.activation_bytes, int) and self.activation_bytes >= 0):
            problems.append(f"activation_bytes={self.activation_bytes!r} must be an integer >= 0")
        for (pp, tp), per_stage in self.stage_bytes.items():
            if len(per_stage) != pp or min(per_stage) < 0:
                problems.append(f"stage_bytes for pp={pp} tp={tp} must be {pp} sizes >= 0 (got {per_stage})")
        if problems:
            raise PlacementError(f"invalid ModelProfile {self.name!r}: " + "; ".join(problems))

    def weight_bytes(self, pp: int, tp: int, stage: int) -> int:
        """This model's weight bytes on one device of ``stage`` in a ``pp x tp`` group."""
        per_stage = self.stage_bytes.get((pp, tp))
        return per_stage[stage] if per_stage is not None else -(-self.param_bytes // (pp * tp))


def by_name(profiles: Sequence[ModelProfile] | Mapping[str, ModelProfile]) -> dict[str, ModelProfile]:
    """Profiles keyed by name (a mapping is checked to be keyed by its profiles' names)."""
    items = list(profiles.values()) if isinstance(profiles, Mapping) else list(profiles)
    out: dict[str, ModelProfile] = {}
    for p in items:
        if p.name in out:
            raise PlacementError(f"two profiles are named {p.name!r}")
        out[p.name] = p
    if isinstance(profiles, Mapping) and set(profiles) != set(out):
        raise PlacementError(f"profile keys {sorted(profiles)} differ from their names {sorted(out)}")
    return out


@dataclass(frozen=True)
class MeasuredLatency:
    """A measured ``LatencyModel`` (every model of the same shape runs at these stage times) and the
    time a request spends outside the devices (``overhead_s``: HTTP, tokenizing, span decoding), as a
    JSON file: ``{"overhead_s": 0.004, "stages": {"1x1": {"1": [0.033], "4": [0.117]}, "2x1": ...}}``
    (keys ``PPxTP``, then batch size, then one time per stage)."""

    latency: LatencyModel
    overhead_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        stages = {
            f"{pp}x{tp}": {str(b): list(t) for b, t in self.latency.points(pp, tp).items()}
            for pp, tp in self.latency.configs
        }
        return {"overhead_s": self.overhead_s, "stages": stages}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> MeasuredLatency:
        """The profile in ``path``; ``PlacementError`` naming what is wrong with it."""
        try:
            body = json.loads(Path(path).read_text())
            table = {
                tuple(int(x) for x in key.split("x")): {int(b): t for b, t in by_batch.items()}
                for key, by_batch in body["stages"].items()
            }
            overhead = float(body.get("overhead_s", 0.0))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise PlacementError(f"latency profile {path}: {type(err).__name__}: {err}") from None
        if not (math.isfinite(overhead) and overhead >= 0):
            raise PlacementError(f"latency profile {path}: overhead_s={overhead!r} must be >= 0")
        return cls(LatencyModel(table), overhead)  # type: ignore[arg-type]
