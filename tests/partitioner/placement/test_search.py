"""Placement policies on the two cases that motivate them (AlpaServe, OSDI'23 section 3):

- steady Poisson load, a tight SLO and a pipeline hop that costs: one device per model wins;
- two models bursting in turns, an SLO of 5x one request's latency and devices that hold one
  model each but not two: both models split across both devices (pp=2) win.

``auto`` must find (about) the better one in each. Latencies: 10 ms per request at pp=1 with a
little batching gain; pp=2 halves a stage and adds a hop.
"""

from __future__ import annotations

import pytest

from shardserve.partitioner.placement.latency import LatencyModel, ModelProfile, PlacementError
from shardserve.partitioner.placement.layout import Group, Placement
from shardserve.partitioner.placement.search import auto, choose_placement, dedicated, multiplexed, replan
from shardserve.partitioner.placement.simulator import SimConfig
from shardserve.partitioner.placement.workload import ArrivalSpec, Workload, alternating_bursts, steady

GiB = 2**30
MEMORY = int(1.5 * GiB)  # one 1 GiB model per device, not two; half of each (pp=2) fits
CONFIG = SimConfig(max_batch_size=4)


def profile(name: str, *, hop: float, single: float = 0.010, fixed_share: float = 0.2) -> ModelProfile:
    table = {
        (pp, 1): {
            b: single / pp * (fixed_share + (1 - fixed_share) * b) + (hop if pp > 1 else 0.0)
            for b in (1, 2, 4, 8, 16)
        }
        for pp in (1, 2)
    }
    return ModelProfile(name, param_bytes=GiB, latency=LatencyModel(table))


def steady_case():
    profiles = [profile("a", hop=0.002), profile("b", hop=0.002)]  # pp=2: 14 ms instead of 10 ms
    trace = steady(("a", "b"), rate=80.0, duration_s=30.0, seed=2).trace()
    return profiles, trace, 0.020


def bursty_case():
    profiles = [profile("a", hop=0.0005), profile("b", hop=0.0005)]  # pp=2: 11 ms
    trace = alternating_bursts(("a", "b"), burst_rate=120.0, period_s=2.0, duration_s=20.0, seed=1).trace()
    return profiles, trace, 0.050


def run_all(profiles, trace, slo):
    kw = {"num_devices": 2, "device_memory_bytes": MEMORY, "slo_s": slo, "config": CONFIG}
    return dedicated(profiles, trace, **kw), multiplexed(profiles, trace, **kw), auto(profiles, trace, **kw)


def test_dedicated_wins_under_steady_load_and_a_tight_slo() -> None:
    ded, mux, best = run_all(*steady_case())
    assert ded.placement == Placement((Group((0,), 1, 1, ("a",)), Group((1,), 1, 1, ("b",))))
    assert mux.placement == Placement((Group((0, 1), 2, 1, ("a", "b")),))
    assert ded.result.attainment > 0.85
    assert ded.result.attainment > mux.result.attainment + 0.1, (ded.result, mux.result)
    assert best.result.attainment >= max(ded.result.attainment, mux.result.attainment) - 0.01
    assert all(g.pp == 1 for g in best.placement.groups)


def test_multiplexed_wins_when_models_burst_in_turns() -> None:
    ded, mux, best = run_all(*bursty_case())
    assert sorted((g.models, g.pp) for g in ded.placement.groups) == [(("a",), 1), (("b",), 1)]
    assert mux.placement == Placement((Group((0, 1), 2, 1, ("a", "b")),))
    assert mux.result.attainment > 0.9
    assert mux.result.attainment > ded.result.attainment + 0.1, (ded.result, mux.result)
    assert best.result.attainment >= max(ded.result.attainment, mux.result.attainment) - 0.01
    assert best.placement.groups[0].pp == 2 and set(best.placement.groups[0].models) == {"a", "b"}
    # each device of the multiplexed group holds half of each model: 1 GiB of the 1.5 GiB
    assert mux.placement.device_bytes({p.name: p for p in bursty_case()[0]}) == {0: GiB, 1: GiB}


