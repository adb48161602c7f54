"""How much more load a fixed placement absorbs: the largest rate (or CV) at a target SLO attainment.

Owns ``largest_passing`` (a monotone search: doubling or halving from a start, then geometric
bisection to a relative tolerance) and ``headroom`` (the largest value of a workload knob, the total
rate or the inter-arrival CV, at which the simulated attainment of ``placement`` stays at or above
``target``), AlpaServe's two measures of a placement: the rate and the burstiness it serves within
its SLOs. The placement is held fixed (the one chosen for the nominal workload); every trial draws
its own trace with the workload's seed. PURE LOGIC.

    rate = headroom(placement, profiles, lambda r: steady(names, rate=r, duration_s=30).trace(),
                    start=10.0, slo_s=0.1, target=0.99)
    python -m pytest tests/partitioner/placement/test_headroom.py -q
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence

from shardserve.partitioner.placement.latency import ModelProfile, PlacementError
from shardserve.partitioner.placement.layout import Placement
from shardserve.partitioner.placement.simulator import SimConfig, simulate
from shardserve.partitioner.placement.workload import Trace

logger = logging.getLogger(__name__)


def largest_passing(
    passes: Callable[[float], bool],
    *,
    start: float,
    low: float,
    high: float,
    rel_tol: float = 0.05,
) -> float:
    """The largest ``x`` in ``[low, high]`` with ``passes(x)``, to ``rel_tol`` (``passes`` must hold
    below some threshold and fail above it); ``0.0`` when even ``low`` fails, ``high`` when it passes."""
    if not (0 < low <= start <= high and 0 < rel_tol < 1):
        raise PlacementError(
            f"need 0 < low={low:g} <= start={start:g} <= high={high:g} and 0 < rel_tol={rel_tol:g} < 1"
        )
    if passes(start):
        good = start
        while True:  # double until it fails
            bad = min(high, good * 2)
            if bad == good:
                return high
            if not passes(bad):
                break
            good = bad
    else:
        bad = start
        while True:  # halve until it passes
            good = max(low, bad / 2)
            if passes(good):
                break
            if good <= low:
                return 0.0
            bad = good
    while bad / good > 1 + rel_tol:
        x = math.sqrt(good * bad)
        if passes(x):
            good = x
        else:
            bad = x
    return good


def headroom(
    placement: Placement,
    profiles: Sequence[ModelProfile] | Mapping[str, ModelProfile],
    trace_at: Callable[[float], Trace],
    *,
    start: float,
    slo_s: float | Mapping[str, float],
    target: float = 0.99,
    config: SimConfig | None = None,
    low: float | None = None,
    high: float | None = None,
    rel_tol: float = 0.05,
) -> float:
    """The largest knob value ``x`` (``trace_at(x)`` draws the workload at it) at which ``placement``'s
    simulated attainment is >= ``target`` (default range: ``start / 64`` to ``start * 64``)."""

    def passes(x: float) -> bool:
        attainment = simulate(placement, profiles, trace_at(x), slo_s=slo_s, config=config).attainment
        logger.debug("headroom: %g -> attainment %.4f", x, attainment)
        return attainment >= target

    return largest_passing(
        passes,
        start=start,
        low=start / 64 if low is None else low,
        high=start * 64 if high is None else high,
        rel_tol=rel_tol,
    )
