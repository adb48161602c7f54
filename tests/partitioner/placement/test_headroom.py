"""The largest rate (or CV) a fixed placement serves at a target attainment: the monotone search,
and on a simulated device whose capacity is known."""

from __future__ import annotations

import pytest

from shardserve.partitioner.placement.headroom import headroom, largest_passing
from shardserve.partitioner.placement.latency import LatencyModel, ModelProfile, PlacementError
from shardserve.partitioner.placement.layout import Group, Placement
from shardserve.partitioner.placement.simulator import SimConfig
from shardserve.partitioner.placement.workload import steady


@pytest.mark.parametrize(("threshold", "start"), [(7.3, 1.0), (0.3, 1.0), (1.02, 1.0), (55.0, 50.0)])
def test_largest_passing_finds_the_threshold_within_its_tolerance(threshold: float, start: float) -> None:
    calls = []

    def passes(x: float) -> bool:
        calls.append(x)
        return x <= threshold

    got = largest_passing(passes, start=start, low=0.01, high=100.0, rel_tol=0.05)
    assert threshold / 1.05 <= got <= threshold and len(calls) < 20


def test_largest_passing_at_the_ends_and_bad_ranges() -> None:
    assert largest_passing(lambda x: True, start=1.0, low=0.01, high=100.0) == 100.0
    assert largest_passing(lambda x: False, start=1.0, low=0.01, high=100.0) == 0.0
    with pytest.raises(PlacementError, match="low=2 <= start=1"):
        largest_passing(lambda x: True, start=1.0, low=2.0, high=100.0)


def test_headroom_of_one_device_is_about_its_capacity() -> None:
    """10 ms a request, no batching gain: one device serves < 100 req/s; with a 1 s SLO and Poisson
    arrivals it meets 99 % up to somewhat below that, and two replicas about twice as far."""
    lat = LatencyModel({(1, 1): {1: 0.010}})
    prof = [ModelProfile("a", param_bytes=1, latency=lat)]
    one = Placement((Group((0,), 1, 1, ("a",)),))
    two = Placement((Group((0,), 1, 1, ("a",)), Group((1,), 1, 1, ("a",))))
    kw = dict(start=20.0, slo_s=1.0, config=SimConfig(max_batch_size=1, admission=False))

    def trace_at(rate: float):
        return steady(["a"], rate=rate, duration_s=60.0, seed=5).trace()

    r1, r2 = headroom(one, prof, trace_at, **kw), headroom(two, prof, trace_at, **kw)
    assert 60.0 < r1 < 100.0 and 1.6 < r2 / r1 < 2.1, (r1, r2)