def test_search_is_deterministic_and_replan_moves_only_for_a_gain() -> None:
    profiles, trace, slo = bursty_case()
    kw = {"num_devices": 2, "device_memory_bytes": MEMORY, "slo_s": slo, "config": CONFIG}
    assert auto(profiles, trace, **kw) == auto(profiles, trace, **kw)
    ded = dedicated(profiles, trace, **kw)
    moved = replan(trace, profiles, current=ded.placement, **kw)
    assert moved.policy == "auto" and moved.placement.groups[0].pp == 2
    stays = replan(trace, profiles, current=moved.placement, **kw)
    assert stays.policy == "current" and stays.placement == moved.placement
    chosen = choose_placement("multiplexed", profiles, trace, **kw).placement
    assert [(g.devices, g.pp, set(g.models)) for g in chosen.groups] == [((0, 1), 2, {"a", "b"})]


def test_multiplexed_splits_models_across_groups_when_they_do_not_all_fit() -> None:
    profiles = [profile(m, hop=0.0005) for m in ("a", "b", "c", "d")]
    trace = steady(("a", "b", "c", "d"), rate=80.0, duration_s=10.0, seed=4).trace()
    memory = int(1.2 * GiB)
    kw = {"device_memory_bytes": memory, "slo_s": 0.05, "config": CONFIG}
    # 4 devices in pairs: a device holds the halves of two models (1 GiB), not of three
    mux = multiplexed(profiles, trace, num_devices=4, group_size=2, **kw)
    assert [len(g.models) for g in mux.placement.groups] == [2, 2]
    assert sorted(m for g in mux.placement.groups for m in g.models) == ["a", "b", "c", "d"]
    assert mux.result.attainment > 0.9
    mux.placement.check_memory({p.name: p for p in profiles}, device_memory_bytes=memory)


def test_placements_that_cannot_fit_say_the_numbers() -> None:
    profiles, trace, slo = steady_case()
    with pytest.raises(
        PlacementError, match=r"a needs 1024\.0 MiB; b needs 1024\.0 MiB > 512\.0 MiB per device"
    ):
        dedicated(profiles, trace, num_devices=2, device_memory_bytes=512 * 2**20, slo_s=slo)
    with pytest.raises(PlacementError, match=r"a needs 512\.0 MiB per device at pp=2; .* > 256\.0 MiB"):
        multiplexed(profiles, trace, num_devices=2, device_memory_bytes=256 * 2**20, slo_s=slo)
    with pytest.raises(PlacementError, match="pp=3 latencies"):
        multiplexed(profiles, trace, num_devices=3, device_memory_bytes=MEMORY, slo_s=slo)
    with pytest.raises(PlacementError, match=r"no model fits any group of 2 devices with 256\.0 MiB"):
        auto(profiles, trace, num_devices=2, device_memory_bytes=256 * 2**20, slo_s=slo)


def test_auto_tries_tensor_parallel_only_where_profiles_have_it() -> None:
    """Given tp=2 latencies better than pp=2's (6 ms for the whole request, one stage), auto picks a
    tp=2 group for the bursts; without them it never proposes tp > 1 (the other tests)."""
    _, trace, slo = bursty_case()
    profiles = []
    for name in ("a", "b"):
        base = profile(name, hop=0.0005)
        table = {
            c: {b: base.latency.stages(c[0], 1, b) for b in (1, 2, 4, 8, 16)} for c in base.latency.configs
        }
        table[(1, 2)] = {b: 0.006 * (0.2 + 0.8 * b) for b in (1, 2, 4, 8, 16)}
        profiles.append(ModelProfile(name, param_bytes=GiB, latency=LatencyModel(table)))
    best = auto(profiles, trace, num_devices=2, device_memory_bytes=MEMORY, slo_s=slo, config=CONFIG)
    assert [(g.pp, g.tp, set(g.models)) for g in best.placement.groups] == [(1, 2, {"a", "b"})]
    assert best.result.attainment > 0.95


def test_dedicated_gives_spare_devices_to_the_busier_model() -> None:
    """4 devices, a at 150 req/s and b at 20: each model gets a device (b first: alone it meets its
    SLO, a on one device does not), then a the two spare ones."""
    profiles = [profile("a", hop=0.001), profile("b", hop=0.001)]
    trace = Workload((ArrivalSpec("a", 150.0), ArrivalSpec("b", 20.0)), duration_s=20.0, seed=6).trace()
    ded = dedicated(profiles, trace, num_devices=4, device_memory_bytes=MEMORY, slo_s=0.03, config=CONFIG)
    assert sorted(g.models for g in ded.placement.groups) == [("a",), ("a",), ("a",), ("b",)]
    assert ded.result.per_model["a"].attainment > 0.95
