"""The search's evaluator: component by component, it gives exactly what ``simulate`` gives for the
whole placement, and a step that changes one group re-simulates only that group's component."""

from __future__ import annotations

import math

import pytest

from shardserve.partitioner.placement.evaluate import Evaluator
from shardserve.partitioner.placement.latency import LatencyModel, ModelProfile
from shardserve.partitioner.placement.layout import Group, Placement
from shardserve.partitioner.placement.simulator import SimConfig, simulate
from shardserve.partitioner.placement.workload import steady

GiB = 2**30


def _profile(name: str, single: float) -> ModelProfile:
    table = {
        (pp, 1): {b: single / pp * (0.3 + 0.7 * b) + 0.001 * (pp > 1) for b in (1, 4, 16)} for pp in (1, 2)
    }
    return ModelProfile(name, param_bytes=GiB, latency=LatencyModel(table))


PROFILES = {m: _profile(m, s) for m, s in zip("abcde", (0.010, 0.012, 0.008, 0.020, 0.015), strict=True)}
TRACE = steady(tuple(PROFILES), rate=300.0, cv=3.0, duration_s=10.0, seed=4, skew=1.0).trace()
SLO = {m: 5 * p.latency.latency(1, 1) for m, p in PROFILES.items()}

PLACEMENTS = [
    Placement(()),  # nothing placed: every request refused
    Placement(
        (Group((0,), 1, 1, ("a",)), Group((1,), 1, 1, ("b", "c")), Group((2,), 1, 1, ("d",)))
    ),  # e nowhere
    Placement(
        (Group((0,), 1, 1, ("a", "b")), Group((1,), 1, 1, ("a",)), Group((2, 3), 2, 1, ("c", "d", "e")))
    ),
    Placement(
        (Group((0, 1), 2, 1, ("a", "b", "c", "d", "e")), Group((2,), 1, 1, ()), Group((3,), 1, 1, ("e",)))
    ),
]


def _same(got, want) -> None:
    assert got.attainment == want.attainment
    assert list(got.per_model) == list(want.per_model)
    for m, w in want.per_model.items():
        g = got.per_model[m]
        assert (g.requests, g.good, g.late, g.rejected, g.expired) == (
            w.requests,
            w.good,
            w.late,
            w.rejected,
            w.expired,
        )
        assert g.p99_s == w.p99_s or (math.isnan(g.p99_s) and math.isnan(w.p99_s))
    o, w = got.overall, want.overall
    assert (o.requests, o.good, o.late, o.rejected, o.expired) == (
        w.requests,
        w.good,
        w.late,
        w.rejected,
        w.expired,
    )
    assert o.p50_s == pytest.approx(w.p50_s, nan_ok=True) and o.p99_s == pytest.approx(w.p99_s, nan_ok=True)


@pytest.mark.parametrize("overhead_s", [0.0, 0.004])
def test_the_evaluator_gives_what_simulate_gives(overhead_s: float) -> None:
    config = SimConfig(max_batch_size=8, overhead_s=overhead_s)
    ev = Evaluator(PROFILES, TRACE, slo_s=SLO, config=config)
    assert ev.decomposed is (overhead_s == 0)
    for placement in PLACEMENTS:
        _same(ev.run(placement), simulate(placement, PROFILES, TRACE, slo_s=SLO, config=config))
    assert PLACEMENTS[0].groups == () and ev.run(PLACEMENTS[0]).overall.rejected == len(TRACE.requests)


def test_a_step_re_simulates_only_the_component_it_changes() -> None:
    ev = Evaluator(PROFILES, TRACE, slo_s=SLO, config=SimConfig(max_batch_size=8))
    base = PLACEMENTS[1]
    ev.run(base)
    first = ev.simulations
    assert first == 4  # {a}, {b, c}, {d}, and e refused
    ev.run(base)
    assert ev.simulations == first  # cached
    grown = base.replace(2, base.groups[2].with_model("e"))  # d's group takes e
    _same(ev.run(grown), simulate(grown, PROFILES, TRACE, slo_s=SLO, config=SimConfig(max_batch_size=8)))
    assert ev.simulations == first + 1  # only {d, e}: {a} and {b, c} are cached, nothing is refused
